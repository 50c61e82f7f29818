"""Which rows and columns of Megatron's fused weights belong to a nested width: the prefix layout.

After importance reordering every nested model is a prefix, but Megatron fuses several units
into one weight: ``linear_qkv`` holds each query group's query heads followed by its K and V
heads, a gated ``linear_fc1`` holds two halves, a Mamba ``in_proj`` holds ``[z | x | B | C | dt]``.
These functions give the local index sets of the active block of such a weight. The elastic
layers compute on exactly these blocks (``elastic.layers``) and ``nested.slicing`` cuts exactly
these blocks out for the plain smaller model, so training and extraction cannot disagree.
"""

from __future__ import annotations

import weakref

import torch

from elastic_plugin.models.config import ConfigError

__all__ = [
    "Index",
    "ffn_rows",
    "local_mamba_dims",
    "mamba_active_rows",
    "check_size",
    "mamba_rows",
    "proj_cols",
    "qkv_rows",
    "query_rows",
]

Index = None | int | torch.Tensor
"""Which units of a (local) dimension are active: None = all, int = that many leading units,
a 1-d LongTensor = those positions in that order."""


def qkv_rows(attn, per_group: int) -> torch.Tensor:
    """Local qkv rows of the first ``per_group`` query heads of each group, plus K and V."""
    d = attn.hidden_size_per_attention_head
    groups = attn.num_query_groups_per_partition
    # from the config: inside the sliced forward the per-partition head count is reduced
    q_per_group = attn.config.num_attention_heads // attn.config.num_query_groups
    block = (q_per_group + 2) * d
    rows = []
    for g in range(groups):
        start = g * block
        rows.append(torch.arange(start, start + per_group * d))
        rows.append(torch.arange(start + q_per_group * d, start + block))
    return torch.cat(rows)


def proj_cols(attn, per_group: int) -> torch.Tensor:
    """Local ``linear_proj`` columns of the first ``per_group`` query heads of each group."""
    # from the config: inside the sliced forward the per-partition head count is reduced
    q_per_group = attn.config.num_attention_heads // attn.config.num_query_groups
    return query_rows(
        attn.num_query_groups_per_partition,
        q_per_group,
        attn.hidden_size_per_attention_head,
        per_group,
    )


def query_rows(groups: int, q_per_group: int, head_dim: int, active: int) -> torch.Tensor:
    """Rows of the first ``active`` query heads of every group in an unfused query projection
    (heads group-major, ``head_dim`` rows each): Hugging Face's ``q_proj`` rows, ``o_proj``'s
    and Megatron's ``linear_proj`` columns."""
    return torch.cat(
        [
            torch.arange(g * q_per_group * head_dim, (g * q_per_group + active) * head_dim)
            for g in range(groups)
        ]
    )


def ffn_rows(mlp, local: int | None) -> Index:
    """fc1 rows of the first ``local`` neurons (both halves for gated units)."""
    if local is None or not mlp.config.gated_linear_unit:
        return local
    half = mlp.linear_fc1.weight.shape[0] // 2
    return torch.cat([torch.arange(local), half + torch.arange(local)])


_INDEX_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()


def local_mamba_dims(mixer) -> tuple[int, int, int, int, int]:
    """(local heads, local groups, heads per group, head dim, state size) on this TP rank."""
    heads, groups = mixer.nheads_local_tp, mixer.ngroups_local_tp
    return heads, groups, heads // groups, mixer.headdim, mixer.d_state


def check_size(name: str, value: int | None, full: int) -> int:
    """``value`` (None = ``full``) as an int in [1, full], or a ConfigError naming ``name``."""
    if value is None:
        return full
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= full:
        raise ConfigError(f"{name}={value!r}: must be an int in [1, {full}] (None = {full})")
    return value


def mamba_active_rows(mixer, heads_per_group: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Local index sets of the active part of ``mixer`` (cached per mixer, sizes and device).

    In Megatron 0.19.2 each TP rank's in_proj rows are ``[z | x | B | C | dt]`` with
    ``z``/``x`` of ``d_inner_local`` rows (head ``h`` channel ``c`` at ``h * headdim + c``),
    ``B``/``C`` of ``ngroups_local * d_state`` rows and ``dt`` one row per local head; heads are
    group-major (head ``g * heads_per_group + j`` belongs to group ``g``). The conv channels are
    ``[x | B | C]``. Returned keys (LongTensors on the weights' device):

    * ``heads``: active local heads, group-major (``g * r + j`` for ``j < k``);
    * ``channels``: their d_inner channels ``h * headdim + c`` for ``c < p'`` (head-major), which
      index z, x, ``D`` (when per channel), the norm weight and out_proj's columns;
    * ``z``, ``x``, ``bc`` (all B and C rows), ``dt``: in_proj rows per part; ``in_proj``: their
      concatenation, which is the ``[z | x | B | C | dt]`` layout of the smaller mixer;
    * ``conv``: conv1d channels ``[x active | B | C]``.
    """
    heads, groups, per_group, hd, state = local_mamba_dims(mixer)
    k = check_size("heads_per_group", heads_per_group, per_group)
    p = check_size("head_dim", head_dim, hd)
    device = mixer.in_proj.weight.device
    per_mixer = _INDEX_CACHE.setdefault(mixer, {})
    key = (k, p, device)
    if key not in per_mixer:
        rows = mamba_rows(groups, per_group, hd, state, k, p)
        per_mixer[key] = {name: t.to(device) for name, t in rows.items()}
    return per_mixer[key]


def mamba_rows(
    groups: int,
    per_group: int,
    head_dim: int,
    d_state: int,
    active_per_group: int,
    active_head_dim: int,
) -> dict[str, torch.Tensor]:
    """The index sets of :func:`mamba_active_rows` from the dimensions alone (``groups`` groups
    of ``per_group`` heads of ``head_dim`` channels, state ``d_state``): the same layout in
    Megatron's ``MambaMixer`` and Hugging Face's NemotronH mixer."""
    d_inner = groups * per_group * head_dim
    bc_rows = 2 * groups * d_state
    act_heads = (
        torch.arange(groups)[:, None] * per_group + torch.arange(active_per_group)[None]
    ).reshape(-1)
    channels = (act_heads[:, None] * head_dim + torch.arange(active_head_dim)[None]).reshape(-1)
    parts = {
        "z": channels,
        "x": d_inner + channels,
        "bc": 2 * d_inner + torch.arange(bc_rows),
        "dt": 2 * d_inner + bc_rows + act_heads,
    }
    return {
        **parts,
        "in_proj": torch.cat([parts["z"], parts["x"], parts["bc"], parts["dt"]]),
        "conv": torch.cat([channels, d_inner + torch.arange(bc_rows)]),
        "heads": act_heads,
        "channels": channels,
    }
