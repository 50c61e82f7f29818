"""Zero-shot pruning by masking, to judge an importance order (single rank, TP=1).

Keeping the top-k units of an order and zeroing the rest computes *exactly* what the sliced
smaller model computes, with one correction: RMS norms over a partly zeroed axis divide by the
full width, so the kept weights are scaled by sqrt(kept / width) to normalize over the kept
units only (eps aside). Orders compared by the quality benchmark: importance, random, and
weight magnitude.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from elastic_plugin.importance.reorder import within_groups
from elastic_plugin.importance.scores import ImportanceScores

PRUNABLE = (
    "embedding",
    "ffn",
    "shared_ffn",
    "attention_heads",
    "mamba_heads",
    "mamba_channels",
    "experts",
)


def _zero_(tensor: torch.Tensor, dim: int, drop: torch.Tensor) -> None:
    tensor.data.index_fill_(dim, drop.to(tensor.device), 0.0)


def _drop(order: torch.Tensor, keep: int) -> torch.Tensor:
    return order[keep:]


def _layers(model):
    return list(getattr(model, "module", model).decoder.layers)


# ------------------------------------------------------------------------- orders
def importance_orders(
    scores: ImportanceScores,
    axis: str,
    query_groups: int,
    mamba_groups: int,
    mamba_source: str | None = None,
    statistic: str | None = None,
) -> dict[int, torch.Tensor]:
    """Most important first, per layer (key 0 for the embedding); heads within groups.

    ``statistic``: one of ``methods.STATISTICS[axis]`` (default: ``methods.DEFAULTS``)."""
    from elastic_plugin.importance.reorder import Permutations

    perms = Permutations.from_scores(
        scores,
        query_groups,
        mamba_groups,
        mamba_source=mamba_source,
        methods={axis: statistic} if statistic else None,
    )
    if axis == "embedding":
        return {} if perms.embedding is None else {0: perms.embedding}  # no scores: like other axes
    return dict(getattr(perms, axis))


def magnitude_orders(model, axis: str) -> dict[int, torch.Tensor]:
    """Baseline: the L2 norm of the weights that write each unit (single rank)."""
    from elastic_plugin.importance.magnitude import weight_magnitudes

    w = weight_magnitudes(model)
    desc = lambda x: torch.argsort(x, descending=True, stable=True)  # noqa: E731
    if axis == "mamba_heads":
        return {
            k: within_groups(v.sum(1), _mamba_groups(model)) for k, v in w["mamba_weight"].items()
        }
    if axis == "mamba_channels":
        return {k: desc(v.sum(0)) for k, v in w["mamba_weight"].items()}
    if axis == "attention_heads":
        groups = _query_groups(model)
        return {k: within_groups(v, groups) for k, v in w["attention_heads_weight"].items()}
    return {k: desc(v) for k, v in w[f"{axis}_weight"].items()}


def _mamba_groups(model) -> int:
    from megatron.core.ssm.mamba_layer import MambaLayer

    return next(lyr.mixer.ngroups_local_tp for lyr in _layers(model) if isinstance(lyr, MambaLayer))


def _query_groups(model) -> int:
    return next(
        lyr.self_attention.num_query_groups_per_partition
        for lyr in _layers(model)
        if hasattr(getattr(lyr, "self_attention", None), "linear_proj")
    )


def random_orders(
    reference: dict[int, torch.Tensor], seed: int, groups: dict[int, int] | None = None
) -> dict[int, torch.Tensor]:
    """Random orders with the same shapes (heads stay within their groups)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, order in reference.items():
        g = (groups or {}).get(key, 1)
        per = order.numel() // g
        local = torch.stack([torch.randperm(per, generator=gen) for _ in range(g)])
        out[key] = (local + torch.arange(g).unsqueeze(1) * per).reshape(-1)
    return out


# -------------------------------------------------------------------------- masks
@torch.no_grad()
def mask_prune(model, axis: str, orders: dict[int, torch.Tensor], keep_fraction: float) -> None:
    """Keep the first ``keep_fraction`` of each order (per group for heads); zero the rest."""
    if axis not in PRUNABLE:
        raise ValueError(f"axis {axis!r}; allowed: {', '.join(PRUNABLE)}")
    if not 0 < keep_fraction <= 1:
        raise ValueError(f"keep_fraction={keep_fraction} must be in (0, 1]")
    handlers: dict[str, Callable] = {
        "embedding": _prune_hidden,
        "ffn": _prune_ffn,
        "shared_ffn": _prune_ffn,
        "attention_heads": _prune_heads,
        "mamba_heads": _prune_mamba,
        "mamba_channels": _prune_mamba,
        "experts": _prune_experts,
    }
    handlers[axis](model, axis, orders, keep_fraction)


