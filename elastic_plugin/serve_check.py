"""``elastic-plugin serve-check DIR``: load an export the way a serving runtime would, from its
files alone, and check its logits against the elastic model it was cut from.

    elastic-plugin serve-check demo_out/exports/hf_0.4_bf16
    elastic-plugin serve-check demo_out/exports/nested --budget 0.77 [--ckpt CKPT] [--json]

Loader: a homogeneous, unquantized export goes through stock
``transformers.AutoModelForCausalLM.from_pretrained`` (missing or unexpected keys fail the check);
per-layer (``layer_overrides``) and FP8 / NVFP4 exports, which stock transformers cannot run on a
CPU, through ``export.hf.load_hf_model`` (quantized weights dequantized to the stored values,
activations fake-quantized with the stored ``input_scale`` when calibrated); a nested directory
through ``export.nested_hf.load_nested``. Reference: the elastic checkpoint named
in ``export_meta.json`` (or ``--ckpt``) with the budget's stored choice, run by the elastic layers,
so this command sits above the stages (it is the one place after training that builds the
trainer's model). Exit 0 when the logits agree within the precision's tolerance, 1 when not, 2 for
bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, cast

from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.models.config import ConfigError

PROG = "elastic-plugin serve-check"
# max |diff| / ||ref|| allowed per precision (fp32: absolute max diff instead)
FP32_ABS_TOL = 1e-4
REL_TOL = {"bf16": 0.02, "fp16": 0.02, "fp8": 0.1, "nvfp4": 0.3}


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-check",
        help="load an export as a runtime would and check it against the elastic model",
        description="Load a Hugging Face export (or one budget of a nested directory) from its "
        "files alone, run a forward and compare its logits with the elastic checkpoint's model "
        "at that budget.",
    )
    parser.add_argument("dir", metavar="DIR", help="an HF export, or a nested directory")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="B",
        help="the budget to check (nested directories only)",
    )
    parser.add_argument(
        "--ckpt",
        default=None,
        metavar="DIR",
        help="the elastic checkpoint (default: the source in export_meta.json)",
    )
    parser.add_argument("--tokens", type=int, default=32, metavar="N", help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_serve_check)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the files and flags say, checked before any model is built."""
    from elastic_plugin.checkpoint.hub import EXPORT_META, hub_weight_files
    from elastic_plugin.checkpoint.meta import (
        match_budget,
        read_elastic_meta,
        stored_choice,
        trained_budgets,
    )
    from elastic_plugin.export.hf import (
        HF_CONFIG,
        config_dtype,
        export_input_amax,
        read_quant_config,
    )
    from elastic_plugin.export.nested_hf import NESTED_CONFIG, budget_input_amax, read_nested_config

    path = Path(args.dir)
    if not (path / HF_CONFIG).is_file():
        raise ConfigError(f"DIR {path}: no {HF_CONFIG} (not a Hugging Face export)")
    hub_weight_files(path)
    if args.tokens < 2:
        raise ConfigError(f"--tokens {args.tokens}: must be >= 2")
    export_meta = (
        json.loads((path / EXPORT_META).read_text()) if (path / EXPORT_META).is_file() else {}
    )
    nested = (path / NESTED_CONFIG).is_file()
    if nested and args.budget is None:
        raise ConfigError(f"--budget: {path} is a nested directory; name the budget to check")
    if not nested and args.budget is not None:
        raise ConfigError(f"--budget goes with a nested directory; {path} holds one budget")
    ckpt = args.ckpt or export_meta.get("source")
    if not ckpt:
        raise ConfigError(f"--ckpt: {path}/{EXPORT_META} names no source checkpoint; pass --ckpt")
    meta = read_elastic_meta(ckpt)
    if nested:
        read_nested_config(path)
        budget = args.budget
    else:
        budget = float(export_meta["budget"])
    match = match_budget(float(budget), trained_budgets(meta))
    if match is None:
        raise ConfigError(f"--budget {budget}: not a trained budget of --ckpt {ckpt}")
    config = json.loads((path / HF_CONFIG).read_text())
    quantize, _ = read_quant_config(path)
    if quantize is None:
        input_amax: dict[str, float] = {}
    elif nested:
        input_amax = budget_input_amax(path, match)
    else:
        input_amax = export_input_amax(path)[1]
    dtype = config_dtype(config)
    choice = stored_choice(meta, match, ckpt)
    return {
        "path": path,
        "ckpt": Path(ckpt),
        "meta": meta,
        "budget": match,
        "choice": choice,
        "nested": nested,
        "per_layer": "layer_overrides" in config
        or any(isinstance(v, list) and len(set(v)) > 1 for v in choice.values()),
        "precision": quantize or dtype,
        "input_amax": input_amax,
        "vocab": int(config["vocab_size"]),
    }


