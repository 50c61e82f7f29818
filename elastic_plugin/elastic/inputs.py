"""``elastic-train``'s command line checked and resolved before Megatron is imported.

Every mistake the command line can hold (the checkpoints, the config's model and ``elastic:``
section, the layout, the schedule, the data, a ``--resume`` that does not match the saved run) is
found here, in seconds, as a ``ConfigError`` naming the flag; only torch is imported (for the
budget-reachability check). ``elastic.command`` then runs what this returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_plugin.checkpoint.meta import (
    CHECKPOINT_META,
    ELASTIC_SUBDIR,
    has_saves,
    newest_readable_meta,
    read_checkpoint_meta,
)
from elastic_plugin.cli_args import (
    blend_prefixes,
    check_data_path_args,
    layer_spec_from_args,
    layout_from_args,
    runtime_from_args,
)
from elastic_plugin.elastic.args import elastic_config_from_args
from elastic_plugin.elastic.schedule import student_schedule
from elastic_plugin.models.config import (
    ConfigError,
    ExperimentConfig,
    config_from_dict,
    load_config,
)
from elastic_plugin.models.context_parallel import check_context_parallel
from elastic_plugin.models.runtime import Runtime, with_saved_precision
from elastic_plugin.training.batching import microbatches_per_step
from elastic_plugin.training.recovery import check_resumable_state

if TYPE_CHECKING:  # checking imports no torch (parallel.py does)
    from elastic_plugin.parallel import Layout

__all__ = ["PROG", "QUICK_ITERS", "DataSource", "ElasticInputs", "check_elastic_inputs"]

PROG = "elastic-plugin elastic-train"
QUICK_ITERS = 30

# --flag -> schedule field, for flags whose default is the student's (elastic.schedule)
_SCHEDULE_FLAGS: tuple[tuple[str, str], ...] = (
    ("--train-iters", "train_iters"),
    ("--lr", "lr"),
    ("--min-lr", "min_lr"),
    ("--lr-warmup-iters", "lr_warmup_iters"),
    ("--eval-interval", "eval_interval"),
    ("--log-interval", "log_interval"),
    ("--eval-iters", "eval_iters"),
    ("--save-interval", "save_interval"),
    ("--keep-last", "keep_last"),
    ("--dataloader-type", "dataloader_type"),
)
# --flag -> field whose default comes from the experiment config's training: section
_TRAINING_FLAGS: tuple[tuple[str, str], ...] = (
    ("--seq-length", "seq_length"),
    ("--micro-batch-size", "micro_batch_size"),
    ("--global-batch-size", "global_batch_size"),
)


@dataclass
class DataSource:
    """Where batches come from: a Megatron indexed dataset, or the built-in task (re)prepared."""

    data_path: str | None = None
    valid_data_path: str | None = None
    tokenizer: str | None = None
    prepared: str | None = None  # the teacher's prepared built-in data (reused when complete)


@dataclass
class ElasticInputs:
    """A fully checked command line (checking it imported no Megatron)."""

    cfg: ExperimentConfig
    ecfg: Any  # ElasticConfig
    resolved: Any  # ResolvedElastic
    layout: Layout
    schedule: dict[str, Any]  # the student's TrainingConfig fields
    student: Path
    teacher: Path | None
    out: Path
    data: DataSource
    finished: dict[str, Any] | None = None  # --resume of a run that already reached train_iters


def _warn(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG}: warning: {message}", file=sys.stderr)


def _model_difference(a, b) -> str | None:
    for f in dataclasses.fields(a):
        if getattr(a, f.name) != getattr(b, f.name):
            return f"model.{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
    return None


def _depth_pruned_of(student, teacher) -> bool:
    """Whether ``student`` is ``teacher`` with whole layers removed (only the pattern differs,
    and the student's is a subsequence of the teacher's)."""
    same = dataclasses.replace(student, hybrid_layer_pattern=teacher.hybrid_layer_pattern)
    if _model_difference(teacher, same) is not None:
        return False
    rest = iter(teacher.hybrid_layer_pattern)
    return all(symbol in rest for symbol in student.hybrid_layer_pattern)


def _experiment_config(
    args: argparse.Namespace, meta: dict[str, Any]
) -> tuple[ExperimentConfig, dict[str, Any], str]:
    """(config, raw elastic: section, its source): the model is always the checkpoint's."""
    ckpt_cfg = config_from_dict(meta["config"], source=f"--ckpt {args.ckpt}/{CHECKPOINT_META}")
    if not args.config:
        return ckpt_cfg, ckpt_cfg.elastic, f"--ckpt {args.ckpt}/{CHECKPOINT_META}"
    cfg = load_config(args.config)
    diff = _model_difference(cfg.model, ckpt_cfg.model)
    if diff:
        raise ConfigError(
            f"--config {args.config}: its model differs from the checkpoint's "
            f"({diff}); the model always comes from --ckpt"
        )
    return cfg, cfg.elastic, f"--config {args.config}"


