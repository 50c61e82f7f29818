"""``elastic-plugin extract``: one nested model of an elastic checkpoint as a plain Megatron model.

    elastic-plugin extract --ckpt demo_out/checkpoints/elastic --budget 0.4 --out small_0.4
    elastic-plugin extract --ckpt CKPT --budget 0.6 --interpolate --out small_0.6 \\
        --target-tensor-model-parallel-size 2
    elastic-plugin extract --ckpt CKPT --budget 0.4 --format hf --quantize nvfp4 --out hf_0.4_nvfp4

Runs as one process. The output is an ordinary Megatron dist checkpoint (plus
``elastic_meta.json`` with kind "extracted" and the reduced config), so it loads under any layout;
the ``--target-*`` flags only check that the extracted model's sizes split that way. ``--format hf``
writes Hugging Face NemotronH safetensors instead (``transformers`` loads it; per-layer widths
too, through ``elastic_plugin.export.hf.load_hf_model``), optionally with FP8 / NVFP4 weights in
ModelOpt's unified layout (``--quantize``). Bad input
(incomplete checkpoint, untrained or out-of-range budget, a target layout that does not divide,
an --out that already holds something) fails with exit code 2 before Megatron is imported.
"""

from __future__ import annotations

import argparse
import json
import time

from elastic_plugin.elastic.extract import plan_extraction, run_extraction
from elastic_plugin.models.config import ConfigError

from elastic_plugin.cli_errors import report_bad_input
PROG = "elastic-plugin extract"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract", help="extract one nested model of an elastic checkpoint (zero-shot)",
        description="Cut the nested model of one budget out of an elastic checkpoint and save it "
        "as a plain, smaller Megatron-Core checkpoint (loads under any TP/PP/EP layout).")
    parser.add_argument("--ckpt", required=True, metavar="DIR",
                        help="the elastic checkpoint (OUT/checkpoints/elastic of elastic-train)")
    parser.add_argument("--budget", required=True, type=float, metavar="B",
                        help="a trained budget (e.g. 0.4), or one in between with --interpolate")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="new checkpoint directory (must not exist, or be empty)")
    parser.add_argument("--interpolate", action="store_true",
                        help="allow an untrained budget inside the trained range (the router's "
                        "choice for it)")
    parser.add_argument("--format", default="megatron", choices=None, metavar="{megatron,hf}",
                        help="megatron: a plain Megatron-Core dist checkpoint (default); hf: "
                        "Hugging Face NemotronH safetensors + config.json")
    parser.add_argument("--dtype", default=None, metavar="{bf16,fp16,fp32}",
                        help="--format hf: dtype of the written weights (default bf16)")
    parser.add_argument("--quantize", default=None, metavar="{fp8,nvfp4}",
                        help="--format hf: quantize the linear weights (FP8 E4M3 per-tensor "
                        "scales, or NVFP4 E2M1 with an E4M3 scale per 16 values + FP32 scale)")
    group = parser.add_argument_group("target layout (checked only: the extracted sizes must "
                                      "divide it)")
    group.add_argument("--target-tensor-model-parallel-size", type=int, default=None, metavar="N")
    group.add_argument("--target-pipeline-model-parallel-size", type=int, default=None,
                       metavar="N")
    group.add_argument("--target-expert-model-parallel-size", type=int, default=None, metavar="N")
    parser.set_defaults(func=run_extract)


def _target(args: argparse.Namespace) -> tuple[int, int, int] | None:
    values = (args.target_tensor_model_parallel_size, args.target_pipeline_model_parallel_size,
              args.target_expert_model_parallel_size)
    if all(v is None for v in values):
        return None
    for flag, value in zip(("--target-tensor-model-parallel-size",
                            "--target-pipeline-model-parallel-size",
                            "--target-expert-model-parallel-size"), values):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    return tuple(1 if v is None else v for v in values)  # type: ignore[return-value]



def run_extract(args: argparse.Namespace) -> int:
    start = time.time()
    try:
        plan = plan_extraction(args.ckpt, args.budget, args.out, args.interpolate, _target(args),
                               args.format, args.dtype, args.quantize)
        summary = run_extraction(plan)  # raises ConfigError before writing (interpolated choice)
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    summary["seconds"] = round(time.time() - start, 2)
    print(json.dumps(summary, indent=2))
    return 0
