"""``elastic-plugin evaluate``: the demo report (accuracy per budget and precision, budget control),
or, on the user's own data, held-out language-model loss per budget and precision.

    elastic-plugin evaluate --ckpt demo_out/checkpoints/elastic --exports demo_out/exports --out demo_out
    elastic-plugin evaluate --ckpt run/checkpoints/elastic --exports run/exports --out run/eval \
        --data-path data/valid_text_document --tokenizer teacher/iter_0000000/hf_tokenizer/tokenizer.json

    elastic-plugin evaluate --ckpt run/checkpoints/elastic --budget 0.7 --tasks arc_easy,hellaswag

The demo form writes ``report.json``, ``report.md``, ``accuracy_vs_params.png``,
``loss_per_budget.png`` and ``accuracy_vs_latency.png`` into --out; the ``--data-path`` form
writes ``lm_report.json``, ``lm_report.md`` and ``loss_vs_params.png``; the ``--tasks`` form runs
standard benchmarks through lm-evaluation-harness (``harness.cli``: any HF directory with
``--hf``, a nested checkpoint at a trained ``--budget``). Bad input exits 2 before any model is
loaded.
"""

from __future__ import annotations

import argparse

from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.models.config import ConfigError


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="accuracy of every nested model and precision; budget control",
        description="Answer the task's held-out problems with every trained budget (and every "
        "exported precision), then with elastic budget control (think small, answer large) and "
        "capped thinking; write report.json / report.md and plots.",
    )
    # required by every form but --hf / --list-tasks / --write-tasks (checked in run_evaluate)
    parser.add_argument("--ckpt", default=None, metavar="DIR", help="the elastic checkpoint")
    parser.add_argument("--out", default=None, metavar="DIR", help="where the report goes")
    parser.add_argument(
        "--exports",
        default=None,
        metavar="DIR",
        help="an `elastic-plugin export` directory: also evaluate its BF16/FP8/NVFP4 models",
    )
    parser.add_argument("--num-problems", type=int, default=200, metavar="N")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="problems per batched generation (accuracy, throughput; default 50), or "
        "sequences per forward with --tasks (default 16)",
    )
    parser.add_argument(
        "--latency-problems",
        type=int,
        default=32,
        metavar="N",
        help="problems answered one at a time to measure batch-1 latency",
    )
    lm = parser.add_argument_group(
        "your own data (instead of the demo task): held-out language-model loss"
    )
    lm.add_argument(
        "--data-path",
        default=None,
        metavar="PREFIX",
        help="Megatron indexed dataset prefix (e.g. prepare-data's valid split)",
    )
    lm.add_argument("--tokenizer", default=None, metavar="FILE", help="its tokenizer.json")
    lm.add_argument("--num-sequences", type=int, default=64, metavar="N")
    lm.add_argument(
        "--seq-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sequence (default: the checkpoint's training seq_length)",
    )
    lm.add_argument("--micro-batch-size", type=int, default=8, metavar="N")
    parser.add_argument("--no-progress", action="store_true")
    from elastic_plugin.harness.cli import add_benchmark_arguments

    add_benchmark_arguments(parser)
    parser.set_defaults(func=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    from elastic_plugin.harness.cli import run_benchmarks, wants_benchmarks

    if wants_benchmarks(args):
        return run_benchmarks(args)
    missing = [
        flag for flag, value in (("--ckpt", args.ckpt), ("--out", args.out)) if value is None
    ]
    if missing:
        return report_bad_input(
            "elastic-plugin evaluate",
            ConfigError(
                f"the following arguments are required: {', '.join(missing)} (or --tasks with "
                "--ckpt/--hf for the standard benchmarks)"
            ),
        )
    if args.budget is not None:
        return report_bad_input(
            "elastic-plugin evaluate", ConfigError("--budget goes with --tasks (a benchmark run)")
        )
    if args.batch_size is None:
        args.batch_size = 50
    if args.data_path is not None or args.tokenizer is not None:
        return _run_lm(args)
    from elastic_plugin.evaluation.report import REPORT_MD, evaluate_demo

    try:
        evaluate_demo(
            args.ckpt,
            args.out,
            args.exports,
            args.num_problems,
            args.batch_size,
            args.latency_problems,
            progress=not args.no_progress,
        )
    except ConfigError as exc:
        return report_bad_input("elastic-plugin evaluate", exc)
    print(open(f"{args.out}/{REPORT_MD}").read())
    return 0


def _run_lm(args: argparse.Namespace) -> int:
    """``--data-path``: held-out loss per nested model and precision on the user's data."""
    from elastic_plugin.cli_args import check_data_path_args
    from elastic_plugin.data.jsonl import JsonlError
    from elastic_plugin.evaluation.lm_loss import LM_REPORT_MD, evaluate_lm

    try:
        if args.data_path is None:
            raise ConfigError("--tokenizer is given without --data-path (give both, or neither)")
        check_data_path_args(args)
        evaluate_lm(
            args.ckpt,
            args.out,
            args.data_path,
            args.tokenizer,
            args.exports,
            args.num_sequences,
            args.seq_length,
            args.micro_batch_size,
            progress=not args.no_progress,
        )
    except (ConfigError, JsonlError) as exc:
        return report_bad_input("elastic-plugin evaluate", exc)
    print(open(f"{args.out}/{LM_REPORT_MD}").read())
    return 0
