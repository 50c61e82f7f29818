"""``elastic-plugin compare``: does the method pay? The elastic run's nested models against
pruning + distilling each size alone, training each size from scratch, and zero-shot pruning,
with the same data, teacher and evaluation.

    elastic-plugin compare --ckpt demo_out/checkpoints/elastic --out demo_out/compare
    elastic-plugin compare --ckpt demo_out/checkpoints/elastic --out cmp --budgets 0.4 \\
        --routes elastic,prune_distil,zero_shot --token-budgets equal_cost --seeds 1

Writes ``compare.json``, ``compare.md`` and ``compare_accuracy_vs_params.png`` into --out (and
one folder per trained model under --out/runs, reused by a rerun). Bad input exits 2 before
anything is trained.
"""

from __future__ import annotations

import argparse

from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.comparison.plan import ROUTES, TOKEN_BUDGETS
from elastic_plugin.models.config import ConfigError

PROG = "elastic-plugin compare"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="the elastic run vs pruning/distilling or training each size separately",
        description="For each trained budget's architecture: the elastic model, the same "
        "architecture pruned from the teacher and distilled alone, trained from scratch, and "
        "pruned with no training, at equal total cost and at equal tokens per model; writes "
        "compare.json / compare.md and a plot.",
    )
    parser.add_argument("--ckpt", required=True, metavar="DIR", help="the elastic checkpoint")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the report goes")
    parser.add_argument(
        "--reordered",
        default=None,
        metavar="DIR",
        help="the importance-ordered teacher the elastic run started from (default: "
        "checkpoints/reordered next to --ckpt)",
    )
    parser.add_argument(
        "--budgets",
        default=None,
        metavar="LIST",
        help="trained budgets to compare, comma-separated, or 'smallest' (default: every one "
        "below 1.0)",
    )
    parser.add_argument("--routes", default=",".join(ROUTES), metavar="LIST")
    parser.add_argument(
        "--token-budgets",
        default=",".join(TOKEN_BUDGETS),
        metavar="LIST",
        help="equal_cost: the elastic run's tokens split over the sizes; equal_tokens: the "
        "elastic run's tokens for each size",
    )
    parser.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds per trained route")
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        metavar="F",
        help="train the separate routes on F x their token budget (a reduced, cheaper run)",
    )
    parser.add_argument("--num-problems", type=int, default=200, metavar="N")
    parser.add_argument("--batch-size", type=int, default=50, metavar="N")
    parser.add_argument("--eval-sequences", type=int, default=64, metavar="N")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_compare_cli)


def run_compare_cli(args: argparse.Namespace) -> int:
    from elastic_plugin.comparison.compare import check_inputs, run_compare

    try:
        inputs = check_inputs(
            args.ckpt,
            args.out,
            reordered=args.reordered,
            budgets=args.budgets,
            routes=args.routes,
            token_budgets=args.token_budgets,
            seeds=args.seeds,
            scale=args.scale,
            num_problems=args.num_problems,
            batch_size=args.batch_size,
            eval_sequences=args.eval_sequences,
        )
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    from elastic_plugin.comparison.report import markdown

    report = run_compare(inputs, progress=not args.no_progress)
    print(markdown(report))
    return 0
