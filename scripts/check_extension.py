"""Assert what the installed extension holds: `make install` runs this after building it.

    python scripts/check_extension.py --cuda-archs "8.0;9.0;10.0"   # the CUDA ops must be there
    python scripts/check_extension.py --no-cuda                    # a C++-only build (SKIP_CUDA)

Every fact comes from the loaded library, never from a build log: ``elastic_plugin.ops``'
backend report (``cpp+cuda``), the code objects in the library's fatbin (one cubin per asked
architecture), and the dispatcher's record of which source file registered each op's CUDA
kernel (every op that a ``csrc/*.cu`` file registers for CUDA must come from that file, not
from the PyTorch stand-in). It prints what it found, so CI's log shows the architectures, and
exits 1 naming each mismatch.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CUDA_BLOCK = re.compile(
    r"TORCH_LIBRARY_IMPL\(\s*elastic_plugin\s*,\s*CUDA\s*,\s*\w+\s*\)\s*\{(.*?)\n\}", re.S
)


def cuda_ops_in_sources(csrc: Path = ROOT / "csrc") -> dict[str, str]:
    """``{op: file name}`` for every op a ``.cu`` file registers a CUDA kernel for."""
    found = {}
    for path in sorted(csrc.glob("*.cu")):
        for block in _CUDA_BLOCK.findall(path.read_text()):
            for op in re.findall(r'\.impl\(\s*"(\w+)"', block):
                found[op] = path.name
    return found


def problems(
    info: dict,
    expected_targets: list[str] | None,
    sources: dict[str, list[str]],
    wanted: dict[str, str],
) -> list[str]:
    """What is wrong with a build (empty: as asked). ``expected_targets`` None: a C++-only build
    was asked for; ``sources``: op -> files that registered its CUDA kernel."""
    found = []
    if info["backend"] == "pytorch":
        return [f"the extension is not loaded: {info['reason']}"]
    if expected_targets is None:
        if info["cuda_kernels"]:
            found.append("a C++-only build was asked for, but the library has CUDA kernels")
        return found
    if info["backend"] != "cpp+cuda" or not info["cuda_kernels"]:
        found.append(f"backend {info['backend']!r}, not 'cpp+cuda': {info['reason']}")
    if info["cuda_targets"] != expected_targets:
        found.append(
            f"the library's fatbin holds {info['cuda_targets'] or 'no CUDA code'}, "
            f"expected {expected_targets}"
        )
    if not wanted:
        found.append("no csrc/*.cu file registers a CUDA kernel (TORCH_LIBRARY_IMPL(..., CUDA, m))")
    for op, file in sorted(wanted.items()):
        registered = sources.get(op, [])
        if not any(Path(path).name == file for path in registered):
            found.append(
                f"elastic_plugin::{op}'s CUDA kernel is registered by {registered or 'nothing'}, "
                f"not by csrc/{file}"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cuda-archs", metavar="LIST", help='TORCH_CUDA_ARCH_LIST, e.g. "8.0;9.0"')
    group.add_argument("--no-cuda", action="store_true", help="a C++-only build was asked for")
    args = parser.parse_args(argv)

    import torch

    import elastic_plugin.ops as ops

    info = ops.backend_info()
    expected = None if args.no_cuda else ops.arch_targets(args.cuda_archs)
    wanted = cuda_ops_in_sources()
    sources = {op: ops.kernel_sources(op, "CUDA") for op in wanted}
    print(f"==> elastic_plugin._C: {info['backend']} ({info['reason']}), torch {torch.__version__}")
    print(f"    library: {info['extension_path']}")
    if expected is not None:
        print(f"    CUDA code in the library's fatbin: {', '.join(info['cuda_targets']) or 'none'}")
        print(f"    asked for: {args.cuda_archs} -> {', '.join(expected)}")
        for op in sorted(wanted):
            print(f"    CUDA kernel of elastic_plugin::{op}: {', '.join(sources[op]) or 'none'}")
    wrong = problems(info, expected, sources, wanted)
    for item in wrong:
        print(f"ERROR: {item}", file=sys.stderr)
    if not wrong:
        print("    OK" if expected is not None else "    OK (C++ kernels only, as asked)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
