"""Reorder a Megatron-Core HybridModel so every nested width is a prefix, without changing its output.

Permutations come from importance scores (most important first). Each axis permutes every
coupled tensor (docs/design.md, "Width axes and nesting"): the hidden axis touches embeddings,
every norm, every input column
and output row; FFN neurons touch fc1 rows / fc2 columns; query heads move within their query
group (qkv rows, proj columns); Mamba heads within their group and head channels (z/x rows,
dt, conv, A_log, D, dt_bias, gated norm, out_proj columns); experts move with their router row
and bias.

Layouts. Query-group and Mamba-group axes are local to a TP rank (a rank holds whole groups) and
the hidden axis is replicated: no data moves. FFN neurons (TP-sharded) and experts (EP-sharded)
are ranked globally; in memory they are assigned *strided* (rank r of t holds canonical positions
r, r+t, r+2t, ...), so every rank's local prefix of w/t units is exactly the global top-w. On disk
the canonical order is kept (``checkpoint.layout``: ``canonical_weights`` converts for saving,
``mark_loaded_reordered`` after loading), so a checkpoint is the same whatever layout wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from elastic_plugin.checkpoint.layout import (
    STRIDED_ATTR,
    ep_group_and_size,
    global_axes,
    permute_,
    permute_experts_,
    permute_ffn_neurons_,
    permute_many_,
    strided_index,
    tp_group_and_size,
)
from elastic_plugin.checkpoint.tensor_file import (
    layer_key,
    layers_from,
    read_tensor_file,
    write_tensor_file,
)
from elastic_plugin.importance.scores import ImportanceScores
from elastic_plugin.models.config import ConfigError

if TYPE_CHECKING:  # Megatron ships no types: these annotate what a function takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.attention import SelfAttention


# in a reordered checkpoint: how it was reordered (safetensors; "permutations.pt" before, a pickle)
PERMUTATIONS_FILE = "permutations.safetensors"
PERMUTATIONS_FORMAT = "permutations"
_PERM_AXES = (
    "ffn",
    "shared_ffn",
    "attention_heads",
    "mamba_heads",
    "mamba_channels",
    "experts",
)


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
    def from_scores(
        cls,
        scores: ImportanceScores,
        query_groups: int,
        mamba_groups: int,
        mamba_top_channels: int | None = None,
        mamba_source: str | None = None,
        methods: dict[str, str] | None = None,
    ) -> Permutations:
        """Descending order per axis; heads ordered within their (query / Mamba) group.

        ``methods``: axis -> statistic (``importance.methods.STATISTICS``) for the axes named;
        the others use ``methods.DEFAULTS``. ``mamba_source`` ("out_proj_input" or "x_proj", the
        published x-projection statistic), when given, ranks both Mamba axes unless ``methods``
        names them. Measured per axis: docs/importance.md, "The ablation"
        (bench/bench_importance_ablation.py)."""
        from elastic_plugin.importance.methods import axis_scores, resolve_methods

        chosen = resolve_methods(scores, methods, mamba_source)

        def order(x: torch.Tensor) -> torch.Tensor:
            return torch.argsort(x, descending=True, stable=True)

        def ranked(axis: str) -> dict[int, torch.Tensor]:
            return {k: order(v) for k, v in axis_scores(scores, axis, chosen[axis]).items()}

        embedding = ranked("embedding") if scores.embedding is not None else {}
        perms = cls(embedding=embedding.get(0))
        perms.ffn = ranked("ffn")
        perms.shared_ffn = ranked("shared_ffn")
        perms.experts = ranked("experts")
        perms.attention_heads = {
            k: within_groups(v, query_groups)
            for k, v in axis_scores(scores, "attention_heads", chosen["attention_heads"]).items()
        }
        perms.mamba_channels = ranked("mamba_channels")
        head_stat = chosen["mamba_heads"]
        sources = ("x_proj", "out_proj_input")
        if mamba_top_channels is not None and head_stat not in sources:
            # head norms over the top channels exist for the per-channel statistics only
            channel_stat = chosen["mamba_channels"]
            head_stat = channel_stat if channel_stat in sources else "out_proj_input"
        if mamba_top_channels is not None:
            heads = {
                k: scores.mamba_head_scores(k, mamba_top_channels, head_stat) for k in scores.mamba
            }
        else:
            heads = axis_scores(scores, "mamba_heads", head_stat)
        perms.mamba_heads = {k: within_groups(v, mamba_groups) for k, v in heads.items()}
        return perms

    def save(self, path: str | Path) -> None:
        """A safetensors file (``checkpoint.tensor_file``): ``embedding`` and ``axis/layer``."""
        tensors: dict[str, torch.Tensor] = {}
        if self.embedding is not None:
            tensors["embedding"] = self.embedding
        for axis in _PERM_AXES:
            for layer, perm in getattr(self, axis).items():
                tensors[layer_key(axis, layer)] = perm
        write_tensor_file(path, tensors, {}, PERMUTATIONS_FORMAT, 1)

    @classmethod
    def load(cls, path: str | Path) -> Permutations:
        """Read :meth:`save`'s file (or an old ``torch.save`` one, through the allowlist check
        and ``torch.load(weights_only=True)``); each tensor must be a 1-D integer permutation."""
        where = f"permutations {path}"
        found = read_tensor_file(path, PERMUTATIONS_FORMAT, 1, where)
        if found.legacy is not None:
            raw = found.legacy
            if not isinstance(raw, dict) or set(raw) - {"embedding", *_PERM_AXES}:
                raise ConfigError(f"{where}: not a permutations dict")
            perms = cls(**raw)
        else:
            perms = cls(
                embedding=found.tensors.get("embedding"),
                **{axis: layers_from(found.tensors, axis, where) for axis in _PERM_AXES},
            )
        for axis in ("embedding", *_PERM_AXES):
            value = getattr(perms, axis)
            items = [value] if axis == "embedding" else list((value or {}).values())
            if axis != "embedding" and not isinstance(value, dict):
                raise ConfigError(f"{where}: {axis} is not a per-layer table")
            for perm in items:
                if perm is None and axis == "embedding":
                    continue
                if not _is_permutation(perm):
                    raise ConfigError(f"{where}: {axis} holds something that is not a permutation")
        return perms


def _is_permutation(perm: object) -> bool:
    """A 1-D integer tensor holding each of 0..n-1 once."""
    if not isinstance(perm, torch.Tensor) or perm.dim() != 1:
        return False
    if perm.dtype.is_floating_point or perm.dtype.is_complex or perm.dtype == torch.bool:
        return False
    return bool(torch.equal(torch.sort(perm.long()).values, torch.arange(perm.numel())))


def within_groups(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """Descending order of global ids that reorders units only inside each contiguous group."""
    per = scores.numel() // groups
    blocks = scores.reshape(groups, per)
    local = torch.argsort(blocks, dim=1, descending=True, stable=True)
    return (local + torch.arange(groups).unsqueeze(1) * per).reshape(-1)


# ------------------------------------------------------------------ tensor helpers


def _expand_units(perm: torch.Tensor, unit: int) -> torch.Tensor:
    """Unit permutation -> row permutation for units of ``unit`` consecutive rows."""
    return (perm.unsqueeze(1) * unit + torch.arange(unit).unsqueeze(0)).reshape(-1)


# ------------------------------------------------------------------- layer handlers
def _hidden_(model: torch.nn.Module, perm: torch.Tensor) -> None:
    """The hidden axis: every tensor that reads or writes the residual stream. Tied embeddings
    are one tensor (the output layer then holds none, or under PP the last stage's copy, which
    is permuted like the embedding on the first stage)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from elastic_plugin.models.layers import head_norms
    from elastic_plugin.models.norms import LocalRMSNorm

    # q/k norms (qk_layernorm) are head_dim-sized and read no residual stream: never permuted
    skip = {id(norm) for norm in head_norms(model)}
    seen: set[int] = set()
    targets: list[tuple[torch.Tensor, int]] = []
    for module in model.modules():
        tensors: list[tuple[torch.Tensor | None, int]]
        if id(module) in skip:
            continue
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm, LocalRMSNorm)):
            bias = getattr(module, "bias", None)  # RMSNorm has none
            tensors = [(module.weight, 0)] + ([(bias, 0)] if bias is not None else [])
        elif isinstance(module, ColumnParallelLinear):
            tensors = [(module.weight, 1)]
        elif isinstance(module, RowParallelLinear):
            tensors = [(module.weight, 0)] + ([(module.bias, 0)] if module.bias is not None else [])
        elif type(module).__name__ == "VocabParallelEmbedding":  # matched by name: a Module
            tensors = [(cast(torch.Tensor, module.weight), 1)]
        elif type(module).__name__ == "TopKRouter":
            tensors = [(cast(torch.Tensor, module.weight), 1)]
        else:
            continue
        for tensor, dim in tensors:
            if tensor is None or id(tensor) in seen:  # tied embeddings: permute once
                continue
            seen.add(id(tensor))
            targets.append((tensor, dim))
    permute_many_(targets, perm)  # the whole residual stream in one call


