"""Side-by-side timing: interleaved repetitions and medians, because the machine is noisy.

Timing candidates one after another lets a burst of load from a neighbour land on one of
them only; interleaving (with a rotating order) spreads it over all, and medians drop it.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A no-op on CPU; waits for queued kernels on an accelerator."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def interleaved_medians(
    candidates: dict[str, Callable[[], object]],
    *,
    reps: int = 15,
    warmup: int = 2,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured round-robin ``reps`` times."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    items = list(candidates.items())
    for _ in range(warmup):
        for _, fn in items:
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name, _ in items}
    for rep in range(reps):
        shift = rep % len(items)
        for name, fn in items[shift:] + items[:shift]:
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def keep_freed_memory() -> bool:
    """glibc keeps freed memory for reuse (``elastic_plugin.compat.host``, what every command
    sets at start-up): big outputs would otherwise come fresh from the kernel on every call, and
    the page faults swamp what is measured. False where glibc's mallopt is unavailable."""
    from elastic_plugin.compat.host import keep_freed_memory as keep

    return keep()


def copy_floor(work: Path, nbytes: int) -> Callable[[], None]:
    """A timed step that copies a file of ``nbytes`` inside ``work`` (and deletes the copy): the
    floor any writer of that many bytes pays on this disk, to set beside a step that writes them."""
    blob = work / f"blob_{nbytes}.bin"
    blob.write_bytes(bytes(nbytes))
    names = itertools.count()

    def copy() -> None:
        target = work / f"copy_{next(names)}.bin"
        shutil.copyfile(blob, target)
        target.unlink()

    return copy
