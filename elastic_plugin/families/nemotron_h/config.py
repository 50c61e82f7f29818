"""A Hugging Face NemotronH ``config.json`` as our ``ModelConfig`` (torch-free).

``elastic-plugin import`` starts the pipeline from a pretrained ``NemotronHForCausalLM`` and
``elastic-plugin params --hf`` sizes one, so both read the same mapping (through the families
registry, ``elastic_plugin/families/__init__.py``). The reference for what
a field means is transformers' own ``NemotronHConfig`` / ``NemotronHForCausalLM`` (5.24): its
defaults fill absent fields and its legacy names (``mamba_n_groups``, ``hybrid_override_pattern``,
``num_local_experts`` ...) are accepted. Every field either maps onto ours, is checked against
the values our Megatron model computes the same function with, or is known not to change the
function (initialisation, caching, token ids); anything else is refused with a ConfigError that
names the field, its value and what is allowed, because a silently ignored field would give a
different model (the same rule as our YAML configs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from elastic_plugin.families.base import refuse as _refuse
from elastic_plugin.families.bookkeeping import without_bookkeeping
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "HF_ARCHITECTURE",
    "HF_MODEL_TYPE",
    "MAMBA_NORM_EPS",
    "hf_config_notes",
    "model_config_from_hf",
]

HF_ARCHITECTURE = "NemotronHForCausalLM"
HF_MODEL_TYPE = "nemotron_h"
# hybrid_override_pattern symbols and layers_block_type names (legacy ones too) -> our kinds
_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCKS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
_PATTERN = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
# NemotronHConfig.__post_init__ / attribute_map: old name -> the field it sets
_LEGACY = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "num_local_experts": "n_routed_experts",
    "layer_types": "layers_block_type",
}
# transformers' NemotronHConfig defaults of the fields read here (an absent field means these)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "tie_word_embeddings": False,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "sliding_window": None,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "time_step_limit": [0.0, math.inf],
    "use_conv_bias": True,
    "chunk_size": 128,
    "mamba_proj_bias": False,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
    "use_bias": False,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-5,
    "hidden_dropout": 0.0,
}
# Fields that do not change what the model computes from tokens beyond transformers' bookkeeping
# (``families/bookkeeping.py`` drops that first): generation and cache settings,
# initialisation-only values, and settings transformers' NemotronH never reads.
_NO_EFFECT = {
    "auto_map": "remote code location; transformers' own NemotronH is the reference",
    "use_cache": "generation",
    "num_logits_to_keep": "generation",
    "use_mamba_kernels": "kernel choice (deprecated, no effect)",
    "mamba_ssm_cache_dtype": "generation cache",
    "time_step_min": "dt_bias initialisation (see hf_config_notes for transformers' prefill floor)",
    "time_step_max": "dt_bias initialisation",
    "time_step_floor": "dt_bias initialisation",
    "time_step_rank": "Mamba-1's dt rank: not read by transformers' NemotronH (Mamba-2 has none)",
    "rescale_prenorm_residual": "initialisation",
    "residual_in_fp32": "not read by transformers' NemotronH",
    "expand": "not read: d_inner is mamba_num_heads * mamba_head_dim",
    "moe_shared_expert_overlap": "communication schedule",
    "output_router_logits": "training output",
    "n_shared_experts": "not read: transformers' NemotronH builds one shared expert per MoE layer",
    "mtp_layers_block_type": "only with num_nextn_predict_layers > 0",
    "mtp_hybrid_override_pattern": "only with num_nextn_predict_layers > 0",
    "rope_theta": "NemotronH has no position embedding",
    "rope_scaling": "NemotronH has no position embedding",
    "rope_parameters": "NemotronH has no position embedding",
    "partial_rotary_factor": "NemotronH has no position embedding",
}
_MAPPED = {
    "vocab_size",
    "hidden_size",
    "layers_block_type",
    "hybrid_override_pattern",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "ssm_state_size",
    "conv_kernel",
    "chunk_size",
    "use_conv_bias",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "routed_scaling_factor",
    "layer_norm_epsilon",
    "norm_eps",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "initializer_range",
}
_CHECKED = {
    "hidden_act",
    "mlp_hidden_act",
    "mamba_hidden_act",
    "use_bias",
    "mlp_bias",
    "attention_bias",
    "mamba_proj_bias",
    "norm_topk_prob",
    "n_group",
    "topk_group",
    "time_step_limit",
    "num_nextn_predict_layers",
    "moe_latent_size",
    "sliding_window",
    "attention_dropout",
    "hidden_dropout",
    "attention_head_dim",  # the released remote code's name: must equal head_dim
}
# Megatron's Mamba gated RMSNorm hard-codes this epsilon; NemotronH uses layer_norm_epsilon
MAMBA_NORM_EPS = 1e-5


def _resolved(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``raw`` with legacy names under their current ones (refused when both disagree) and
    transformers' defaults for what is absent; unknown fields are refused."""
    out = dict(raw)
    for old, new in _LEGACY.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ConfigError(
                f"{source}: {old}={value!r} and {new}={out[new]!r} disagree "
                f"({old} is the legacy name of {new}); keep one"
            )
        out[new] = value
    known = _MAPPED | _CHECKED | set(_NO_EFFECT)
    unknown = sorted(set(out) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown config.json field(s) {', '.join(unknown)}: not known to leave "
            "the model's function unchanged, so they are not ignored; known fields: "
            f"{', '.join(sorted(known))}"
        )
    return {**_DEFAULTS, **out}