def _attention_heads_(attention: SelfAttention, perm: torch.Tensor) -> None:
    """Query heads within their query group; this rank holds whole groups (no data moves)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    heads = attention.num_attention_heads_per_partition
    groups = attention.num_query_groups_per_partition
    d = attention.hidden_size_per_attention_head
    per_group = heads // groups
    local = perm[tp_rank * heads : (tp_rank + 1) * heads] - tp_rank * heads
    if local.min() < 0 or local.max() >= heads:
        raise ValueError("attention head permutation moves heads across tensor-parallel ranks")
    # qkv rows: [groups, (per_group + 2) * d]; only the query block of each group moves (the
    # qkv bias with it). The q/k norms (qk_layernorm) act on every head alike: they stay.
    rows = torch.arange((per_group + 2) * d * groups).view(groups, per_group + 2, d)
    q_old = local.view(groups, per_group) % per_group
    new_rows = rows.clone()
    for g in range(groups):
        new_rows[g, :per_group] = rows[g, q_old[g]]
    permute_(attention.linear_qkv.weight, 0, new_rows.reshape(-1))
    if attention.linear_qkv.bias is not None:
        permute_(attention.linear_qkv.bias, 0, new_rows.reshape(-1))
    permute_(attention.linear_proj.weight, 1, _expand_units(local, d))


def _mamba_(mixer: MambaMixer, head_perm: torch.Tensor, channel_perm: torch.Tensor) -> None:
    """Mamba heads within their group and head channels (same order for every head)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    heads, head_dim = mixer.nheads_local_tp, mixer.headdim
    d_inner, state, groups = mixer.d_inner_local_tp, mixer.d_state, mixer.ngroups_local_tp
    local = head_perm[tp_rank * heads : (tp_rank + 1) * heads] - tp_rank * heads
    if local.min() < 0 or local.max() >= heads:
        raise ValueError("Mamba head permutation moves heads across tensor-parallel ranks")
    channels = (local.unsqueeze(1) * head_dim + channel_perm.unsqueeze(0)).reshape(
        -1
    )  # d_inner map
    bc = 2 * groups * state
    in_rows = torch.cat(
        [channels, d_inner + channels, 2 * d_inner + torch.arange(bc), 2 * d_inner + bc + local]
    )
    permute_(mixer.in_proj.weight, 0, in_rows)
    conv_rows = torch.cat([channels, d_inner + torch.arange(bc)])
    permute_(mixer.conv1d_weight, 0, conv_rows)
    if getattr(mixer, "conv1d_bias", None) is not None:
        permute_(mixer.conv1d_bias, 0, conv_rows)
    for name in ("A_log", "dt_bias"):
        permute_(getattr(mixer, name), 0, local)
    if hasattr(mixer, "_A_neg_exp_cache_stale"):
        mixer._A_neg_exp_cache_stale = True  # Megatron caches -exp(A_log)
    permute_(mixer.D, 0, channels if mixer.D.numel() == d_inner else local)
    by_channel = [(mixer.out_proj.weight, 1)]
    if getattr(mixer, "norm", None) is not None and getattr(mixer.norm, "weight", None) is not None:
        by_channel.append((mixer.norm.weight, 0))
    permute_many_(by_channel, channels)


