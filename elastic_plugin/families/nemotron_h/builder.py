"""transformers' ``NemotronHForCausalLM`` of our tensors: its ``config.json`` and the model.

Sizes are read from the tensors, not from a config, so a heterogeneous nested model (a different
width per layer) converts the same way. Stock ``transformers`` builds every layer of a kind from
one set of config fields; for per-layer widths ``config.json`` carries ``layer_overrides`` (layer
index -> the fields that differ) and :func:`build_hf_model` builds those layers with them.
Homogeneous exports load with ``AutoModelForCausalLM.from_pretrained`` alone.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = ["HF_BLOCK", "NO_DT_FLOOR", "PATTERN", "build_hf_model", "hf_config"]

# HF block types, keyed by our layer kinds (Mamba is "linear_attention" in transformers >= 5)
HF_BLOCK = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
PATTERN = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
# Megatron's Mamba mixer applies no dt floor (dt_limit (0, inf)); NemotronH clamps dt at
# time_step_min, whose log it also takes for initialisation: the smallest normal float32 keeps
# the clamp a no-op for every positive dt.
NO_DT_FLOOR = float(torch.finfo(torch.float32).tiny)


def _layer_fields(
    kind: str, hf: Mapping[str, torch.Tensor], i: int, head_dim: int
) -> dict[str, int]:
    """The NemotronH config fields of layer ``i``, read off its tensors."""
    p = f"model.layers.{i}.mixer."
    if kind == "mamba":
        heads = hf[p + "A_log"].numel()
        return {
            "mamba_num_heads": heads,
            "mamba_head_dim": hf[p + "out_proj.weight"].shape[1] // heads,
        }
    if kind == "attention":
        return {"num_attention_heads": hf[p + "q_proj.weight"].shape[0] // head_dim}
    if kind == "mlp":
        return {"intermediate_size": hf[p + "up_proj.weight"].shape[0]}
    up = hf[p + "experts.up_proj"]
    shared = hf.get(p + "shared_experts.up_proj.weight")
    return {
        "n_routed_experts": up.shape[0],
        "moe_intermediate_size": up.shape[1],
        "moe_shared_expert_intermediate_size": 0 if shared is None else shared.shape[0],
    }


def hf_config(
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    torch_dtype: str,
    token_ids: Mapping[str, int],
) -> dict[str, Any]:
    """``config.json`` for the converted tensors. Global fields take the first layer of each
    kind; layers that differ go to ``layer_overrides`` (only heterogeneous models have any)."""
    vocab, hidden = hf["model.embeddings.weight"].shape
    per_layer = [
        _layer_fields(kind, hf, i, model.head_dim) for i, kind in enumerate(model.layer_types)
    ]
    defaults: dict[str, int] = {}
    for fields in per_layer:
        for key, value in fields.items():
            defaults.setdefault(key, value)
    overrides = {
        str(i): diff
        for i, fields in enumerate(per_layer)
        if (diff := {k: v for k, v in fields.items() if defaults[k] != v})
    }
    blocks = [HF_BLOCK[kind] for kind in model.layer_types]
    ids = dict(token_ids)
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "torch_dtype": torch_dtype,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "layers_block_type": blocks,
        "num_hidden_layers": len(blocks),
        "hybrid_override_pattern": "".join(PATTERN[k] for k in model.layer_types),
        "num_attention_heads": defaults.get(
            "num_attention_heads", max(model.num_attention_heads, 1)
        ),
        "num_key_value_heads": model.query_groups if model.count("attention") else 1,
        "head_dim": model.head_dim,
        "attention_bias": False,
        "intermediate_size": defaults.get("intermediate_size", model.ffn_hidden_size or 1),
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "use_bias": False,
        "mamba_num_heads": defaults.get("mamba_num_heads", model.mamba_num_heads or 1),
        "mamba_head_dim": defaults.get("mamba_head_dim", model.mamba_head_dim),
        "n_groups": model.mamba_num_groups,
        "ssm_state_size": model.mamba_state_dim,
        "conv_kernel": model.mamba_conv_kernel,
        "chunk_size": model.mamba_chunk_size,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "time_step_min": NO_DT_FLOOR,
        "n_routed_experts": defaults.get("n_routed_experts", max(model.num_moe_experts, 2)),
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": defaults.get(
            "moe_intermediate_size", model.moe_ffn_hidden_size or 1
        ),
        "moe_shared_expert_intermediate_size": defaults.get(
            "moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size
        ),
        "n_shared_experts": 1,
        "norm_topk_prob": model.moe_router_topk > 1,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "n_group": 1,
        "topk_group": 1,
        "layer_norm_epsilon": model.layernorm_epsilon,
        "residual_in_fp32": False,
        "max_position_embeddings": model.max_sequence_length,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "pad_token_id": ids.get("pad"),
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
    }
    if overrides:
        config["layer_overrides"] = overrides
    return config


def build_hf_model(
    config_json: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    source: str = "the model",
):
    """``NemotronHForCausalLM`` of a ``config.json`` dict holding ``state`` (transformers'
    names): each layer in ``layer_overrides`` is built from a copy of the config with its own
    fields, since stock transformers builds every layer of a kind alike."""
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    raw = dict(config_json)
    overrides = raw.pop("layer_overrides", {})
    config = NemotronHConfig(
        **{
            k: v
            for k, v in raw.items()
            if k not in ("architectures", "model_type", "torch_dtype", "quantization_config")
        }
    )
    with no_init_weights():  # every weight comes from ``state`` (checked below): no random init
        model = NemotronHForCausalLM(config)
        for index, fields in overrides.items():
            layer_config = copy.deepcopy(config)
            for key, value in fields.items():
                setattr(layer_config, key, value)
            model.model.layers[int(index)] = NemotronHBlock(layer_config, int(index))
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    if unexpected or [
        k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings
    ]:
        raise ConfigError(
            f"{source}: weights do not match config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    # transformers wraps ``to`` with functools.wraps(Module.to): its type loses the self binding
    return model.to(dtype).eval()  # type: ignore[arg-type]
