"""A model config's architecture as Megatron's ``TransformerConfig`` fields: the one mapping.

``models.builder.transformer_config`` passes these fields to Megatron-Core, and
``elastic.megatron_lm_args.arch_flags`` renders and checks Megatron-LM's command-line flags from
the same values, so an elastic run inside Megatron-LM's own loop and one of ``elastic-train``
build the same function (same special cases: a pure-Mamba model still has one attention head
for Megatron's bookkeeping, no dropout, FP32 MoE routing, the load-balancing loss only with a
coefficient). Torch-free: the Megatron-LM argument checks run before anything heavy is imported.
"""

from __future__ import annotations

from typing import Any

from elastic_plugin.models.config import ModelConfig

__all__ = ["architecture_fields"]


def architecture_fields(model: ModelConfig) -> dict[str, Any]:
    """``TransformerConfig`` keyword -> value for what ``model`` computes (no layout, no
    precision, no kernel choices: those come from the run)."""
    fields: dict[str, Any] = {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        # Megatron divides by the head count even with no attention layer
        "num_attention_heads": max(model.num_attention_heads, 1),
        "num_query_groups": model.num_query_groups,
        "kv_channels": model.head_dim,
        "ffn_hidden_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "normalization": model.normalization,
        "layernorm_epsilon": model.layernorm_epsilon,
        "add_bias_linear": model.add_bias_linear,
        "add_qkv_bias": model.add_qkv_bias,
        "qk_layernorm": model.qk_layernorm,
        "init_method_std": model.init_method_std,
        # the plugin's models run without dropout (Megatron-LM's default is 0.1): a student with
        # dropout would not be the function its teacher is
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "mamba_num_heads": model.mamba_num_heads or None,
        "mamba_head_dim": model.mamba_head_dim,
        "mamba_num_groups": model.mamba_num_groups,
        "mamba_state_dim": model.mamba_state_dim,
    }
    if model.count("moe"):
        fields.update(
            num_moe_experts=model.num_moe_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
            moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff else "none",
            moe_token_dispatcher_type=model.moe_token_dispatcher_type,
            moe_router_dtype="fp32",  # routing in FP32 under BF16 training, as Nano v3 trains
        )
    return fields
