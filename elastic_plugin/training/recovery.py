"""What a training command does around a failure: continue one metrics trace on ``--resume``,
and turn a failed save or a hung peer into one message that says what is left and what to do.

Shared by ``train`` (the teacher) and ``elastic-train``: both keep their saves in a stage
directory with history (``checkpoint.history``), so after a crash the last complete save is the
one the latest pointer names, and a rerun with ``--resume`` continues from it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import LATEST_FILE
from elastic_plugin.models.config import ConfigError, ExperimentConfig
from elastic_plugin.models.runtime import Runtime, with_saved_precision

__all__ = [
    "SCHEDULE_KEYS",
    "check_resumable_state",
    "check_resumable_training",
    "read_metrics",
    "restart_metrics",
    "save_failed_message",
    "stuck_rank_message",
]

# training.* settings that decide the loss trace from the next iteration on (the LR schedule,
# the batches and their order): a resumed run must keep them. Logging and evaluation may change.
SCHEDULE_KEYS = (
    "train_iters",
    "lr",
    "min_lr",
    "lr_warmup_iters",
    "weight_decay",
    "clip_grad",
    "global_batch_size",
    "micro_batch_size",
    "seq_length",
    "seed",
)


def check_resumable_state(meta: Mapping[str, Any], runtime: Runtime, layout, where: str) -> None:
    """The optimizer state of a save loads only into the layout (it is not resharded) and the
    precision (FP32 main weights or none) that wrote it."""
    saved_layout = meta.get("layout") or {}
    if saved_layout:  # a field added since (context parallelism) has its default in older saves
        saved_layout = {**dataclasses.asdict(type(layout)()), **saved_layout}
    if saved_layout != dataclasses.asdict(layout):
        raise ConfigError(
            f"{where} was written with layout {saved_layout}; resume with the same layout "
            f"flags (optimizer state is not resharded)"
        )
    runtime.check_resumable(meta, where)


def check_resumable_training(
    meta: Mapping[str, Any], cfg: ExperimentConfig, layout, where: str
) -> None:
    """A save continues only as the run that wrote it: the same layout and precision
    (``check_resumable_state``), model and schedule. The error names what differs."""
    check_resumable_state(meta, Runtime.of(with_saved_precision(cfg.training, meta)), layout, where)
    saved = meta.get("config") or {}
    for section, current, why in (
        ("model", cfg.model, "is another model"),
        ("data", cfg.data, "was trained on other data (--quick changes data.num_train)"),
    ):
        differ = _differing(saved.get(section) or {}, dataclasses.asdict(current))
        if differ:
            raise ConfigError(
                f"{where} {why}: {section}.{f', {section}.'.join(differ)} differ; resume with "
                f"the --config (and flags) it was trained with"
            )
    training_now = dataclasses.asdict(cfg.training)
    saved_training = saved.get("training") or {}
    changed = [
        k for k in SCHEDULE_KEYS if k in saved_training and saved_training[k] != training_now[k]
    ]
    if changed:
        was = ", ".join(f"training.{k}={saved_training[k]!r}" for k in changed)
        now = ", ".join(f"{training_now[k]!r}" for k in changed)
        raise ConfigError(
            f"{where} was trained with {was} (now {now}); resume with the same schedule "
            f"(--config, --train-iters)"
        )


def _differing(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The keys a save recorded whose value differs now, sorted."""
    return sorted(k for k, v in saved.items() if now.get(k) != v)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def restart_metrics(path: Path, start_iter: int) -> None:
    """Keep the records of iterations before ``start_iter``: a run killed after its last save
    (or resumed from an older save because a newer one was damaged) logged iterations that it
    trains again now, and the file must read as one uninterrupted trace."""
    if start_iter == 1 or not path.is_file():
        path.write_text("")
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and int(json.loads(line).get("iteration", 0)) < start_iter
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def save_failed_message(prog: str, out: Path, stage: Path, exc: OSError) -> str:
    """What a failed write leaves: the last complete save (history publishes a save only after
    it is fully written, so the earlier ones are intact) and how to continue."""
    latest = stage / LATEST_FILE
    last = (
        f"the last complete save is iteration {latest.read_text().strip()} in {stage}"
        if latest.is_file()
        else "no save was completed"
    )
    return (
        f"{prog}: error: writing under --out {out} failed ({exc}); {last}; free the space "
        f"and rerun with --resume"
    )


def stuck_rank_message(prog: str, out: Path, exc: RuntimeError) -> str | None:
    """The error naming the rank(s) that stopped, when ``exc`` is a collective that timed out
    (None for any other error: the caller re-raises it). Call on every rank that caught it."""
    import torch.distributed as dist

    from elastic_plugin.parallel import collective_timeout_s
    from elastic_plugin.training.heartbeat import Heartbeat, is_collective_timeout

    if not is_collective_timeout(exc):
        return None
    heartbeat = Heartbeat(out, dist.get_rank(), dist.get_world_size())
    return f"{prog}: error: {heartbeat.stuck_report(collective_timeout_s())}"
