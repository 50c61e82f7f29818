"""Residual-stream norms for the local (non-TE) spec.

Megatron-Core's ``WrappedTorchNorm`` refuses sequence parallelism. Under SP each TP rank
normalizes a different slice of the sequence, so the norm weight's gradient is a partial sum:
marking the weight ``sequence_parallel`` makes ``finalize_model_grads`` all-reduce it over TP,
exactly as TE's norms do. This class is also the one place elastic embedding widths will hook.
"""

from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor signature and SP support."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"normalization={config.normalization!r}: the local spec supports RMSNorm only"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the local spec")
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        # Megatron's flag on the parameter (a dynamic attribute: grads all-reduced over TP)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


class HeadRMSNorm(LocalRMSNorm):
    """The per-head RMSNorm of queries and keys (``qk_layernorm``, Qwen3) in the local spec.

    Megatron builds it with ``hidden_size=head_dim`` and applies it to every head alike; without
    a class in the spec it asks for TE's norm and fails without TE. Its own type says that its
    weight is head_dim-sized: it is not on the residual stream, so the hidden axis (reordering,
    elastic widths, slicing) never touches it, and nested query heads share it unchanged. Under
    TP each rank's heads give a partial gradient; Megatron's ``finalize_model_grads`` all-reduces
    ``q_layernorm``/``k_layernorm`` weights over TP when ``config.qk_layernorm`` is set.
    """