def _check_architecture(c: Mapping[str, Any], source: str) -> None:
    arch = c.get("architectures")
    if arch is not None and list(arch) != [HF_ARCHITECTURE]:
        raise ConfigError(
            f"{source}: unsupported architecture architectures={arch!r}; allowed: "
            f"[{HF_ARCHITECTURE!r}] (Nemotron-H / Nemotron-3, transformers' NemotronH)"
        )
    if c.get("model_type", HF_MODEL_TYPE) != HF_MODEL_TYPE:
        raise ConfigError(
            f"{source}: unsupported architecture model_type={c.get('model_type')!r}; "
            f"allowed: {HF_MODEL_TYPE!r}"
        )


def _layer_kinds(c: Mapping[str, Any], source: str) -> list[str]:
    """Layer kinds from ``layers_block_type`` and/or the legacy ``hybrid_override_pattern``."""
    from_list = from_pattern = None
    blocks = c.get("layers_block_type")
    if blocks is not None:
        if not isinstance(blocks, list) or any(b not in _BLOCKS for b in blocks):
            bad = (
                blocks if not isinstance(blocks, list) else [b for b in blocks if b not in _BLOCKS]
            )
            raise ConfigError(
                f"{source}: layers_block_type has {bad!r}; allowed entries: "
                f"{', '.join(sorted(_BLOCKS))}"
            )
        from_list = [_BLOCKS[b] for b in blocks]
    pattern = c.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or set(pattern) - set(_SYMBOLS):
            raise ConfigError(
                f"{source}: hybrid_override_pattern={pattern!r}; allowed symbols: M (Mamba-2), "
                "* (attention), - (MLP), E (MoE)"
            )
        from_pattern = [_SYMBOLS[s] for s in pattern]
    if from_list is not None and from_pattern is not None and from_list != from_pattern:
        raise ConfigError(
            f"{source}: layers_block_type and hybrid_override_pattern={pattern!r} describe "
            "different layers; keep one"
        )
    kinds = from_list if from_list is not None else from_pattern
    if not kinds:
        raise ConfigError(
            f"{source}: names no layers; needs layers_block_type (list) or "
            "hybrid_override_pattern (string of M, *, -, E)"
        )
    layers = c.get("num_hidden_layers")
    if layers is not None and layers != len(kinds):
        raise ConfigError(
            f"{source}: num_hidden_layers={layers} contradicts the {len(kinds)} layers of "
            "layers_block_type / hybrid_override_pattern"
        )
    return kinds