def _load_export(plan: dict[str, Any]) -> tuple[Any, str, list[str], list[str]]:
    """(model, loader, missing keys, unexpected keys) as a runtime would load the files."""
    import torch

    if plan["nested"]:
        from elastic_plugin.export.nested_hf import load_nested

        return load_nested(plan["path"], plan["budget"]), "load_nested", [], []
    if plan["per_layer"] or plan["precision"] in ("fp8", "nvfp4"):
        from elastic_plugin.export.hf import load_hf_model

        return load_hf_model(plan["path"]), "elastic_plugin load_hf_model", [], []
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        plan["path"], dtype=torch.float32, output_loading_info=True
    )
    # with output_loading_info transformers returns (model, info); its stubs say model only
    model, info = cast(tuple[Any, dict[str, list[str]]], loaded)
    return (
        model.eval(),
        "transformers AutoModelForCausalLM",
        list(info["missing_keys"]),
        list(info["unexpected_keys"]),
    )


def _reference(plan: dict[str, Any], tokens: Any) -> Any:
    """The elastic model's logits at the budget's stored choice (TP=PP=EP=1, this process)."""
    import torch

    from elastic_plugin.cli_args import start_ranks
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.model import build_elastic_chunks
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.parallel import Layout

    start_ranks(Layout(), one_process="serve-check runs as one process")
    meta = plan["meta"]
    model_cfg = config_from_dict(meta["config"]).model
    resolved = ElasticConfig.from_dict(meta["config"]["elastic"]).resolve(model_cfg)
    chunks, state, _ = build_elastic_chunks(plan["ckpt"], Layout(), resolved, wrap_ddp=False)
    model = chunks[0].eval()
    state.set_sizes(plan["choice"])
    position = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position, None).float()


def _activation_quant(model: Any, input_amax: dict[str, float], fmt: str) -> Any:
    """The export's static activation quantization (its ``input_scale``) applied as a runtime
    would, through ModelOpt's fake quant; nothing for weight-only and unquantized exports."""
    from contextlib import nullcontext

    if not input_amax:
        return nullcontext()
    from elastic_plugin.export.calibrate import activation_fake_quant

    return activation_fake_quant(model, input_amax, fmt)


def serve_check(args: argparse.Namespace) -> dict[str, Any]:
    """The check (see the module docstring); ConfigError for bad input."""
    import torch

    plan = _plan(args)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, plan["vocab"], (2, args.tokens), generator=gen)
    model, loader, missing, unexpected = _load_export(plan)
    amax = plan["input_amax"]
    with torch.no_grad(), _activation_quant(model, amax, plan["precision"]):
        logits = model(tokens).logits.float()
    reference = _reference(plan, tokens)
    diff = (logits - reference).abs().max().item()
    rel = ((logits - reference).norm() / reference.norm()).item()
    precision = plan["precision"]
    ok = (
        not missing
        and not unexpected
        and (diff <= FP32_ABS_TOL if precision == "fp32" else rel <= REL_TOL.get(precision, 0.3))
    )
    return {
        "dir": str(plan["path"]),
        "loader": loader,
        "budget": plan["budget"],
        "precision": precision,
        "per_layer": plan["per_layer"],
        "activation_quant": bool(amax),
        "missing_keys": missing,
        "unexpected_keys": unexpected,
        "max_abs_diff": diff,
        "rel_diff": rel,
        "tolerance": (
            {"max_abs_diff": FP32_ABS_TOL}
            if precision == "fp32"
            else {"rel_diff": REL_TOL.get(precision, 0.3)}
        ),
        "ok": ok,
    }


def run_serve_check(args: argparse.Namespace) -> int:
    try:
        result = serve_check(args)
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        verdict = "OK" if result["ok"] else "MISMATCH"
        print(
            f"{verdict}: {result['dir']} (budget {result['budget']:g}, {result['precision']}, "
            f"{result['loader']}): max |diff| {result['max_abs_diff']:.3e}, relative "
            f"{result['rel_diff']:.3e}, tolerance {result['tolerance']}"
        )
        if result["missing_keys"] or result["unexpected_keys"]:
            print(
                f"missing keys {result['missing_keys'][:5]}, unexpected "
                f"{result['unexpected_keys'][:5]}",
                file=sys.stderr,
            )
    return 0 if result["ok"] else 1
