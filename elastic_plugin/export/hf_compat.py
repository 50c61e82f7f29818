"""Which of our models a Hugging Face family can hold (torch-free: the CLIs check before loading)."""

from __future__ import annotations

from elastic_plugin.families import family_for_model
from elastic_plugin.models.config import ModelConfig

__all__ = ["check_hf_compatible", "HF_DTYPES", "QUANTIZE_FORMATS"]

HF_DTYPES = ("bf16", "fp16", "fp32")
QUANTIZE_FORMATS = ("fp8", "nvfp4")  # weights: E4M3 per tensor; E2M1 + E4M3 per 16 + FP32


def check_hf_compatible(model: ModelConfig) -> None:
    """Some supported family's stock transformers class computes ``model``; else a ConfigError
    saying, for each family, which ModelConfig field stands in the way."""
    family_for_model(model)
