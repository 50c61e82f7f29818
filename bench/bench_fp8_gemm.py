"""FP8 GEMM of an elastic linear's active block vs the model-dtype GEMM of the same block.

What ``elastic.fp8_gemm`` costs or saves per linear: ``fp8_linear`` (both operands quantized to
E4M3 with current scaling every call, as training does, then the GEMM) against ``F.linear`` on
the same strided prefix ``w[:n, :k]`` in the model dtype (bf16 on a GPU, fp32 on CPU), for the
full width and keep fractions 0.77 / 0.5 (column-parallel prefix n, k = full). Columns:

* ``fp8/dense``: time ratio (< 1: FP8 is faster). On an FP8 GPU (sm_89+) this is
  ``torch._scaled_mm``; elsewhere the exact emulation (a correctness path: expect > 1).
* ``fp8_tflops`` / ``dense_tflops`` and, on an H100/H200, ``fp8_of_peak`` (dense FP8 peak
  989 TFLOPS; the quantization passes are included in the FP8 time).

Run: ``python bench/bench_fp8_gemm.py [--quick] [--reps N]`` or
``python bench/run_all.py --only fp8_gemm``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians, synchronizer  # noqa: E402

from elastic_plugin.elastic.layers.fp8 import Fp8Recipe, fp8_linear  # noqa: E402
from elastic_plugin.ops._fp8 import _scaled_mm_usable  # noqa: E402

KEEP_FRACTIONS = (1.0, 0.77, 0.5)
HOPPER_FP8_DENSE_TFLOPS = 989.0  # H100/H200 SXM, dense (no sparsity)


def _method(x: torch.Tensor, n: int, k: int, scaling: str) -> str:
    return "scaled_mm" if _scaled_mm_usable(x, n, k, scaling, x.dtype) else "emulate"


def run(device: str | None = None, reps: int = 7, quick: bool = False) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    tokens, width = (8192, 8192) if gpu else ((256, 1024) if quick else (512, 2048))
    dtype = torch.bfloat16 if gpu else torch.float32
    hopper = gpu and torch.cuda.get_device_capability(dev) == (9, 0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=gen).to(dtype).to(dev)
    weight = torch.randn(width, width, generator=gen).to(dtype).to(dev)
    sync = synchronizer(dev)
    rows = []
    for keep in KEEP_FRACTIONS:
        n = max(16, round(width * keep / 16) * 16)
        block = weight[:n]  # the active rows of a column-parallel weight, read in place
        recipes = {s: Fp8Recipe(s) for s in ("tensor", "row")}
        for scaling, recipe in recipes.items():  # sanity: FP8 close to the dense product
            err = (fp8_linear(x, block, recipe).float() - F.linear(x, block).float()).norm()
            if err > 0.1 * F.linear(x, block).float().norm():
                raise AssertionError(f"fp8_linear ({scaling}) is off by {err:.3g} at keep {keep}")
        times = interleaved_medians(
            {
                "dense": lambda: F.linear(x, block),
                "tensor": lambda: fp8_linear(x, block, recipes["tensor"]),
                "row": lambda: fp8_linear(x, block, recipes["row"]),
            },
            reps=reps,
            sync=sync,
        )
        flops = 2.0 * tokens * n * width
        for scaling in ("tensor", "row"):
            row = {
                "name": f"fp8_gemm {scaling} keep {keep:g} [{dev.type} {str(dtype)[6:]}, "
                f"{_method(x, n, width, scaling)}]",
                "dense_ms": times["dense"] * 1e3,
                "fp8_ms": times[scaling] * 1e3,
                "fp8/dense": times[scaling] / times["dense"],
                "dense_tflops": flops / times["dense"] / 1e12,
                "fp8_tflops": flops / times[scaling] / 1e12,
            }
            if hopper:
                row["fp8_of_peak"] = row["fp8_tflops"] / HOPPER_FP8_DENSE_TFLOPS
            rows.append(row)
    return rows


if __name__ == "__main__":
    from run_all import bench_main

    bench_main(
        lambda quick, reps: run(reps=reps or 7, quick=quick),
        "FP8 GEMM of an elastic linear's active block vs the model-dtype GEMM",
    )
