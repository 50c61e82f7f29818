"""The models the evaluation runs: every trained budget of an elastic checkpoint (cut out in
memory, fp32), and each exported HF variant (BF16 / FP8 / NVFP4) loaded back into a plain
Megatron model with exactly the values its file holds (quantized weights dequantized)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = ["load_budget_models", "load_export_model"]


def load_budget_models(ckpt: str | Path, budgets: list[float]) -> dict[tuple[float, str], Any]:
    """``{(budget, "fp32"): model}`` for the trained budgets (one load of the checkpoint)."""
    from elastic_plugin.nested.model import load_nested_models

    loaded = load_nested_models(ckpt, budgets)
    return {(budget, "fp32"): model.eval() for budget, (model, _) in zip(budgets, loaded)}


def load_export_model(export_dir: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A plain Megatron ``HybridModel`` holding an HF export's weights, and its export meta.

    Homogeneous exports only (plain Megatron builds every layer of a kind alike)."""
    from elastic_plugin.checkpoint.hub import from_hub, read_hub_tensors
    from elastic_plugin.export.extract import EXPORT_META
    from elastic_plugin.export.hf import HF_QUANT_CONFIG, hf_to_megatron
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.nested.choice import homogeneous_choice
    from elastic_plugin.parallel import Layout, build_model_chunks

    export_dir = Path(export_dir)
    meta = json.loads((export_dir / EXPORT_META).read_text())
    full = ModelConfig(**meta["model"])
    small = model_for_choice(full, homogeneous_choice(meta["choice"], meta["budget"]))
    tensors = from_hub(read_hub_tensors(export_dir))
    if (export_dir / HF_QUANT_CONFIG).is_file():
        from elastic_plugin.export.quantize import dequantize_state_dict

        tensors = dequantize_state_dict(
            tensors, json.loads((export_dir / HF_QUANT_CONFIG).read_text())
        )
    state = {k: v.float() for k, v in hf_to_megatron(tensors, small).items()}
    model = build_model_chunks(small, Layout(), wrap_ddp=False)[0][0]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConfigError(
            f"{export_dir}: weights do not fit the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    return model.eval(), meta
