"""One Hugging Face directory that serves every trained budget: the nested checkpoint.

``export --nested`` writes the full importance-ordered model once, in its family's Hub layout,
plus ``nested_config.json``: every trained budget's choice (per axis, per layer), its total and
active parameters, the budget metric, and the model config the choices refer to. Every budget is
a prefix of those weights, so ``slice`` (``elastic-plugin slice --hf DIR --budget B --out DIR2``)
and ``load_nested(dir, budget)`` build a budget's model from the files alone, with transformers
and this module (no elastic checkpoint, no Megatron); the result equals that budget's own export
bit for bit (tested).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import budget_label, match_budget, trained_listing
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "NESTED_CONFIG",
    "budget_input_amax",
    "load_nested",
    "nested_config",
    "read_nested_config",
    "slice_nested",
    "sliced_tensors",
    "write_nested_export",
]

NESTED_CONFIG = "nested_config.json"
NESTED_FORMAT = "elastic_plugin.nested/1"


def nested_config(
    meta: Mapping[str, Any], model: ModelConfig, params: Mapping[str, Mapping[str, int]]
) -> dict[str, Any]:
    """``nested_config.json`` for an elastic checkpoint's ``meta`` (``read_elastic_meta``):
    ``params`` maps each budget label to its ``{"total", "active"}``."""
    from elastic_plugin.checkpoint.meta import stored_choices, trained_budgets
    from elastic_plugin.nested.choice import choice_sizes

    choices = stored_choices(meta)
    budgets = []
    for budget in sorted(trained_budgets(meta), reverse=True):
        label = budget_label(budget)
        sizes = choice_sizes(model, choices[label])
        budgets.append(
            {
                "budget": budget,
                "label": label,
                "choice": choices[label],
                "sizes": {
                    axis: (per[None] if None in per else {str(k): v for k, v in per.items()})
                    for axis, per in sizes.items()
                },
                "params": dict(params[label]),
            }
        )
    elastic = meta["config"].get("elastic") or {}
    return {
        "format": NESTED_FORMAT,
        "budget_metric": elastic.get("budget_metric", "active_params"),
        "model": dataclasses.asdict(model),
        "budgets": budgets,
    }


def read_nested_config(path: str | Path) -> dict[str, Any]:
    """``nested_config.json`` of a nested directory, or a ConfigError naming ``--hf``."""
    file = Path(path) / NESTED_CONFIG
    if not file.is_file():
        raise ConfigError(
            f"--hf {path}: no {NESTED_CONFIG} (not a nested export; write one with "
            "elastic-plugin export --nested)"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--hf {path}: {NESTED_CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("format") != NESTED_FORMAT:
        raise ConfigError(f"--hf {path}: {NESTED_CONFIG} is not format {NESTED_FORMAT!r}")
    return config


def _budget_entry(path: str | Path, config: Mapping[str, Any], budget: float) -> dict[str, Any]:
    budgets = [float(b["budget"]) for b in config["budgets"]]
    match = match_budget(budget, budgets)
    if match is None:
        raise ConfigError(
            f"--budget {budget_label(budget)}: not a budget of {path}; trained "
            f"budgets: {trained_listing(budgets)}"
        )
    return next(b for b in config["budgets"] if float(b["budget"]) == match)


@dataclasses.dataclass
class _Budget:
    """One budget cut from a nested directory, in memory."""

    entry: dict[str, Any]  # its nested_config.json entry
    full_config: dict[str, Any]  # the directory's config.json
    model: ModelConfig
    tensors: dict[str, Any]  # transformers' names; quantized ones as stored
    quant_config: dict[str, Any] | None  # the budget's hf_quant_config.json (quantized only)


def _sliced(path: Path, budget: float) -> _Budget:
    from elastic_plugin.export.hf import HF_CONFIG, read_quant_config
    from elastic_plugin.export.hf_slicing import slice_hub_files

    config = read_nested_config(path)
    entry = _budget_entry(path, config, budget)
    model = ModelConfig(**config["model"])
    hf_config = json.loads((path / HF_CONFIG).read_text())
    fmt, quant_config = read_quant_config(path)
    if fmt is None:
        return _Budget(entry, hf_config, model, slice_hub_files(path, model, entry["choice"]), None)
    from elastic_plugin.export.quant_slicing import (
        slice_quant_config,
        slice_quantized_files,
        with_input_scales,
    )

    assert quant_config is not None
    tensors = slice_quantized_files(path, model, entry["choice"], fmt)
    if entry.get("input_amax"):  # this budget's own calibration replaces the parent's scales
        plain = {k: v for k, v in tensors.items() if not k.endswith(".input_scale")}
        tensors = with_input_scales(plain, entry["input_amax"], fmt)
    return _Budget(entry, hf_config, model, tensors, slice_quant_config(quant_config, tensors))


def _plain(budget: _Budget) -> dict[str, Any]:
    """The budget's weights as its model computes with them (quantized ones dequantized)."""
    from elastic_plugin.export.quantize import dequantize_state_dict

    if budget.quant_config is None:
        return budget.tensors
    return dequantize_state_dict(budget.tensors, budget.quant_config)


