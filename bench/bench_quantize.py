"""Export quantization of one weight vs a plain copy of it (what moving its bytes costs).

Per weight shape and dtype, side by side: ``quantize_fp8`` / ``quantize_nvfp4`` (the whole export
step: the tensor's amax, then the ``fp8_quantize`` / ``nvfp4_quantize`` op, a C++ kernel on CPU
when built), each op alone, its PyTorch reference (the fallback without the extension) and
``clone``. Columns ``*/copy`` are time ratios; ``*_speedup`` = reference / kernel.

Run: ``python bench/bench_quantize.py [--quick] [--reps N]`` or
``python bench/run_all.py --only quantize``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians, synchronizer  # noqa: E402

import elastic_plugin.ops as ops  # noqa: E402
from elastic_plugin.export.quantize import E2M1_MAX, E4M3_MAX, quantize_fp8, quantize_nvfp4  # noqa: E402
from elastic_plugin.ops._quantize import (  # noqa: E402
    fp8_quantize,
    nvfp4_quantize,
    reference_fp8_quantize,
    reference_nvfp4_quantize,
)


def run(device: str | None = None, reps: int = 5, quick: bool = False) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = [(1024, 1024)] if quick else [(4096, 4096), (8 * 1024, 2048)]
    sync = synchronizer(dev)
    rows = []
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(dev)
            row_scale = torch.full(
                (shape[0],), float(w.abs().max()) / (E2M1_MAX * E4M3_MAX), device=dev
            )
            ref = reference_nvfp4_quantize(w, row_scale)
            got = nvfp4_quantize(w, row_scale)
            if not (
                torch.equal(got[0], ref[0])
                and torch.equal(got[1].view(torch.uint8), ref[1].view(torch.uint8))
            ):
                raise AssertionError(
                    f"nvfp4_quantize disagrees with its reference at {shape} {dtype}"
                )
            fp8_scale = row_scale * E2M1_MAX  # amax / 448
            if not torch.equal(
                fp8_quantize(w, fp8_scale).view(torch.uint8),
                reference_fp8_quantize(w, fp8_scale).view(torch.uint8),
            ):
                raise AssertionError(
                    f"fp8_quantize disagrees with its reference at {shape} {dtype}"
                )
            times = interleaved_medians(
                {
                    "fp8": lambda: quantize_fp8(w),
                    "nvfp4": lambda: quantize_nvfp4(w),
                    "fp8_kernel": lambda: fp8_quantize(w, fp8_scale),
                    "fp8_reference": lambda: reference_fp8_quantize(w, fp8_scale),
                    "kernel": lambda: nvfp4_quantize(w, row_scale),
                    "reference": lambda: reference_nvfp4_quantize(w, row_scale),
                    "copy": lambda: w.clone(),
                },
                reps=reps,
                sync=sync,
            )
            copy = times["copy"]
            rows.append(
                {
                    "name": f"quantize {shape[0]}x{shape[1]} {str(dtype)[6:]} [{dev.type}, {ops.backend()}]",
                    "copy_ms": copy * 1e3,
                    "fp8/copy": times["fp8"] / copy,
                    "fp8_speedup": times["fp8_reference"] / times["fp8_kernel"],
                    "nvfp4/copy": times["nvfp4"] / copy,
                    "nvfp4_kernel/copy": times["kernel"] / copy,
                    "nvfp4_reference/copy": times["reference"] / copy,
                    "nvfp4_speedup": times["reference"] / times["kernel"],
                }
            )
    return rows


if __name__ == "__main__":
    from run_all import bench_main

    bench_main(
        lambda quick, reps: run(reps=reps or 5, quick=quick),
        "export quantization (FP8, NVFP4 kernel vs reference) vs a copy",
    )
