"""``elastic-plugin export``: every nested model of an elastic checkpoint, in every precision.

    elastic-plugin export --ckpt demo_out/checkpoints/elastic --out demo_out/exports

Writes, per trained budget, the plain Megatron checkpoint and Hugging Face NemotronH exports in
BF16 / FP8 / NVFP4, measures each export's validation loss, and writes ``exports.json``,
``exports.md`` and ``exports.png`` (size vs loss). Bad input exits 2 before anything is loaded.
"""

from __future__ import annotations

import argparse

from elastic_plugin.models.config import ConfigError

from elastic_plugin.cli_errors import report_bad_input


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="export every nested model (Megatron + HF in BF16/FP8/NVFP4) and measure it",
        description="Extract every trained budget of an elastic checkpoint as a plain Megatron "
        "checkpoint and as Hugging Face NemotronH safetensors in each precision; report sizes, "
        "validation loss per export, and one nested checkpoint vs separate ones.")
    parser.add_argument("--ckpt", required=True, metavar="DIR", help="the elastic checkpoint")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="new directory for the exports and the report")
    parser.add_argument("--precisions", default="bf16,fp8,nvfp4", metavar="LIST",
                        help="comma-separated HF export precisions (bf16, fp8, nvfp4)")
    parser.add_argument("--no-megatron", action="store_true",
                        help="skip the plain Megatron checkpoints")
    parser.add_argument("--eval-sequences", type=int, default=64, metavar="N",
                        help="validation sequences per export (0: no evaluation)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from elastic_plugin.export.report import REPORT_MD, export_all

    try:
        if args.eval_sequences < 0:
            raise ConfigError(f"--eval-sequences {args.eval_sequences}: must be >= 0")
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        report = export_all(args.ckpt, args.out, precisions, not args.no_megatron,
                            args.eval_sequences, progress=not args.no_progress)
    except ConfigError as exc:
        return report_bad_input("elastic-plugin export", exc)
    print(open(f"{args.out}/{REPORT_MD}").read())
    return 0 if report["exports"] else 1
