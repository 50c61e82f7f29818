"""``config.json`` of a GPT-family model (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral) as our
``ModelConfig`` (torch-free).

Every such model is a pre-norm decoder: HF layer i is attention (Megatron layer 2i) then a
SwiGLU MLP or a softmax-routed MoE (Megatron layer 2i+1), so its pattern is ``*-`` / ``*E``
repeated. A family folder describes what differs in a :class:`GptSpec`: its transformers
defaults, the fields it knows, the ones it fixes (Qwen2's q/k/v bias, Qwen3's QK norm) and how
it places MoE layers. Every field either maps onto ours, is checked against the value our
Megatron model computes the same function with, or is known not to change the function
(generation, initialisation, training-only settings); anything else is refused naming the field
and its value, as for Nemotron-H (``families/nemotron_h/config.py``). transformers' bookkeeping
(its base-class fields, leading-underscore fields, token ids) is dropped first, by
``families/bookkeeping.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from elastic_plugin.families.base import refuse
from elastic_plugin.families.bookkeeping import without_bookkeeping
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "COMMON_NO_EFFECT",
    "FEATURES",
    "LLAMA3_FIXED",
    "GptSpec",
    "gpt_model_config",
    "rope_settings",
]

# Megatron's RotaryEmbedding applies Llama 3.1's frequency scaling with these fixed
# (megatron/core/models/common/embeddings/rope_utils.py: low 1, high 4, original context 8192)
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Fields of other architectures that name a feature our models do not compute: refused with
# what they are, rather than as unknown fields
FEATURES = {
    "q_lora_rank": "multi-head latent attention (MLA)",
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "qk_rope_head_dim": "multi-head latent attention (MLA)",
    "qk_nope_head_dim": "multi-head latent attention (MLA)",
    "v_head_dim": "multi-head latent attention (MLA)",
    "sinks": "attention sinks",
    "use_sinks": "attention sinks",
    "attention_sinks": "attention sinks",
    "num_sink_tokens": "attention sinks",
    "sliding_window_pattern": "sliding-window attention",
    "no_rope_layers": "layers without RoPE (NoPE)",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "output logit soft-capping",
    "n_shared_experts": "shared experts (this architecture has none in transformers)",
    "shared_expert_intermediate_size": "shared experts (this architecture has none in transformers)",
    "moe_layer_freq": "MoE layer frequency of another architecture",
    "first_k_dense_replace": "dense-then-MoE layout of another architecture",
}

# Fields no GPT family's function depends on beyond transformers' bookkeeping (which
# ``families/bookkeeping.py`` drops first); what is read is listed per family
COMMON_NO_EFFECT = {
    "use_cache": "generation",
    "initializer_range": "mapped to init_method_std (initialisation only)",
    "pretraining_tp": "sliced matmuls in Llama's reference code: the same function",
}


@dataclasses.dataclass(frozen=True)
class GptSpec:
    """What one GPT family's config.json holds and fixes."""

    architecture: str
    model_type: str
    #: transformers' defaults of the fields read (an absent field means these)
    defaults: Mapping[str, Any]
    #: fields this family's config accepts beyond the common ones, with why they are harmless
    #: (those that do change the function are read by :func:`gpt_model_config`)
    extra_no_effect: Mapping[str, str]
    #: fields read (and mapped or checked) for this family
    read: frozenset[str]
    #: q/k/v biases always (Qwen2), never (the others)
    qkv_bias: bool = False
    #: per-head RMSNorm of q and k always (Qwen3, Qwen3-MoE)
    qk_norm: bool = False
    #: whether config.json may set head_dim (Qwen2 derives it as hidden / heads)
    has_head_dim: bool = True
    #: layer i -> "mlp" or "moe" for MoE families; None: every layer dense
    mlp_kind: Callable[[Mapping[str, Any], int, str], str] | None = None
    #: other names transformers writes for a field (old or attribute-map name -> the one read)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: config.json names of the MoE sizes: (experts, top-k, expert FFN)
    moe_fields: tuple[str, str, str] = (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    )
    #: fields some released files carry (the authors' own code reads them; transformers does
    #: not) that state a property this family always has: field -> (the only value accepted,
    #: why); any other value is refused, since the checkpoint then means another function
    declared: Mapping[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)


MAX_LAYERS = 10_000  # a declared depth beyond any model's: refused before a pattern is built


def _positive_int(c: Mapping[str, Any], field: str, source: str, maximum: int | None = None) -> int:
    value = c.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{source}: {field}={value!r} must be a positive integer")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{source}: {field}={value!r} must be at most {maximum}")
    return value


