"""``elastic_plugin::fp8_quantize`` / ``nvfp4_quantize``: export quantization of weight rows.

Exporting a nested model quantizes every linear weight with the scale ``s`` of its tensor (one
per expert of a stack; passed per row). FP8: ``e4m3(clamp(x / s, -448, 448))``. NVFP4: per
16-value block an E4M3 scale ``clamp(amax / (6 s), 2^-9, 448)`` (amax 0 -> 1), then E2M1 codes
of ``x / (scale * s)`` packed two per byte. The PyTorch compositions below are the references
and the fallbacks; the C++ kernels (``csrc/quantize_cpu.cpp``, CPU) read the weight once
(instead of several passes; about twenty for NVFP4) and give the same bytes. Non-finite
weights raise: their codes would be meaningless.
"""

from __future__ import annotations

import torch

from elastic_plugin.ops._fp8 import E4M3_MAX
from elastic_plugin.ops._loader import cpu_kernel_serves, register_cpu_ops

NVFP4_OP, NVFP4_SCHEMA = (
    "elastic_plugin::nvfp4_quantize",
    "(Tensor w, Tensor row_scale) -> (Tensor, Tensor)",
)
FP8_OP, FP8_SCHEMA = "elastic_plugin::fp8_quantize", "(Tensor w, Tensor row_scale) -> Tensor"
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 4-bit codes (uint8) of ``x``: nearest grid magnitude, a tie goes to the even code
    (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), beyond 6 saturates to 6;
    bit 3 is the sign, set for every x < 0.

    E2M1 is a float with one mantissa bit: its grid step is 0.5 below 2, 1 in [2, 4) and 2
    from 4 on, and ``torch.round`` (half to even) on each step's multiples gives the even code.
    """
    a = x.abs().float()
    code = torch.where(
        a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a * 0.5) + 4)
    )
    return code.clamp_(max=7).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element 2i low nibble, 2i+1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def check_args(who: str, w: torch.Tensor, row_scale: torch.Tensor, col_multiple: int = 1) -> None:
    """Metadata checks shared by every implementation (shapes only: also under tracing)."""
    if not isinstance(w, torch.Tensor) or not isinstance(row_scale, torch.Tensor):
        raise TypeError(f"{who}: w and row_scale must be tensors")
    if w.dim() != 2:
        raise ValueError(f"{who}: w must be 2-D [rows, cols], got shape {list(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{who}: w must be float32 or bfloat16, got {w.dtype}")
    if w.shape[1] % col_multiple:
        raise ValueError(f"{who}: cols must divide by {col_multiple}, got {w.shape[1]}")
    if row_scale.dtype != torch.float32 or row_scale.dim() != 1 or row_scale.shape[0] != w.shape[0]:
        raise ValueError(
            f"{who}: row_scale must be float32 of shape [rows={w.shape[0]}], got "
            f"{row_scale.dtype} {list(row_scale.shape)}"
        )


def _finite(who: str, x: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{who}: w has NaN or infinite values; their codes would be meaningless")
    return x


def reference_fp8_quantize(w: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch implementation (the fallback): ``float8_e4m3fn [rows, cols]``."""
    check_args("fp8_quantize", w, row_scale)
    x = _finite("fp8_quantize", w.float())
    return (x / row_scale.view(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def reference_nvfp4_quantize(
    w: torch.Tensor, row_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch implementation (the fallback): ``(packed uint8 [rows, cols/2],
    block_scale float8_e4m3fn [rows, cols/16])``."""
    check_args("nvfp4_quantize", w, row_scale, BLOCK)
    x = _finite("nvfp4_quantize", w.float())
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    g = row_scale.view(-1, 1)
    scale = blocks.abs().amax(-1) / (E2M1_MAX * g)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    block_scale = scale.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float() * g).unsqueeze(-1)
    return pack_e2m1(round_e2m1(scaled.reshape(x.shape))), block_scale


def _fake_nvfp4(w: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_args("nvfp4_quantize", w, row_scale, BLOCK)
    rows, cols = w.shape
    return (
        w.new_empty((rows, cols // 2), dtype=torch.uint8),
        w.new_empty((rows, cols // BLOCK), dtype=torch.float8_e4m3fn),
    )


def _fake_fp8(w: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    check_args("fp8_quantize", w, row_scale)
    return w.new_empty(w.shape, dtype=torch.float8_e4m3fn)


# Keeps the Python registrations alive for the life of the process.
_LIB = register_cpu_ops(
    [
        (NVFP4_OP, NVFP4_SCHEMA, reference_nvfp4_quantize, _fake_nvfp4),
        (FP8_OP, FP8_SCHEMA, reference_fp8_quantize, _fake_fp8),
    ]
)


def fp8_quantize(w: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 codes ``clamp(w / row_scale[r], -448, 448)`` of the rows of ``w`` ([rows, cols],
    float32 or bfloat16); the C++ kernel and the reference give the same bytes."""
    check_args("fp8_quantize", w, row_scale)
    if cpu_kernel_serves(w):
        return torch.ops.elastic_plugin.fp8_quantize.default(w, row_scale)
    return reference_fp8_quantize(w, row_scale)


def nvfp4_quantize(w: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 ``(packed codes, E4M3 block scales)`` of the rows of ``w`` ([rows, cols], float32
    or bfloat16, cols divisible by 16) with global scale ``row_scale[r]`` for row r; the C++
    kernel and the reference give the same bytes."""
    check_args("nvfp4_quantize", w, row_scale, BLOCK)
    if cpu_kernel_serves(w):
        return torch.ops.elastic_plugin.nvfp4_quantize.default(w, row_scale)
    return reference_nvfp4_quantize(w, row_scale)
