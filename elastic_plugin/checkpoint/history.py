"""Checkpoint history with fallback, in Megatron-LM's layout: ``STAGE/iter_NNNNNNN/`` per save and
``STAGE/latest_checkpointed_iteration.txt`` naming the newest, written atomically and last.

Why: a run that keeps only one checkpoint has nothing to fall back to when that one is damaged
(a node died mid-write on a shared filesystem, a disk filled). Each save is a complete checkpoint
of its own (published by rename, with its files' digests); the pointer moves only after the new
one verified; older saves beyond ``keep_last`` are pruned only then. ``--resume`` takes the newest
save that verifies and says which it skipped and why. Every reader accepts the stage directory
(its newest save), a given ``iter_`` directory, or an old single-directory checkpoint, through
:func:`resolve_checkpoint`. Torch-free.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from elastic_plugin.models.config import DEFAULT_KEEP_LAST, ConfigError

__all__ = [
    "DEFAULT_KEEP_LAST",
    "IMPORT_ITERATION",
    "LATEST_FILE",
    "iteration_dir",
    "iteration_dirs",
    "newest_verified",
    "prune_history",
    "resolve_checkpoint",
    "run_dir",
    "write_latest",
]

LATEST_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's name, read by its tools
IMPORT_ITERATION = 0  # an imported parent's save: no iteration of ours has trained it yet
_ITER = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(stage: str | Path, iteration: int) -> Path:
    """``STAGE/iter_NNNNNNN`` (Megatron-LM's zero-padded name)."""
    return Path(stage) / f"iter_{int(iteration):07d}"


def iteration_dirs(stage: str | Path) -> list[tuple[int, Path]]:
    """The published saves of a stage directory, newest first (``.tmp`` leftovers excluded)."""
    root = Path(stage)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _ITER.match(child.name)
        if match and child.is_dir():
            found.append((int(match[1]), child))
    return sorted(found, reverse=True)


def _latest_iteration(stage: Path) -> int:
    latest = stage / LATEST_FILE
    text = latest.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{latest}: {text!r} is not an iteration number (the file names the newest save)"
        ) from None


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` stands for: a stage directory's newest save (its
    ``latest_checkpointed_iteration.txt``), else ``path`` itself (an ``iter_`` directory, or a
    checkpoint written before history existed)."""
    root = Path(path)
    if not (root / LATEST_FILE).is_file():
        return root
    iteration = _latest_iteration(root)
    target = iteration_dir(root, iteration)
    if not target.is_dir():
        raise ConfigError(
            f"{root / LATEST_FILE} names iteration {iteration}, but {target} is missing; "
            f"saves present: {[p.name for _, p in iteration_dirs(root)] or 'none'}"
        )
    return target


def run_dir(ckpt: str | Path) -> Path:
    """The run directory (a training command's ``--out``) of ``OUT/checkpoints/STAGE``, given
    the stage directory or one of its ``iter_`` saves: where the run's metrics files are."""
    path = Path(ckpt)
    if _ITER.match(path.name):
        path = path.parent
    return path.parent.parent


def write_latest(stage: str | Path, iteration: int) -> None:
    """Point the stage at ``iteration``: written to a temporary file, then renamed over the old
    pointer, so a reader sees the old or the new number, never a partial one."""
    root = Path(stage)
    tmp = root / f".{LATEST_FILE}.tmp"
    tmp.write_text(f"{int(iteration)}\n")
    os.replace(tmp, root / LATEST_FILE)


def prune_history(stage: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` saves (never the one the pointer names);
    returns what was removed. ``keep_last`` < 1 keeps everything."""
    if keep_last < 1:
        return []
    root = Path(stage)
    current = resolve_checkpoint(root).resolve()  # the stage itself when nothing is pointed at
    removed = []
    for _, path in iteration_dirs(root)[keep_last:]:
        if path.resolve() == current:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def newest_verified(
    stage: str | Path, verify: Callable[[Path], object]
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest save of ``stage`` that ``verify`` accepts (it raises ConfigError on a damaged
    one), and the newer ones skipped with the reason; ``(None, skipped)`` when none verifies."""
    skipped: list[tuple[Path, str]] = []
    for _, path in iteration_dirs(stage):
        try:
            verify(path)
        except ConfigError as exc:
            skipped.append((path, str(exc)))
            continue
        return path, skipped
    return None, skipped
