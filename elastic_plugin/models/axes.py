"""The width axes of a model and the plain model of one choice of sizes: the nested vocabulary.

Every stage speaks of a nested model the same way: a *choice* maps width axes to sizes
(``{"embedding": 48, "ffn": 96, ...}``, axes left out are full). ``model_axes`` says which axes a
model has, their full size, the multiple a size must be and its minimum; ``model_for_choice``
turns a homogeneous choice into the ``ModelConfig`` of the genuinely smaller plain model (what
extraction writes and generation runs). Pure config arithmetic: no torch, no Megatron.

=============== ================================================================================
embedding        hidden channels (full ``hidden_size``); always one global choice
ffn              dense-MLP neurons of '-' layers (full ``ffn_hidden_size``), multiple of TP
shared_ffn       MoE shared-expert neurons (full ``moe_shared_expert_intermediate_size``), x TP
attention_heads  total query heads (full ``num_attention_heads``), nested within each query
                 group, so a multiple of ``num_query_groups`` (KV heads are not elastic)
mamba_heads      total Mamba heads, nested within each Mamba group: a multiple of
                 ``mamba_num_groups``
mamba_head_dim   channels per Mamba head, in [1, ``mamba_head_dim``]
experts          routed experts per MoE layer, a multiple of EP and >= ``moe_router_topk``
=============== ================================================================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "ELASTIC_AXES",
    "IMPORTANCE_AXES",
    "MODEL_FIELD",
    "model_axes",
    "model_for_choice",
    "multiple_name",
]

ELASTIC_AXES: tuple[str, ...] = (
    "embedding",
    "ffn",
    "shared_ffn",
    "attention_heads",
    "mamba_heads",
    "mamba_head_dim",
    "experts",
)

MODEL_FIELD: dict[str, str] = {
    "embedding": "hidden_size",
    "ffn": "ffn_hidden_size",
    "shared_ffn": "moe_shared_expert_intermediate_size",
    "attention_heads": "num_attention_heads",
    "mamba_heads": "mamba_num_heads",
    "mamba_head_dim": "mamba_head_dim",
    "experts": "num_moe_experts",
}  # axis -> the ModelConfig field it scales
assert tuple(MODEL_FIELD) == ELASTIC_AXES

# the axes importance scores are collected for (``importance.hooks``); one Mamba statistic
# ranks both Mamba axes (heads and head channels), and the shared expert's FFN is asked for by
# name; here, torch-free, so ``importance --axes`` is checked while parsing
IMPORTANCE_AXES: tuple[str, ...] = ("embedding", "ffn", "attention_heads", "mamba", "experts")


def model_axes(
    model: ModelConfig, tp: int = 1, ep: int = 1
) -> dict[str, tuple[int, int, int, tuple[int, ...], str]]:
    """The axes ``model`` has: name -> (full, multiple, minimum, layer numbers, unit)."""
    numbers: dict[str, tuple[int, ...]] = {
        kind: tuple(i + 1 for i, k in enumerate(model.layer_types) if k == kind)
        for kind in ("mamba", "attention", "mlp", "moe")
    }
    axes: dict[str, tuple[int, int, int, tuple[int, ...], str]] = {
        "embedding": (model.hidden_size, 1, 1, (), "hidden channels")
    }
    if numbers["mlp"]:
        axes["ffn"] = (model.ffn_hidden_size, tp, tp, numbers["mlp"], "dense-MLP neurons")
    if numbers["moe"] and model.moe_shared_expert_intermediate_size:
        axes["shared_ffn"] = (
            model.moe_shared_expert_intermediate_size,
            tp,
            tp,
            numbers["moe"],
            "shared-expert neurons",
        )
    if numbers["attention"]:
        g = model.query_groups
        axes["attention_heads"] = (
            model.num_attention_heads,
            g,
            g,
            numbers["attention"],
            "query heads",
        )
    if numbers["mamba"]:
        g = model.mamba_num_groups
        axes["mamba_heads"] = (model.mamba_num_heads, g, g, numbers["mamba"], "Mamba heads")
        axes["mamba_head_dim"] = (
            model.mamba_head_dim,
            1,
            1,
            numbers["mamba"],
            "channels per Mamba head",
        )
    if numbers["moe"]:
        smallest = ep * math.ceil(model.moe_router_topk / ep)
        axes["experts"] = (model.num_moe_experts, ep, smallest, numbers["moe"], "routed experts")
    return {name: axes[name] for name in ELASTIC_AXES if name in axes}


def multiple_name(axis: str, model: ModelConfig) -> str:
    """What a size of ``axis`` must be a multiple of, in words (for error messages)."""
    return {
        "ffn": "the tensor-parallel size",
        "shared_ffn": "the tensor-parallel size",
        "attention_heads": f"model.num_query_groups={model.query_groups} (heads are nested "
        "within each query group)",
        "mamba_heads": f"model.mamba_num_groups={model.mamba_num_groups} (heads are nested "
        "within each Mamba group)",
        "experts": "the expert-parallel size",
    }.get(axis, "1")


def model_for_choice(model: ModelConfig, choice: Mapping[str, int]) -> ModelConfig:
    """The plain (non-elastic) ModelConfig of a homogeneous integer choice: what extraction
    writes. Query groups and the attention head dim stay as in the original (only query heads
    are elastic; ``kv_channels`` is set explicitly so it no longer follows hidden/heads)."""
    changes: dict[str, Any] = {}  # ModelConfig field -> value (all int fields)
    for axis, value in choice.items():
        if axis not in MODEL_FIELD:
            raise ConfigError(f"choice axis {axis!r}; allowed: {', '.join(ELASTIC_AXES)}")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"choice[{axis!r}]={value!r}; allowed: a positive integer")
        changes[MODEL_FIELD[axis]] = value
    if model.num_attention_heads:
        changes["kv_channels"] = model.head_dim
        changes["num_query_groups"] = model.query_groups
    return dataclasses.replace(model, **changes).validate()


def choice_sizes(
    model_cfg: ModelConfig, choice: Mapping[str, int | Sequence[int]]
) -> dict[str, dict[int | None, int]]:
    """Validated sizes: axis -> {layer number: size} (``{None: size}`` for the embedding).

    Axes left out are full. A size must be what the elastic layers can compute at TP=1/EP=1
    (``config.model_axes``): a multiple of the axis' group count in [minimum, full]."""
    axes = model_axes(model_cfg)
    unknown = [name for name in choice if name not in axes]
    if unknown:
        raise ConfigError(
            f"choice axis {unknown[0]!r} is not an elastic axis of this model; "
            f"allowed: {', '.join(axes)}"
        )
    out: dict[str, dict[int | None, int]] = {}
    for name, (full, multiple, minimum, layers, _unit) in axes.items():
        value = choice.get(name, full)
        allowed = (
            f"allowed: multiples of {multiple} ({multiple_name(name, model_cfg)}) "
            f"in [{minimum}, {full}]"
        )
        if name == "experts" and minimum > multiple:
            allowed += f" (at least model.moe_router_topk={model_cfg.moe_router_topk})"
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if not layers:
                raise ConfigError(
                    f"choice[{name!r}]={list(value)!r}: one global size only (an int); {allowed}"
                )
            if len(value) != len(layers):
                raise ConfigError(
                    f"choice[{name!r}] has {len(value)} sizes; allowed: one int, "
                    f"or one per layer {list(layers)} ({len(layers)} sizes)"
                )
            items: list[object] = list(value)
        else:
            items = [value] * max(1, len(layers))
        sizes: list[int] = []
        for size in items:
            if (
                not isinstance(size, int)
                or isinstance(size, bool)
                or size % multiple
                or not minimum <= size <= full
            ):
                raise ConfigError(f"choice[{name!r}]={value!r}: {size!r} is not allowed; {allowed}")
            sizes.append(size)
        out[name] = dict(zip(layers, sizes)) if layers else {None: sizes[0]}
    return out
