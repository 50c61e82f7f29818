"""Llama (transformers' ``LlamaForCausalLM``): ``*-`` pairs, SwiGLU, RoPE (default or Llama 3.1's
``llama3`` scaling), GQA, RMSNorm, tied or untied embeddings, no biases. On disk the names are
transformers' own (``model.layers.{i}.self_attn.q_proj.weight`` ...)."""

from __future__ import annotations

from typing import Any

from elastic_plugin.families.gpt import GptFamily
from elastic_plugin.families.gpt.common import BASE_READ, dense_fields
from elastic_plugin.families.gpt.config import GptSpec
from elastic_plugin.models.config import ModelConfig

__all__ = ["FAMILY", "SPEC"]

SPEC = GptSpec(
    architecture="LlamaForCausalLM",
    model_type="llama",
    # transformers' LlamaConfig defaults
    defaults={
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "rope_theta": 10000.0,
    },
    extra_no_effect={},
    read=BASE_READ | {"attention_bias", "mlp_bias"},
)


def _fields(model: ModelConfig, sizes: dict[str, int], kinds: list[str]) -> dict[str, Any]:
    return {**dense_fields(model, sizes, kinds), "attention_bias": False, "mlp_bias": False}


FAMILY = GptFamily(SPEC, "Llama 2/3/3.1+ (llama3 RoPE scaling), tied or untied", "dense", _fields)
