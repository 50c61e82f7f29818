"""The student's optimisation settings for elastic training (no Megatron import: the CLI checks
them before anything heavy is loaded)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_plugin.checkpoint.history import DEFAULT_KEEP_LAST
from elastic_plugin.models.config import ConfigError

DATALOADER_TYPES = ("shuffled", "single")


@dataclass
class ElasticSchedule:
    """The student's optimisation settings (the teacher's are in the experiment config)."""

    train_iters: int = 300
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 10
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    global_batch_size: int = 16
    micro_batch_size: int = 16
    seq_length: int = 128
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 4
    save_interval: int = 0  # 0: only at the end
    keep_last: int = DEFAULT_KEEP_LAST  # saves kept in checkpoints/elastic/iter_*; 0: keep all
    seed: int = 1234
    # "shuffled": each epoch in a seeded random order (our sampler); "single": in the dataset's
    # order, as Megatron-LM's default ``--dataloader-type single`` reads (GPTDataset has already
    # shuffled its samples), so a run here and one in Megatron-LM's loop see the same batches
    dataloader_type: str = "shuffled"

    def check(self) -> None:
        for name in (
            "train_iters",
            "global_batch_size",
            "micro_batch_size",
            "seq_length",
            "log_interval",
            "eval_interval",
            "eval_iters",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"elastic training: {name}={value!r} must be a positive integer")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ConfigError(
                f"elastic training: keep_last={self.keep_last!r} must be an integer >= 0"
            )
        if self.dataloader_type not in DATALOADER_TYPES:
            raise ConfigError(
                f"elastic training: dataloader_type={self.dataloader_type!r} must be one of "
                f"{', '.join(DATALOADER_TYPES)} (--dataloader-type)"
            )
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(
                f"elastic training: need lr > 0 and 0 <= min_lr <= lr "
                f"(lr={self.lr}, min_lr={self.min_lr})"
            )
