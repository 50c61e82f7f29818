"""``elastic_plugin::nvfp4_quantize`` / ``fp8_quantize``: the C++ kernels give the PyTorch
references' bytes exactly (codes and E4M3 block scales, fp32 and bf16, per-row scales, every
rounding and saturation edge), refuse non-finite weights and bad shapes with errors naming the
argument, pass ``opcheck``, and the pure-PyTorch fallback (extension disabled) serves the same ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import elastic_plugin.ops as ops
from elastic_plugin.ops._quantize import (
    fp8_quantize,
    nvfp4_quantize,
    reference_fp8_quantize,
    reference_nvfp4_quantize,
)

REPO = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(
    not ops.INFO.uses_extension, reason="the C++ extension is not built"
)


def _edge_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that hit every branch: exact grid values and midpoints (scale 448, g = 1/448 so the
    block divides by exactly 1), an all-zero block (scale 1), a tiny block (scale clamps to
    2^-9), a block far above g (scale clamps to 448: codes saturate), signed zeros."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6])
    mids = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0]
    )
    below = torch.nextafter(mids, torch.zeros_like(mids))
    rows = torch.stack(
        [
            torch.cat([grid, mids]),
            torch.cat([below, torch.zeros(16)]),
            torch.cat([torch.full((16,), 1e-30), torch.linspace(-1e6, 1e6, 16)]),
        ]
    )
    return rows, torch.tensor([1 / 448, 1 / 448, 1e-3])


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_bytes_equal_the_reference(dtype) -> None:
    rows, scales = _edge_rows()
    gen = torch.Generator().manual_seed(0)
    spread = torch.logspace(-8, 4, 64).view(-1, 1)  # rows of very different magnitudes
    random = torch.randn(64, 256, generator=gen) * spread
    cases = [(rows, scales), (random, torch.rand(64, generator=gen) * 1e-2 + 1e-6)]
    for w, row_scale in cases:
        w = w.to(dtype)
        kernel = torch.ops.elastic_plugin.nvfp4_quantize.default(w, row_scale)
        assert _same(kernel, reference_nvfp4_quantize(w, row_scale))
        assert (
            kernel[0].shape == (w.shape[0], w.shape[1] // 2)
            and kernel[1].dtype == torch.float8_e4m3fn
        )
    # the edge rows really reach the branches: exact codes, a zero block's scale 1, clamps
    packed, scale = reference_nvfp4_quantize(rows, scales)
    assert packed[0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x7F]
    assert packed[0, 8:16].tolist() == [
        0x20,
        0x42,
        0x64,
        0x76,
        0xA8,
        0xCA,
        0xEC,
        0x0E,
    ]  # ties: even codes
    assert scale[1, 1].float().item() == 1.0 and scale[2, 0].float().item() == 2.0**-9
    assert scale[2, 1].float().item() == 448.0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kernel_bytes_equal_the_reference(dtype) -> None:
    """Scaled values below, at and beyond +-448 (saturation), E4M3 ties and subnormals, +-0."""
    gen = torch.Generator().manual_seed(1)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)]
    ties = (e4m3[1:] + e4m3[:-1]) / 2  # halfway between neighbours (same sign)
    special = torch.tensor(
        [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 480.0, -1e6, 2.0**-9, 2.0**-10, 3e-3]
    )
    edge = torch.cat([e4m3, ties, special])
    edge = torch.cat([edge, torch.zeros(-edge.numel() % 32)]).reshape(-1, 32)
    random = torch.randn(40, 96, generator=gen) * torch.logspace(-6, 3, 40).view(-1, 1)
    for w, row_scale in (
        (edge, torch.ones(edge.shape[0])),
        (random, torch.rand(40, generator=gen) + 1e-3),
    ):
        w = w.to(dtype)
        got = torch.ops.elastic_plugin.fp8_quantize.default(w, row_scale)
        want = reference_fp8_quantize(w, row_scale)
        assert got.dtype == torch.float8_e4m3fn and torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        )


def test_bad_input_is_refused_naming_the_argument() -> None:
    w = torch.randn(4, 32)
    for quantize in (reference_fp8_quantize, fp8_quantize):
        with pytest.raises(ValueError, match="fp8_quantize: w has NaN or infinite"):
            quantize(torch.full((2, 3), float("inf")), torch.ones(2))
        with pytest.raises(
            ValueError, match=r"fp8_quantize: row_scale must be float32 of shape \[rows=4\]"
        ):
            quantize(w, torch.ones(4, 1))
    implementations = [reference_nvfp4_quantize, nvfp4_quantize]
    for quantize in implementations:
        for bad in (float("nan"), float("inf")):
            poisoned = w.clone()
            poisoned[2, 5] = bad
            with pytest.raises(ValueError, match="NaN or infinite"):
                quantize(poisoned, torch.ones(4))
        with pytest.raises(ValueError, match="cols must divide by 16"):
            quantize(torch.randn(4, 24), torch.ones(4))
        with pytest.raises(TypeError, match="float32 or bfloat16"):
            quantize(w.half(), torch.ones(4))
        with pytest.raises(ValueError, match=r"row_scale must be float32 of shape \[rows=4\]"):
            quantize(w, torch.ones(3))


@needs_kernel
def test_kernel_refuses_non_finite_weights_itself() -> None:
    w = torch.randn(4, 32)
    w[3, 31] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        torch.ops.elastic_plugin.nvfp4_quantize.default(w, torch.ones(4))
    with pytest.raises(ValueError, match="NaN or infinite"):
        torch.ops.elastic_plugin.fp8_quantize.default(w, torch.ones(4))


def test_opcheck() -> None:
    w = torch.randn(8, 64)
    torch.library.opcheck(
        torch.ops.elastic_plugin.nvfp4_quantize.default, (w, torch.full((8,), 0.01))
    )
    torch.library.opcheck(
        torch.ops.elastic_plugin.fp8_quantize.default, (w, torch.full((8,), 0.01))
    )


_CHILD = textwrap.dedent(
    """
    import json, torch
    import elastic_plugin.ops as ops
    from elastic_plugin.ops._quantize import fp8_quantize, nvfp4_quantize, reference_nvfp4_quantize
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    scale = torch.full((8,), 0.01)
    got = torch.ops.elastic_plugin.nvfp4_quantize.default(w, scale)
    ref = reference_nvfp4_quantize(w, scale)
    same = torch.equal(got[0], ref[0]) and torch.equal(got[1].view(torch.uint8), ref[1].view(torch.uint8))
    torch.library.opcheck(torch.ops.elastic_plugin.nvfp4_quantize.default, (w, scale))
    torch.library.opcheck(torch.ops.elastic_plugin.fp8_quantize.default, (w, scale))
    fp8 = torch.ops.elastic_plugin.fp8_quantize.default(w, scale).view(torch.uint8)
    print(json.dumps({"backend": ops.backend(), "same": same,
                      "wrapper_same": torch.equal(nvfp4_quantize(w, scale)[0], ref[0]),
                      "fp8_same": torch.equal(fp8, fp8_quantize(w, scale).view(torch.uint8))}))
    """
)


@pytest.mark.integration
def test_fallback_op_without_the_extension() -> None:
    env = {**os.environ, ops.DISABLE_ENV: "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"backend": "pytorch", "same": True, "wrapper_same": True, "fp8_same": True}


def test_bench_quantize_runs_quick() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_quantize
    finally:
        sys.path.remove(str(REPO / "bench"))
    rows = bench_quantize.run(reps=1, quick=True)
    assert len(rows) == 2
    for row in rows:
        assert all(
            row[key] > 0 for key in ("fp8/copy", "fp8_speedup", "nvfp4/copy", "nvfp4_speedup")
        ), row