def sliced_tensors(hf_dir: str | Path, budget: float) -> dict[str, Any]:
    """Budget ``budget``'s tensors (transformers' names, as the directory stores them: its
    dtype, or quantized with their scales), sliced from a nested directory in memory."""
    return _sliced(Path(hf_dir), budget).tensors


def slice_nested(
    hf_dir: str | Path,
    budget: float,
    out_dir: str | Path,
    max_shard_size: str | int | None = None,
) -> dict[str, Any]:
    """Write budget ``budget`` of a nested directory as its own HF export into ``out_dir``
    (written as ``<out>.tmp`` and renamed: an interrupted run leaves no ``<out>``)."""
    from elastic_plugin.checkpoint.hub import DEFAULT_MAX_SHARD_BYTES, parse_shard_size
    from elastic_plugin.checkpoint.io import fresh_temporary, publish_directory
    from elastic_plugin.export.hf import config_dtype, read_quant_config, write_hf_checkpoint
    from elastic_plugin.export.hf import hf_config as make_hf_config

    path, out = Path(hf_dir), Path(out_dir)
    shard = DEFAULT_MAX_SHARD_BYTES if max_shard_size is None else parse_shard_size(max_shard_size)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {out}: exists and is not an empty directory (nothing is overwritten)"
        )
    sliced = _sliced(path, budget)
    entry, full_config, model = sliced.entry, sliced.full_config, sliced.model
    dtype = config_dtype(full_config)
    ids = {k: full_config.get(f"{k}_token_id") for k in ("pad", "bos", "eos")}
    config = make_hf_config(
        _plain(sliced), model, dtype, {k: v for k, v in ids.items() if v is not None}
    )
    tokenizer = path / "tokenizer.json"
    fmt, _ = read_quant_config(path)
    tmp = fresh_temporary(out)
    size = write_hf_checkpoint(
        tmp,
        sliced.tensors,
        config,
        dtype,
        tokenizer if tokenizer.is_file() else None,
        sliced.quant_config,
        extra_files={
            "export_meta.json": {
                "kind": "hf",
                "dtype": dtype,
                "quantize": fmt,
                "source": str(path),
                "budget": entry["budget"],
                "choice": entry["choice"],
                "params": entry["params"],
                "model": dataclasses.asdict(model),
                "sliced_from_nested": True,
            }
        },
        max_shard_bytes=shard,
    )
    publish_directory(tmp, out)
    return {
        "out": str(out.resolve()),
        "budget": entry["budget"],
        "choice": entry["choice"],
        "params": entry["params"],
        "bytes": size,
    }


def load_nested(hf_dir: str | Path, budget: float, dtype: Any = None):
    """The family's transformers model of budget ``budget``, built from a nested directory's files
    alone (per-layer widths included); ``dtype`` defaults to float32. A quantized directory's
    weights are dequantized to the exact values the quantized model multiplies with (its
    activation scales: :func:`budget_input_amax`)."""
    import torch

    from elastic_plugin.export.hf import build_hf_model
    from elastic_plugin.export.hf import hf_config as make_hf_config

    path = Path(hf_dir)
    sliced = _sliced(path, budget)
    tensors = _plain(sliced)
    config = make_hf_config(tensors, sliced.model, "fp32")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        config[key] = sliced.full_config.get(key)
    return build_hf_model(config, tensors, dtype or torch.float32, source=str(path))


