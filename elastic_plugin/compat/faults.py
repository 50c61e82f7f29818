"""Fault injection at named points of training and checkpoint saving, for the fault-tolerance
tests (``tests/test_faults.py``): kill this rank with SIGKILL (a node lost mid-step or mid-save),
fail a write with ENOSPC (a full disk), hang (a stuck rank), or send this rank SIGTERM (a job
preempted or at its time limit: the scheduler's signal, as torchrun forwards it).

Inert unless ``ELASTIC_PLUGIN_FAULT`` is set: a comma-separated list of

    POINT@N[:rank=R|all][:action=kill|enospc|hang|preempt]

meaning "the N-th time this process reaches POINT (1-based), on rank R (default: all ranks),
do ACTION (default kill)". The points are :data:`POINTS`; a spec naming another one, or a bad
field, is refused when first read, so a misspelled test cannot pass by injecting nothing.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

__all__ = ["FAULT_ENV", "POINTS", "FaultSpec", "fault_point", "parse_faults"]

FAULT_ENV = "ELASTIC_PLUGIN_FAULT"
POINTS = (
    "train.step",  # the start of each training iteration
    "save.written",  # every rank's shards written into <dir>.tmp, before the digests
    "save.published",  # <dir> renamed into place, before it is verified and pointed at
    "save.pointer",  # latest_checkpointed_iteration.txt moved (rank 0), before pruning
)
ACTIONS = ("kill", "enospc", "hang", "preempt")


@dataclass(frozen=True)
class FaultSpec:
    point: str
    hit: int
    rank: int | None  # None: every rank
    action: str


def parse_faults(text: str) -> list[FaultSpec]:
    """The specs of ``ELASTIC_PLUGIN_FAULT`` (see the module docstring); ValueError names the
    bad part."""
    specs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        head, *options = part.split(":")
        point, sep, hit = head.partition("@")
        if point not in POINTS or not sep or not hit.isdigit() or int(hit) < 1:
            raise ValueError(
                f"{FAULT_ENV}: {part!r} must start with POINT@N (N >= 1); points: {', '.join(POINTS)}"
            )
        rank: int | None = None
        action = "kill"
        for option in options:
            key, _, value = option.partition("=")
            if key == "rank" and (value == "all" or value.isdigit()):
                rank = None if value == "all" else int(value)
            elif key == "action" and value in ACTIONS:
                action = value
            else:
                raise ValueError(
                    f"{FAULT_ENV}: {part!r}: bad option {option!r} "
                    f"(rank=R|all, action={'|'.join(ACTIONS)})"
                )
        specs.append(FaultSpec(point, int(hit), rank, action))
    return specs


_SPECS: list[FaultSpec] | None = None
_HITS: dict[str, int] = {}


def fault_point(point: str) -> None:
    """Count one arrival at ``point``; act if a spec of this rank says so."""
    global _SPECS
    if _SPECS is None:
        _SPECS = parse_faults(os.environ.get(FAULT_ENV, ""))
    if not _SPECS:
        return
    _HITS[point] = _HITS.get(point, 0) + 1
    rank = int(os.environ.get("RANK", "0"))
    for spec in _SPECS:
        if spec.point == point and spec.hit == _HITS[point] and spec.rank in (None, rank):
            _act(spec, rank)


def _act(spec: FaultSpec, rank: int) -> None:
    message = f"[fault] rank {rank}: {spec.action} at {spec.point} (arrival {spec.hit})"
    print(message, flush=True)
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == "preempt":
        os.kill(os.getpid(), signal.SIGTERM)
    elif spec.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {spec.point})")
    else:
        while True:  # a stuck rank: only the launcher's timeout ends it
            time.sleep(3600)
