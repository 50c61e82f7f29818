"""``make gpu-wheels``: fill ``.whl/`` with what the GPU acceptance run needs and the device lacks.

    python scripts/gpu_wheels.py [--dest .whl]

The GPU machine has no network and an image without Megatron-Core or ModelOpt; what a call takes
along is the working tree plus carried folders, 64 MiB in all. This downloads the wheels of
``requirements-gpu.txt`` for that image (CPython 3.12, manylinux x86_64; no dependencies: the file
lists every one the image lacks), writes the tiny model's data (``prepare-data``: the image has
no reasoning-gym to generate it) into ``.whl/data``, and checks that ``.whl`` plus the working
tree that travels stay under the limit. ``scripts/gpu_check.sh`` installs the wheels there.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # what one device call takes along: working tree + carried folders
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "any",
)
# the data of the end-to-end run: the tiny model's task at `train --quick`'s sizes
DATA_ARGS = ("--task", "products", "--num-train", "3000", "--num-valid", "200")


def tree_bytes() -> int:
    """Bytes of the working tree that travels: tracked and untracked-but-not-ignored files."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = (ROOT / name.decode() for name in names if name)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    args = parser.parse_args(argv)
    dest = args.dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", "3.12", "--implementation", "cp", *platforms]
        + ["-d", str(dest), "-r", str(ROOT / "requirements-gpu.txt")],
        check=True,
    )
    subprocess.run(
        [sys.executable, "-m", "elastic_plugin.cli", "prepare-data", *DATA_ARGS]
        + ["--out", str(dest / "data"), "--no-progress"],
        check=True,
        cwd=ROOT,
    )
    wheels = sorted(dest.glob("*.whl"))
    carried, tree = folder_bytes(dest), tree_bytes()
    for wheel in wheels:
        print(f"    {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"    {folder_bytes(dest / 'data') / 2**20:6.2f} MiB  data/ (the tiny model's)")
    total = carried + tree
    print(
        f"==> {dest}: {carried / 2**20:.1f} MiB ({len(wheels)} wheels + data); with the working "
        f"tree ({tree / 2**20:.1f} MiB) {total / 2**20:.1f} MiB of the {LIMIT / 2**20:.0f} MiB a "
        "device call takes along"
    )
    if total > LIMIT:
        print(f"ERROR: over the {LIMIT / 2**20:.0f} MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
