"""Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``): Qwen3's attention (QK norm, free head_dim)
with softmax-routed SwiGLU experts (``norm_topk_prob=true``: top-k weights renormalised, which is
Megatron's top-k-then-softmax) in the layers ``decoder_sparse_step`` / ``mlp_only_layers`` name,
dense SwiGLU MLPs (``intermediate_size``) elsewhere; no shared expert. Experts are fused in
memory and stored per expert on disk (``mlp.experts.{e}.gate_proj`` / ``up_proj`` /
``down_proj``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic_plugin.families.base import refuse
from elastic_plugin.families.gpt import GptFamily
from elastic_plugin.families.gpt.common import BASE_READ, moe_sizes
from elastic_plugin.families.gpt.config import GptSpec
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = ["FAMILY", "SPEC"]


def _mlp_kind(c: Mapping[str, Any], i: int, source: str) -> str:
    """transformers' rule: layer i is sparse unless listed in ``mlp_only_layers``, when
    ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``."""
    step, only = c.get("decoder_sparse_step"), c.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise ConfigError(f"{source}: decoder_sparse_step={step!r} must be a positive integer")
    layers = c.get("num_hidden_layers")
    if not isinstance(only, list) or any(
        not isinstance(j, int) or not 0 <= j < int(layers or 0) for j in only
    ):
        raise ConfigError(f"{source}: mlp_only_layers={only!r} must list layer indices")
    if c.get("norm_topk_prob") is not True:
        raise refuse(
            source,
            "norm_topk_prob",
            c.get("norm_topk_prob"),
            "true",
            "Megatron's softmax routing renormalises the top-k weights (no pre-softmax option "
            "in ModelConfig)",
        )
    experts = c.get("num_experts", 0)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise ConfigError(f"{source}: num_experts={experts!r} must be a non-negative integer")
    sparse = i not in only and experts > 0 and (i + 1) % step == 0
    return "moe" if sparse else "mlp"


SPEC = GptSpec(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    # transformers' Qwen3MoeConfig defaults (head_dim: its attention's hidden / heads fallback)
    defaults={
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
        "rope_theta": 10000.0,
    },
    extra_no_effect={
        "sliding_window": "read only with use_sliding_window=true (refused)",
        "max_window_layers": "read only with use_sliding_window=true (refused)",
        "output_router_logits": "output selection",
        "router_aux_loss_coef": "training loss only",
    },
    read=BASE_READ
    | {
        "attention_bias",
        "use_sliding_window",
        "decoder_sparse_step",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "num_experts",
        "norm_topk_prob",
        "mlp_only_layers",
    },
    qk_norm=True,
    mlp_kind=_mlp_kind,
    # transformers 5 writes num_local_experts (its attribute map), the released files num_experts
    aliases={"num_local_experts": "num_experts"},
    # Qwen3-Coder's releases write these for their own code (transformers does not read them)
    declared={
        "qkv_bias": (False, "Qwen3-MoE has no q/k/v bias"),
        "use_qk_norm": (True, "Qwen3-MoE always normalises queries and keys"),
    },
)


def _fields(model: ModelConfig, sizes: dict[str, int], kinds: list[str]) -> dict[str, Any]:
    return {
        "head_dim": model.head_dim,
        "intermediate_size": sizes.get("intermediate_size", model.ffn_hidden_size or 1),
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        **moe_sizes(model, sizes, "num_experts"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind == "mlp"],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


FAMILY = GptFamily(
    SPEC, "Qwen3-MoE: QK norm, softmax experts, dense layers mixed", "mixed", _fields
)
