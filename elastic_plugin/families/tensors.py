"""Tensor re-layouts every family shares: Megatron's fused ``linear_qkv`` <-> q/k/v, a gated
``linear_fc1`` <-> gate/up, and cutting a budget's prefix out of one tensor (in memory or
straight from a safetensors file)."""

from __future__ import annotations

from typing import Any

import torch

from elastic_plugin.families.base import Cut
from elastic_plugin.models.config import ConfigError

__all__ = ["cut_tensor", "fuse_qkv", "no_rule", "read_cut", "split_qkv"]


def no_rule(keys: list[str]) -> ConfigError:
    """Tensors a family's slicing has no rule for."""
    return ConfigError(
        f"slice: tensors without a slicing rule: {sorted(keys)[:3]} (a quantized or foreign "
        "checkpoint?)"
    )


def split_qkv(
    qkv: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of Megatron's fused ``linear_qkv`` weight or bias: rows interleaved per query
    group (the group's query heads, then its K head, then its V head)."""
    flat = qkv.reshape(qkv.shape[0], -1)
    per_group = flat.shape[0] // (groups * head_dim)
    blocks = flat.reshape(groups, per_group, head_dim, -1)
    tail = qkv.shape[1:]
    q = blocks[:, : per_group - 2].reshape(-1, *tail)
    return q, blocks[:, -2].reshape(-1, *tail), blocks[:, -1].reshape(-1, *tail)


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, head_dim: int
) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    tail = q.shape[1:]
    blocks = torch.cat(
        [
            q.reshape(groups, -1, head_dim, *tail),
            k.reshape(groups, 1, head_dim, *tail),
            v.reshape(groups, 1, head_dim, *tail),
        ],
        dim=1,
    )
    return blocks.reshape(-1, *tail)


def cut_tensor(tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    """A fresh contiguous copy of ``tensor`` cut to prefixes / index sets."""
    out = tensor
    for dim, index in cut:
        if isinstance(index, int):
            out = out.narrow(dim, 0, index)
        else:
            out = out.index_select(dim, index.to(out.device))
    return out.clone(memory_format=torch.contiguous_format)


def read_cut(handle: Any, key: str, cut: Cut) -> torch.Tensor:
    """One cut tensor of an open safetensors file: prefix cuts read only the prefix
    (``get_slice``); index sets read the tensor, then select."""
    if all(isinstance(index, int) for _, index in cut):
        view = handle.get_slice(key)
        index = [slice(None)] * len(view.get_shape())
        for dim, keep in cut:
            index[dim] = slice(0, keep)
        return view[tuple(index)].clone(memory_format=torch.contiguous_format)
    return cut_tensor(handle.get_tensor(key), cut)
