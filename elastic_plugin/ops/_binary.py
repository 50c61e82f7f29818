"""What the compiled extension holds, read from the library itself rather than from a build log.

Two facts prove that the CUDA ops were compiled: the shared library's fatbin (the ELF section
``.nv_fatbin``, where nvcc puts one cubin per GPU architecture and optionally PTX) lists the
architectures, and the dispatcher records the source file that registered each op's CUDA
kernel (a ``.cu`` file, not the PyTorch stand-in a CPU-only build registers for CUDA tensors).
Both are read without a GPU, so a CI machine can assert them.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import torch

FATBIN_SECTION = ".nv_fatbin"
_FATBIN_MAGIC = 0xBA55ED50  # a fat binary's header (nvcc's fatbinary format)
_KIND_PTX, _KIND_CUBIN = 1, 2


def _elf_section(data: bytes, wanted: str) -> bytes | None:
    """The bytes of section ``wanted`` of a little-endian ELF64 file (None if it has none)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]  # name offset, type, flags, address, file offset, size
    strings = headers[shstrndx][4]
    for name, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", strings + name)
        if data[strings + name : end].decode() == wanted:
            return data[offset : offset + size]
    return None


def fatbin_targets(library: str | Path) -> list[str]:
    """Each code object in the library's fatbin as ``sm_NN`` (a cubin) or ``compute_NN`` (PTX),
    sorted by architecture; an empty list when the library holds no CUDA code."""
    section = _elf_section(Path(library).read_bytes(), FATBIN_SECTION)
    if section is None:
        return []
    found: set[tuple[int, str]] = set()
    pos = 0
    while pos + 16 <= len(section):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", section, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned within the section
            continue
        entry, end = pos + header_size, pos + header_size + fat_size
        while entry + 32 <= end:
            kind, _, entry_header, size = struct.unpack_from("<HHIQ", section, entry)
            (arch,) = struct.unpack_from("<I", section, entry + 28)
            if kind in (_KIND_PTX, _KIND_CUBIN):
                found.add((arch, "sm" if kind == _KIND_CUBIN else "compute"))
            entry += entry_header + size
        pos = end
    return [f"{prefix}_{arch}" for arch, prefix in sorted(found)]


def arch_targets(arch_list: str) -> list[str]:
    """The code objects a ``TORCH_CUDA_ARCH_LIST`` asks torch's build for: ``"8.0;9.0+PTX"`` ->
    ``["sm_80", "sm_90", "compute_90"]`` (sorted as :func:`fatbin_targets` sorts them)."""
    found: set[tuple[int, str]] = set()
    for item in re.split(r"[;,\s]+", arch_list.strip()):
        if not item:
            continue
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item)
        if match is None:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST entry {item!r} is not of the form 9.0, 9.0a or 9.0+PTX"
            )
        arch = int(match.group(1)) * 10 + int(match.group(2))
        found.add((arch, "sm"))
        if match.group(4):
            found.add((arch, "compute"))
    return [f"{prefix}_{arch}" for arch, prefix in sorted(found)]


def kernel_sources(op: str, dispatch_key: str = "CUDA") -> list[str]:
    """The source files that registered ``elastic_plugin::<op>``'s kernel for ``dispatch_key``
    (as the dispatcher records them: ``csrc/gather_cuda.cu``; a Python file for the PyTorch
    stand-in); empty when there is none."""
    name = f"elastic_plugin::{op}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key):
        return []
    dump = torch._C._dispatch_dump(name)
    return re.findall(rf"^{dispatch_key}: registered at (\S+?):\d+", dump, re.MULTILINE)
