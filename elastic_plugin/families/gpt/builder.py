"""transformers' model of GPT-family tensors: its ``config.json`` and the model.

Sizes are read from the tensors, so a nested budget describes itself. A homogeneous budget is a
stock config (``from_pretrained`` loads it alone). Per-layer widths have no stock field in these
families (transformers builds every decoder layer from one config), so, as for Nemotron-H,
``config.json`` carries ``layer_overrides`` (HF layer index -> the fields that differ) and
:func:`build_hf_model` builds those layers from a copy of the config with them; stock
transformers loading such a directory would refuse it on the shapes, not compute something else.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from elastic_plugin.families.gpt.config import LLAMA3_FIXED
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = ["build_hf_model", "hf_config", "layer_sizes", "rope_parameters"]


def rope_parameters(model: ModelConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of our RoPE settings."""
    if not model.rope_scaling:
        return {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    return {
        "rope_type": "llama3",
        "rope_theta": float(model.rotary_base),
        "factor": float(model.rope_scaling_factor),
        **LLAMA3_FIXED,
    }


def layer_sizes(
    hf: Mapping[str, torch.Tensor], model: ModelConfig, experts_field: str
) -> list[dict[str, int]]:
    """Per HF layer: query heads, and FFN width (dense) or routed experts (MoE)."""
    out = []
    for i in range(model.num_layers // 2):
        d = f"model.layers.{i}."
        fields = {
            "num_attention_heads": hf[d + "self_attn.q_proj.weight"].shape[0] // model.head_dim
        }
        if model.layer_types[2 * i + 1] == "mlp":
            fields["intermediate_size"] = hf[d + "mlp.gate_proj.weight"].shape[0]
        else:
            fields[experts_field] = hf[d + "mlp.experts.gate_up_proj"].shape[0]
        out.append(fields)
    return out


def hf_config(
    architecture: str,
    model_type: str,
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    torch_dtype: str,
    token_ids: Mapping[str, int],
    family_fields: Callable[[ModelConfig, dict[str, int], list[str]], dict[str, Any]],
    experts_field: str = "num_experts",
) -> dict[str, Any]:
    """``config.json`` of the tensors: the fields every GPT family shares, then
    ``family_fields(model, first layer sizes, layer kinds)``; per-layer sizes that differ from
    the first layer's go to ``layer_overrides``."""
    vocab, hidden = hf["model.embed_tokens.weight"].shape
    per_layer = layer_sizes(hf, model, experts_field)
    defaults: dict[str, int] = {}
    for fields in per_layer:
        for key, value in fields.items():
            defaults.setdefault(key, value)
    overrides = {
        str(i): diff
        for i, fields in enumerate(per_layer)
        if (diff := {k: v for k, v in fields.items() if defaults[k] != v})
    }
    kinds = [model.layer_types[2 * i + 1] for i in range(model.num_layers // 2)]
    first = hf["model.layers.0.self_attn.k_proj.weight"]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "torch_dtype": torch_dtype,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "num_hidden_layers": len(kinds),
        "num_attention_heads": defaults["num_attention_heads"],
        "num_key_value_heads": int(first.shape[0]) // model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_sequence_length,
        "initializer_range": model.init_method_std,
        "rms_norm_eps": model.layernorm_epsilon,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "rope_parameters": rope_parameters(model),
        "attention_dropout": 0.0,
        "pad_token_id": token_ids.get("pad"),
        "bos_token_id": token_ids.get("bos"),
        "eos_token_id": token_ids.get("eos"),
        **family_fields(model, defaults, kinds),
    }
    if overrides:
        config["layer_overrides"] = overrides
    return config


_NOT_KWARGS = (
    "architectures",
    "model_type",
    "torch_dtype",
    "quantization_config",
    "layer_overrides",
)


def build_hf_model(
    architecture: str,
    config_json: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    source: str = "the model",
):
    """The transformers ``architecture`` model of ``config_json`` holding ``state``; layers in
    ``layer_overrides`` are built from a config copy with their own sizes."""
    import transformers
    from transformers.initialization import no_init_weights

    cls = getattr(transformers, architecture)
    config = cls.config_class(**{k: v for k, v in config_json.items() if k not in _NOT_KWARGS})
    with no_init_weights():  # every weight comes from ``state`` (checked below): no random init
        model = cls(config)
        for index, fields in (config_json.get("layer_overrides") or {}).items():
            layer_config = copy.deepcopy(config)
            for key, value in fields.items():
                setattr(layer_config, key, value)
            layer = model.model.layers[int(index)]
            model.model.layers[int(index)] = type(layer)(layer_config, int(index))
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    tied = bool(config.tie_word_embeddings)
    if unexpected or [k for k in missing if k != "lm_head.weight" or not tied]:
        raise ConfigError(
            f"{source}: weights do not match config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if tied:
        model.tie_weights()
    return model.to(dtype).eval()