# ------------------------------------------------------------------------- driver


@torch.no_grad()
def apply_permutations(model: torch.nn.Module, perms: Permutations) -> None:
    """Reorder this rank's model chunk in place (collective over TP/EP groups).

    Globally ranked axes end up strided across ranks (see the module docstring)."""
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.attention import SelfAttention

    inner: HybridModel = getattr(model, "module", model)
    if getattr(inner, STRIDED_ATTR, False):
        raise ValueError("this model is already reordered; reorder the original weights")
    tp_group, tp = tp_group_and_size()
    _, ep = ep_group_and_size()
    if perms.embedding is not None:
        _hidden_(inner, perms.embedding)
    for layer in inner.decoder.layers:
        number = int(layer.layer_number)
        if isinstance(layer, MambaLayer) and number in perms.mamba_heads:
            _mamba_(layer.mixer, perms.mamba_heads[number], perms.mamba_channels[number])
        attention = getattr(layer, "self_attention", None)
        if isinstance(attention, SelfAttention) and number in perms.attention_heads:
            _attention_heads_(attention, perms.attention_heads[number])
    for kind, number, module in global_axes(inner):
        perm = getattr(perms, kind).get(number)
        if perm is None:
            continue
        shards = ep if kind == "experts" else tp
        physical = perm[strided_index(perm.numel(), shards)]
        if kind == "experts":
            permute_experts_(module, physical)
        else:
            permute_ffn_neurons_(module, physical, tp_group)
    setattr(inner, STRIDED_ATTR, True)
