"""Which rank is stuck: per-rank heartbeats, read when a collective times out.

A hung rank (a dead GPU, a deadlocked kernel, a stalled filesystem) shows up on every other rank
as a collective that times out after ``--distributed-timeout-minutes``, with nothing naming the
rank that stopped. Each rank therefore writes ``OUT/heartbeats/rank_NNNNN.json`` (host, PID, the
iteration and phase it reached, the time) at every iteration, evaluation and save, and a rank
whose collective timed out marks its file ``waiting`` and, after a grace period in which the
others that timed out do the same, names every rank that did not: those are stuck where their
last heartbeat says. Files are replaced atomically (write, then rename), so a reader never sees
half a record.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_DIR", "Heartbeat", "is_collective_timeout"]

HEARTBEAT_DIR = "heartbeats"
_TIMEOUT_WORDS = ("timed out", "timeout", "time out")


def is_collective_timeout(exc: BaseException) -> bool:
    """True for the error a collective raises when a peer never joined (gloo: "Timed out
    waiting ...", NCCL's watchdog: "... collective operation timeout")."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _TIMEOUT_WORDS)


class Heartbeat:
    """This rank's heartbeat file under ``out_dir/heartbeats``, and the stuck-rank report."""

    def __init__(self, out_dir: str | Path, rank: int, world: int) -> None:
        self.dir = Path(out_dir) / HEARTBEAT_DIR
        self.rank, self.world = rank, world
        self.dir.mkdir(parents=True, exist_ok=True)
        self.last: dict[str, Any] = {}

    def path(self, rank: int) -> Path:
        return self.dir / f"rank_{rank:05d}.json"

    def beat(self, iteration: int, phase: str, waiting: bool = False) -> None:
        """Record that this rank reached ``phase`` of ``iteration`` (now)."""
        self.last = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "iteration": iteration,
            "phase": phase,
            "time": time.time(),
            "waiting": waiting,
        }
        tmp = self.path(self.rank).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.last))
        tmp.replace(self.path(self.rank))

    def read(self) -> dict[int, dict[str, Any] | None]:
        """Every rank's last record (None: none written, or unreadable)."""
        out: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world):
            try:
                out[rank] = json.loads(self.path(rank).read_text())
            except (OSError, ValueError):
                out[rank] = None
        return out

    def stuck_report(self, timeout_s: float, grace_s: float = 10.0) -> str:
        """After this rank's collective timed out: mark it waiting, give the other waiting ranks
        ``grace_s`` to do the same, then name the ranks that did not, where they stopped."""
        if not self.last:  # another object wrote this rank's beats (the training loop)
            self.last = self.read().get(self.rank) or {}
        self.beat(int(self.last.get("iteration", 0)), str(self.last.get("phase", "?")), True)
        deadline = time.time() + grace_s
        records = self.read()
        while time.time() < deadline:
            if all(r is not None and r.get("waiting") for r in records.values()):
                break
            time.sleep(0.5)
            records = self.read()
        now = time.time()
        stuck = [rank for rank, r in records.items() if r is None or not r.get("waiting")]
        waiting = [rank for rank in records if rank not in stuck]
        parts = []
        for rank in stuck:
            r = records[rank]
            parts.append(
                f"rank {rank}: no heartbeat"
                if r is None
                else f"rank {rank} ({r['host']}, pid {r['pid']}) is stuck: its last heartbeat, "
                f"{now - r['time']:.0f} s ago, was iteration {r['iteration']} {r['phase']}"
            )
        where = f"iteration {self.last.get('iteration')} ({self.last.get('phase')})"
        head = (
            f"a collective timed out after {timeout_s:.0f} s on rank {self.rank} at {where}; "
            f"ranks waiting: {waiting}"
        )
        if not stuck:
            return f"{head}; every rank reports waiting (no single stuck rank)"
        return f"{head}; " + "; ".join(parts)