def _prune_ffn(model, axis, orders, keep_fraction):
    for layer in _layers(model):
        n = int(layer.layer_number)
        if n not in orders:
            continue
        mlp = layer.mlp.shared_experts if axis == "shared_ffn" else layer.mlp
        drop = _drop(orders[n], int(orders[n].numel() * keep_fraction))
        _zero_(mlp.linear_fc1.weight, 0, drop)
        _zero_(mlp.linear_fc2.weight, 1, drop)


def _grouped_drop(order: torch.Tensor, groups: int, keep_fraction: float) -> torch.Tensor:
    per = order.numel() // groups
    keep = int(per * keep_fraction)
    return order.view(groups, per)[:, keep:].reshape(-1)


def _prune_heads(model, axis, orders, keep_fraction):
    for layer in _layers(model):
        n = int(layer.layer_number)
        if n not in orders:
            continue
        att = layer.self_attention
        d = att.hidden_size_per_attention_head
        drop = _grouped_drop(orders[n], att.num_query_groups_per_partition, keep_fraction)
        cols = (drop.unsqueeze(1) * d + torch.arange(d)).reshape(-1)
        _zero_(att.linear_proj.weight, 1, cols)


def _prune_mamba(model, axis, orders, keep_fraction):
    for layer in _layers(model):
        n = int(layer.layer_number)
        if n not in orders:
            continue
        m = layer.mixer
        heads, p = m.nheads_local_tp, m.headdim
        if axis == "mamba_heads":
            drop_heads = _grouped_drop(orders[n], m.ngroups_local_tp, keep_fraction)
            channels = (drop_heads.unsqueeze(1) * p + torch.arange(p)).reshape(-1)
            kept_fraction_in_group = 1 - drop_heads.numel() / heads
        else:
            drop_ch = _drop(orders[n], int(p * keep_fraction))
            channels = (torch.arange(heads).unsqueeze(1) * p + drop_ch.unsqueeze(0)).reshape(-1)
            kept_fraction_in_group = 1 - drop_ch.numel() / p
        d_inner = m.d_inner_local_tp
        _zero_(m.in_proj.weight, 0, d_inner + channels)  # x = 0 ...
        _zero_(m.conv1d_weight, 0, channels)  # ... also after the conv (its bias would leak)
        if getattr(m, "conv1d_bias", None) is not None:
            _zero_(m.conv1d_bias, 0, channels)
        _zero_(m.out_proj.weight, 1, channels)
        norm_weight = m.norm.weight
        norm_weight.data.mul_(math.sqrt(kept_fraction_in_group))  # RMS over kept channels only


def _prune_experts(model, axis, orders, keep_fraction):
    for layer in _layers(model):
        n = int(layer.layer_number)
        if n not in orders:
            continue
        router = layer.mlp.router
        drop = _drop(orders[n], int(orders[n].numel() * keep_fraction))
        if getattr(router, "expert_bias", None) is not None:
            router.expert_bias.data[drop] = -1e9  # never selected; top-k among the kept
        else:
            _zero_(router.weight, 0, drop)
            raise NotImplementedError("expert pruning needs a router with expert bias")


def _prune_hidden(model, axis, orders, keep_fraction):
    """Zero dropped channels wherever the residual stream is written; norms over kept ones."""
    from elastic_plugin.models.layers import head_norms
    from elastic_plugin.models.norms import LocalRMSNorm

    inner = getattr(model, "module", model)
    skip = {id(norm) for norm in head_norms(inner)}  # q/k norms: over head_dim, not hidden
    order = orders[0]
    width = order.numel()
    drop = _drop(order, int(width * keep_fraction))
    scale = math.sqrt(1 - drop.numel() / width)
    _zero_(inner.embedding.word_embeddings.weight, 1, drop)
    for module in inner.modules():
        if (
            isinstance(module, (LocalRMSNorm, torch.nn.RMSNorm))
            and module.weight.numel() == width
            and id(module) not in skip
        ):
            module.weight.data.mul_(scale)
            _zero_(module.weight, 0, drop)
        name = type(module).__name__
        if name == "RowParallelLinear" and module.weight.shape[0] == width:
            _zero_(module.weight, 0, drop)
