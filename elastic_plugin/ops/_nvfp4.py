"""``elastic_plugin::nvfp4_quantize``: NVFP4 codes and E4M3 block scales of weight rows.

Exporting a nested model in NVFP4 quantizes every linear weight: per 16-value block an E4M3
scale ``clamp(amax / (6 g), 2^-9, 448)`` (amax 0 -> 1), then E2M1 codes of
``x / (scale * g)`` packed two per byte, where ``g`` is the tensor's global scale (one per
expert of a stack; passed per row). The PyTorch composition below is the reference and the
fallback; the C++ kernel (``csrc/nvfp4_cpu.cpp``, CPU) makes one pass instead of about twenty
and gives the same bytes. Non-finite weights raise: their codes would be meaningless.
"""

from __future__ import annotations

import torch

from elastic_plugin.ops._fp8 import E4M3_MAX
from elastic_plugin.ops._loader import INFO

OP_NAME = "elastic_plugin::nvfp4_quantize"
SCHEMA = "(Tensor w, Tensor row_scale) -> (Tensor, Tensor)"
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
_WHO = "nvfp4_quantize"


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 4-bit codes (uint8) of ``x``: nearest grid magnitude, a tie goes to the even code
    (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), beyond 6 saturates to 6;
    bit 3 is the sign, set for every x < 0.

    E2M1 is a float with one mantissa bit: its grid step is 0.5 below 2, 1 in [2, 4) and 2
    from 4 on, and ``torch.round`` (half to even) on each step's multiples gives the even code.
    """
    a = x.abs().float()
    code = torch.where(a < 2, torch.round(a * 2),
                       torch.where(a < 4, torch.round(a) + 2, torch.round(a * 0.5) + 4))
    return code.clamp_(max=7).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element 2i low nibble, 2i+1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def check_args(w: torch.Tensor, row_scale: torch.Tensor) -> None:
    """Metadata checks shared by every implementation (shapes only: also under tracing)."""
    if not isinstance(w, torch.Tensor) or not isinstance(row_scale, torch.Tensor):
        raise TypeError(f"{_WHO}: w and row_scale must be tensors")
    if w.dim() != 2:
        raise ValueError(f"{_WHO}: w must be 2-D [rows, cols], got shape {list(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{_WHO}: w must be float32 or bfloat16, got {w.dtype}")
    if w.shape[1] % BLOCK:
        raise ValueError(f"{_WHO}: cols must divide by {BLOCK}, got {w.shape[1]}")
    if row_scale.dtype != torch.float32 or row_scale.dim() != 1 or row_scale.shape[0] != w.shape[0]:
        raise ValueError(f"{_WHO}: row_scale must be float32 of shape [rows={w.shape[0]}], got "
                         f"{row_scale.dtype} {list(row_scale.shape)}")


def reference_nvfp4_quantize(w: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch implementation (the fallback): ``(packed uint8 [rows, cols/2],
    block_scale float8_e4m3fn [rows, cols/16])``."""
    check_args(w, row_scale)
    x = w.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{_WHO}: w has NaN or infinite values; NVFP4 codes of those would be meaningless")
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    g = row_scale.view(-1, 1)
    scale = blocks.abs().amax(-1) / (E2M1_MAX * g)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    block_scale = scale.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float() * g).unsqueeze(-1)
    return pack_e2m1(round_e2m1(scaled.reshape(x.shape))), block_scale


def _fake(w: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(w, row_scale)
    rows, cols = w.shape
    return (w.new_empty((rows, cols // 2), dtype=torch.uint8),
            w.new_empty((rows, cols // BLOCK), dtype=torch.float8_e4m3fn))


def _register() -> None:
    if not INFO.uses_extension:
        torch.library.custom_op(OP_NAME, reference_nvfp4_quantize, mutates_args=(), schema=SCHEMA)
    torch.library.register_fake(OP_NAME, _fake, lib=_LIB)


# Keeps the Python registrations alive for the life of the process.
_LIB = torch.library.Library("elastic_plugin", "FRAGMENT")
_register()


def nvfp4_quantize(w: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 ``(packed codes, E4M3 block scales)`` of the rows of ``w`` ([rows, cols], float32
    or bfloat16, cols divisible by 16) with global scale ``row_scale[r]`` for row r.

    The C++ kernel serves CPU tensors when the extension is built; elsewhere (CUDA, or no
    extension) the PyTorch reference runs. Both give the same bytes."""
    check_args(w, row_scale)
    if INFO.uses_extension and w.device.type == "cpu":
        return torch.ops.elastic_plugin.nvfp4_quantize.default(w, row_scale)
    return reference_nvfp4_quantize(w, row_scale)
