"""Megatron-Core's ``MambaMixer`` run at a smaller width: fewer heads, channels and hidden units.

An elastic Mamba layer is nested three ways (docs/design.md, "Width axes and nesting"): heads
within each Mamba group (after
reordering, the active heads are the first ``k`` of every group, and a TP rank holds whole
groups, so the set is local), channels within every head (the first ``p'`` of the head dim, the
same for every head) and the residual stream (the first ``h'`` hidden channels). The B/C
projections, the state size and the number of groups are not elastic.

*Sliced* mode computes only the active part: the in_proj GEMM produces only the active z/x/dt
rows (plus all B/C rows), the causal conv runs over the active x channels plus B/C, the SSD scan
over the active heads and channels, the gated RMSNorm over each group's active channels, and the
out_proj GEMM reads only the active channels and writes only ``h'`` outputs. This is exactly a
genuinely smaller ``MambaMixer`` (``k * groups`` heads of dim ``p'``, hidden ``h'``) whose weights
are the active blocks.

*Masked* mode (for the router's gradient) multiplies the SSM output of head ``j`` / channel ``c``
by ``head_mask[j] * channel_mask[c]``, lets the gated norm divide the group's sum of squares by
the soft active count ``sum(head_mask) * sum(channel_mask)`` instead of the group size, and
multiplies the output by ``hidden_mask``; with a hard 0/1 mask at full width this equals sliced
mode at the mask's widths. Both modes can be combined (masks over a sliced width).

The math follows ``MambaMixer.forward`` / ``_ssm_training`` / ``_ssm_prefill`` of Megatron-Core
0.19.2 and calls the same op functions, read from ``megatron.core.ssm.mamba_mixer`` at call time:
the ``mamba_ssm`` / ``causal_conv1d`` kernels when installed, our pure-PyTorch fallbacks
(``elastic_plugin.compat``) otherwise.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from elastic_plugin.elastic.layers.linear import column_parallel_forward, row_parallel_forward
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.prefix import (
    check_size,
    local_mamba_dims,
    mamba_active_rows,
    mamba_rows,
)

__all__ = ["elastic_mamba_forward"]


def _mixer_module():
    """Megatron's mixer module; its globals hold the kernels (patched by our CPU compat)."""
    from megatron.core.ssm import mamba_mixer

    return mamba_mixer


