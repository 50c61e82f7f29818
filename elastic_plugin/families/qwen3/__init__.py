"""Qwen3 (transformers' ``Qwen3ForCausalLM``): Llama's block with a per-head RMSNorm of queries and
keys (``ModelConfig.qk_layernorm``; weights ``head_dim``-sized) and a ``head_dim`` that need not be
hidden / heads (``ModelConfig.kv_channels``); no biases, no sliding window."""

from __future__ import annotations

from typing import Any

from elastic_plugin.families.gpt import GptFamily
from elastic_plugin.families.gpt.common import BASE_READ, dense_fields
from elastic_plugin.families.gpt.config import GptSpec
from elastic_plugin.models.config import ModelConfig

__all__ = ["FAMILY", "SPEC"]

SPEC = GptSpec(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    # transformers' Qwen3Config defaults
    defaults={
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "rope_theta": 10000.0,
    },
    extra_no_effect={
        "sliding_window": "read only with use_sliding_window=true (refused)",
        "max_window_layers": "read only with use_sliding_window=true (refused)",
    },
    read=BASE_READ | {"attention_bias", "use_sliding_window", "layer_types"},
    qk_norm=True,
)


def _fields(model: ModelConfig, sizes: dict[str, int], kinds: list[str]) -> dict[str, Any]:
    return {
        **dense_fields(model, sizes, kinds),
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": len(kinds),
    }


FAMILY = GptFamily(SPEC, "Qwen3: QK norm, free head_dim", "dense", _fields)
