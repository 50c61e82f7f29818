"""Reorder a Megatron-Core HybridModel so every nested width is a prefix, without changing its output.

Permutations come from importance scores (most important first). Each axis permutes every
coupled tensor (DESIGN.md): the hidden axis touches embeddings, every norm, every input column
and output row; FFN neurons touch fc1 rows / fc2 columns; query heads move within their query
group (qkv rows, proj columns); Mamba heads within their group and head channels (z/x rows,
dt, conv, A_log, D, dt_bias, gated norm, out_proj columns); experts move with their router row
and bias.

Layouts. Query-group and Mamba-group axes are local to a TP rank (a rank holds whole groups) and
the hidden axis is replicated: no data moves. FFN neurons (TP-sharded) and experts (EP-sharded)
are ranked globally; in memory they are assigned *strided* (rank r of t holds canonical positions
r, r+t, r+2t, ...), so every rank's local prefix of w/t units is exactly the global top-w. On disk
the canonical order is kept: ``canonical_weights`` converts for saving, ``to_strided`` after
loading, so a checkpoint is the same whatever layout wrote it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_plugin.importance.scores import ImportanceScores

STRIDED_ATTR = "_elastic_strided"


@dataclass
class Permutations:
    """New position i holds old unit ``perm[i]``; per-layer axes keyed by global layer number."""

    embedding: torch.Tensor | None = None
    ffn: dict[int, torch.Tensor] = field(default_factory=dict)
    shared_ffn: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_heads: dict[int, torch.Tensor] = field(default_factory=dict)  # global head ids
    mamba_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    mamba_channels: dict[int, torch.Tensor] = field(default_factory=dict)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_scores(cls, scores: ImportanceScores, query_groups: int, mamba_groups: int,
                    mamba_top_channels: int | None = None,
                    mamba_source: str = "out_proj_input") -> "Permutations":
        """Descending order per axis; heads ordered within their (query / Mamba) group.

        ``mamba_source``: "out_proj_input" (default) or "x_proj" (the published x-projection
        statistic). On the demo teacher, pruning Mamba heads/channels to 50% by the x-projection
        order was no better than random (valid loss 2.91 vs 2.92), by out_proj's input 2.40 —
        better than random and weight magnitude (2.82); see bench/bench_importance.py."""
        def order(x: torch.Tensor) -> torch.Tensor:
            return torch.argsort(x, descending=True, stable=True)

        perms = cls(embedding=order(scores.embedding) if scores.embedding is not None else None)
        perms.ffn = {k: order(v) for k, v in scores.ffn.items()}
        perms.shared_ffn = {k: order(v) for k, v in scores.shared_ffn.items()}
        perms.experts = {k: order(v) for k, v in scores.experts.items()}
        perms.attention_heads = {k: _within_groups(v, query_groups)
                                 for k, v in scores.attention_heads.items()}
        for layer in scores.mamba:
            perms.mamba_channels[layer] = order(scores.mamba_channel_scores(layer, mamba_source))
            perms.mamba_heads[layer] = _within_groups(
                scores.mamba_head_scores(layer, mamba_top_channels, mamba_source), mamba_groups)
        return perms

    def save(self, path: str | Path) -> None:
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path: str | Path) -> "Permutations":
        return cls(**torch.load(path, weights_only=False))


def _within_groups(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """Descending order of global ids that reorders units only inside each contiguous group."""
    per = scores.numel() // groups
    blocks = scores.reshape(groups, per)
    local = torch.argsort(blocks, dim=1, descending=True, stable=True)
    return (local + torch.arange(groups).unsqueeze(1) * per).reshape(-1)


def strided_index(num_units: int, shards: int) -> torch.Tensor:
    """sigma: physical position ``r*L + j`` (rank r, local j) holds canonical ``r + j*shards``."""
    local = num_units // shards
    rank = torch.arange(shards).unsqueeze(1)
    return (rank + torch.arange(local).unsqueeze(0) * shards).reshape(-1)


# ------------------------------------------------------------------ tensor helpers
def _permute_(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> None:
    _permute_many_([(tensor, dim)], index)


def _permute_many_(targets: list[tuple[torch.Tensor, int]], index: torch.Tensor) -> None:
    """Apply one permutation to several tensors (one model chunk, so one device), each along
    its own dim, in place: one ``ordered_gather_many`` call (the csrc kernel copies them in one
    parallel region and checks ``index`` once)."""
    from elastic_plugin.ops import ordered_gather_many

    if not targets:
        return
    perm = index.to(device=targets[0][0].device, dtype=torch.long)
    gathered = ordered_gather_many([t.data for t, _ in targets], perm, perm.numel(),
                                   [d for _, d in targets])
    for (tensor, _), new in zip(targets, gathered):
        tensor.data.copy_(new)


def _global_permute_(tensors: list[torch.Tensor], dim: int, full_index: torch.Tensor,
                     group) -> None:
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


def _expand_units(perm: torch.Tensor, unit: int) -> torch.Tensor:
    """Unit permutation -> row permutation for units of ``unit`` consecutive rows."""
    return (perm.unsqueeze(1) * unit + torch.arange(unit).unsqueeze(0)).reshape(-1)


# ------------------------------------------------------------------- layer handlers
def _hidden_(model: torch.nn.Module, perm: torch.Tensor) -> None:
    """The hidden axis: every tensor that reads or writes the residual stream."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from elastic_plugin.models.norms import LocalRMSNorm

    seen: set[int] = set()
    targets: list[tuple[torch.Tensor, int]] = []
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm, LocalRMSNorm)):
            tensors = [(module.weight, 0)] + ([(module.bias, 0)] if getattr(module, "bias", None) is not None else [])
        elif isinstance(module, ColumnParallelLinear):
            tensors = [(module.weight, 1)]
        elif isinstance(module, RowParallelLinear):
            tensors = [(module.weight, 0)] + ([(module.bias, 0)] if module.bias is not None else [])
        elif type(module).__name__ == "VocabParallelEmbedding":
            tensors = [(module.weight, 1)]
        elif type(module).__name__ == "TopKRouter":
            tensors = [(module.weight, 1)]
        else:
            continue
        for tensor, dim in tensors:
            if tensor is None or id(tensor) in seen:  # tied embeddings: permute once
                continue
            seen.add(id(tensor))
            targets.append((tensor, dim))
    _permute_many_(targets, perm)  # the whole residual stream in one call