def _positive_flags(args: argparse.Namespace) -> None:
    """Integer flags > 0 (>= 0 where 0 means none), learning rates >= 0: named as typed."""
    for flag in (
        "--train-iters",
        "--eval-interval",
        "--log-interval",
        "--eval-iters",
        "--seq-length",
        "--micro-batch-size",
        "--global-batch-size",
        "--stop-after",
        "--profile",
    ):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value <= 0:
            raise ConfigError(f"{flag}={value} must be > 0")
    if args.profile is not None and args.stop_after is not None:
        raise ConfigError("--profile N trains N iterations itself; drop --stop-after")
    for flag in ("--save-interval", "--keep-last", "--lr-warmup-iters", "--lr", "--min-lr"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value >= 0:
            raise ConfigError(f"{flag}={value} must be >= 0")
    if args.lr is not None and args.lr == 0:
        raise ConfigError("--lr=0 must be > 0")


def _schedule(args: argparse.Namespace, cfg: ExperimentConfig) -> dict[str, Any]:
    """The student's schedule fields: flags > --quick > config training: (sizes, seed) > the
    student's defaults (``elastic.schedule``)."""
    values = dataclasses.asdict(student_schedule())
    t = cfg.training
    values.update(
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        seed=t.seed,
    )
    if args.quick:
        iters = args.train_iters or QUICK_ITERS
        values.update(
            train_iters=iters,
            eval_interval=iters,
            log_interval=min(10, iters),
            eval_iters=2,
            lr_warmup_iters=min(values["lr_warmup_iters"], iters // 3),
        )
    for flag, name in (*_SCHEDULE_FLAGS, *_TRAINING_FLAGS):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            values[name] = value
    if values["min_lr"] > values["lr"]:
        raise ConfigError(f"--min-lr={values['min_lr']} must be <= --lr={values['lr']}")
    return values


def _check_schedule(sched: dict[str, Any], cfg: ExperimentConfig, ecfg, layout, world: int) -> None:
    seq = sched["seq_length"]
    if seq > cfg.model.max_sequence_length:
        raise ConfigError(
            f"--seq-length={seq} exceeds model.max_sequence_length={cfg.model.max_sequence_length}"
        )
    for i, stage in enumerate(ecfg.curriculum):
        if stage.seq_length and stage.seq_length > seq:
            raise ConfigError(
                f"elastic.curriculum[{i}].seq_length={stage.seq_length} exceeds "
                f"--seq-length={seq}; stages train on a prefix of each sequence, so "
                f"raise --seq-length to the longest stage"
            )
    for stage_seq in [seq] + [s.seq_length for s in ecfg.curriculum if s.seq_length]:
        check_context_parallel(cfg.model, layout.cp, layout.tp, stage_seq)
    dp = layout.data_parallel(world)
    microbatches_per_step(
        sched["global_batch_size"],
        sched["micro_batch_size"],
        dp,
        names=("--global-batch-size", "--micro-batch-size"),
        context=f" (world {world} / TP {layout.tp} / PP {layout.pp} / CP {layout.cp})",
    )


def _check_layout(cfg: ExperimentConfig, layout, meta: dict[str, Any], ckpt: str) -> None:
    cfg.model.check_parallel(layout.tp, layout.pp, layout.ep)
    check_context_parallel(cfg.model, layout.cp, layout.tp)
    if layout.tp > 1 and cfg.model.count("moe") and not layout.sequence_parallel:
        raise ConfigError(
            "MoE layers with --tensor-model-parallel-size > 1 need "
            "--sequence-parallel (Megatron-Core refuses to train them otherwise)"
        )
    layout.check_world(int(os.environ.get("WORLD_SIZE", "1")))
    if meta.get("reordered"):
        return
    if layout.tp > 1 or layout.ep > 1:
        raise ConfigError(
            f"--ckpt {ckpt} is not importance-reordered; with tensor/expert parallel size > 1 the "
            f"nested widths need the reordered (strided) layout: run `elastic-plugin importance "
            f"--ckpt {ckpt} --out scores.pt` and `elastic-plugin reorder --ckpt {ckpt} --scores "
            f"scores.pt --out REORDERED`, then pass --ckpt REORDERED"
        )
    _warn(
        f"--ckpt {ckpt} is not importance-reordered; the nested models will be the first "
        f"channels in their original order (run `elastic-plugin reorder` first)"
    )


def _data_source(args: argparse.Namespace, meta: dict[str, Any]) -> DataSource:
    """--data-path, else the teacher's data as its checkpoint records it, else re-prepare the task."""
    if args.data_path:
        check_data_path_args(args)
        return DataSource(args.data_path, args.valid_data_path, args.tokenizer)
    if args.valid_data_path or args.tokenizer:
        raise ConfigError("--valid-data-path and --tokenizer go with --data-path")
    data = meta.get("data") or {}
    if data.get("data_path"):
        prefixes = (data["data_path"], data.get("valid_data_path") or data["data_path"])
        tokenizer = meta.get("tokenizer")
        if (
            not all(Path(q + ".idx").is_file() for p in prefixes for q in blend_prefixes(p))
            or not tokenizer
            or not Path(tokenizer).is_file()
        ):
            raise ConfigError(
                f"--ckpt {args.ckpt} was trained on {data['data_path']} (tokenizer "
                f"{tokenizer}), which is not readable here; pass --data-path and "
                f"--tokenizer"
            )
        return DataSource(prefixes[0], prefixes[1], tokenizer)
    prepared = data.get("prepared")
    if prepared and Path(prepared).is_dir():
        return DataSource(prepared=str(prepared))
    return DataSource()  # the built-in task, prepared again from the config's data: section


def _check_resume(
    args: argparse.Namespace,
    out: Path,
    ecfg,
    layout,
    sched: dict[str, Any],
    cfg: ExperimentConfig,
) -> dict[str, Any] | None:
    """A resumable run must match the saved one; returns the saved meta when already finished."""
    ckpt = out.joinpath(*ELASTIC_SUBDIR)
    if not has_saves(ckpt):
        if ckpt.exists() and not args.resume:
            raise ConfigError(
                f"--out {out}: {ckpt} exists but is incomplete; remove it or pass --resume"
            )
        return None
    if not args.resume:
        raise ConfigError(
            f"--out {out} already holds an elastic checkpoint ({ckpt}); pass --resume "
            f"to continue it, or choose another --out"
        )
    _, meta = newest_readable_meta(ckpt)
    training = with_saved_precision(cfg.training, meta)
    check_resumable_state(meta, Runtime.of(training), layout, f"--resume: {ckpt}")
    saved_elastic = (meta.get("config") or {}).get("elastic")
    if saved_elastic != ecfg.to_dict():
        changed = sorted(
            k for k in ecfg.to_dict() if (saved_elastic or {}).get(k) != ecfg.to_dict()[k]
        )
        raise ConfigError(
            f"--resume: {ckpt} was trained with other elastic settings "
            f"(elastic.{', elastic.'.join(changed)}); resume with the same "
            f"--config / --elastic-* flags"
        )
    saved = meta.get("scheduler") or {}
    expected = {
        "max_lr": ("--lr", sched["lr"]),
        "min_lr": ("--min-lr", sched["min_lr"]),
        "lr_decay_steps": ("--train-iters", sched["train_iters"]),
    }
    for key, (flag, value) in expected.items():
        if key in saved and float(saved[key]) != float(value):
            raise ConfigError(
                f"--resume: {ckpt} was trained with {flag} {saved[key]:g}, not "
                f"{value:g}; resume with the same schedule"
            )
    if int(meta.get("iteration", 0)) >= sched["train_iters"]:
        return meta
    return None


def check_elastic_inputs(args: argparse.Namespace) -> ElasticInputs:
    """Everything that can be wrong with the command line, found before any heavy import."""
    meta = read_checkpoint_meta(args.ckpt, "--ckpt")
    cfg, base, source = _experiment_config(args, meta)
    _positive_flags(args)
    ecfg = elastic_config_from_args(args, base=base, base_source=source)
    layout = layout_from_args(args, cfg.parallel)
    _check_layout(cfg, layout, meta, args.ckpt)
    cfg = dataclasses.replace(
        cfg, training=runtime_from_args(args, cfg.training, cfg.model, layout.pp)
    )
    resolved = ecfg.resolve(cfg.model, layout.tp, layout.ep)
    if ecfg.mode == "sliced" and not ecfg.router.hard:
        raise ConfigError(
            "--elastic-soft-masks needs --elastic-mode masked (elastic.mode=sliced "
            "slices each budget's weights, which needs hard router choices)"
        )
    teacher = None
    if ecfg.teacher == "frozen":
        teacher = Path(args.teacher_ckpt or args.ckpt)
        tmeta = read_checkpoint_meta(teacher, "--teacher-ckpt")
        tcfg = config_from_dict(
            tmeta["config"], source=f"--teacher-ckpt {teacher}/{CHECKPOINT_META}"
        )
        diff = _model_difference(tcfg.model, cfg.model)
        if diff and layout.pp == 1 and _depth_pruned_of(cfg.model, tcfg.model):
            diff = None  # a depth-pruned student (nested/depth.py) of this teacher: same logits
        if diff:
            raise ConfigError(
                f"--teacher-ckpt {teacher}: another architecture than --ckpt ({diff})"
            )
    elif args.teacher_ckpt:
        raise ConfigError(
            "--teacher-ckpt is unused with --elastic-teacher self (the model at full "
            "budget is its own teacher)"
        )
    # the student's layers are sliced; a frozen teacher only runs (spec_choice.MODEL_ROLES)
    layer_spec_from_args(args, ["student", "teacher"] if teacher is not None else ["student"])
    sched = _schedule(args, cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _check_schedule(sched, cfg, ecfg, layout, world)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    finished = _check_resume(args, out, ecfg, layout, sched, cfg)
    data = _data_source(args, meta) if finished is None else DataSource()
    covered = sum(
        stage.iters or 0
        for stage in ecfg.curriculum_in_iterations(sched["global_batch_size"], sched["seq_length"])
    )
    if covered > sched["train_iters"]:
        _warn(
            f"elastic.curriculum covers {covered} iterations but the run has "
            f"{sched['train_iters']}; later stages will not run"
        )
    return ElasticInputs(
        cfg, ecfg, resolved, layout, sched, Path(args.ckpt), teacher, out, data, finished
    )