def _check_function(c: Mapping[str, Any], kinds: list[str], source: str) -> None:
    """Refuse every value under which NemotronH computes what our Megatron model cannot."""
    rules: list[tuple[str, bool, str, str]] = [
        ("mlp_hidden_act", c["mlp_hidden_act"] == "relu2", "'relu2'", "squared-ReLU MLPs only"),
        ("hidden_act", c.get("hidden_act", "relu2") == "relu2", "'relu2'", "squared-ReLU only"),
        ("use_bias", c["use_bias"] is False, "false", "Megatron's Mamba linears have no bias"),
        ("mamba_proj_bias", c["mamba_proj_bias"] is False, "false", "no Mamba projection bias"),
        ("mlp_bias", c["mlp_bias"] is False, "false", "our MLPs and experts have no bias"),
        ("attention_bias", c["attention_bias"] is False, "false", "no attention biases"),
        ("sliding_window", c["sliding_window"] is None, "null", "attention is global"),
        ("attention_dropout", c["attention_dropout"] == 0, "0", "our models train without"),
        ("hidden_dropout", c["hidden_dropout"] == 0, "0", "our models train without"),
        (
            "num_nextn_predict_layers",
            c["num_nextn_predict_layers"] == 0,
            "0",
            "multi-token prediction layers are not built",
        ),
    ]
    limit = c["time_step_limit"]
    bounds = [_number(x) for x in limit] if isinstance(limit, list | tuple) else []
    no_clamp = len(bounds) == 2 and bounds[0] <= 0.0 and bounds[1] == math.inf
    rules.append(
        (
            "time_step_limit",
            no_clamp,
            "[0.0, Infinity]",
            "Megatron's Mamba clamps dt to (0, inf) only",
        )
    )
    if "mamba" in kinds:
        rules += [
            ("mamba_hidden_act", c["mamba_hidden_act"] == "silu", "'silu'", "Mamba conv is SiLU"),
            (
                "layer_norm_epsilon",
                c["layer_norm_epsilon"] == MAMBA_NORM_EPS,
                repr(MAMBA_NORM_EPS),
                "Megatron's Mamba gated norm uses 1e-5, NemotronH uses one epsilon for all",
            ),
        ]
    if "moe" in kinds:
        topk = _positive_int(c, "num_experts_per_tok", source)
        rules += [
            (
                "norm_topk_prob",
                c["norm_topk_prob"] is (topk > 1),
                f"{str(topk > 1).lower()} with num_experts_per_tok={topk}",
                "Megatron normalises sigmoid top-k weights exactly when top-k > 1",
            ),
            ("n_group", c["n_group"] == 1, "1", "group-limited routing is not supported"),
            ("topk_group", c["topk_group"] == 1, "1", "group-limited routing is not supported"),
            ("moe_latent_size", c["moe_latent_size"] is None, "null", "no latent MoE"),
        ]
    legacy_head_dim = c.get("attention_head_dim")
    if legacy_head_dim is not None and legacy_head_dim != c["head_dim"]:
        rules.append(
            (
                "attention_head_dim",
                False,
                f"{c['head_dim']!r} (= head_dim)",
                "transformers' NemotronH reads head_dim; a different attention_head_dim (the "
                "remote code's name) would mean another model",
            )
        )
    for name in ("norm_eps", "rms_norm_eps"):
        if name in c and c[name] != c["layer_norm_epsilon"]:
            rules.append(
                (
                    name,
                    False,
                    f"{c['layer_norm_epsilon']!r} (= layer_norm_epsilon)",
                    "NemotronH's norms use layer_norm_epsilon; a different value contradicts it",
                )
            )
    for field, ok, allowed, why in rules:
        if not ok:
            raise _refuse(source, field, c.get(field), allowed, why)


