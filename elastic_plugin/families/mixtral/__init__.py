"""Mixtral (transformers' ``MixtralForCausalLM``): Llama's attention with softmax-routed SwiGLU
experts in every layer (top-k weights renormalised, Megatron's top-k-then-softmax), no shared
expert, no sliding window. Experts are fused in memory (``mlp.experts``) and stored on disk
under ``block_sparse_moe`` one tensor per expert: ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic_plugin.families.gpt import GptFamily, GptKeys
from elastic_plugin.families.gpt.common import BASE_READ, moe_sizes
from elastic_plugin.families.gpt.config import GptSpec
from elastic_plugin.models.config import ModelConfig

__all__ = ["FAMILY", "SPEC"]


def _every_layer(c: Mapping[str, Any], i: int, source: str) -> str:
    return "moe"


SPEC = GptSpec(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    # transformers' MixtralConfig defaults
    defaults={
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "rope_theta": 1e6,
    },
    extra_no_effect={
        "output_router_logits": "output selection",
        "router_aux_loss_coef": "training loss only",
        "router_jitter_noise": "training-time noise only (transformers applies it in train mode)",
    },
    read=BASE_READ | {"sliding_window", "num_experts_per_tok", "num_local_experts"},
    mlp_kind=_every_layer,
    # Mixtral's expert FFN width is its intermediate_size
    moe_fields=("num_local_experts", "num_experts_per_tok", "intermediate_size"),
)


def _fields(model: ModelConfig, sizes: dict[str, int], kinds: list[str]) -> dict[str, Any]:
    return {
        "head_dim": model.head_dim,
        "intermediate_size": model.moe_ffn_hidden_size,
        **moe_sizes(model, sizes, "num_local_experts"),
        "sliding_window": None,
    }


FAMILY = GptFamily(
    SPEC,
    "Mixtral: softmax experts in every layer",
    "moe",
    _fields,
    keys=GptKeys("block_sparse_moe", ("w1", "w3", "w2")),
    experts_field="num_local_experts",
)
