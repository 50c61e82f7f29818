"""``elastic-plugin train``: the main job's first stage, training the teacher.

Runs as one process (``make demo``) or under ``torchrun`` with any TP/PP/EP layout. Data is the
built-in reasoning task (prepared on first use) or the user's own Megatron indexed dataset
(``--data-path`` + ``--tokenizer``). All input is checked before any model is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from elastic_plugin.checkpoint.history import DEFAULT_KEEP_LAST, resolve_checkpoint
from elastic_plugin.checkpoint.lock import acquire_out_lock, add_force_unlock_arg
from elastic_plugin.checkpoint.meta import TEACHER_SUBDIR, has_saves, newest_readable_meta
from elastic_plugin.cli_args import (
    add_exit_signal_arg,
    add_layer_spec_arg,
    add_layout_args,
    add_runtime_args,
    check_data_path_args,
    exit_signal_from_args,
    layer_spec_from_args,
    layout_from_args,
    runtime_from_args,
    start_ranks,
)
from elastic_plugin.cli_errors import EXIT_BAD_INPUT, report_bad_input
from elastic_plugin.models.config import ConfigError, load_config
from elastic_plugin.models.context_parallel import check_context_parallel
from elastic_plugin.training.recovery import (
    check_resumable_training,
    save_failed_message,
    stuck_rank_message,
)

PROG = "elastic-plugin train"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train the teacher model (Megatron-Core, any TP/PP/EP layout)",
        description="Train the full-size (teacher) model through Megatron-Core and save a dist "
        "checkpoint, metrics and a loss plot into --out.",
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="experiment YAML")
    parser.add_argument("--out", default="demo_out", metavar="DIR", help="output folder")
    parser.add_argument(
        "--data-path",
        default=None,
        metavar="PREFIX",
        help="your Megatron indexed dataset prefix (train); default: built-in task",
    )
    parser.add_argument("--valid-data-path", default=None, metavar="PREFIX")
    parser.add_argument(
        "--tokenizer", default=None, metavar="FILE", help="tokenizer.json for --data-path"
    )
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (fewer iterations and examples) to check the pipeline",
    )
    parser.add_argument("--no-progress", action="store_true")
    saves = parser.add_argument_group("checkpoints (Megatron-LM's layout: iter_NNNNNNN + pointer)")
    saves.add_argument(
        "--save-interval",
        type=int,
        default=None,
        metavar="N",
        help="also save every N iterations (default: training.save_interval, 0: only at the "
        "end), for --resume",
    )
    saves.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="N",
        help=f"keep the newest N saves in OUT/checkpoints/teacher/iter_* (default: "
        f"training.keep_last, {DEFAULT_KEEP_LAST}; 0: all); older ones are removed only after a "
        "new save verified",
    )
    saves.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest save of OUT/checkpoints/teacher that verifies (else "
        "start; damaged newer saves are skipped, and named); safe on every (re)submission",
    )
    saves.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="train at most N iterations in this job, save and exit; rerun with --resume",
    )
    add_exit_signal_arg(saves)
    add_force_unlock_arg(parser)
    add_layout_args(parser)
    add_runtime_args(parser)
    add_layer_spec_arg(parser, "the trained model")
    parser.set_defaults(func=run_train)


def _checked_inputs(args: argparse.Namespace):
    """Everything that can be wrong with the command line, found before any heavy work."""
    cfg = load_config(args.config)
    training = cfg.training
    data = cfg.data
    if args.train_iters is not None:
        if args.train_iters <= 0:
            raise ConfigError(f"--train-iters={args.train_iters} must be > 0")
        training = dataclasses.replace(training, train_iters=args.train_iters)
    if args.save_interval is not None:  # checked below, with --stop-after
        training = dataclasses.replace(training, save_interval=args.save_interval)
    if args.keep_last is not None:
        training = dataclasses.replace(training, keep_last=args.keep_last)
    if args.quick:
        training = dataclasses.replace(
            training,
            train_iters=min(training.train_iters, 60),
            eval_interval=30,
            log_interval=10,
            lr_warmup_iters=min(training.lr_warmup_iters, 10),
            eval_iters=2,
        )
        data = dataclasses.replace(
            data, num_train=min(data.num_train, 3000), num_valid=min(data.num_valid, 200)
        )
    if args.data_path:
        check_data_path_args(args)
    cfg = dataclasses.replace(cfg, training=training, data=data)
    layout = layout_from_args(args, cfg.parallel)
    cfg.model.check_parallel(layout.tp, layout.pp, layout.ep)
    check_context_parallel(cfg.model, layout.cp, layout.tp, cfg.training.seq_length)
    cfg = dataclasses.replace(
        cfg, training=runtime_from_args(args, cfg.training, cfg.model, layout.pp)
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout.check_world(world)
    layer_spec_from_args(args, ["trained"])
    for flag, value, least in (
        ("--save-interval", args.save_interval, 0),
        ("--keep-last", args.keep_last, 0),
        ("--stop-after", args.stop_after, 1),
    ):
        if value is not None and value < least:
            raise ConfigError(f"{flag}={value} must be >= {least}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    finished = _check_existing_saves(args, cfg, layout, out)
    return cfg, layout, out, finished


def _check_existing_saves(args: argparse.Namespace, cfg, layout, out: Path) -> dict | None:
    """A teacher stage that already has saves is continued (--resume, as the same run) or
    refused, never overwritten; returns the newest save's metadata when it is finished."""
    stage = out.joinpath(*TEACHER_SUBDIR)
    if not has_saves(stage):
        return None
    if not args.resume:
        raise ConfigError(
            f"--out {out} already holds a teacher checkpoint ({stage}); pass --resume to "
            f"continue it, or choose another --out"
        )
    readable, meta = newest_readable_meta(stage)
    check_resumable_training(meta, cfg, layout, f"--resume: {readable}")
    return meta if int(meta.get("iteration", 0)) >= cfg.training.train_iters else None


