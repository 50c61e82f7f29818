"""Which of our models Hugging Face's NemotronH can hold (torch-free: the CLIs check before loading)."""

from __future__ import annotations

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = ["check_hf_compatible", "HF_DTYPES", "QUANTIZE_FORMATS"]

HF_DTYPES = ("bf16", "fp16", "fp32")
QUANTIZE_FORMATS = ("fp8", "nvfp4")  # weights: E4M3 per tensor; E2M1 + E4M3 per 16 + FP32


def check_hf_compatible(model: ModelConfig) -> None:
    """NemotronH holds one architecture family; anything else is refused naming the field."""
    rules = [
        ("model.activation", model.activation, ("squared_relu",), "NemotronH MLPs are relu2"),
        (
            "model.position_embedding_type",
            model.position_embedding_type,
            ("none",),
            "NemotronH attention has no position embedding",
        ),
        (
            "model.add_bias_linear",
            model.add_bias_linear,
            (False,),
            "NemotronH linears have no bias",
        ),
    ]
    if model.count("mamba"):  # NemotronH's gated Mamba norm shares the layer norms' epsilon
        rules += [
            (
                "model.layernorm_epsilon",
                model.layernorm_epsilon,
                (1e-5,),
                "Megatron's Mamba gated norm uses 1e-5, NemotronH uses one epsilon for all",
            )
        ]
    if model.count("moe"):
        rules += [
            (
                "model.moe_router_score_function",
                model.moe_router_score_function,
                ("sigmoid",),
                "NemotronH routes with sigmoid scores",
            )
        ]
    for field, value, allowed, why in rules:
        if value not in allowed:
            raise ConfigError(
                f"--format hf: {field}={value!r} cannot be written as NemotronH "
                f"({why}); allowed: {', '.join(map(repr, allowed))}"
            )
