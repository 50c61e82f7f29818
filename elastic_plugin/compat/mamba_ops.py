"""Pure-PyTorch Mamba-2 operations, drop-in for the ``mamba_ssm`` / ``causal_conv1d`` kernels.

Megatron-Core's ``MambaMixer`` calls CUDA/Triton kernels from ``mamba_ssm`` and ``causal_conv1d``
(training and prefill) and its own Triton kernels (decode). None of them run on a CPU, and the
packages do not even import without CUDA. The functions here keep the *same signatures and
semantics* so that :func:`install_mamba_fallbacks` can put them into Megatron's namespace:

* :func:`mamba_chunk_scan_combined` - the Mamba-2 SSD scan in its chunked dual form
  (quadratic attention-like form inside a chunk, linear state passing between chunks);
* :func:`mamba_split_conv1d_scan_combined` - the fused training op (split, conv, scan, gate);
* :func:`causal_conv1d_fn` - depthwise causal convolution, layout ``(batch, dim, seqlen)``;
* :class:`RMSNormGated` - gated, optionally grouped RMSNorm (same parameter names);
* :func:`causal_conv1d_update_ref` / :func:`selective_state_update_ref` - single-step decode.

Everything is differentiable by autograd and is computed in (at least) float32; outputs come back
in the input dtype, so float64 inputs give float64-accurate results (used by the tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "RMSNormGated",
    "ExtendedRMSNormGated",
    "causal_conv1d_fn",
    "causal_conv1d_update_ref",
    "gated_rms_norm",
    "install_mamba_fallbacks",
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "selective_state_update_ref",
    "ssd_chunk_scan",
]

_NO_LIMIT = (0.0, float("inf"))
_ACTIVATIONS = (None, "silu", "swish")


# --------------------------------------------------------------------------------- helpers
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float32 at least (bf16/fp16 inputs), float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _check_activation(activation: None | str | bool) -> bool:
    """Return True when SiLU should be applied; Megatron passes "silu", mamba_ssm also bools."""
    if isinstance(activation, bool):
        return activation
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {_ACTIVATIONS} (or a bool), got {activation!r}"
        )
    return activation is not None


def _check_shape(name: str, t: Tensor | None, shape: Sequence[int]) -> None:
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _process_dt(
    dt: Tensor,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: Sequence[float],
) -> Tensor:
    """dt (+ bias) -> softplus (identity above 20) -> clamp to ``dt_limit``, as the Triton kernel.

    The kernel clamps unconditionally, so with the default ``(0, inf)`` a negative raw ``dt``
    (no softplus) acts as 0, i.e. neither decays nor writes the state.
    """
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt, beta=1.0, threshold=20.0)
    return dt.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))


def _segsum_stable(a: Tensor) -> Tensor:
    """``out[..., i, j] = sum_{k=j+1..i} a[..., k]`` for ``j <= i`` and ``-inf`` above the diagonal.

    Built from a masked cumulative sum rather than differences of one long cumsum, so it stays
    exact for long spans of strong decay (used for the chunk-to-chunk state passing).
    """
    t = a.size(-1)
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    x = a.unsqueeze(-1).expand(*a.shape, t).masked_fill(~strict, 0.0)  # x[..., k, j] = a[k], k > j
    out = x.cumsum(dim=-2)
    lower = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(0)
    return out.masked_fill(~lower, float("-inf"))


# ----------------------------------------------------------------------- the SSD chunk scan
def ssd_chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Core Mamba-2 SSD scan on already-discretised inputs (no D, no gate).

    Computes ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t`` for every head, with
    ``x (b, l, h, p)``, ``dt (b, l, h)`` (after bias/softplus), ``A (h,)``, ``B, C (b, l, g, n)``
    (``g`` divides ``h``; head ``i`` reads group ``i // (h // g)``), ``initial_states (b, h, p, n)``
    and ``seq_idx (b, l)`` (non-decreasing ids of packed sequences; the state resets between them).

    Inside a chunk of ``Q`` steps the output is the masked quadratic form ``(C B^T * L) (dt x)``
    with the decay matrix ``L``; chunk-end states are passed between chunks with one small
    ``(chunks+1)^2`` decay matrix, so the cost is ``O(l Q)`` instead of ``O(l^2)``.
    Returns ``(y (b, l, h, p), final_state (b, h, p, n))`` in the compute dtype.
    """
    b, l, h, p = x.shape
    g, n = B.shape[-2], B.shape[-1]
    r = h // g
    q = min(int(chunk_size), max(l, 1))  # a chunk longer than the sequence only adds padding
    nc = max(1, math.ceil(l / q))
    pad = nc * q - l
    ct = x.dtype

    if pad:
        # dt = 0 on padded steps: no decay and no input, so the final state is unchanged.
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
        if seq_idx is not None:
            seq_idx = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1)

    # Chunked, head-major views: heads are split into (group, head-in-group).
    xc = x.reshape(b, nc, q, g, r, p).permute(0, 1, 3, 4, 2, 5)  # (b, c, g, r, Q, p)
    dtc = dt.reshape(b, nc, q, g, r).permute(0, 1, 3, 4, 2)  # (b, c, g, r, Q)
    Bc = B.reshape(b, nc, q, g, n).permute(0, 1, 3, 2, 4)  # (b, c, g, Q, n)
    Cc = C.reshape(b, nc, q, g, n).permute(0, 1, 3, 2, 4)  # (b, c, g, Q, n)
    xdt = xc * dtc.unsqueeze(-1)
    cs = torch.cumsum(dtc * A.to(ct).reshape(g, r, 1), dim=-1)  # (b, c, g, r, Q), log-decay

    same = None
    if seq_idx is not None:
        sc = seq_idx.reshape(b, nc, q)
        same = (sc.unsqueeze(-1) == sc.unsqueeze(-2)).to(ct)  # (b, c, Q, Q)

    # 1) intra-chunk (diagonal blocks): y_l = sum_{s<=l} C_l.B_s exp(cs_l - cs_s) dt_s x_s
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril(0)
    seg = (cs.unsqueeze(-1) - cs.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
    decay = torch.exp(seg)  # (b, c, g, r, Q, Q)
    if same is not None:
        decay = decay * same[:, :, None, None]
    cb = torch.matmul(Cc, Bc.transpose(-1, -2))  # (b, c, g, Q, Q)
    y = torch.matmul(decay * cb.unsqueeze(3), xdt)  # (b, c, g, r, Q, p)

    # 2) state at each chunk end from that chunk's own inputs
    decay_to_end = torch.exp(cs[..., -1:] - cs)  # (b, c, g, r, Q)
    if same is not None:
        decay_to_end = decay_to_end * same[:, :, -1, :][:, :, None, None]
    states = torch.matmul((xdt * decay_to_end.unsqueeze(-1)).transpose(-1, -2), Bc.unsqueeze(3))
    # states: (b, c, g, r, p, n)

    # 3) pass states across chunks: S_z = sum_{c<=z} exp(sum of chunk decays c+1..z) s_c
    if initial_states is None:
        init = states.new_zeros(b, 1, g, r, p, n)
    else:
        init = initial_states.to(ct).reshape(b, 1, g, r, p, n)
    states_all = torch.cat([init, states], dim=1)  # (b, c+1, g, r, p, n)
    chunk_log = F.pad(cs[..., -1].permute(0, 2, 3, 1), (1, 0))  # (b, g, r, c+1)
    chunk_decay = torch.exp(_segsum_stable(chunk_log))  # (b, g, r, c+1, c+1)
    if seq_idx is not None:
        ends = torch.cat([seq_idx[:, :1], seq_idx.reshape(b, nc, q)[:, :, -1]], dim=1)  # (b, c+1)
        chunk_decay = chunk_decay * (ends.unsqueeze(-1) == ends.unsqueeze(-2)).to(ct)[:, None, None]
    passed = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states_all)  # (b, c+1, g, r, p, n)
    prev, final = passed[:, :-1], passed[:, -1]

    # 4) contribution of the state entering each chunk: y_l += exp(cs_l) C_l . S_prev
    decay_from_start = torch.exp(cs)  # (b, c, g, r, Q)
    if seq_idx is not None:
        entering = ends[:, :-1]  # sequence id of the state entering chunk c
        decay_from_start = (
            decay_from_start * (sc == entering.unsqueeze(-1)).to(ct)[:, :, None, None]
        )
    y_off = torch.matmul(Cc.unsqueeze(3), prev.transpose(-1, -2))  # (b, c, g, r, Q, p)
    y = y + y_off * decay_from_start.unsqueeze(-1)

    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, nc * q, h, p)[:, :l]
    return y, final.reshape(b, h, p, n)


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: Sequence[float] = _NO_LIMIT,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``.

    Shapes: ``x (b, l, h, p)``, ``dt (b, l, h)``, ``A (h,)``, ``B, C (b, l, g, n)``,
    ``D (h,)`` or ``(h, p)``, ``z (b, l, h, p)``, ``dt_bias (h,)``, ``initial_states (b, h, p, n)``,
    ``seq_idx (b, l)``. ``y = scan + D x``, then ``y *= silu(z)`` when ``z`` is given.
    Returns ``y`` (dtype of ``x``), plus the final state ``(b, h, p, n)`` if ``return_final_states``
    (in ``state_dtype`` when given, else float32 or float64). ``cu_seqlens`` / varlen states are
    not supported (dynamic-batching inference only).
    """
    if cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError(
            "cu_seqlens / return_varlen_states are not supported by the CPU fallback"
        )
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    if B.dim() != 4 or B.shape[:2] != (b, l):
        raise ValueError(
            f"B must be (batch, seqlen, ngroups, dstate) = ({b}, {l}, g, n), got {tuple(B.shape)}"
        )
    g, n = B.shape[2], B.shape[3]
    if h % g != 0:
        raise ValueError(f"ngroups ({g}) must divide nheads ({h})")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _check_shape("dt", dt, (b, l, h))
    _check_shape("A", A, (h,))
    _check_shape("C", C, (b, l, g, n))
    _check_shape("z", z, (b, l, h, p))
    _check_shape("dt_bias", dt_bias, (h,))
    _check_shape("initial_states", initial_states, (b, h, p, n))
    _check_shape("seq_idx", seq_idx, (b, l))
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"D must have shape ({h},) or ({h}, {p}), got {tuple(D.shape)}")
    if len(dt_limit) != 2 or float(dt_limit[0]) > float(dt_limit[1]):
        raise ValueError(f"dt_limit must be (min, max) with min <= max, got {dt_limit!r}")
    if seq_idx is not None and l > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        raise ValueError("seq_idx must be non-decreasing along the sequence (packed sequences)")

    out_dtype = x.dtype
    ct = _compute_dtype(x.dtype)
    dt_p = _process_dt(
        dt.to(ct), None if dt_bias is None else dt_bias.to(ct), dt_softplus, dt_limit
    )
    y, final = ssd_chunk_scan(
        x.to(ct), dt_p, A.to(ct), B.to(ct), C.to(ct), chunk_size, initial_states, seq_idx
    )
    if D is not None:
        Dc = D.to(ct)
        y = y + x.to(ct) * (Dc.unsqueeze(-1) if Dc.dim() == 1 else Dc)
    if z is not None:
        y = y * F.silu(z.to(ct))
    y = y.to(out_dtype)
    if return_final_states:
        return y, final.to(state_dtype or ct)
    return y


# ---------------------------------------------------------------------------- causal conv
@overload
def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: Literal[False] = False,
    final_states_out: Tensor | None = None,
    activation: None | str | bool = None,
) -> Tensor: ...


@overload
def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    *,
    return_final_states: Literal[True],
    final_states_out: Tensor | None = None,
    activation: None | str | bool = None,
) -> tuple[Tensor, Tensor]: ...


@overload
def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: None | str | bool = None,
) -> Tensor | tuple[Tensor, Tensor]: ...


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: Tensor | None = None,
    activation: None | str | bool = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as ``causal_conv1d.causal_conv1d_fn``: depthwise causal conv (+ SiLU).

    ``x (b, d, l)``, ``weight (d, w)``, ``bias (d,)``, ``initial_states (b, d, w-1)`` (the inputs
    before position 0, zeros if None), ``seq_idx (b, l)`` (taps never cross a sequence boundary).
    ``out[t] = act(bias + sum_k weight[k] * x[t - (w-1) + k])``. With ``return_final_states``
    also returns the last ``w-1`` inputs ``(b, d, w-1)`` (the decode conv state), written into
    ``final_states_out`` when given.
    """
    silu = _check_activation(activation)
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, dim, seqlen), got shape {tuple(x.shape)}")
    b, d, l = x.shape
    if weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"weight must be (dim={d}, width), got {tuple(weight.shape)}")
    w = weight.shape[1]
    _check_shape("bias", bias, (d,))
    _check_shape("initial_states", initial_states, (b, d, w - 1))
    _check_shape("seq_idx", seq_idx, (b, l))

    wt = weight.to(x.dtype)
    if initial_states is None:
        xp = F.pad(x, (w - 1, 0))
    else:
        xp = torch.cat([initial_states.to(x.dtype), x], dim=-1)
    if seq_idx is None:
        out = F.conv1d(xp, wt.unsqueeze(1), None if bias is None else bias.to(x.dtype), groups=d)
    else:
        # Tap k of output t reads xp[t + k]; keep it only inside t's own sequence. The w-1
        # prefix positions (initial state) belong to the first sequence of the row.
        sp = torch.cat([seq_idx[:, :1].expand(b, w - 1), seq_idx], dim=1)  # (b, l + w - 1)
        keep = (sp.unfold(1, w, 1) == seq_idx.unsqueeze(-1)).to(x.dtype)  # (b, l, w)
        windows = xp.unfold(-1, w, 1)  # (b, d, l, w)
        out = torch.einsum("bdlw,blw,dw->bdl", windows, keep, wt)
        if bias is not None:
            out = out + bias.to(x.dtype).unsqueeze(-1)
    if silu:
        out = F.silu(out)
    if not return_final_states:
        return out
    final = xp[..., xp.shape[-1] - (w - 1) :]
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