def run_train(args: argparse.Namespace) -> int:
    try:
        cfg, layout, out, finished = _checked_inputs(args)
        if finished is not None:
            if int(os.environ.get("RANK", "0")) == 0:
                print(json.dumps(_summary(finished, out), indent=2))
            return 0
        lock = acquire_out_lock(out, force=args.force_unlock)  # one writer per --out
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    with lock:
        return _train(args, cfg, layout, out)


def _summary(meta: dict, out: Path) -> dict:
    """What a finished run reports when rerun with --resume: its newest save."""
    return {
        "checkpoint": str(resolve_checkpoint(out.joinpath(*TEACHER_SUBDIR))),
        "iterations": meta.get("iteration"),
        "train_loss": meta.get("final_train_loss"),
        "valid_loss": meta.get("final_valid_loss"),
        "already_trained": True,
    }


def _train(args: argparse.Namespace, cfg, layout, out: Path) -> int:
    """The heavy part, holding --out's lock: process group, data, model, training."""
    start_ranks(timeout_minutes=args.distributed_timeout_minutes)
    from elastic_plugin.training.data_feed import build_data_feed
    from elastic_plugin.training.teacher import SavePolicy, train_teacher

    feed = build_data_feed(
        cfg,
        out,
        layout,
        data_path=args.data_path,
        valid_data_path=args.valid_data_path,
        tokenizer_path=args.tokenizer,
        progress=not args.no_progress,
    )
    if feed.vocab_size > cfg.model.vocab_size:
        print(
            f"{PROG}: error: the tokenizer has {feed.vocab_size} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    import torch.distributed as dist

    try:
        run = train_teacher(
            cfg,
            layout,
            out,
            feed.train_iterator,
            feed.valid_iterator,
            progress=not args.no_progress,
            extra_meta={"tokenizer": feed.tokenizer_path, "data": feed.describe()},
            saves=SavePolicy(args.resume, args.stop_after, exit_signal_from_args(args)),
        )
    except ConfigError as exc:  # found after start-up (a damaged save); every rank alike
        dist.destroy_process_group()
        return report_bad_input(PROG, exc)
    except OSError as exc:  # a full disk or a lost filesystem while saving
        stage = out.joinpath(*TEACHER_SUBDIR)
        print(save_failed_message(PROG, out, stage, exc), file=sys.stderr, flush=True)
        return 1
    except RuntimeError as exc:  # a peer never joined a collective: name the stuck rank
        report = stuck_rank_message(PROG, out, exc)
        if report is None:
            raise
        print(report, file=sys.stderr, flush=True)
        return 1

    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "checkpoint": run.checkpoint_dir,
                    "iterations": run.iterations,
                    "train_loss": run.final_train_loss,
                    "valid_loss": run.final_valid_loss,
                    "plot": run.plot_path,
                    "seconds": round(run.seconds, 1),
                    **(
                        {
                            "stopped_at": f"{run.iterations}/{cfg.training.train_iters}: rerun "
                            "with --resume to continue"
                        }
                        if run.iterations < cfg.training.train_iters
                        else {}
                    ),
                    **({"preempted_by": run.preempted_by} if run.preempted_by else {}),
                },
                indent=2,
            )
        )
    dist.destroy_process_group()
    return 0
