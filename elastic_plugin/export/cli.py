"""``elastic-plugin extract`` and ``elastic-plugin export``: nested models out of an elastic checkpoint.

    elastic-plugin extract --ckpt demo_out/checkpoints/elastic --budget 0.4 --out small_0.4
    elastic-plugin extract --ckpt CKPT --budget 0.6 --interpolate --out small_0.6 \\
        --target-tensor-model-parallel-size 2
    elastic-plugin extract --ckpt CKPT --budget 0.4 --format hf --quantize nvfp4 --out hf_0.4_nvfp4
    elastic-plugin export --ckpt demo_out/checkpoints/elastic --out demo_out/exports

``extract`` cuts one budget out, as one process. The output is an ordinary Megatron dist
checkpoint (plus ``elastic_meta.json`` with kind "extracted" and the reduced config), so it loads
under any layout; the ``--target-*`` flags only check that the extracted model's sizes split that
way. ``--format hf`` writes the family's Hugging Face safetensors instead (``transformers`` loads
it; per-layer widths too, through ``elastic_plugin.export.hf.load_hf_model``), optionally with
FP8 / NVFP4 weights in ModelOpt's unified layout (``--quantize``).

``export`` writes, per trained budget, the plain Megatron checkpoint and Hugging Face NemotronH
exports in BF16 / FP8 / NVFP4 (``--gguf``: and GGUF files for llama.cpp), measures each export's
validation loss, and writes ``exports.json``, ``exports.md`` and ``exports.png`` (size vs loss).

Bad input (incomplete checkpoint, untrained or out-of-range budget, a target layout that does not
divide, an --out that already holds something) exits 2 before Megatron is imported.
"""

from __future__ import annotations

import argparse
import json
import time

from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.export.extract import QuantOptions, plan_extraction, run_extraction
from elastic_plugin.models.config import ConfigError

EXTRACT_PROG = "elastic-plugin extract"
SHARD_HELP = (
    "--format hf: largest safetensors shard (e.g. 5GB, 500MB, 2GiB; default 5GB); past it the "
    "export is sharded with model.safetensors.index.json"
)


def _add_quant_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quantized exports (FP8 / NVFP4)")
    group.add_argument(
        "--calib-samples",
        type=int,
        default=0,
        metavar="N",
        help="calibrate static activation scales (input_scale, as ModelOpt writes them) on N "
        "sequences of --calib-data with ModelOpt, per budget (default 0: weight-only)",
    )
    group.add_argument(
        "--calib-data",
        default=None,
        metavar="PREFIX",
        help="Megatron indexed dataset prefix (PREFIX.bin/.idx) for --calib-samples "
        "(default: the checkpoint's training data)",
    )
    group.add_argument(
        "--seq-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens per calibration (and, for export, validation) sequence (default: the "
        "checkpoint's training seq_length)",
    )
    group.add_argument(
        "--nvfp4-unaligned",
        default="error",
        metavar="{error,high-precision}",
        help="NVFP4 weights some budget would cut through a 16-value block along the input: "
        "refuse (default) or keep them in high precision in every budget",
    )


def _quant_options(args: argparse.Namespace) -> QuantOptions:
    if args.seq_length is not None and args.seq_length < 1:
        raise ConfigError(f"--seq-length {args.seq_length}: must be >= 1")
    return QuantOptions(args.nvfp4_unaligned, args.calib_samples, args.calib_data, args.seq_length)


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    _register_extract(subparsers)
    _register_export(subparsers)
    _register_slice(subparsers)


def _register_extract(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract",
        help="extract one nested model of an elastic checkpoint (zero-shot)",
        description="Cut the nested model of one budget out of an elastic checkpoint and save it "
        "as a plain, smaller Megatron-Core checkpoint (loads under any TP/PP/EP layout).",
    )
    parser.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="the elastic checkpoint (OUT/checkpoints/elastic of elastic-train)",
    )
    parser.add_argument(
        "--budget",
        required=True,
        type=float,
        metavar="B",
        help="a trained budget (e.g. 0.4), or one in between with --interpolate",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="new checkpoint directory (must not exist, or be empty)",
    )
    parser.add_argument(
        "--interpolate",
        action="store_true",
        help="allow an untrained budget inside the trained range (the router's choice for it)",
    )
    parser.add_argument(
        "--format",
        default="megatron",
        choices=None,
        metavar="{megatron,hf}",
        help="megatron: a plain Megatron-Core dist checkpoint (default); hf: "
        "the family's Hugging Face safetensors + config.json",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        metavar="{bf16,fp16,fp32}",
        help="--format hf: dtype of the written weights (default bf16)",
    )
    parser.add_argument(
        "--quantize",
        default=None,
        metavar="{fp8,nvfp4}",
        help="--format hf: quantize the linear weights (FP8 E4M3 per-tensor "
        "scales, or NVFP4 E2M1 with an E4M3 scale per 16 values + FP32 scale)",
    )
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE", help=SHARD_HELP)
    _add_quant_args(parser)
    add_target_layout_args(parser, "the extracted sizes must divide it")
    parser.set_defaults(func=run_extract)


