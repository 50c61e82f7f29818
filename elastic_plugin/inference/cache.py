"""The decoding state of one batch of sequences: K/V per attention layer, conv + SSM state per
Mamba layer, and each sequence's length.

Attention needs every past key/value (preallocated to ``max_length`` so a decode step writes in
place); a Mamba layer needs only its last ``conv_kernel - 1`` conv inputs (the ``[x | B | C]``
channels) and its SSM state ``(heads, head_dim, state)``, kept in float32 as Megatron's
inference path does, so long generations do not accumulate bf16 rounding. Rows are sequences;
each row has its own length, so prompts of different lengths share one cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.layers import hybrid_layer_kind

if TYPE_CHECKING:  # Megatron ships no types: this annotates what allocate takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["InferenceCache", "layer_kind"]

SSM_STATE_DTYPE = torch.float32


def layer_kind(layer: torch.nn.Module) -> str:
    """ "mamba", "attention" or "positionwise" (MLP / MoE: no state across tokens)."""
    kind = hybrid_layer_kind(layer)
    return kind if kind in ("mamba", "attention") else "positionwise"


@dataclass
class InferenceCache:
    """Per-layer decoding state for ``batch`` sequences of at most ``max_length`` tokens.

    ``keys[i]`` / ``values[i]``: ``[batch, max_length, query_groups, head_dim]`` of attention
    layer ``i`` (index into ``model.decoder.layers``); ``conv[i]``: ``[batch, conv_channels,
    conv_kernel - 1]`` and ``ssm[i]``: ``[batch, heads, head_dim, state]`` (float32) of Mamba
    layer ``i``; ``lengths``: tokens already in the cache per row; ``rope``: the rotary angle
    table ``[max_length, rot_dim]`` of a RoPE model (None otherwise); ``step_rope``: the cos and
    sin of the rows' current positions while a decode step runs (``inference.fast_decode``:
    every attention layer rotates with the same ones).
    """

    batch: int
    max_length: int
    lengths: torch.Tensor
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)
    rope: torch.Tensor | None = None
    step_rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def allocate(cls, model: HybridModel, batch: int, max_length: int) -> InferenceCache:
        """Empty (zero) caches for ``model`` (a plain TP=PP=1 ``HybridModel``)."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"batch={batch!r}: must be a positive int")
        limit = int(model.max_sequence_length)
        if (
            isinstance(max_length, bool)
            or not isinstance(max_length, int)
            or not 1 <= max_length <= limit
        ):
            raise ConfigError(
                f"max_length={max_length!r}: must be an int in [1, {limit}] "
                f"(the model's max_sequence_length)"
            )
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        cache = cls(batch, max_length, torch.zeros(batch, dtype=torch.long, device=device))
        for index, layer in enumerate(model.decoder.layers):
            kind = layer_kind(layer)
            if kind == "attention":
                core = layer.self_attention
                shape = (
                    batch,
                    max_length,
                    core.num_query_groups_per_partition,
                    core.hidden_size_per_attention_head,
                )
                cache.keys[index] = torch.zeros(shape, dtype=dtype, device=device)
                cache.values[index] = torch.zeros(shape, dtype=dtype, device=device)
            elif kind == "mamba":
                mixer = layer.mixer
                width = mixer.conv1d_weight.shape[-1]
                cache.conv[index] = torch.zeros(
                    batch,
                    mixer.conv1d_weight.shape[0],
                    width - 1,
                    dtype=mixer.conv1d_weight.dtype,
                    device=device,
                )
                cache.ssm[index] = torch.zeros(
                    batch,
                    mixer.nheads_local_tp,
                    mixer.headdim,
                    mixer.d_state,
                    dtype=SSM_STATE_DTYPE,
                    device=device,
                )
        if getattr(model, "position_embedding_type", "none") == "rope":
            table = model.rotary_pos_emb(max_length)  # [max_length, 1, 1, rot_dim]
            cache.rope = table.reshape(max_length, table.shape[-1])
        return cache

    def nbytes(self) -> int:
        """Bytes held by the K/V, conv and SSM tensors."""
        tensors = [
            *self.keys.values(),
            *self.values.values(),
            *self.conv.values(),
            *self.ssm.values(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Forget the sequences in ``rows`` (all when None): length 0 and zero states."""
        index = slice(None) if rows is None else rows
        self.lengths[index] = 0
        for table in (self.conv, self.ssm):
            for tensor in table.values():
                tensor[index] = 0
