"""``elastic-plugin evaluate``: the demo report (accuracy per budget and precision, budget control).

    elastic-plugin evaluate --ckpt demo_out/checkpoints/elastic --exports demo_out/exports --out demo_out

Writes ``report.json``, ``report.md``, ``accuracy_vs_params.png``, ``loss_per_budget.png`` and
``accuracy_vs_latency.png`` into --out. Bad input exits 2 before any model is loaded.
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
    parser.add_argument("--ckpt", required=True, metavar="DIR", help="the elastic checkpoint")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the report goes")
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
        default=50,
        metavar="N",
        help="problems per batched generation (accuracy, throughput)",
    )
    parser.add_argument(
        "--latency-problems",
        type=int,
        default=32,
        metavar="N",
        help="problems answered one at a time to measure batch-1 latency",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
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
