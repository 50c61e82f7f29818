"""``elastic-plugin elastic-train``: train every nested budget of a reordered checkpoint in one run.

    elastic-plugin elastic-train --ckpt demo_out/checkpoints/reordered --out demo_out
    torchrun --nproc_per_node 8 -m elastic_plugin.cli elastic-train --ckpt CKPT --out OUT \\
        --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 --resume

Runs as one process or under ``torchrun`` with any TP/PP/EP/DP layout. The model comes from the
checkpoint; the ``elastic:`` settings from ``--config`` (an experiment YAML) or the checkpoint's own
config, then ``--elastic-config`` and the ``--elastic-*`` flags. The data is what the teacher was
trained on (its checkpoint records where) or ``--data-path``. This module parses; the command line
is checked by ``elastic.inputs`` before Megatron is imported (bad input fails in seconds with exit
code 2 and a message naming the flag) and run by ``elastic.command``.
"""

from __future__ import annotations

import argparse
import json
import os

from elastic_plugin.checkpoint.lock import acquire_out_lock, add_force_unlock_arg
from elastic_plugin.cli_args import (
    add_exit_signal_arg,
    add_layer_spec_arg,
    add_layout_args,
    add_runtime_args,
)
from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.elastic import command
from elastic_plugin.elastic.args import add_elastic_args
from elastic_plugin.elastic.inputs import PROG, QUICK_ITERS, check_elastic_inputs
from elastic_plugin.elastic.schedule import DATALOADER_TYPES
from elastic_plugin.models.config import ConfigError


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "elastic-train",
        help="train all nested budgets of a reordered checkpoint (elastic)",
        description="Distil every budget of an importance-reordered checkpoint from the frozen "
        "teacher, with a budget router, in one run (any TP/PP/EP layout). Writes "
        "OUT/checkpoints/elastic, OUT/elastic_metrics.jsonl and loss/router plots.",
    )
    parser.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="the importance-reordered checkpoint (elastic-plugin reorder --out)",
    )
    parser.add_argument(
        "--teacher-ckpt",
        default=None,
        metavar="DIR",
        help="the frozen teacher (default: --ckpt, which computes the same function)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="experiment YAML whose elastic: section (and training: defaults) to use; "
        "default: the checkpoint's own config",
    )
    parser.add_argument("--out", default="demo_out", metavar="DIR", help="output folder")
    sched = parser.add_argument_group(
        "schedule (defaults: the config's training: section for "
        "sequence length and batch sizes, else the student's defaults: elastic/schedule.py)"
    )
    sched.add_argument("--train-iters", type=int, default=None)
    sched.add_argument(
        "--lr",
        type=float,
        default=None,
        help="model learning rate (router: x elastic.router.lr_mult)",
    )
    sched.add_argument("--min-lr", type=float, default=None)
    sched.add_argument("--lr-warmup-iters", type=int, default=None)
    sched.add_argument("--micro-batch-size", type=int, default=None)
    sched.add_argument("--global-batch-size", type=int, default=None)
    sched.add_argument("--seq-length", type=int, default=None)
    sched.add_argument("--eval-interval", type=int, default=None)
    sched.add_argument("--log-interval", type=int, default=None)
    sched.add_argument("--eval-iters", type=int, default=None)
    sched.add_argument(
        "--dataloader-type",
        choices=DATALOADER_TYPES,
        default=None,
        help="shuffled (default): every epoch in a seeded random order; single: in the "
        "dataset's order, as Megatron-LM's --dataloader-type single (the same batches as "
        "examples/pretrain_elastic.py on the same data)",
    )
    sched.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="checkpoint every N iterations (0: only at the end)",
    )
    sched.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="N",
        help="keep the newest N saves in OUT/checkpoints/elastic/iter_* (default 2; 0: all); "
        "older ones are removed only after a new save verified",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest save of OUT/checkpoints/elastic that verifies (else "
        "start; damaged newer saves are skipped, and named); safe to pass on every "
        "(re)submission of a job",
    )
    parser.add_argument(
        "--no-save-optim",
        action="store_true",
        help="save the model without the optimizer state (Megatron-LM's flag; a third of the "
        "bytes): for a checkpoint that only seeds another run (a --resume from it is refused)",
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="train at most N iterations in this job, checkpoint and exit; "
        "rerun with --resume to continue (time-limited jobs)",
    )
    add_exit_signal_arg(parser)
    parser.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="N",
        help="scaling measurement: train N iterations, write each rank's step time, tokens/s, "
        "TFLOP/s, peak memory and budgets per iteration to OUT/profile/rank_NNNNN.jsonl; no "
        "evaluation, no checkpoint (examples/slurm/sweep.sh, scaling-report)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run ({QUICK_ITERS} iterations, evaluation at the end)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--data-path",
        default=None,
        metavar="PREFIX",
        help="your Megatron indexed dataset prefix (train); default: the data "
        "the checkpoint was trained on",
    )
    parser.add_argument("--valid-data-path", default=None, metavar="PREFIX")
    parser.add_argument(
        "--tokenizer", default=None, metavar="FILE", help="tokenizer.json for --data-path"
    )
    add_force_unlock_arg(parser)
    add_layout_args(parser)
    add_runtime_args(parser)
    add_layer_spec_arg(parser, "the frozen teacher and the elastic student")
    add_elastic_args(parser)
    parser.set_defaults(func=run_elastic_train)


# ------------------------------------------------------------------------------ input checks


def run_elastic_train(args: argparse.Namespace) -> int:
    try:
        inputs = check_elastic_inputs(args)
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    if inputs.finished is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(command.finished_summary(inputs), indent=2))
        return 0
    try:
        lock = acquire_out_lock(inputs.out, force=args.force_unlock)  # one writer per --out
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    with lock:
        return command.train(inputs, args)
