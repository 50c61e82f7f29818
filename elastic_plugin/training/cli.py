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

from elastic_plugin.checkpoint.lock import acquire_out_lock, add_force_unlock_arg
from elastic_plugin.cli_args import (
    add_layout_args,
    add_runtime_args,
    check_data_path_args,
    layout_from_args,
    runtime_from_args,
    start_ranks,
)
from elastic_plugin.cli_errors import EXIT_BAD_INPUT, report_bad_input
from elastic_plugin.models.config import ConfigError, load_config


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
    add_force_unlock_arg(parser)
    add_layout_args(parser)
    add_runtime_args(parser)
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
    cfg = dataclasses.replace(
        cfg, training=runtime_from_args(args, cfg.training, cfg.model, layout.pp)
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout.check_world(world)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    return cfg, layout, out


def run_train(args: argparse.Namespace) -> int:
    try:
        cfg, layout, out = _checked_inputs(args)
        lock = acquire_out_lock(out, force=args.force_unlock)  # one writer per --out
    except ConfigError as exc:
        return report_bad_input("elastic-plugin train", exc)
    with lock:
        return _train(args, cfg, layout, out)


def _train(args: argparse.Namespace, cfg, layout, out: Path) -> int:
    """The heavy part, holding --out's lock: process group, data, model, training."""
    start_ranks(timeout_minutes=args.distributed_timeout_minutes)
    from elastic_plugin.training.data_feed import build_data_feed
    from elastic_plugin.training.teacher import train_teacher

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
            f"elastic-plugin train: error: the tokenizer has {feed.vocab_size} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    run = train_teacher(
        cfg,
        layout,
        out,
        feed.train_iterator(),
        feed.valid_iterator,
        progress=not args.no_progress,
        extra_meta={"tokenizer": feed.tokenizer_path, "data": feed.describe()},
    )
    import torch.distributed as dist

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
                },
                indent=2,
            )
        )
    dist.destroy_process_group()
    return 0
