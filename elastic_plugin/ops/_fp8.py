"""FP8 (E4M3) prefix GEMM: a CPU emulation that checks the numerics of the GPU FP8 path.

Nested models are served in FP8 (docs/design.md, "Quantization"), and a sliced nested width is a
prefix ``weight[:n, :k]``.  On a GPU with FP8 tensor cores (compute capability >= 8.9)
``torch._scaled_mm`` runs the real thing; elsewhere this module emulates it exactly as the
hardware defines it: quantize both operands to ``float8_e4m3fn`` with scales
``amax / 448`` (per tensor, or per row: one per token of x and one per output row of the
weight), multiply the FP8 values (exactly representable in fp32) with fp32 accumulation,
then apply the scales.  That is dequantize-and-matmul in fp32, with the scaling moved
after the sum as the GPU does it; the two differ only by fp32 rounding.

The functions are compositions of PyTorch ops, so they trace under ``torch.compile``.
They compute values only: no gradient is defined through the FP8 rounding.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch

from elastic_plugin.ops._masked_gemm import check_args as _check_prefix_args

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALINGS = ("tensor", "row")
METHODS = ("auto", "emulate", "scaled_mm")
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_scaling(who: str, scaling: object) -> str:
    if scaling not in SCALINGS:
        raise ValueError(f"{who}: scaling must be one of {SCALINGS}, got {scaling!r}")
    return scaling


AmaxReduce = Callable[[torch.Tensor], torch.Tensor] | None
"""Applied to an operand's amax before the scales are taken (e.g. a MAX all-reduce over the
tensor-parallel ranks that hold the other parts of the operand): returns the amax to use."""


def quantize_e4m3(
    t: torch.Tensor, scaling: str = "tensor", dim: int = -1, amax_reduce: AmaxReduce = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``t`` to ``float8_e4m3fn``; return ``(fp8 values, fp32 scales)``.

    ``scales = amax / 448`` (1 where that is 0), and ``fp8.float() * scales`` dequantizes.

    Args:
        t: a floating-point tensor (float16, bfloat16, float32, float64).
        scaling: ``"tensor"``: one scale (a 0-d tensor); ``"row"``: one scale per slice
            along ``dim``, i.e. amax reduced over ``dim`` and kept as size 1 there.
        dim: the dim shared by one scale for ``"row"`` (the GEMM's contraction dim: -1
            for x ``[tokens, k]`` and for a weight ``[n, k]``); ignored for ``"tensor"``.
        amax_reduce: maps the local amax (0-d, or size 1 along ``dim``) to the one to scale by;
            must keep its shape. ``None``: the local amax.
    """
    who = "quantize_e4m3"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: t must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(
            f"{who}: t must be float16, bfloat16, float32 or float64, got dtype {t.dtype}"
        )
    _check_scaling(who, scaling)
    if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
        raise TypeError(f"{who}: dim must be an int, got {type(dim).__name__}")
    dim = operator.index(dim)
    if scaling == "row":
        if t.dim() == 0:
            raise ValueError(f"{who}: scaling='row' needs at least 1 dimension, got a 0-d tensor")
        if not -t.dim() <= dim < t.dim():
            raise ValueError(
                f"{who}: dim must be in [{-t.dim()}, {t.dim() - 1}] for a {t.dim()}-D t, got {dim}"
            )

    values = t.float()
    if scaling == "tensor":
        amax = values.abs().amax() if values.numel() > 0 else values.new_zeros(())
    elif values.shape[dim] > 0:
        amax = values.abs().amax(dim=dim, keepdim=True)
    else:  # nothing to reduce over: every scale is 1
        shape = list(values.shape)
        shape[dim] = 1
        amax = values.new_zeros(shape)
    if amax_reduce is not None:
        reduced = amax_reduce(amax.contiguous())
        if not isinstance(reduced, torch.Tensor) or reduced.shape != amax.shape:
            raise ValueError(
                f"{who}: amax_reduce must return a tensor of the amax's shape "
                f"{list(amax.shape)}, got {getattr(reduced, 'shape', type(reduced).__name__)}"
            )
        amax = reduced
    # test the scale, not the amax: an amax below 448 x the smallest subnormal gives scale 0
    scales = amax / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    # Clamp before the cast: out-of-range casts saturate in recent torch but are not promised to.
    fp8 = (values / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return fp8, scales


def dequantize_e4m3(
    fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``fp8 * scales`` in ``dtype`` (the inverse of quantize_e4m3, up to FP8 rounding)."""
    if not isinstance(fp8, torch.Tensor) or fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"dequantize_e4m3: fp8 must be a float8_e4m3fn tensor, got {getattr(fp8, 'dtype', type(fp8))}"
        )
    return (fp8.float() * scales).to(dtype)


def _scaled_mm_usable(
    x: torch.Tensor, n: int, k: int, scaling: str, out_dtype: torch.dtype
) -> bool:
    """Whether torch._scaled_mm can run this case on x's GPU (FP8 tensor cores, aligned sizes)."""
    if not (x.is_cuda and hasattr(torch, "_scaled_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    if k % 16 != 0 or n % 16 != 0:
        return False
    # Row-wise scales are a bfloat16-output kernel in cuBLASLt/CUTLASS.
    return scaling == "tensor" or out_dtype == torch.bfloat16


def fp8_prefix_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    n: int,
    k: int,
    scaling: str = "tensor",
    out_dtype: torch.dtype | None = None,
    method: str = "auto",
    x_amax_reduce: AmaxReduce = None,
    w_amax_reduce: AmaxReduce = None,
) -> torch.Tensor:
    """``x[..., :k] @ weight[:n, :k].T`` with both operands quantized to FP8 E4M3.

    Args:
        x, weight, n, k: as for :func:`elastic_plugin.ops.prefix_linear` (no bias).
        scaling: ``"tensor"`` (one scale per operand) or ``"row"`` (per token of x, per
            output row of weight; robust to outlier rows).
        out_dtype: float32, bfloat16 or float16; default float32, or x's dtype if it is a
            16-bit float.
        method: ``"emulate"`` (fp32 matmul of the FP8 values, any device),
            ``"scaled_mm"`` (``torch._scaled_mm``; on CPU it exists but is slow, for tests),
            ``"auto"``: ``scaled_mm`` on an FP8-capable GPU when sizes allow, else emulate.
        x_amax_reduce, w_amax_reduce: :data:`AmaxReduce` hooks for x's amax (0-d or
            ``[tokens, 1]``) and the weight's (0-d or ``[n, 1]``): how a tensor-parallel
            caller makes the scales of an operand sharded along k those of the whole operand.

    Returns:
        ``[..., n]`` tensor of ``out_dtype``.
    """
    who = "fp8_prefix_linear"
    _check_prefix_args(x, weight, None, n, k)
    _check_scaling(who, scaling)
    if method not in METHODS:
        raise ValueError(f"{who}: method must be one of {METHODS}, got {method!r}")
    if out_dtype is None:
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{who}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if method == "scaled_mm" and not hasattr(torch, "_scaled_mm"):
        raise ValueError(
            f"{who}: method='scaled_mm' needs torch._scaled_mm, absent in torch {torch.__version__}"
        )

    out_shape = (*x.shape[:-1], n)
    x2d = x[..., :k].reshape(math.prod(x.shape[:-1]), k)  # not -1: k may be 0
    x_fp8, x_scales = quantize_e4m3(
        x2d, scaling, dim=-1, amax_reduce=x_amax_reduce
    )  # [M, 1] or 0-d
    w_fp8, w_scales = quantize_e4m3(
        weight[:n, :k], scaling, dim=-1, amax_reduce=w_amax_reduce
    )  # [n, 1]
    w_scales_t = w_scales.t() if scaling == "row" else w_scales  # [1, n] broadcasts over outputs

    use_scaled_mm = method == "scaled_mm" or (
        method == "auto" and _scaled_mm_usable(x, n, k, scaling, out_dtype)
    )
    if use_scaled_mm:
        # w_fp8 is a fresh contiguous [n, k], so its transpose is the column-major operand required.
        y = torch._scaled_mm(
            x_fp8, w_fp8.t(), scale_a=x_scales, scale_b=w_scales_t.contiguous(), out_dtype=out_dtype
        )
    else:
        y = (x_fp8.float() @ w_fp8.float().t()).mul_(x_scales).mul_(w_scales_t)
    return y.to(out_dtype).reshape(out_shape)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F`` in float64 (0 when both are zero)."""
    a, e = approx.double(), exact.double()
    denom = e.norm()
    return float((a - e).norm() / denom) if denom > 0 else float((a - e).norm())
