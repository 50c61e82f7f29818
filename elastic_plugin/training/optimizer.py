"""Megatron's optimizer and LR schedule, built the same way for every trainer here.

The teacher's schedule and the elastic student's (both a ``TrainingConfig``) read the same
fields (``lr``, ``min_lr``, ``lr_warmup_iters``, ``train_iters``, ``weight_decay``,
``clip_grad``), so their schedules agree and a resume restores either the same way.
"""

from __future__ import annotations

from typing import Any, Protocol

from elastic_plugin.parallel import Layout, build_optimizer
from elastic_plugin.training.step import cosine_lr_scheduler

__all__ = ["OptimizerSchedule", "optimizer_and_scheduler"]


class OptimizerSchedule(Protocol):
    """The fields of a schedule the optimizer and its LR schedule are built from."""

    lr: float
    min_lr: float
    lr_warmup_iters: int
    train_iters: int
    weight_decay: float
    clip_grad: float


def optimizer_and_scheduler(
    chunks: list, sched: OptimizerSchedule, layout: Layout, config_overrides: dict | None = None
) -> tuple[Any, Any]:
    """Megatron's (distributed when the layout says so) Adam and its cosine LR schedule;
    ``config_overrides``: parameter groups with their own LR (the elastic router's)."""
    optimizer = build_optimizer(
        chunks,
        lr=sched.lr,
        min_lr=sched.min_lr,
        weight_decay=sched.weight_decay,
        clip_grad=sched.clip_grad,
        distributed_optimizer=layout.distributed_optimizer,
        config_overrides=config_overrides,
    )
    scheduler = cosine_lr_scheduler(
        optimizer,
        sched.lr,
        sched.min_lr,
        sched.lr_warmup_iters,
        sched.train_iters,
        sched.weight_decay,
    )
    return optimizer, scheduler
