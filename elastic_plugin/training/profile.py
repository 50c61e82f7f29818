"""Per-rank step profiles for scaling experiments (``elastic-train --profile N``).

The metrics file logs one figure per interval for the whole run (the largest rank's memory, the
world's throughput). A layout sweep also needs each rank's own figures, to see the slow or
memory-bound rank of a layout: every rank appends one record per iteration to
``OUT/profile/rank_NNNNN.jsonl`` with the iteration's budgets (micro-batches per budget label),
its step time on this rank, the global tokens, tokens/s, model TFLOP/s per rank (as
``training.throughput`` counts them) and this rank's peak memory so far.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from elastic_plugin.training.throughput import GIB, peak_memory_bytes

__all__ = ["PROFILE_DIR", "StepProfile", "read_profiles"]

PROFILE_DIR = "profile"


class StepProfile:
    """This rank's profile file (started empty), one JSON line per iteration."""

    def __init__(self, out_dir: str | Path, rank: int, world: int, data_parallel: int) -> None:
        self.path = Path(out_dir) / PROFILE_DIR / f"rank_{rank:05d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.rank, self.world, self.data_parallel = rank, world, data_parallel
        self.host = socket.gethostname()

    def record(
        self,
        iteration: int,
        budgets: dict[str, int],
        seconds: float,
        tokens: int,
        replica_flops: float,
    ) -> dict[str, Any]:
        """Append one iteration: ``replica_flops`` is what one data-parallel replica ran."""
        seconds = max(seconds, 1e-9)
        entry = {
            "iteration": iteration,
            "rank": self.rank,
            "host": self.host,
            "budgets": budgets,
            "step_seconds": round(seconds, 6),
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "tflops_per_rank": replica_flops * self.data_parallel / seconds / self.world / 1e12,
            "peak_memory_gib": peak_memory_bytes() / GIB,
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(entry) + "\n")
        return entry


def read_profiles(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its records, from ``run_dir/profile`` (empty when the run was not profiled)."""
    records: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / PROFILE_DIR).glob("rank_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            records[int(rows[0]["rank"])] = rows
    return records