TARGET_FLAGS = (
    "--target-tensor-model-parallel-size",
    "--target-pipeline-model-parallel-size",
    "--target-expert-model-parallel-size",
)


def add_target_layout_args(parser: argparse.ArgumentParser, what: str) -> None:
    """``--target-{tensor,pipeline,expert}-model-parallel-size``: a layout the output must
    split under, checked before any weight is read (the output itself is layout-free)."""
    group = parser.add_argument_group(f"target layout (checked only: {what})")
    for flag in TARGET_FLAGS:
        group.add_argument(flag, type=int, default=None, metavar="N")


def target_layout(args: argparse.Namespace) -> tuple[int, int, int] | None:
    """(tp, pp, ep) of the ``--target-*`` flags (unset ones 1), or None when none is given."""
    values = tuple(getattr(args, flag[2:].replace("-", "_")) for flag in TARGET_FLAGS)
    if all(v is None for v in values):
        return None
    for flag, value in zip(TARGET_FLAGS, values):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    return tuple(1 if v is None else v for v in values)  # type: ignore[return-value]


def run_extract(args: argparse.Namespace) -> int:
    start = time.time()
    try:
        plan = plan_extraction(
            args.ckpt,
            args.budget,
            args.out,
            args.interpolate,
            target_layout(args),
            args.format,
            args.dtype,
            args.quantize,
            args.max_shard_size,
            _quant_options(args),
        )
        summary = run_extraction(plan)  # raises ConfigError before writing (interpolated choice)
    except ConfigError as exc:
        return report_bad_input(EXTRACT_PROG, exc)
    summary["seconds"] = round(time.time() - start, 2)
    print(json.dumps(summary, indent=2))
    return 0


def _register_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export every nested model (Megatron + HF in BF16/FP8/NVFP4) and measure it",
        description="Extract every trained budget of an elastic checkpoint as a plain Megatron "
        "checkpoint and as the family's Hugging Face safetensors in each precision; report sizes, "
        "validation loss per export, and one nested checkpoint vs separate ones.",
    )
    parser.add_argument("--ckpt", required=True, metavar="DIR", help="the elastic checkpoint")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="new directory for the exports and the report"
    )
    parser.add_argument(
        "--precisions",
        default="bf16,fp8,nvfp4",
        metavar="LIST",
        help="comma-separated HF export precisions (bf16, fp8, nvfp4)",
    )
    parser.add_argument(
        "--no-megatron", action="store_true", help="skip the plain Megatron checkpoints"
    )
    parser.add_argument(
        "--eval-sequences",
        type=int,
        default=64,
        metavar="N",
        help="validation sequences per export (0: no evaluation)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help=SHARD_HELP.replace("--format hf: ", "HF exports: "),
    )
    parser.add_argument(
        "--nested",
        action="store_true",
        help="also write, per precision, OUT/nested (bf16), OUT/nested_fp8, OUT/nested_nvfp4: one "
        "Hugging Face directory with the full model once and nested_config.json, from which "
        "`elastic-plugin slice` / load_nested build any budget (quantized ones with each "
        "budget's own activation scales)",
    )
    parser.add_argument(
        "--gguf",
        nargs="+",
        default=(),
        metavar="TYPE",
        help="also write each budget's BF16 export as a GGUF file for llama.cpp, "
        "OUT/gguf/<budget>.<TYPE>.gguf, for each TYPE of f32, bf16, q8_0 (GPT families; "
        "budgets with one size per axis)",
    )
    _add_quant_args(parser)
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from elastic_plugin.export.report import REPORT_MD, export_all

    try:
        if args.eval_sequences < 0:
            raise ConfigError(f"--eval-sequences {args.eval_sequences}: must be >= 0")
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        report = export_all(
            args.ckpt,
            args.out,
            precisions,
            not args.no_megatron,
            args.eval_sequences,
            progress=not args.no_progress,
            max_shard_size=args.max_shard_size,
            nested=args.nested,
            quant=_quant_options(args),
            gguf=args.gguf,
        )
    except ConfigError as exc:
        return report_bad_input("elastic-plugin export", exc)
    print(open(f"{args.out}/{REPORT_MD}").read())
    return 0 if report["exports"] else 1


def _register_slice(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "slice",
        help="cut one budget out of a nested Hugging Face directory (export --nested)",
        description="Build one trained budget's Hugging Face export from a nested "
        "directory alone (no elastic checkpoint, no Megatron); it equals that budget's own export.",
    )
    parser.add_argument("--hf", required=True, metavar="DIR", help="the nested directory")
    parser.add_argument("--budget", required=True, type=float, metavar="B", help="a trained budget")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="new directory (must not exist, or be empty)"
    )
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE", help=SHARD_HELP)
    parser.set_defaults(func=run_slice)


def run_slice(args: argparse.Namespace) -> int:
    from elastic_plugin.export.nested_hf import slice_nested

    start = time.time()
    try:
        summary = slice_nested(args.hf, args.budget, args.out, args.max_shard_size)
    except ConfigError as exc:
        return report_bad_input("elastic-plugin slice", exc)
    summary["seconds"] = round(time.time() - start, 2)
    print(json.dumps(summary, indent=2))
    return 0
