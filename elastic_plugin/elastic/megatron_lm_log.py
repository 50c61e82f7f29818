"""Megatron-LM's log of an elastic run: per-budget losses, router choices, throughput, memory.

Megatron-LM reduces each loss a forward step reports per iteration as sum / count, so a budget
that an iteration did not draw would log 0/0 (and count as a NaN iteration). The per-budget
figures are therefore accumulated here over the log interval and written after Megatron's own
line, every ``--log-interval`` (``install_log_hook`` wraps ``training.training_log``), as one
``elastic |`` line and, when Megatron has a TensorBoard writer (``--tensorboard-dir``), as
``elastic/...`` scalars: KD and budget loss per budget, the router's choice per budget and axis
(size / full size), tokens/s, model TFLOP/s per rank (the nested models that ran, the teacher's
forward included: ``ElasticStep.choice_flops``) and the largest rank's peak memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.meta import budget_label
from elastic_plugin.training.throughput import ThroughputMeter, all_reduce_host

__all__ = ["ElasticLog", "install_log_hook"]

_INSTALLED = "_elastic_log_hook"


class ElasticLog:
    """One interval's elastic figures of this rank, reduced over data parallelism when logged.

    ``add`` takes the report ``ElasticStep._loss`` returns (KD sum, tokens, budget loss, CE sum,
    budget index); ``iteration_started`` / ``end_iteration`` bracket an iteration's training
    time; ``choices()`` gives the router's current choice table (budget label -> axis -> size).
    """

    def __init__(
        self,
        budgets: list[float],
        full_sizes: dict[str, int],
        choices: Callable[[], dict[str, dict[str, Any]]],
        take_flops: Callable[[], float],
        world: int = 1,
        data_parallel: int = 1,
        group: Any = None,
    ) -> None:
        self.labels = [budget_label(b) for b in budgets]
        self.full_sizes = full_sizes
        self.choices, self.take_flops = choices, take_flops
        self.group = group
        self.meter = ThroughputMeter(world=world, data_parallel=data_parallel)
        self.window = torch.zeros(len(budgets), 4, dtype=torch.float64)

    def iteration_started(self) -> None:
        self.meter.start()

    def add(self, report: torch.Tensor) -> None:
        """One training micro-batch: KD sum, tokens, budget loss at its budget's row."""
        values = report.detach().double().cpu()
        index = int(values[4].item())
        self.window[index] += torch.stack(
            [values[0], values[1], values[2], torch.ones((), dtype=torch.float64)]
        )

    def end_iteration(self, iteration: int, tokens: int, log_interval: int, writer=None):
        """Count the iteration; every ``log_interval`` iterations reduce, reset and return the
        log line (None otherwise). Collective on log iterations: every rank must call it."""
        self.meter.stop(tokens, self.take_flops())
        if iteration % log_interval:
            return None
        totals = self.window.clone()
        if dist.is_initialized() and self.group is not None:
            totals = all_reduce_host(totals, group=self.group)
        self.window.zero_()
        rate = self.meter.report()  # collective: the largest rank's peak memory
        kd = {
            label: float(totals[i, 0] / totals[i, 1])
            for i, label in enumerate(self.labels)
            if totals[i, 1] > 0
        }
        budget_loss = {
            label: float(totals[i, 2] / totals[i, 3])
            for i, label in enumerate(self.labels)
            if totals[i, 3] > 0
        }
        table = self.choices()
        fractions = {
            label: {axis: _mean(size) / self.full_sizes[axis] for axis, size in row.items()}
            for label, row in table.items()
        }
        if writer is not None:
            _write_scalars(writer, iteration, kd, budget_loss, fractions, rate)
        return format_line(iteration, self.labels, kd, budget_loss, table, rate)


def _mean(size: Any) -> float:
    """An axis' size, or the mean of its per-layer sizes (heterogeneous choices)."""
    return sum(size) / len(size) if isinstance(size, list) else float(size)


def format_line(
    iteration: int,
    labels: list[str],
    kd: dict[str, float],
    budget_loss: dict[str, float],
    table: dict[str, dict[str, Any]],
    rate: dict[str, Any],
) -> str:
    """`` elastic | iteration N | kd loss <b>: ... | budget loss <b>: ... | tokens/s: ... |
    TFLOP/s/rank: ... | peak memory/rank (GiB): ... | choice <b>: axis=size ...`` (a budget the
    interval did not draw shows ``-``)."""

    def value(d: dict[str, float], label: str) -> str:
        return f"{d[label]:.6E}" if label in d else "-"

    parts = [f" elastic | iteration {iteration:8d}"]
    parts += [f"kd loss {label}: {value(kd, label)}" for label in labels]
    parts += [f"budget loss {label}: {value(budget_loss, label)}" for label in labels]
    parts += [
        f"tokens/s: {rate['tokens_per_s']:.1f}",
        f"TFLOP/s/rank: {rate['tflops_per_rank']:.4g}",
        f"peak memory/rank (GiB): {rate['peak_memory_gib']:.3f}",
    ]
    for label, row in table.items():
        sizes = " ".join(f"{axis}={_render(size)}" for axis, size in row.items())
        parts.append(f"choice {label}: {sizes}")
    return " | ".join(parts) + " |"


def _render(size: Any) -> str:
    if isinstance(size, list):
        return f"{_mean(size):g}(mean)"
    return str(size)


def _write_scalars(writer, iteration, kd, budget_loss, fractions, rate) -> None:
    for label, v in kd.items():
        writer.add_scalar(f"elastic/kd loss {label}", v, iteration)
    for label, v in budget_loss.items():
        writer.add_scalar(f"elastic/budget loss {label}", v, iteration)
    for label, row in fractions.items():
        for axis, fraction in row.items():
            writer.add_scalar(f"elastic/choice {label}/{axis}", fraction, iteration)
    writer.add_scalar("elastic/tokens per second", rate["tokens_per_s"], iteration)
    writer.add_scalar("elastic/TFLOPs per second per rank", rate["tflops_per_rank"], iteration)
    writer.add_scalar("elastic/peak memory per rank GiB", rate["peak_memory_gib"], iteration)


def install_log_hook(log_of: Callable[[], ElasticLog | None]) -> bool:
    """Wrap ``megatron.training.training.training_log`` (called every iteration on every rank)
    to end the iteration in ``log_of()`` and print its line on the last rank every
    ``--log-interval``. Idempotent; returns whether it installed now."""
    import megatron.training.training as training

    if getattr(training.training_log, _INSTALLED, False):
        return False
    orig = training.training_log

    @functools.wraps(orig)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        result = orig(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)
        log = log_of()
        if log is not None:
            from megatron.training import get_args, get_tensorboard_writer, print_rank_last

            args = get_args()
            line = log.end_iteration(
                iteration,
                args.global_batch_size * args.seq_length,
                args.log_interval,
                get_tensorboard_writer(),
            )
            if line is not None:
                print_rank_last(line)
        return result

    setattr(training_log, _INSTALLED, True)
    training.training_log = training_log
    return True
