"""``elastic-plugin import``: start the pipeline from a pretrained Hugging Face model of a
supported family, or from a Megatron-LM checkpoint (hybrid model or GPTModel).

    elastic-plugin import --hf ./NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --out nano_teacher
    elastic-plugin import --megatron ./megatron_run/checkpoints --out my_teacher
    elastic-plugin importance --ckpt nano_teacher ...   # then reorder, elastic-train

The output is a ``kind: teacher`` stage directory in Megatron-LM's layout: ``iter_0000000/`` (Megatron
dist checkpoint + ``elastic_meta.json``, the tokenizer files under ``hf_tokenizer/``) and
``latest_checkpointed_iteration.txt``, read by every later stage like one ``train`` wrote.
Bad input (config.json fields our model cannot compute, missing / truncated shards, tensors that
contradict config.json, a non-empty ``--out``) exits 2 before Megatron is imported or a weight
is read.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.export.cli import add_target_layout_args, target_layout
from elastic_plugin.models.config import ConfigError, ModelConfig

IMPORT_PROG = "elastic-plugin import"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Add ``import (--hf DIR | --megatron DIR) --out CKPT [--dtype bf16|fp32] [--no-progress]
    [--target-*-parallel-size N]``."""
    parser = subparsers.add_parser(
        "import",
        help="import a Hugging Face model or a Megatron-LM checkpoint as a teacher",
        description="Convert a Hugging Face directory of a supported family (config.json + "
        "safetensors, sharded or not), or a Megatron-LM torch_dist checkpoint of a hybrid model "
        "or a GPTModel (any TP/PP/EP; architecture from its saved args; GPT layer i becomes a "
        "'*-' or '*E' pair), into a teacher checkpoint that "
        "importance, reorder and elastic-train start from. Runs as one process at TP=PP=EP=1; later stages load it in "
        "any layout.",
    )
    parser.add_argument("--hf", metavar="DIR", help="Hugging Face model directory")
    parser.add_argument(
        "--megatron",
        metavar="DIR",
        help="Megatron-LM save directory (torch_dist; latest_checkpointed_iteration.txt), "
        "instead of --hf",
    )
    parser.add_argument("--out", required=True, metavar="CKPT", help="new checkpoint directory")
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="precision the checkpoint stores (default fp32: bf16 inputs convert exactly)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_target_layout_args(parser, "the imported model's sharded sizes must divide it")
    parser.set_defaults(func=run_import_command)


def run_import_command(args: argparse.Namespace) -> int:
    """Check everything, then import; print the summary as JSON."""
    try:
        summary = _import(args)
    except ConfigError as exc:
        return report_bad_input(IMPORT_PROG, exc)
    print(json.dumps(summary, indent=2))
    return 0


def _import(args: argparse.Namespace) -> dict[str, Any]:
    """The import of exactly one of ``--hf`` / ``--megatron``."""
    if (args.hf is None) == (getattr(args, "megatron", None) is None):
        given = "both --hf and --megatron" if args.hf is not None else "neither --hf nor --megatron"
        raise ConfigError(f"give exactly one source: --hf DIR or --megatron DIR (got {given})")
    target = target_layout(args)
    if args.hf is not None:
        from elastic_plugin.export.hf_import import plan_import, run_import

        plan = plan_import(args.hf, args.out, args.dtype)
        _check_target(plan.source.model, target)
        return run_import(plan, not args.no_progress) | _target_summary(target)
    from elastic_plugin.export.megatron_import import plan_megatron_import, run_megatron_import

    mplan = plan_megatron_import(args.megatron, args.out, args.dtype)
    _check_target(mplan.source.model, target)
    return run_megatron_import(mplan, not args.no_progress) | _target_summary(target)


def _check_target(model: ModelConfig, target: tuple[int, int, int] | None) -> None:
    """The layout later stages will load the import in must split its sizes: refused here,
    naming the field and the flag, rather than after the weights were copied."""
    if target is None:
        return
    try:
        model.check_parallel(*target)
    except ConfigError as exc:
        raise ConfigError(f"the target layout (--target-*-parallel-size): {exc}") from exc


def _target_summary(target: tuple[int, int, int] | None) -> dict[str, Any]:
    if target is None:
        return {}
    return {"target_layout_checked": dict(zip(("tp", "pp", "ep"), target))}