def _mlp_neurons_(mlp: torch.nn.Module, full: torch.Tensor, group) -> None:
    """FFN neurons: fc1 rows (each half when gated) and bias, fc2 columns — global over TP.

    ``full`` indexes the global neuron axis as currently laid out across the TP ranks."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    gated = mlp.config.gated_linear_unit
    halves = 2 if gated else 1
    views = [fc1.weight.data.view(halves, -1, fc1.weight.shape[-1])]
    if fc1.bias is not None:
        views.append(fc1.bias.data.view(halves, -1))
    _global_permute_([_Param(v) for v in views], 1, full, group)
    _global_permute_([fc2.weight], 1, full, group)


class _Param:
    """A view wrapper so ``_global_permute_`` can write into views of a parameter."""

    def __init__(self, view: torch.Tensor) -> None:
        self.data = view


def _attention_heads_(attention: torch.nn.Module, perm: torch.Tensor) -> None:
    """Query heads within their query group; this rank holds whole groups (no data moves)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    heads = attention.num_attention_heads_per_partition
    groups = attention.num_query_groups_per_partition
    d = attention.hidden_size_per_attention_head
    per_group = heads // groups
    local = perm[tp_rank * heads:(tp_rank + 1) * heads] - tp_rank * heads
    if local.min() < 0 or local.max() >= heads:
        raise ValueError("attention head permutation moves heads across tensor-parallel ranks")
    # qkv rows: [groups, (per_group + 2) * d]; only the query block of each group moves.
    rows = torch.arange((per_group + 2) * d * groups).view(groups, per_group + 2, d)
    q_old = local.view(groups, per_group) % per_group
    new_rows = rows.clone()
    for g in range(groups):
        new_rows[g, :per_group] = rows[g, q_old[g]]
    _permute_(attention.linear_qkv.weight, 0, new_rows.reshape(-1))
    if attention.linear_qkv.bias is not None:
        _permute_(attention.linear_qkv.bias, 0, new_rows.reshape(-1))
    _permute_(attention.linear_proj.weight, 1, _expand_units(local, d))