def _number(c: Mapping[str, Any], field: str, source: str) -> float:
    value = c.get(field)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{source}: {field}={value!r} must be a finite number")
    return float(value)


def rope_settings(c: Mapping[str, Any], default_theta: float, source: str) -> dict[str, Any]:
    """``rotary_base`` / ``rope_scaling`` / ``rope_scaling_factor`` of a config: transformers 5's
    ``rope_parameters`` or the released files' ``rope_theta`` + ``rope_scaling``. Default RoPE
    and Llama 3.1's ``llama3`` scaling (with Megatron's fixed factors) are mapped; any other type
    or factor is refused naming the field."""
    params = c.get("rope_parameters")
    scaling = c.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError(
            f"{source}: rope_parameters={params!r} and rope_scaling={scaling!r} disagree; keep one"
        )
    name = "rope_parameters" if params is not None else "rope_scaling"
    rope = params if params is not None else scaling
    if rope is None:
        rope = {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{source}: {name}={rope!r} must be an object or null")
    theta_field = f"{name}.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope.get("rope_theta", c.get("rope_theta", default_theta))
    if "rope_theta" in rope and "rope_theta" in c and c["rope_theta"] != rope["rope_theta"]:
        raise ConfigError(
            f"{source}: rope_theta={c['rope_theta']!r} and {name}.rope_theta="
            f"{rope['rope_theta']!r} disagree; keep one"
        )
    if (
        not isinstance(theta, int | float)
        or isinstance(theta, bool)
        or not math.isfinite(theta)
        or theta <= 0
    ):
        raise ConfigError(f"{source}: {theta_field}={theta!r} must be a finite number > 0")
    if float(theta) != int(theta):
        raise refuse(source, theta_field, theta, "an integer", "Megatron's rotary_base is an int")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse(source, "partial_rotary_factor", partial, "1.0", "RoPE on the whole head")
    out: dict[str, Any] = {"rotary_base": int(theta)}
    if rope_type == "default":
        extra = sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if extra:
            raise refuse(source, f"{name}.{extra[0]}", rope[extra[0]], "absent", "default RoPE")
        return out
    if rope_type != "llama3":
        raise refuse(
            source,
            f"{name}.rope_type",
            rope_type,
            "'default', 'llama3'",
            "Megatron's RotaryEmbedding computes plain and Llama 3.1-scaled RoPE only",
        )
    for field, fixed in LLAMA3_FIXED.items():
        if rope.get(field) != fixed:
            raise refuse(
                source,
                f"{name}.{field}",
                rope.get(field),
                repr(fixed),
                "Megatron's Llama 3.1 RoPE scaling fixes low_freq_factor 1, high_freq_factor 4 "
                "and original_max_position_embeddings 8192",
            )
    factor = rope.get("factor")
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor > 0:
        raise refuse(source, f"{name}.factor", factor, "a number > 0", "the scaling factor")
    known = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", *LLAMA3_FIXED}
    extra = sorted(set(rope) - known)
    if extra:
        raise refuse(source, f"{name}.{extra[0]}", rope[extra[0]], "absent", "llama3 RoPE")
    return {**out, "rope_scaling": True, "rope_scaling_factor": float(factor)}


def _check_known(spec: GptSpec, raw: Mapping[str, Any], source: str) -> None:
    for field, what in FEATURES.items():
        if field in raw and raw[field] not in (None, False, 0, []):
            raise refuse(source, field, raw[field], "absent", f"{what} is not supported")
    for field, (value, why) in spec.declared.items():
        if field in raw and raw[field] != value:
            raise refuse(source, field, raw[field], repr(value), why)
    known = spec.read | set(COMMON_NO_EFFECT) | set(spec.extra_no_effect) | set(spec.declared)
    # layer_types is checked entry by entry (_check_attention) whatever the family; a feature
    # field that switches its feature off (0, false, null, []) is the model without it
    known |= {"layer_types", *FEATURES}
    if "sliding_window" not in known:  # a family without the field: named as the feature
        if raw.get("sliding_window") is not None:
            raise refuse(
                source,
                "sliding_window",
                raw["sliding_window"],
                "null or absent",
                "sliding-window attention is not supported",
            )
        known = known | {"sliding_window"}
    unknown = sorted(set(raw) - known)
    if unknown:
        shown = ", ".join(f"{k}={raw[k]!r}" for k in unknown[:5])
        raise ConfigError(
            f"{source}: {spec.architecture} config.json field(s) not known to leave the model's "
            f"function unchanged, so not ignored: {shown}"
            + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
        )


def _check_attention(spec: GptSpec, c: Mapping[str, Any], n_layers: int, source: str) -> None:
    rules: list[tuple[str, bool, str, str]] = [
        ("hidden_act", c.get("hidden_act") == "silu", "'silu'", "SwiGLU MLPs and experts"),
        ("attention_bias", not c.get("attention_bias"), "false", "no bias on o_proj"),
        ("mlp_bias", not c.get("mlp_bias"), "false", "our MLPs have no bias"),
        ("attention_dropout", not c.get("attention_dropout"), "0", "our models train without"),
        ("use_sliding_window", not c.get("use_sliding_window"), "false", "global attention only"),
    ]
    if "use_sliding_window" not in spec.read:  # Mixtral: sliding_window itself switches it on
        rules.append(
            ("sliding_window", c.get("sliding_window") is None, "null", "global attention only")
        )
    for field, ok, allowed, why in rules:
        if not ok:
            raise refuse(source, field, c.get(field), allowed, why)
    layer_types = c.get("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(
            f"{source}: layer_types={str(layer_types)[:80]} must list num_hidden_layers="
            f"{n_layers} entries, each 'full_attention'"
        )
    for i, kind in enumerate(layer_types):  # the first layer that is not global, by index
        if kind != "full_attention":
            raise refuse(
                source,
                f"layer_types[{i}]",
                kind,
                "'full_attention'",
                "sliding-window attention is not supported; global attention in every layer",
            )


def gpt_model_config(spec: GptSpec, config_json: Mapping[str, Any], source: str) -> ModelConfig:
    """Our ModelConfig of a GPT-family ``config.json`` (see the module docstring)."""
    config_json = without_bookkeeping(config_json, source)
    for alias, name in spec.aliases.items():
        if alias in config_json:
            value = config_json.pop(alias)
            if name in config_json and config_json[name] != value:
                raise ConfigError(
                    f"{source}: {alias}={value!r} and {name}={config_json[name]!r} disagree "
                    f"({alias} is another name of {name}); keep one"
                )
            config_json[name] = value
    _check_known(spec, config_json, source)
    c = {**spec.defaults, **config_json}
    layers = _positive_int(c, "num_hidden_layers", source, maximum=MAX_LAYERS)
    _check_attention(spec, c, layers, source)
    hidden = _positive_int(c, "hidden_size", source)
    heads = _positive_int(c, "num_attention_heads", source)
    groups = c.get("num_key_value_heads")
    groups = heads if groups is None else groups
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0 or heads % groups:
        raise ConfigError(
            f"{source}: num_key_value_heads={groups!r} must be a positive divisor of "
            f"num_attention_heads={heads}"
        )
    head_dim = c.get("head_dim") if spec.has_head_dim else None
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}"
                + (" (and head_dim is not given)" if spec.has_head_dim else "")
            )
        head_dim = hidden // heads
    head_dim = _positive_int({"head_dim": head_dim}, "head_dim", source)
    kinds = [
        spec.mlp_kind(c, i, source) if spec.mlp_kind is not None else "mlp" for i in range(layers)
    ]
    model = ModelConfig(
        hybrid_layer_pattern="".join("*-" if k == "mlp" else "*E" for k in kinds),
        hidden_size=hidden,
        vocab_size=_positive_int(c, "vocab_size", source),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim if head_dim != hidden // heads or hidden % heads else None,
        activation="swiglu",
        layernorm_epsilon=_number(c, "rms_norm_eps", source),
        position_embedding_type="rope",
        max_sequence_length=_positive_int(c, "max_position_embeddings", source),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        init_method_std=_number(c, "initializer_range", source),
        add_bias_linear=False,
        qk_layernorm=spec.qk_norm,
        add_qkv_bias=spec.qkv_bias,
        # the file's own RoPE fields (the default theta only when it names none)
        **rope_settings(config_json, float(spec.defaults.get("rope_theta", 10000.0)), source),
    )
    if "mlp" in kinds:
        model.ffn_hidden_size = _positive_int(c, "intermediate_size", source)
    if "moe" in kinds:
        experts, topk, ffn = spec.moe_fields
        model.num_moe_experts = _positive_int(c, experts, source)
        model.moe_router_topk = _positive_int(c, topk, source)
        model.moe_ffn_hidden_size = _positive_int(c, ffn, source)
        model.moe_router_score_function = "softmax"
    try:
        return model.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
