"""The elastic student's schedule: a ``TrainingConfig`` (the one schedule type) with the
student's defaults (no Megatron import: the CLI checks it before anything heavy is loaded)."""

from __future__ import annotations

from typing import Any

from elastic_plugin.models.config import DATALOADER_TYPES, TrainingConfig

__all__ = ["DATALOADER_TYPES", "STUDENT_DEFAULTS", "student_schedule"]

# where the student's schedule differs from the teacher's defaults (``TrainingConfig``)
STUDENT_DEFAULTS: dict[str, Any] = dict(
    train_iters=300,
    lr=1e-3,
    min_lr=1e-4,
    lr_warmup_iters=10,
    weight_decay=0.0,
    global_batch_size=16,
    micro_batch_size=16,
    eval_interval=100,
    eval_iters=4,
)


def student_schedule(**values: Any) -> TrainingConfig:
    """The elastic student's schedule: ``values`` over the student's defaults."""
    return TrainingConfig(**(STUDENT_DEFAULTS | values))