def _mamba_(mixer: torch.nn.Module, head_perm: torch.Tensor, channel_perm: torch.Tensor) -> None:
    """Mamba heads within their group and head channels (same order for every head)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    heads, head_dim = mixer.nheads_local_tp, mixer.headdim
    d_inner, state, groups = mixer.d_inner_local_tp, mixer.d_state, mixer.ngroups_local_tp
    local = head_perm[tp_rank * heads:(tp_rank + 1) * heads] - tp_rank * heads
    if local.min() < 0 or local.max() >= heads:
        raise ValueError("Mamba head permutation moves heads across tensor-parallel ranks")
    channels = (local.unsqueeze(1) * head_dim + channel_perm.unsqueeze(0)).reshape(-1)  # d_inner map
    bc = 2 * groups * state
    in_rows = torch.cat([channels, d_inner + channels,
                         2 * d_inner + torch.arange(bc), 2 * d_inner + bc + local])
    _permute_(mixer.in_proj.weight, 0, in_rows)
    conv_rows = torch.cat([channels, d_inner + torch.arange(bc)])
    _permute_(mixer.conv1d_weight, 0, conv_rows)
    if getattr(mixer, "conv1d_bias", None) is not None:
        _permute_(mixer.conv1d_bias, 0, conv_rows)
    for name in ("A_log", "dt_bias"):
        _permute_(getattr(mixer, name), 0, local)
    if hasattr(mixer, "_A_neg_exp_cache_stale"):
        mixer._A_neg_exp_cache_stale = True  # Megatron caches -exp(A_log)
    _permute_(mixer.D, 0, channels if mixer.D.numel() == d_inner else local)
    by_channel = [(mixer.out_proj.weight, 1)]
    if getattr(mixer, "norm", None) is not None and getattr(mixer.norm, "weight", None) is not None:
        by_channel.append((mixer.norm.weight, 0))
    _permute_many_(by_channel, channels)


def _ep_group_and_size():
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    return (group if size > 1 else None), size


def _experts_(moe: torch.nn.Module, full: torch.Tensor) -> None:
    """Experts with their router rows and bias; global over EP (``full`` indexes the global
    expert axis as currently laid out)."""
    ep_group, shards = _ep_group_and_size()
    router = moe.router
    _permute_(router.weight, 0, full)
    for name in ("expert_bias", "local_tokens_per_expert"):
        buf = getattr(router, name, None)
        if buf is not None:
            _permute_(buf, 0, full)
    local = moe.experts.local_experts
    for name, _ in local[0].named_parameters():
        stacked = torch.stack([dict(e.named_parameters())[name].data for e in local])
        holder = _Param(stacked)
        _global_permute_([holder], 0, full, ep_group)
        for i, expert in enumerate(local):
            dict(expert.named_parameters())[name].data.copy_(holder.data[i])


# ------------------------------------------------------------------------- driver
def _tp_group_and_size():
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    return (group if size > 1 else None), size


def _global_axes(model: torch.nn.Module):
    """(kind, layer number, module) for every globally ranked, sharded axis of this chunk."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.mlp import MLP

    for layer in model.decoder.layers:
        number = int(layer.layer_number)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoELayer):
            yield "experts", number, mlp
            if mlp.shared_experts is not None:
                yield "shared_ffn", number, mlp.shared_experts
        elif isinstance(mlp, MLP):
            yield "ffn", number, mlp


def _num_units(kind: str, module: torch.nn.Module, tp: int) -> int:
    if kind == "experts":
        return module.router.weight.shape[0]
    return module.linear_fc2.weight.shape[1] * tp


@torch.no_grad()
def apply_permutations(model: torch.nn.Module, perms: Permutations) -> None:
    """Reorder this rank's model chunk in place (collective over TP/EP groups).

    Globally ranked axes end up strided across ranks (see the module docstring)."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.attention import SelfAttention

    model = getattr(model, "module", model)
    if getattr(model, STRIDED_ATTR, False):
        raise ValueError("this model is already reordered; reorder the original weights")
    tp_group, tp = _tp_group_and_size()
    _, ep = _ep_group_and_size()
    if perms.embedding is not None:
        _hidden_(model, perms.embedding)
    for layer in model.decoder.layers:
        number = int(layer.layer_number)
        if isinstance(layer, MambaLayer) and number in perms.mamba_heads:
            _mamba_(layer.mixer, perms.mamba_heads[number], perms.mamba_channels[number])
        attention = getattr(layer, "self_attention", None)
        if isinstance(attention, SelfAttention) and number in perms.attention_heads:
            _attention_heads_(attention, perms.attention_heads[number])
    for kind, number, module in _global_axes(model):
        perm = getattr(perms, kind).get(number)
        if perm is None:
            continue
        shards = ep if kind == "experts" else tp
        physical = perm[strided_index(perm.numel(), shards)]
        if kind == "experts":
            _experts_(module, physical)
        else:
            _mlp_neurons_(module, physical, tp_group)
    setattr(model, STRIDED_ATTR, True)


@torch.no_grad()
def convert_layout(model: torch.nn.Module, to_canonical: bool) -> None:
    """Strided (memory) <-> canonical-contiguous (disk) for every globally ranked axis."""
    model = getattr(model, "module", model)
    tp_group, tp = _tp_group_and_size()
    _, ep = _ep_group_and_size()
    for kind, _, module in _global_axes(model):
        shards = ep if kind == "experts" else tp
        if shards == 1:
            continue
        sigma = strided_index(_num_units(kind, module, tp), shards)
        index = torch.argsort(sigma) if to_canonical else sigma
        if kind == "experts":
            _experts_(module, index)
        else:
            _mlp_neurons_(module, index, tp_group)


@contextmanager
def canonical_weights(model: torch.nn.Module):
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
