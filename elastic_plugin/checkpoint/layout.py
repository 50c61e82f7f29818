"""Canonical order on disk, strided order in memory: the layout of importance-ordered weights.

FFN neurons (sharded over TP) and MoE experts (sharded over EP) are ranked globally. In memory
they are assigned *strided*: rank r of t holds canonical positions r, r+t, r+2t, ..., so every
rank's local prefix of w/t units is exactly the global top-w and a nested width needs no data
movement. On disk a checkpoint keeps the canonical order (position = global rank), so it is the
same whatever layout wrote it: ``canonical_weights`` converts around a save,
``mark_loaded_reordered`` after a load. A model is marked strided by ``STRIDED_ATTR``
(``importance.reorder`` sets it when it reorders; checkpoints record it as ``reordered``).

The permutation primitives here (one permutation of many tensors, a permutation of an axis
sharded over a group, the FFN-neuron and expert axes with every coupled tensor) are the ones the
reordering itself uses, so layout conversion and reordering cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # Megatron ships no types: these annotate what a function takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

__all__ = [
    "STRIDED_ATTR",
    "canonical_weights",
    "convert_layout",
    "ep_group_and_size",
    "global_axes",
    "mark_loaded_reordered",
    "permute_",
    "permute_experts_",
    "permute_ffn_neurons_",
    "permute_many_",
    "strided_index",
    "tp_group_and_size",
]

STRIDED_ATTR = "_elastic_strided"


def strided_index(num_units: int, shards: int) -> torch.Tensor:
    """sigma: physical position ``r*L + j`` (rank r, local j) holds canonical ``r + j*shards``."""
    local = num_units // shards
    rank = torch.arange(shards).unsqueeze(1)
    return (rank + torch.arange(local).unsqueeze(0) * shards).reshape(-1)


def permute_(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> None:
    """Permute one tensor along ``dim`` in place."""
    permute_many_([(tensor, dim)], index)


def permute_many_(targets: Sequence[tuple[torch.Tensor, int]], index: torch.Tensor) -> None:
    """Apply one permutation to several tensors (one model chunk, so one device), each along
    its own dim, in place: one ``ordered_gather_many`` call (the csrc kernel copies them in one
    parallel region and checks ``index`` once)."""
    from elastic_plugin.ops import ordered_gather_many

    if not targets:
        return
    perm = index.to(device=targets[0][0].device, dtype=torch.long)
    gathered = ordered_gather_many(
        [t.data for t, _ in targets], perm, perm.numel(), [d for _, d in targets]
    )
    for (tensor, _), new in zip(targets, gathered):
        tensor.data.copy_(new)


class _Param:
    """A view wrapper so ``_permute_sharded_`` can write into views of a parameter."""

    def __init__(self, view: torch.Tensor) -> None:
        self.data = view


def _permute_sharded_(tensors: list, dim: int, full_index: torch.Tensor, group) -> None:
    """Permute an axis sharded contiguously over ``group``: gather, reindex, keep our block."""
    from elastic_plugin.ops import ordered_gather

    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    for tensor in tensors:
        local = tensor.data
        if size > 1:
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local.contiguous(), group=group)
            full = torch.cat(parts, dim=dim)
        else:
            full = local
        perm = full_index.to(device=full.device, dtype=torch.long)
        permuted = ordered_gather(full, perm, perm.numel(), dim)
        n_local = local.shape[dim]
        tensor.data.copy_(permuted.narrow(dim, rank * n_local, n_local))


def permute_ffn_neurons_(mlp: MLP, full: torch.Tensor, group) -> None:
    """FFN neurons: fc1 rows (each half when gated) and bias, fc2 columns — global over TP.

    ``full`` indexes the global neuron axis as currently laid out across the TP ranks."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    gated = mlp.config.gated_linear_unit
    halves = 2 if gated else 1
    views = [fc1.weight.data.view(halves, -1, fc1.weight.shape[-1])]
    if fc1.bias is not None:
        views.append(fc1.bias.data.view(halves, -1))
    _permute_sharded_([_Param(v) for v in views], 1, full, group)
    _permute_sharded_([fc2.weight], 1, full, group)


def permute_experts_(moe: MoELayer, full: torch.Tensor) -> None:
    """Experts with their router rows and bias; global over EP (``full`` indexes the global
    expert axis as currently laid out)."""
    ep_group, shards = ep_group_and_size()
    router = moe.router
    permute_(router.weight, 0, full)
    for name in ("expert_bias", "local_tokens_per_expert"):
        buf = getattr(router, name, None)
        if buf is not None:
            permute_(buf, 0, full)
    local = moe.experts.local_experts
    for name, _ in local[0].named_parameters():
        stacked = torch.stack([dict(e.named_parameters())[name].data for e in local])
        holder = _Param(stacked)
        _permute_sharded_([holder], 0, full, ep_group)
        for i, expert in enumerate(local):
            dict(expert.named_parameters())[name].data.copy_(holder.data[i])


def tp_group_and_size():
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    return (group if size > 1 else None), size


def ep_group_and_size():
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    return (group if size > 1 else None), size


def global_axes(model: HybridModel):
    """(kind, layer number, module) for every globally ranked, sharded axis of this chunk."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.decoder.layers:
        number = int(layer.layer_number)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoELayer):
            yield "experts", number, mlp
            if mlp.shared_experts is not None:
                yield "shared_ffn", number, mlp.shared_experts
        elif isinstance(mlp, MLP):
            yield "ffn", number, mlp


def _num_units(kind: str, module: MLP | MoELayer, tp: int) -> int:
    if kind == "experts":
        return module.router.weight.shape[0]
    return module.linear_fc2.weight.shape[1] * tp


@torch.no_grad()
def convert_layout(model: torch.nn.Module, to_canonical: bool) -> None:
    """Strided (memory) <-> canonical-contiguous (disk) for every globally ranked axis."""
    inner: HybridModel = getattr(model, "module", model)
    tp_group, tp = tp_group_and_size()
    _, ep = ep_group_and_size()
    for kind, _, module in global_axes(inner):
        shards = ep if kind == "experts" else tp
        if shards == 1:
            continue
        sigma = strided_index(_num_units(kind, module, tp), shards)
        index = torch.argsort(sigma) if to_canonical else sigma
        if kind == "experts":
            permute_experts_(module, index)
        else:
            permute_ffn_neurons_(module, index, tp_group)


@contextmanager
def canonical_weights(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a reordered model holds the canonical (layout-free) order: save here."""
    inner = getattr(model, "module", model)
    strided = getattr(inner, STRIDED_ATTR, False)
    if strided:
        convert_layout(inner, to_canonical=True)
    try:
        yield
    finally:
        if strided:
            convert_layout(inner, to_canonical=False)


def mark_loaded_reordered(model: torch.nn.Module) -> None:
    """After loading a reordered (canonical) checkpoint: lay the global axes out strided."""
    inner = getattr(model, "module", model)
    convert_layout(inner, to_canonical=False)
    setattr(inner, STRIDED_ATTR, True)
