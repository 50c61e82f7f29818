"""The models the evaluation runs: every trained budget of an elastic checkpoint (cut out in
memory, fp32), and each exported HF variant (BF16 / FP8 / NVFP4) loaded back into a plain
Megatron model with exactly the values its file holds (quantized weights dequantized, and with
calibrated ``input_scale`` the activations fake-quantized as a runtime quantizes them)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "budget_params",
    "load_budget_models",
    "load_export_model",
    "megatron_activation_quant",
]


def load_budget_models(ckpt: str | Path, budgets: list[float]) -> dict[tuple[float, str], Any]:
    """``{(budget, "fp32"): model}`` for the trained budgets (one load of the checkpoint)."""
    from elastic_plugin.nested.model import load_nested_models

    loaded = load_nested_models(ckpt, budgets)
    return {(budget, "fp32"): model.eval() for budget, (model, _) in zip(budgets, loaded)}


def budget_params(
    ckpt: Path, meta: dict[str, Any], budgets: Sequence[float | None]
) -> dict[str, dict[str, int]]:
    """``{label: {"total", "active"}}`` per budget: a trained budget's nested model, or (budget
    None, label ``"full"``) the whole model of a non-elastic checkpoint."""
    from elastic_plugin.checkpoint.meta import budget_label, stored_choice
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.choice import homogeneous_choice, nested_params

    model = config_from_dict(meta["config"], source=f"--ckpt {ckpt}").model
    out: dict[str, dict[str, int]] = {}
    for budget in budgets:
        if budget is None:
            counts = count_parameters(model)
            out["full"] = {"total": counts.total, "active": counts.active}
            continue
        choice = homogeneous_choice(stored_choice(meta, budget, ckpt), budget)
        out[budget_label(budget)] = nested_params(meta, model, choice, ckpt)
    return out


def load_export_model(export_dir: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A plain Megatron ``HybridModel`` holding an HF export's weights, and its export meta.

    Homogeneous exports only (plain Megatron builds every layer of a kind alike)."""
    from elastic_plugin.checkpoint.hub import EXPORT_META, read_hub_tensors
    from elastic_plugin.export.hf import HF_QUANT_CONFIG, export_input_amax, hf_to_megatron
    from elastic_plugin.families import family_for_model
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.nested.choice import homogeneous_choice
    from elastic_plugin.parallel import Layout, build_model_chunks

    export_dir = Path(export_dir)
    meta = json.loads((export_dir / EXPORT_META).read_text())
    full = ModelConfig(**meta["model"])
    small = model_for_choice(full, homogeneous_choice(meta["choice"], meta["budget"]))
    tensors = family_for_model(small).from_hub(read_hub_tensors(export_dir))
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
    fmt, input_amax = export_input_amax(export_dir)
    if fmt is not None and input_amax:  # hooks stay: this model exists to be evaluated
        megatron_activation_quant(model, input_amax, fmt)
    return model.eval(), meta


def _megatron_input(key: str) -> tuple[int, str]:
    """(Megatron layer index, role) of an HF module name, from the family that names it
    (``Family.megatron_input``; the families' module names do not overlap)."""
    from elastic_plugin.families import all_families

    for family in all_families():
        found = family.megatron_input(key)
        if found is not None:
            return found
    raise ConfigError(f"calibrated input {key!r}: no Megatron module for it in any family")


def _input_modules(model: Any, key: str) -> tuple[str, list[torch.nn.Module]]:
    """(group, the Megatron modules whose input is HF module ``key``'s input). q/k/v share one
    group, as do a gated MLP's gate/up: Megatron computes each as one linear."""
    index, role = _megatron_input(key)
    layer = model.decoder.layers[index]
    single = {
        "qkv": lambda: layer.self_attention.linear_qkv,
        "proj": lambda: layer.self_attention.linear_proj,
        "mamba_in": lambda: layer.mixer.in_proj,
        "mamba_out": lambda: layer.mixer.out_proj,
        "fc1": lambda: layer.mlp.linear_fc1,
        "fc2": lambda: layer.mlp.linear_fc2,
        "shared_fc1": lambda: layer.mlp.shared_experts.linear_fc1,
        "shared_fc2": lambda: layer.mlp.shared_experts.linear_fc2,
        "experts_fc1": lambda: [e.linear_fc1 for e in layer.mlp.experts.local_experts],
        "experts_fc2": lambda: list(layer.mlp.experts.local_experts),
    }
    found = single[role]()
    # one group per Megatron module set: q/k/v (and a gated MLP's gate/up) read one input
    return f"{index}.{role}", found if isinstance(found, list) else [found]


class _Hooks:
    """The handles of :func:`megatron_activation_quant`; ``calls`` counts, per group, how often
    an input was quantized (every hook must fire)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.calls: dict[str, int] = {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def megatron_activation_quant(
    model: torch.nn.Module, input_amax: Mapping[str, float], fmt: str
) -> _Hooks:
    """Fake-quantize the inputs of a plain Megatron ``HybridModel``'s linears with an HF
    export's static activation scales (``input_amax``: transformers' module names, as
    ``export.hf.export_input_amax`` reads them), as ModelOpt quantizes them in the transformers
    model (``export.calibrate``). A routed expert's ``linear_fc2`` input is Megatron's
    ``act(fc1(x)) * prob`` (it weights tokens before fc2; transformers and the runtimes after
    down_proj): the quantizer sees ``act(fc1(x))``, the token's weight is applied after."""
    from elastic_plugin.export.calibrate import input_fake_quant

    amax: dict[str, float] = {}
    modules: dict[str, list[torch.nn.Module]] = {}
    for key, value in input_amax.items():
        group, targets = _input_modules(model, key)
        amax[group] = max(amax.get(group, 0.0), float(value))
        modules[group] = targets
    hooks = _Hooks()
    for group in sorted(amax):
        quant = input_fake_quant(amax[group], fmt, group)
        hooks.calls[group] = 0
        for module in modules[group]:
            if group.endswith(".experts_fc2"):
                hooks.handles += _expert_down_hooks(module, quant, hooks.calls, group)
            else:
                hooks.handles.append(
                    module.register_forward_pre_hook(_quantize_first(quant, hooks.calls, group))
                )
    return hooks


def _quantize_first(quant: Any, calls: dict[str, int], group: str) -> Any:
    def hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        calls[group] += 1
        return (quant(args[0]), *args[1:])

    return hook


def _expert_down_hooks(expert: Any, quant: Any, calls: dict[str, int], group: str) -> list[Any]:
    """Quantize ``act(fc1(x))`` of one local expert: its MLP receives the tokens' router
    weights (``per_token_scale``) and multiplies them in before ``linear_fc2``."""
    weights: dict[str, torch.Tensor | None] = {"scale": None}

    def remember(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        weights["scale"] = kwargs.get("per_token_scale", args[1] if len(args) > 1 else None)

    def fc2(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        calls[group] += 1
        x, scale = args[0], weights["scale"]
        if scale is None:
            return (quant(x), *args[1:])
        column = scale.unsqueeze(-1).to(x.dtype)
        safe = torch.where(column != 0, column, torch.ones_like(column))
        return (quant(x / safe) * column, *args[1:])

    return [
        expert.register_forward_pre_hook(remember, with_kwargs=True),
        expert.linear_fc2.register_forward_pre_hook(fc2),
    ]
