"""Throughput a cluster user reads: tokens/s, model TFLOP/s per rank, peak memory per rank.

Per logged interval: the tokens of the global batches trained, the model FLOPs of the nested
models that actually ran (``ElasticStep.choice_flops``: each micro-batch at its budget's sliced
widths, the teacher's forward included, recomputation counted as a 4th pass), over the training
time of the interval (evaluation and checkpoints excluded) and the world size. Peak memory is
the largest over the ranks: allocated CUDA memory on a GPU, the process' peak resident set on a
CPU (no allocator statistics exist there).
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

GIB = 2**30


def all_reduce_host(values: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce a small host (CPU) tensor of figures: through the GPU where the group's
    backend is NCCL (which reduces device tensors only), in place otherwise."""
    if dist.get_backend(group) == "nccl":
        on_device = values.to(torch.cuda.current_device())
        dist.all_reduce(on_device, op=op, group=group)
        return on_device.cpu()
    dist.all_reduce(values, op=op, group=group)
    return values


def peak_memory_bytes() -> int:
    """This process' peak memory: CUDA's allocated peak, else the peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


class ThroughputMeter:
    """Accumulates training time, tokens and FLOPs between two ``report`` calls."""

    def __init__(self, world: int = 1, data_parallel: int = 1) -> None:
        self.world = world
        self.data_parallel = data_parallel
        self._began: float | None = None
        self.seconds = 0.0
        self.tokens = 0
        self.flops = 0.0

    def start(self) -> None:
        self._began = time.perf_counter()

    def stop(self, tokens: int, replica_flops: float) -> None:
        """One iteration ended: ``tokens`` of the global batch, ``replica_flops`` one DP replica
        ran (every replica runs the same budgets on its share of the batch)."""
        if self._began is not None:
            self.seconds += time.perf_counter() - self._began
        self._began = None
        self.tokens += tokens
        self.flops += replica_flops * self.data_parallel

    def report(self) -> dict[str, Any]:
        """The interval's figures (collective when a process group exists: the memory peak is
        the max over ranks); resets the interval."""
        seconds = max(self.seconds, 1e-9)
        peak = torch.tensor([float(peak_memory_bytes())], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            peak = all_reduce_host(peak, op=dist.ReduceOp.MAX)
        out = {
            "tokens_per_s": self.tokens / seconds,
            "tflops_per_rank": self.flops / seconds / self.world / 1e12,
            "model_tflops": self.flops / 1e12,
            "peak_memory_gib": float(peak.item()) / GIB,
            "seconds": round(self.seconds, 4),
        }
        self.seconds, self.tokens, self.flops = 0.0, 0, 0.0
        return out


def progress_postfix(rate: dict[str, Any] | None) -> dict[str, str]:
    """The progress line's short form of a ``ThroughputMeter.report`` (empty before one)."""
    if not rate:
        return {}
    return {
        "tok/s": f"{rate['tokens_per_s']:.0f}",
        "TFLOP/s/rank": f"{rate['tflops_per_rank']:.3g}",
        "mem": f"{rate['peak_memory_gib']:.2f}G",
    }
