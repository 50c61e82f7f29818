"""Qwen2 / Qwen2.5 (transformers' ``Qwen2ForCausalLM``): Llama's block with biases on the query,
key and value projections (only those: ``ModelConfig.add_qkv_bias``); no sliding window."""

from __future__ import annotations

from typing import Any

from elastic_plugin.families.gpt import GptFamily
from elastic_plugin.families.gpt.common import BASE_READ, dense_fields
from elastic_plugin.families.gpt.config import GptSpec
from elastic_plugin.models.config import ModelConfig

__all__ = ["FAMILY", "SPEC"]

SPEC = GptSpec(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    # transformers' Qwen2Config defaults
    defaults={
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "rope_theta": 10000.0,
    },
    extra_no_effect={
        "sliding_window": "read only with use_sliding_window=true (refused)",
        "max_window_layers": "read only with use_sliding_window=true (refused)",
    },
    read=BASE_READ | {"use_sliding_window", "layer_types"},
    qkv_bias=True,
    # Qwen2.5's base releases write it (transformers' Qwen2 does not read it)
    declared={"use_mrope": (False, "multimodal RoPE (Qwen2-VL's) is not supported")},
)


def _fields(model: ModelConfig, sizes: dict[str, int], kinds: list[str]) -> dict[str, Any]:
    return {
        **dense_fields(model, sizes, kinds),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": len(kinds),
    }


FAMILY = GptFamily(SPEC, "Qwen2 / Qwen2.5: q/k/v biases", "dense", _fields)