def budget_input_amax(hf_dir: str | Path, budget: float) -> dict[str, float]:
    """The calibrated activation |x|max per module of budget ``budget`` of a quantized nested
    directory ({} for a weight-only or unquantized one): what its sliced ``input_scale`` hold."""
    config = read_nested_config(hf_dir)
    return dict(_budget_entry(hf_dir, config, budget).get("input_amax") or {})


def write_nested_export(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    source: Any = None,
    dtype: str = "bf16",
    max_shard_size: str | int | None = None,
    quantize: str | None = None,
    quant: Any = None,
) -> dict[str, Any]:
    """Write the nested directory of an elastic checkpoint: the full importance-ordered model once
    (``dtype``, the Hub's layout, sharded past ``max_shard_size``) and ``nested_config.json``.
    ``quantize`` "fp8" / "nvfp4": the full model quantized once so that every trained budget is a
    cut of it (``export.quant_slicing``); with ``quant.calib_samples`` each budget's own
    ModelOpt-calibrated activation |x|max goes into its ``nested_config.json`` entry
    (``input_amax``) and the stored ``input_scale`` are the full budget's.
    ``source``: ``export.extract.load_source``'s (model, meta), to load the checkpoint once."""
    from elastic_plugin.checkpoint.hub import DEFAULT_MAX_SHARD_BYTES, EXPORT_META, parse_shard_size
    from elastic_plugin.checkpoint.io import fresh_temporary, publish_directory
    from elastic_plugin.checkpoint.meta import read_elastic_meta, stored_choices, trained_budgets
    from elastic_plugin.export.extract import (
        calibrated_amax,
        load_source,
        plan_extraction,
        quantized_parent,
    )
    from elastic_plugin.export.hf import (
        hf_config,
        megatron_to_hf,
        tokenizer_token_ids,
        write_hf_checkpoint,
    )
    from elastic_plugin.nested.choice import nested_params
    from elastic_plugin.nested.slicing import nested_state_dict

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    shard = DEFAULT_MAX_SHARD_BYTES if max_shard_size is None else parse_shard_size(max_shard_size)
    # the same input checks as every per-budget HF export (format, dtype, quantization, --out)
    meta = read_elastic_meta(ckpt)
    plan = plan_extraction(
        ckpt, max(trained_budgets(meta)), out, fmt="hf", dtype=dtype, quantize=quantize, quant=quant
    )
    model = plan.model
    choices = stored_choices(meta)
    params = {label: nested_params(meta, model, choice, ckpt) for label, choice in choices.items()}
    full, _ = source if source is not None else load_source(plan)
    tensors = megatron_to_hf(nested_state_dict(full, model, {}), model)
    config = hf_config(tensors, model, dtype, tokenizer_token_ids(meta.get("tokenizer")))
    nested = nested_config(meta, model, params)
    quant_config = None
    if quantize is not None:
        from elastic_plugin.export.quant_slicing import with_input_scales

        tensors, quant_config = quantized_parent(plan, full, dict(choices))
        if plan.quant.calib_samples:
            for entry in nested["budgets"]:
                plain = megatron_to_hf(nested_state_dict(full, model, entry["choice"]), model)
                entry["input_amax"] = calibrated_amax(plan, plain, hf_config(plain, model, dtype))
            largest = nested["budgets"][0]["input_amax"]  # budgets run largest first
            tensors = with_input_scales(tensors, largest, quantize)
        nested["quantization"] = {
            "quant_algo": quant_config["quantization"]["quant_algo"],
            **dataclasses.asdict(plan.quant),
        }
    tmp = fresh_temporary(out)
    size = write_hf_checkpoint(
        tmp,
        tensors,
        config,
        dtype,
        meta.get("tokenizer"),
        quant_config,
        extra_files={
            NESTED_CONFIG: nested,
            EXPORT_META: {
                "kind": "hf-nested",
                "dtype": dtype,
                "quantize": quantize,
                "source": str(ckpt),
                "model": dataclasses.asdict(model),
            },
        },
        max_shard_bytes=shard,
    )
    publish_directory(tmp, out)
    return {
        "out": str(out.resolve()),
        "bytes": size,
        "budgets": [b["label"] for b in nested["budgets"]],
    }