def _number(value: Any) -> float:
    """A JSON number, including transformers' ``{"__float__": "Infinity"}`` (how 5.x writes a
    non-finite float) and the ``Infinity`` literal; NaN for anything else."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _finite(c: Mapping[str, Any], field: str, source: str) -> float:
    value = c[field]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{source}: {field}={value!r} must be a finite number")
    return float(value)


def _positive_int(c: Mapping[str, Any], field: str, source: str) -> int:
    value = c[field]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{source}: {field}={value!r} must be a positive integer")
    return value


def model_config_from_hf(
    config_json: Mapping[str, Any], source: str = "config.json"
) -> ModelConfig:
    """Our ModelConfig of a NemotronH ``config.json`` dict (see the module docstring)."""
    if not isinstance(config_json, Mapping):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    _check_architecture(config_json, source)
    c = _resolved(without_bookkeeping(config_json, source), source)
    kinds = _layer_kinds(c, source)
    _check_function(c, kinds, source)
    ints = {
        f: _positive_int(c, f, source)
        for f in ("vocab_size", "hidden_size", "max_position_embeddings")
    }
    model = ModelConfig(
        hybrid_layer_pattern="".join(_PATTERN[k] for k in kinds),
        hidden_size=ints["hidden_size"],
        vocab_size=ints["vocab_size"],
        layernorm_epsilon=float(c["layer_norm_epsilon"]),
        max_sequence_length=ints["max_position_embeddings"],
        untie_embeddings_and_output_weights=not c["tie_word_embeddings"],
        init_method_std=_finite(c, "initializer_range", source),
        activation="squared_relu",
        position_embedding_type="none",
        add_bias_linear=False,
    )
    if "attention" in kinds:
        heads = _positive_int(c, "num_attention_heads", source)
        groups = c["num_key_value_heads"] if c["num_key_value_heads"] is not None else heads
        head_dim = c["head_dim"] if c["head_dim"] is not None else ints["hidden_size"] // heads
        if not isinstance(groups, int) or groups <= 0 or heads % groups:
            raise ConfigError(
                f"{source}: num_key_value_heads={groups!r} must be a positive divisor of "
                f"num_attention_heads={heads}"
            )
        model.num_attention_heads, model.num_query_groups = heads, groups
        model.kv_channels = _positive_int({"head_dim": head_dim}, "head_dim", source)
    if "mlp" in kinds:
        model.ffn_hidden_size = _positive_int(c, "intermediate_size", source)
    if "mamba" in kinds:
        model.mamba_num_heads = _positive_int(c, "mamba_num_heads", source)
        model.mamba_head_dim = _positive_int(c, "mamba_head_dim", source)
        model.mamba_num_groups = _positive_int(c, "n_groups", source)
        model.mamba_state_dim = _positive_int(c, "ssm_state_size", source)
        model.mamba_conv_kernel = _positive_int(c, "conv_kernel", source)
        model.mamba_chunk_size = _positive_int(c, "chunk_size", source)
    if "moe" in kinds:
        _map_moe(model, c, source)
    try:
        return model.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _map_moe(model: ModelConfig, c: Mapping[str, Any], source: str) -> None:
    # transformers' NemotronHMLP takes ``intermediate_size or config.intermediate_size``: a
    # shared expert size of 0 (or null) builds one of intermediate_size, never none
    shared = c["moe_shared_expert_intermediate_size"] or c["intermediate_size"]
    if not isinstance(shared, int) or isinstance(shared, bool) or shared <= 0:
        raise ConfigError(
            f"{source}: moe_shared_expert_intermediate_size={shared!r} must be a positive integer"
        )
    scale = c["routed_scaling_factor"]
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
        raise ConfigError(f"{source}: routed_scaling_factor={scale!r} must be a number > 0")
    model.num_moe_experts = _positive_int(c, "n_routed_experts", source)
    model.moe_router_topk = _positive_int(c, "num_experts_per_tok", source)
    model.moe_ffn_hidden_size = _positive_int(c, "moe_intermediate_size", source)
    model.moe_shared_expert_intermediate_size = shared
    model.moe_router_score_function = "sigmoid"
    # NemotronH always adds e_score_correction_bias to the scores it chooses experts by
    model.moe_router_enable_expert_bias = True
    model.moe_router_topk_scaling_factor = None if scale == 1 else float(scale)


def hf_config_notes(config_json: Mapping[str, Any]) -> list[str]:
    """Accepted differences worth recording with an import (for its metadata)."""
    c = {**_DEFAULTS, **{_LEGACY.get(k, k): v for k, v in config_json.items()}}
    notes: list[str] = []
    floor = float(c.get("time_step_min", 0.001))
    if floor >= 1e-12:  # the exporter writes float32's smallest normal: no floor in effect
        notes.append(
            f"time_step_min={floor}: transformers' NemotronH clamps dt at it in its chunked "
            "(prefill) scan but not in its one-token step; the Megatron model (as the released "
            "models were trained, and as time_step_limit says) applies no dt floor"
        )
    return notes