# ------------------------------------------------------------------------- gated RMSNorm
def gated_rms_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    z: Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> Tensor:
    """``RMSNorm(x) * silu(z)`` (``norm_before_gate``) or ``RMSNorm(x * silu(z))``, per group.

    The mean square is taken over each contiguous group of ``group_size`` channels (all channels
    when None), so tensor-parallel shards that hold whole groups normalise exactly as TP=1 does.
    """
    hidden = x.shape[-1]
    gs = hidden if group_size is None else int(group_size)
    if gs <= 0 or hidden % gs != 0:
        raise ValueError(
            f"group_size ({group_size}) must be positive and divide the last dim ({hidden})"
        )
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    ct = _compute_dtype(x.dtype)
    xf = x.to(ct)
    zf = None if z is None else z.to(ct)
    if zf is not None and not norm_before_gate:
        xf = xf * F.silu(zf)
    xg = xf.reshape(*xf.shape[:-1], hidden // gs, gs)
    xg = xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)
    out = xg.reshape(xf.shape) * weight.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    if zf is not None and norm_before_gate:
        out = out * F.silu(zf)
    return out.to(x.dtype)


class RMSNormGated(nn.Module):
    """Gated RMSNorm with ``mamba_ssm``'s constructor and parameter names (``weight``, ``bias=None``).

    Same signature as ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` so Megatron's
    ``MambaMixer`` builds it unchanged and its state dicts load either way.
    """

    bias: Tensor | None  # registered as None: there is no bias

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if group_size is not None and (group_size <= 0 or hidden_size % group_size != 0):
            raise ValueError(
                f"group_size ({group_size}) must be positive and divide hidden_size ({hidden_size})"
            )
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return gated_rms_norm(
            x,
            self.weight,
            self.bias,
            z=z,
            eps=self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )


class ExtendedRMSNormGated(RMSNormGated):
    """:class:`RMSNormGated` with Megatron's sharded state dict (weight split along TP, axis 0).

    Replaces ``megatron.core.ssm.mamba_mixer.ExtendedRMSNorm``, which subclasses a ``MagicMock``
    when ``mamba_ssm`` is missing and so is not a usable module.
    """

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


# --------------------------------------------------------------------- fused training op
def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    dt_limit: Sequence[float] = _NO_LIMIT,
    return_final_states: bool = False,
    activation: None | str | bool = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    state_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as ``mamba_ssm``'s ``mamba_split_conv1d_scan_combined`` (Megatron's training op).

    ``zxbcdt (b, l, 2*d_mlp + 2*dim + 2*ngroups*dstate + nheads)`` is split into
    ``[z0, x0, z, xBC, dt]``; ``xBC`` goes through the causal conv (+ activation), then the SSD scan
    with ``dt_softplus=True``, ``D`` and ``dt_bias``. Without ``rmsnorm_weight`` the output is
    gated as ``y * silu(z)`` (this is what Megatron uses: it applies its own norm afterwards);
    with it, a gated RMSNorm over groups of ``dim // ngroups`` channels. An optional MLP part
    ``x0 * silu(z0)`` is prepended and ``outproj_weight``/``bias`` applied last.
    """
    if zxbcdt.dim() != 3:
        raise ValueError(
            f"zxbcdt must be (batch, seqlen, features), got shape {tuple(zxbcdt.shape)}"
        )
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim must be given when D has shape (nheads,)")
        nheads = D.shape[0]
    elif D.dim() == 2:
        nheads, headdim = D.shape
    else:
        raise ValueError(f"D must be (nheads,) or (nheads, headdim), got {tuple(D.shape)}")
    b, l, feat = zxbcdt.shape
    dim = nheads * headdim
    conv_dim = conv1d_weight.shape[0]
    if ngroups <= 0 or (conv_dim - dim) % (2 * ngroups) != 0:
        raise ValueError(
            f"conv1d_weight rows ({conv_dim}) must be dim ({dim}) + 2 * ngroups ({ngroups}) * dstate"
        )
    dstate = (conv_dim - dim) // (2 * ngroups)
    d_nonssm2 = feat - 2 * dim - 2 * ngroups * dstate - nheads
    if d_nonssm2 < 0 or d_nonssm2 % 2 != 0:
        raise ValueError(
            f"zxbcdt last dim ({feat}) must be 2*d_mlp + 2*dim ({2 * dim}) + 2*ngroups*dstate "
            f"({2 * ngroups * dstate}) + nheads ({nheads})"
        )
    d_mlp = d_nonssm2 // 2
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, dim, conv_dim, nheads], dim=-1)

    xBC = causal_conv1d_fn(
        xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation
    ).transpose(1, 2)
    x, Bm, Cm = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    res = mamba_chunk_scan_combined(
        x.reshape(b, l, nheads, headdim),
        dt,
        A,
        Bm.reshape(b, l, ngroups, dstate),
        Cm.reshape(b, l, ngroups, dstate),
        chunk_size,
        D=D,
        z=z.reshape(b, l, nheads, headdim) if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
        state_dtype=state_dtype,
    )
    y, final = res if isinstance(res, tuple) else (res, None)  # a tuple iff return_final_states
    y = y.reshape(b, l, dim)
    if rmsnorm_weight is not None:
        y = gated_rms_norm(
            y,
            rmsnorm_weight,
            None,
            z=z,
            eps=rmsnorm_eps,
            group_size=dim // ngroups,
            norm_before_gate=norm_before_gate,
        )
    if d_mlp > 0:
        y = torch.cat([x0 * F.silu(z0), y], dim=-1)
    if outproj_weight is not None:
        out_b = None if outproj_bias is None else outproj_bias.to(y.dtype)
        y = F.linear(y, outproj_weight.to(y.dtype), out_b)
    return (y, final) if final is not None else y  # final is None iff not return_final_states


# ------------------------------------------------------------------------------ decoding
def causal_conv1d_update_ref(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: None | str | bool = None,
    conv_state_indices: Tensor | None = None,
    intermediate_conv_states: Tensor | None = None,
) -> Tensor:
    """One (or a few) decode steps of the causal conv; updates ``conv_state`` in place.

    Megatron's layout (``megatron.core.ssm.ops.causal_conv1d_triton.causal_conv1d_update``):
    ``x (b, d)`` or ``(b, s, d)``, ``conv_state (b_state, d, state_len)`` with
    ``state_len >= w - 1``, ``weight (d, w)``. Each step shifts the state left by one, appends the
    new input and outputs ``act(bias + sum_k weight[k] * state[state_len - w + k])`` (the last
    ``w`` inputs). ``conv_state_indices (b,)`` maps rows to state slots (negative: padding, output
    zero, state untouched); ``intermediate_conv_states (b_state, s, d, state_len)`` receives the
    state after every step (speculative decoding).
    """
    silu = _check_activation(activation)
    squeeze = x.dim() == 2
    xs = x.unsqueeze(1) if squeeze else x
    if xs.dim() != 3:
        raise ValueError(f"x must be (batch, dim) or (batch, seqlen, dim), got {tuple(x.shape)}")
    b, s, d = xs.shape
    w = weight.shape[-1]
    state_len = conv_state.shape[-1]
    if weight.shape != (d, w):
        raise ValueError(f"weight must be (dim={d}, width), got {tuple(weight.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1] != d or state_len < w - 1:
        raise ValueError(
            f"conv_state must be (batch, {d}, state_len >= {w - 1}), got {tuple(conv_state.shape)}"
        )

    if conv_state_indices is None:
        rows = torch.arange(b, device=xs.device)
        valid = torch.ones(b, dtype=torch.bool, device=xs.device)
    else:
        rows = conv_state_indices.to(torch.long)
        valid = rows >= 0
        rows = rows.clamp(min=0)
    ct = _compute_dtype(xs.dtype)
    state = conv_state[rows].to(ct)  # (b, d, state_len)
    full = torch.cat([state, xs.transpose(1, 2).to(ct)], dim=-1)  # (b, d, state_len + s)
    # Step t's window is full[..., state_len - w + 1 + t : state_len + 1 + t].
    windows = full[..., state_len - w + 1 :].unfold(-1, w, 1)  # (b, d, s, w)
    out = torch.einsum("bdsw,dw->bds", windows, weight.to(ct))
    if bias is not None:
        out = out + bias.to(ct).unsqueeze(-1)
    if silu:
        out = F.silu(out)
    out = out * valid.to(ct).view(b, 1, 1)

    with torch.no_grad():
        vr = rows[valid]
        conv_state[vr] = full[valid, :, full.shape[-1] - state_len :].to(conv_state.dtype)
        if intermediate_conv_states is not None:
            steps = full[..., 1:].unfold(
                -1, state_len, 1
            )  # (b, d, s, state_len): state after step t
            intermediate_conv_states[vr] = (
                steps[valid].transpose(1, 2).to(intermediate_conv_states.dtype)
            )
    out = out.transpose(1, 2).to(xs.dtype)
    return out.squeeze(1) if squeeze else out


def selective_state_update_ref(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
    intermediate_ssm_states: Tensor | None = None,
) -> Tensor:
    """Single-token SSM recurrence (decode); updates ``state`` in place.

    Accepts the shapes of ``mamba_ssm`` / Megatron's ``selective_state_update``:
    ``state (b, h, p, n)`` or ``(b, p, n)``; ``x``, ``dt``, ``z``: ``(b, h, p)``, ``(b, s, h, p)``,
    ``(b, p)`` or ``(b, s, p)``; ``A (h, p, n)`` or ``(p, n)``; ``B, C (b, g, n)`` or
    ``(b, s, g, n)`` (or without ``g``); ``D``, ``dt_bias``: ``(h, p)`` or ``(p,)``. With heads,
    per-head ``A``/``D``/``dt_bias`` ``(h,)`` and ``dt (b, [s,] h)`` are accepted too. Per step:
    ``dt <- softplus(dt + dt_bias)``, ``h <- exp(dt A) h + dt B x``, ``y = C.h + D x``,
    ``y *= silu(z)``. ``state_batch_indices`` maps rows to state slots (negative: padding);
    ``intermediate_ssm_states (b_state, s, h, p, n)`` receives the state after every step.
    """
    has_heads = state.dim() == 4
    if state.dim() not in (3, 4):
        raise ValueError(
            f"state must be (batch, nheads, dim, dstate) or (batch, dim, dstate), "
            f"got {tuple(state.shape)}"
        )
    base = 3 if has_heads else 2  # dims of x without a sequence axis
    has_seq = x.dim() == base + 1
    if x.dim() not in (base, base + 1):
        raise ValueError(
            f"x has {x.dim()} dims; expected {base} or {base + 1} for state {tuple(state.shape)}"
        )

    def std(t: Tensor) -> Tensor:
        """Bring x/dt/z to (b, s, h, p) and B/C to (b, s, g, n) (head/group axis 1 if absent)."""
        if not has_seq:
            t = t.unsqueeze(1)
        if not has_heads:
            t = t.unsqueeze(2)
        return t

    # Without a head axis, B/C have no group axis either (as in the Triton kernels).
    xs, dts, Bs, Cs = std(x), std(dt), std(B), std(C)
    zs = None if z is None else std(z)
    As = A if has_heads else A.unsqueeze(0)
    Ds = None if D is None else (D if has_heads else D.unsqueeze(0))
    bias = None if dt_bias is None else (dt_bias if has_heads else dt_bias.unsqueeze(0))
    if has_heads:  # also accept per-head A/D/dt_bias (h,) and dt (b, [s,] h) (tied over p)
        As = As.reshape(-1, 1, 1) if As.dim() == 1 else As
        Ds = Ds.reshape(-1, 1) if Ds is not None and Ds.dim() == 1 else Ds
        bias = bias.reshape(-1, 1) if bias is not None and bias.dim() == 1 else bias
        dts = dts.unsqueeze(-1) if dts.dim() == 3 else dts
    st = state if has_heads else state.unsqueeze(1)
    b, s, h, p = xs.shape
    g, n = Bs.shape[-2], Bs.shape[-1]
    if h % g != 0:
        raise ValueError(f"ngroups ({g}) must divide nheads ({h})")
    if st.shape[1:] != (h, p, n):
        raise ValueError(f"state must be (batch, {h}, {p}, {n}), got {tuple(state.shape)}")

    if state_batch_indices is None:
        rows = torch.arange(b, device=xs.device)
        valid = torch.ones(b, dtype=torch.bool, device=xs.device)
    else:
        rows = state_batch_indices.to(torch.long).reshape(-1)
        valid = rows >= 0
        rows = rows.clamp(min=0)

    ct = _compute_dtype(xs.dtype)
    hcur = st[rows].to(ct)  # (b, h, p, n)
    Af = As.to(ct).expand(h, p, n)
    rep = h // g
    outs, inter = [], []
    for t in range(s):  # s = 1 + speculative tokens: a handful at most
        dtt = dts[:, t].to(ct).expand(b, h, p)
        if bias is not None:
            dtt = dtt + bias.to(ct)
        if dt_softplus:
            dtt = F.softplus(dtt, threshold=20.0)
        Bt = Bs[:, t].to(ct).repeat_interleave(rep, dim=1)  # (b, h, n)
        Ct = Cs[:, t].to(ct).repeat_interleave(rep, dim=1)
        xt = xs[:, t].to(ct)
        hcur = torch.exp(dtt.unsqueeze(-1) * Af) * hcur + (dtt * xt).unsqueeze(-1) * Bt.unsqueeze(2)
        yt = torch.einsum("bhpn,bhn->bhp", hcur, Ct)
        if Ds is not None:
            yt = yt + xt * Ds.to(ct).expand(h, p)
        if zs is not None:
            yt = yt * F.silu(zs[:, t].to(ct))
        outs.append(yt)
        if intermediate_ssm_states is not None:
            inter.append(hcur)
    y = torch.stack(outs, dim=1) * valid.to(ct).view(b, 1, 1, 1)

    with torch.no_grad():
        vr = rows[valid]
        st[vr] = hcur[valid].to(st.dtype)
        if intermediate_ssm_states is not None:
            its = intermediate_ssm_states if has_heads else intermediate_ssm_states.unsqueeze(2)
            its[vr] = torch.stack(inter, dim=1)[valid].to(its.dtype)

    y = y.to(x.dtype)
    if not has_heads:
        y = y.squeeze(2)
    if not has_seq:
        y = y.squeeze(1)
    return y


from elastic_plugin.compat.mamba_install import install_mamba_fallbacks  # noqa: E402  (re-export)
