"""Tiny models for the generation tests and benchmark (one process, TP=PP=EP=1, float32).

Random init plus a seeded perturbation of every parameter and the routers' expert bias, so no
tensor is constant (norm weights 1, D 1, biases 0 would hide a wrong slice or a skipped term).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.models.config import ModelConfig, load_config

TINY_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.yaml"

__all__ = ["TINY_CONFIG", "perturb_", "random_prompts", "tiny_config", "tiny_inference_model"]


def tiny_config(**overrides: Any) -> ModelConfig:
    """The tiny hybrid model (``M*E-M*E-``: Mamba, attention, MoE, MLP) with field overrides."""
    model = load_config(TINY_CONFIG).model
    return replace(model, **overrides).validate() if overrides else model


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Add seeded noise to every parameter and MoE expert-bias buffer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("expert_bias") or tensor.requires_grad:
                tensor.add_(scale * torch.randn(tensor.shape, generator=gen).to(tensor.dtype))


def tiny_inference_model(seed: int = 1, **overrides: Any) -> tuple[torch.nn.Module, ModelConfig]:
    """``(plain HybridModel, its config)`` of the tiny config, seeded and perturbed."""
    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    init_distributed()
    initialize_layout(Layout(), seed=seed)
    cfg = tiny_config(**overrides)
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0]
    perturb_(model, seed)
    model.eval()
    return model, cfg


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