def _pick(tensor: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return tensor if index is None else tensor.index_select(0, index)


def _check_mask(name: str, mask: torch.Tensor | None, size: int) -> None:
    if mask is not None and tuple(mask.shape) != (size,):
        raise ConfigError(
            f"{name} must have shape ({size},) (the computed width), got {tuple(mask.shape)}"
        )


def _check_training_call(mixer, inference_context, packed_seq_params) -> bool:
    """Reject what this training forward does not implement; True when Megatron would take the
    unfused (prefill) path instead of the fused training kernel."""
    mm = _mixer_module()
    in_inference = mm.InferenceMode.is_active()
    if in_inference and inference_context is not None:
        raise NotImplementedError(
            "elastic_mamba_forward is the training forward: inference with a cache "
            "(inference_context) is not supported; extract the nested model and run it instead"
        )
    cp = mixer.cp.cp_size
    if cp != 1:
        if mixer.ngroups_local_tp % cp:
            raise ConfigError(
                f"--context-parallel-size={cp} must divide the Mamba groups per tensor-parallel "
                f"rank ({mixer.ngroups_local_tp}): each CP rank scans whole groups"
            )
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences under context parallelism need TE")
    unfused = in_inference or not mixer.use_mem_eff_path
    if packed_seq_params is not None:
        if unfused:  # the same restriction as MambaMixer.forward
            raise NotImplementedError(
                "packed sequences need the memory-efficient path (use_mamba_mem_eff_path=True)"
            )
        ok, reason = mm._check_mamba_sequence_packing_support(for_inference_not_training=False)
        if not ok:
            raise NotImplementedError(f"packed sequences: {reason}")
    return unfused


def _ssm(
    mixer,
    zxbcdt: torch.Tensor,
    rows: dict[str, torch.Tensor] | None,
    heads: int,
    head_dim: int,
    unfused: bool,
    seq_idx: torch.Tensor | None,
    groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Conv + SSD scan on ``zxbcdt`` [l, b, z|x|B|C|dt] of the active part (of ``groups``
    groups: this TP rank's, or under CP this CP rank's share of them).

    Returns ``(y [l, b, heads*head_dim], gate)``: ``gate`` is the ``z`` still to be applied by
    the gated norm (Megatron's prefill path), or None when ``y`` is already gated (fused path).
    """
    mm = _mixer_module()
    groups, state = groups or mixer.ngroups_local_tp, mixer.d_state
    d = heads * head_dim
    sel = (lambda name: None) if rows is None else rows.__getitem__
    conv_w = _pick(mixer.conv1d_weight, sel("conv")).squeeze(1)  # "d 1 w -> d w"
    conv_b = _pick(mixer.conv1d_bias, sel("conv"))
    dt_bias = _pick(mixer.dt_bias, sel("heads")).float()
    A = -torch.exp(_pick(mixer.A_log, sel("heads")).float())
    if mixer.D_has_hdim:
        D = _pick(mixer.D, sel("channels")).float().reshape(heads, head_dim)
    else:
        D = _pick(mixer.D, sel("heads"))
    state_kwarg = (
        {"state_dtype": mixer.mamba_training_ssm_states_dtype} if mm.MAMBA_HAS_STATE_DTYPE else {}
    )
    zxbcdt = zxbcdt.transpose(0, 1).contiguous()  # l b d -> b l d
    length = zxbcdt.shape[1]

    if not unfused:  # MambaMixer._ssm_training
        y = mm.mamba_split_conv1d_scan_combined(
            zxbcdt,
            conv_w,
            conv_b,
            dt_bias,
            A,
            D=D,
            chunk_size=mixer.chunk_size,
            activation=mixer.activation,
            headdim=None if mixer.D_has_hdim else head_dim,
            ngroups=groups,
            norm_before_gate=mixer.norm_before_gate,
            seq_idx=seq_idx,
            **state_kwarg,
        )
        return y.transpose(0, 1).contiguous(), None

    # MambaMixer._ssm_prefill without a cache (static batching / inference without state)
    z, xbc, dt = torch.split(zxbcdt, [d, d + 2 * groups * state, heads], dim=-1)
    xbc = xbc.transpose(1, 2).contiguous()  # b l d -> b d l
    if mm.causal_conv1d_fn is None:
        xbc = F.silu(
            F.conv1d(
                xbc, conv_w.unsqueeze(1), conv_b, padding=mixer.d_conv - 1, groups=conv_w.shape[0]
            )[..., :length]
        )
    else:
        xbc = mm.causal_conv1d_fn(
            x=xbc, weight=conv_w, bias=conv_b, activation=mixer.activation, seq_idx=None
        )
    xbc = xbc.transpose(1, 2).contiguous()
    x, B, C = torch.split(xbc, [d, groups * state, groups * state], dim=-1)
    b = x.shape[0]
    z = z.reshape(b, length, heads, head_dim).contiguous()
    y = mm.mamba_chunk_scan_combined(
        x.reshape(b, length, heads, head_dim).contiguous(),
        dt.contiguous(),
        A,
        B.reshape(b, length, groups, state).contiguous(),
        C.reshape(b, length, groups, state).contiguous(),
        mixer.chunk_size,
        D=D,
        z=None if mixer.rmsnorm else z,
        dt_bias=dt_bias,
        dt_softplus=True,
        **state_kwarg,
    )
    y = y.reshape(b, length, d).transpose(0, 1).contiguous()
    gate = z.reshape(b, length, d).transpose(0, 1).contiguous() if mixer.rmsnorm else None
    return y, gate


def _cp_rows(mixer, k: int, p: int) -> dict[str, torch.Tensor]:
    """Under CP: the heads, channels and conv channels (this TP rank's indices) of the groups
    this CP rank scans, ``[r G/cp, (r+1) G/cp)``, at ``k`` heads per group of ``p`` channels.
    Megatron's ``MambaContextParallel`` gives CP rank ``r`` the same groups."""
    cache = mixer.__dict__.setdefault("_elastic_cp_rows", {})
    device = mixer.in_proj.weight.device
    if (k, p, device) not in cache:
        _, groups, per_group, hd, state = local_mamba_dims(mixer)
        cp, rank = mixer.cp.cp_size, mixer.cp.cp_rank
        mine = groups // cp
        first = rank * mine
        full = mamba_rows(groups, per_group, hd, state, k, p)
        heads = full["heads"].view(groups, k)[first : first + mine].reshape(-1)
        channels = full["channels"].view(groups, k * p)[first : first + mine].reshape(-1)
        d_inner = groups * per_group * hd
        bc = torch.arange(first * state, (first + mine) * state)
        conv = torch.cat([channels, d_inner + bc, d_inner + groups * state + bc])
        cache[(k, p, device)] = {
            "heads": heads.to(device),
            "channels": channels.to(device),
            "conv": conv.to(device),
        }
    return cache[(k, p, device)]


def _cp_to_heads(mixer, zxbcdt: torch.Tensor, groups: int, k: int, p: int) -> torch.Tensor:
    """[l/cp, b, z|x|B|C|dt] (this rank's two chunks, every active group) -> [l, b, the same
    parts of this rank's groups] in sequence order: Megatron's all-to-alls and chunk reorder
    (``megatron.core.ssm.mamba_context_parallel``), on the active widths."""
    from megatron.core.ssm.mamba_context_parallel import (
        _all_to_all_cp2hp,
        _undo_attention_load_balancing,
    )

    d, bc = groups * k * p, groups * mixer.d_state
    parts = torch.split(zxbcdt, [d, d, bc, bc, groups * k], dim=-1)
    moved = [_all_to_all_cp2hp(t.contiguous(), mixer.cp.cp_group) for t in parts]
    return _undo_attention_load_balancing(torch.cat(moved, dim=-1), mixer.cp.cp_size)


def _norm_sliced(
    mixer,
    y: torch.Tensor,
    gate: torch.Tensor | None,
    channels: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """The mixer's own gated-norm implementation on the active channels.

    The norm class (mamba_ssm's Triton ``RMSNorm`` or our fallback) reads only plain
    attributes (``weight``, ``bias``, ``eps``, ``group_size``, ``norm_before_gate``, ...) from
    ``self``; calling its ``forward`` on a view of the module with the active weight and the
    active group size runs the same kernel at the smaller width.
    """
    norm = mixer.norm
    if channels is None:
        return norm(y, gate)
    bias = getattr(norm, "bias", None)
    view = types.SimpleNamespace(**{k: v for k, v in vars(norm).items() if not k.startswith("_")})
    view.weight = norm.weight.index_select(0, channels)
    view.bias = None if bias is None else bias.index_select(0, channels)
    view.group_size = group_size
    return type(norm).forward(view, y, gate)


def _norm_masked(
    mixer,
    y: torch.Tensor,
    gate: torch.Tensor | None,
    channels: torch.Tensor | None,
    groups: int,
    active_count: torch.Tensor,
) -> torch.Tensor:
    """Gated RMSNorm (norm after gate) whose mean square divides by the soft active count."""
    norm = mixer.norm
    out_dtype = y.dtype
    ct = torch.promote_types(y.dtype, torch.float32)
    yf = y.to(ct)
    if gate is not None:
        yf = yf * F.silu(gate.to(ct))
    grouped = yf.reshape(*yf.shape[:-1], groups, yf.shape[-1] // groups)
    mean_sq = grouped.square().sum(dim=-1, keepdim=True) / active_count.to(ct)
    out = (grouped * torch.rsqrt(mean_sq + norm.eps)).reshape(yf.shape)
    out = out * _pick(norm.weight, channels).to(ct)
    bias = getattr(norm, "bias", None)
    if bias is not None:
        out = out + _pick(bias, channels).to(ct)
    return out.to(out_dtype)


def elastic_mamba_forward(
    mixer,
    hidden_states: torch.Tensor,
    *,
    hidden_active: int | None = None,
    heads_per_group: int | None = None,
    head_dim: int | None = None,
    head_mask: torch.Tensor | None = None,
    channel_mask: torch.Tensor | None = None,
    hidden_mask: torch.Tensor | None = None,
    packed_seq_params=None,
    inference_context=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``MambaMixer.forward`` (training) on the active part; returns ``(out, out_bias)``.

    ``hidden_states``: [s, b, h'] (s/tp under sequence parallelism), only the active hidden
    channels. ``hidden_active`` (h'), ``heads_per_group`` (k), ``head_dim`` (p'): computed
    widths, None = full. Masks are over the computed widths: ``head_mask`` [k] (the same for every
    group), ``channel_mask`` [p'], ``hidden_mask`` [h']. Masks are used as given: under TP each
    rank's mask gradient covers its own heads (and, under sequence parallelism, its own tokens);
    the caller completes it over TP (``ElasticState`` does, with
    ``copy_to_tensor_model_parallel_region``). ``out`` is [s, b, h'] (s/tp under SP).
    """
    unfused = _check_training_call(mixer, inference_context, packed_seq_params)
    _, groups, per_group, hd, _ = local_mamba_dims(mixer)
    h_act = check_size("hidden_active", hidden_active, mixer.d_model)
    k = check_size("heads_per_group", heads_per_group, per_group)
    p = check_size("head_dim", head_dim, hd)
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != h_act:
        raise ConfigError(
            f"hidden_states must be [s, b, hidden_active={h_act}], got {tuple(hidden_states.shape)}"
        )
    _check_mask("head_mask", head_mask, k)
    _check_mask("channel_mask", channel_mask, p)
    _check_mask("hidden_mask", hidden_mask, h_act)

    sliced = k < per_group or p < hd
    rows = mamba_active_rows(mixer, k, p) if sliced else None
    channels = None if rows is None else rows["channels"]
    out_h = None if h_act == mixer.d_model else h_act

    zxbcdt, _ = column_parallel_forward(
        mixer.in_proj, hidden_states, None if rows is None else rows["in_proj"], out_h
    )
    seq_idx = None if packed_seq_params is None else packed_seq_params.seq_idx
    cp = mixer.cp.cp_size
    scan_rows, scan_groups, scan_channels = rows, groups, channels
    if cp > 1:  # sequence-sharded -> this rank's groups over the whole sequence
        scan_rows = _cp_rows(mixer, k, p)
        scan_groups, scan_channels = groups // cp, scan_rows["channels"]
        zxbcdt = _cp_to_heads(mixer, zxbcdt, groups, k, p)
    y, gate = _ssm(mixer, zxbcdt, scan_rows, scan_groups * k, p, unfused, seq_idx, scan_groups)

    if head_mask is not None or channel_mask is not None:
        unit = y.new_ones(())
        hm = unit.expand(k) if head_mask is None else head_mask.to(y.dtype)
        cm = unit.expand(p) if channel_mask is None else channel_mask.to(y.dtype)
        y = (y.reshape(*y.shape[:-1], scan_groups, k, p) * hm[:, None] * cm).reshape(y.shape)
        if mixer.rmsnorm:  # (without the norm, y is already gated: gate is None)
            y = _norm_masked(mixer, y, gate, scan_channels, scan_groups, hm.sum() * cm.sum())
    elif mixer.rmsnorm:
        y = _norm_sliced(mixer, y, gate, scan_channels, k * p)
    if cp > 1:  # back to this rank's two sequence chunks, every active channel
        from megatron.core.ssm.mamba_context_parallel import (
            _all_to_all_hp2cp,
            _redo_attention_load_balancing,
        )

        y = _all_to_all_hp2cp(_redo_attention_load_balancing(y, cp), mixer.cp.cp_group)

    out, out_bias = row_parallel_forward(mixer.out_proj, y, out_h, channels)
    if hidden_mask is not None:
        out = out * hidden_mask.to(out.dtype)
    return out, out_bias
