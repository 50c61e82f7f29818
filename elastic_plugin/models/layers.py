"""What kind of hybrid layer a built Megatron layer is, decided in one place.

Reordering, the elastic layers, slicing and the inference caches all treat a ``HybridModel``'s
layers by kind; they all ask ``hybrid_layer_kind`` so that a layer is never one kind to the
trainer and another to extraction.
"""

from __future__ import annotations

import torch

__all__ = ["ELASTIC_STATE_ATTR", "HEAD_NORMS", "LAYER_KINDS", "head_norms", "hybrid_layer_kind"]

LAYER_KINDS: tuple[str, ...] = ("mamba", "attention", "moe", "mlp")
HEAD_NORMS: tuple[str, ...] = ("q_layernorm", "k_layernorm")
"""Attention's per-head norms (``qk_layernorm``): head_dim-sized, not on the residual stream."""
ELASTIC_STATE_ATTR = "_elastic_state"
"""The attribute ``elastic.layers.elastify`` sets on a model it made elastic (its
``ElasticState``): other stages (generation) check for it without importing the trainer."""


def hybrid_layer_kind(layer: torch.nn.Module) -> str | None:
    """ "mamba", "attention", "moe" or "mlp" for the layers of our hybrid spec; None otherwise."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if isinstance(layer, MambaLayer):
        return "mamba"
    attention = getattr(layer, "self_attention", None)
    if attention is not None and not isinstance(attention, IdentityOp):
        return "attention"
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, MoELayer):
        return "moe"
    if isinstance(mlp, MLP):
        return "mlp"
    return None


def head_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every attention module's q/k norm (``HEAD_NORMS``) in ``model``: the norms that the hidden
    axis must skip. Found by position (an attribute of an attention module), not by class, so a
    TE spec's ``TENorm`` is found too."""
    from megatron.core.transformer.identity_op import IdentityOp

    out: list[torch.nn.Module] = []
    for module in model.modules():
        for name in HEAD_NORMS:
            norm = getattr(module, name, None)
            if isinstance(norm, torch.nn.Module) and not isinstance(norm, IdentityOp):
                out.append(norm)
    return out
