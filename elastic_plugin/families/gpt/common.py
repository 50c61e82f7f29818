"""config.json fields every GPT family reads, and transformers' defaults they share (torch-free)."""

from __future__ import annotations

from typing import Any

from elastic_plugin.models.config import ModelConfig

__all__ = ["BASE_READ", "dense_fields", "moe_sizes"]

# read by gpt_model_config for every GPT family (mapped or checked)
BASE_READ = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "attention_dropout",
    }
)


def dense_fields(model: ModelConfig, sizes: dict[str, int], kinds: list[str]) -> dict[str, Any]:
    """config.json fields of a dense GPT model beyond the shared ones."""
    return {
        "intermediate_size": sizes.get("intermediate_size", model.ffn_hidden_size or 1),
        "head_dim": model.head_dim,
    }


def moe_sizes(model: ModelConfig, sizes: dict[str, int], experts_field: str) -> dict[str, int]:
    """Experts, top-k and expert FFN width of an MoE GPT model."""
    return {
        experts_field: sizes.get(experts_field, model.num_moe_experts),
        "num_experts_per_tok": model.moe_router_topk,
    }
