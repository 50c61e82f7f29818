"""Find the CUDA toolkit the extension's CUDA ops compile with, or install the registry's.

    python scripts/cuda_toolkit.py        # prints the CUDA_HOME to build with (one line)

A toolkit on the machine (``CUDA_HOME``, ``CUDA_PATH``, ``/usr/local/cuda``, ``nvcc`` on ``PATH``)
is used when its CUDA major version is torch's, as torch's extension builder requires. Otherwise
the pinned compiler wheels of ``requirements-cuda.txt`` (nvcc, crt, nvvm, cccl) are installed
into this Python's environment, where torch's own ``nvidia-cuda-runtime`` already put the CUDA
headers and ``libcudart``: ``site-packages/nvidia/cu<major>`` is then a complete toolkit, once a
``libcudart.so`` link to the shipped ``libcudart.so.<major>`` exists for the linker.
``ELASTIC_PLUGIN_CUDA_TOOLKIT=wheels`` takes the wheels even where a system toolkit would do
(``system``: never install them). Messages go to stderr; stdout holds only the path.

``setup.py`` loads this file for :func:`find_system_toolkit`, so both agree on what is found.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements-cuda.txt"
MODE_ENV = "ELASTIC_PLUGIN_CUDA_TOOLKIT"
MODES = ("auto", "system", "wheels")


def _say(message: str) -> None:
    print(f"cuda_toolkit: {message}", file=sys.stderr, flush=True)


def is_toolkit(root: str | Path) -> bool:
    """``root`` holds nvcc and the CUDA runtime headers."""
    root = Path(root)
    return (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime.h").is_file()


def nvcc_release(root: str | Path) -> str | None:
    """``"13.0"`` from ``<root>/bin/nvcc --version``; None when it does not run."""
    try:
        text = subprocess.run(
            [str(Path(root) / "bin" / "nvcc"), "--version"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def system_candidates() -> list[str]:
    """Where a machine's toolkit may be, in the order torch's extension builder looks."""
    found = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append(str(Path(nvcc).resolve().parent.parent))
    return [root for root in found if root]


def find_system_toolkit(torch_cuda: str) -> tuple[str | None, str]:
    """(root, note): the first toolkit whose CUDA major version is ``torch_cuda``'s, or None and
    what was found instead (the note says which toolkits were skipped and why)."""
    skipped = []
    for root in system_candidates():
        if not is_toolkit(root):
            continue
        release = nvcc_release(root)
        if release is not None and release.split(".")[0] == torch_cuda.split(".")[0]:
            return root, f"nvcc {release} in {root}"
        skipped.append(f"{root} (CUDA {release or 'unknown'})")
    if skipped:
        return None, f"toolkits of another CUDA major version than torch's {torch_cuda}: " + (
            ", ".join(skipped)
        )
    return None, "no CUDA toolkit (CUDA_HOME, CUDA_PATH, /usr/local/cuda, nvcc on PATH)"


def pinned(requirements: Path = REQUIREMENTS) -> dict[str, str]:
    """``{distribution: version}`` of the compiler wheels."""
    pins = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise SystemExit(f"{requirements}: {line!r} is not pinned (name==version)")
            pins[name.strip()] = version.strip()
    return pins


def check_pins(pins: dict[str, str], torch_cuda: str, requirements: Path = REQUIREMENTS) -> None:
    """The pinned compiler is torch's CUDA major.minor, or a clear error naming the file."""
    nvcc = pins.get("nvidia-cuda-nvcc")
    if nvcc is None:
        raise SystemExit(f"{requirements} pins no nvidia-cuda-nvcc")
    if ".".join(nvcc.split(".")[:2]) != torch_cuda:
        raise SystemExit(
            f"{requirements} pins nvidia-cuda-nvcc=={nvcc} (CUDA {'.'.join(nvcc.split('.')[:2])}) "
            f"but torch is built with CUDA {torch_cuda}: pin the wheels of CUDA {torch_cuda}"
        )


def wheel_root(torch_cuda: str) -> Path:
    """Where the nvidia wheels of CUDA ``torch_cuda`` put the toolkit in this environment."""
    return Path(sysconfig.get_paths()["purelib"]) / "nvidia" / f"cu{torch_cuda.split('.')[0]}"


def install_wheels(torch_cuda: str, requirements: Path = REQUIREMENTS) -> Path:
    """Install the pinned compiler wheels and complete the toolkit; its root."""
    check_pins(pinned(requirements), torch_cuda, requirements)
    _say(f"installing the registry's CUDA {torch_cuda} compiler ({requirements.name})")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-r", str(requirements)],
        check=True,
    )
    root = wheel_root(torch_cuda)
    major = torch_cuda.split(".")[0]
    runtime = root / "lib" / f"libcudart.so.{major}"
    if not runtime.is_file():
        raise SystemExit(
            f"{runtime} is missing: torch's nvidia-cuda-runtime wheel should have installed it"
        )
    link = root / "lib" / "libcudart.so"
    if not link.exists():
        link.symlink_to(runtime.name)  # the linker's -lcudart; torch ships only the soname
    if not is_toolkit(root) or not (root / "include" / "nv" / "target").is_file():
        raise SystemExit(f"{root} is not a complete toolkit after installing {requirements.name}")
    return root


def main() -> int:
    import torch

    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise SystemExit(f"{MODE_ENV}={mode!r}: allowed values are {', '.join(MODES)}")
    torch_cuda = torch.version.cuda
    if torch_cuda is None:
        raise SystemExit(
            f"torch {torch.__version__} is not a CUDA build, so the CUDA ops cannot be compiled; "
            "install the CUDA build (requirements.txt) or set ELASTIC_PLUGIN_SKIP_CUDA=1"
        )
    root: str | Path | None = None
    if mode != "wheels":
        root, note = find_system_toolkit(torch_cuda)
        _say(note if root else f"{note}: using the registry's compiler")
        if root is None and mode == "system":
            raise SystemExit(f"{MODE_ENV}=system but {note}")
    if root is None:
        root = install_wheels(torch_cuda)
        _say(f"nvcc {nvcc_release(root)} in {root}")
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
