"""Context-parallel rank-pool cases: the elastic step's time and peak memory per rank at CP = 1
or 2 on the same tokens (``bench/bench_cp.py``)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support import elastic_cases


def _batches(vocab: int, seq: int, rows: int, count: int, seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(rows, seq),
            }
        )
    return out


def write_checkpoint(config_path: str, workdir: str, pattern: str | None = None) -> None:
    """The random tiny checkpoint both layouts load (one rank)."""
    cfg = elastic_cases._experiment(config_path, pattern)
    elastic_cases.write_init_checkpoint(cfg, Path(workdir) / "init")


def time_elastic_steps(
    config_path: str,
    workdir: str,
    cp: int,
    seq_length: int,
    steps: int,
    pattern: str | None = None,
    micro_batch: int = 2,
) -> dict[str, Any]:
    """``steps`` elastic training iterations (teacher pass, the student's forward and backward,
    the optimizer) on the same micro-batches at any CP size; per-step seconds (the slowest rank)
    and this rank's peak bytes of one step."""
    from elastic_plugin.parallel import Layout
    from tests.support.memory import peak_bytes

    cfg, chunks, optimizer, step = elastic_cases._setup(
        config_path, Path(workdir), Layout(cp=cp), pattern, "sliced", False, 1234
    )
    batches = _batches(cfg.model.vocab_size, seq_length, micro_batch, step.num_microbatches, 7)

    def one(iteration: int) -> None:
        step.iteration = 1 + iteration % elastic_cases.STEPS  # the same budget draws each round
        step.train_step(chunks, optimizer, iter(batches), seq_length, micro_batch)

    one(0)  # warm-up
    times = []
    for i in range(steps):
        dist.barrier()
        start = time.perf_counter()
        one(i + 1)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    peak, _ = peak_bytes(lambda: one(0), torch.device("cpu"))
    return {"rank": dist.get_rank(), "step_s": statistics.median(times), "peak_bytes": peak}
