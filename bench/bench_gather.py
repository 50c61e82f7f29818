"""ordered_gather vs torch.index_select vs a plain copy of the same number of bytes.

The copy (``clone`` of a contiguous tensor shaped like the output) is what moving the kept
bytes costs at best; the target is gather time <= 1.25 x copy time (>= 0.8x copy speed).
Run: ``python bench/bench_gather.py`` or ``python bench/run_all.py --only gather``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians, synchronizer  # noqa: E402

import elastic_plugin.ops as ops  # noqa: E402

# (label, shape, dtype, dim, kept fraction): weight-slicing shapes of a nested model.
CASES = [
    ("fp32 4096x4096 rows 50%", (4096, 4096), torch.float32, 0, 0.5),
    ("fp32 4096x4096 cols 50%", (4096, 4096), torch.float32, 1, 0.5),
    ("bf16 4096x4096 rows 50%", (4096, 4096), torch.bfloat16, 0, 0.5),
    ("bf16 4096x4096 cols 50%", (4096, 4096), torch.bfloat16, 1, 0.5),
    ("fp32 64x256x1024 mid 50%", (64, 256, 1024), torch.float32, 1, 0.5),
    ("bf16 4096x4096.T rows 50%", (4096, 4096), torch.bfloat16, -1, 0.5),  # non-contiguous src
]


def _make_src(shape: tuple[int, ...], dtype: torch.dtype, dim: int, device: torch.device) -> tuple[torch.Tensor, int]:
    if dim == -1:  # a transposed view: gather its rows, which are strided in memory
        return torch.randn(shape, device=device).to(dtype).t(), 0
    return torch.randn(shape, device=device).to(dtype), dim


def run(device: str | None = None, reps: int = 15) -> list[dict]:
    """One row per case: median ms of each candidate and the ratios."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = synchronizer(dev)
    rows = []
    for label, shape, dtype, dim, fraction in CASES:
        src, d = _make_src(shape, dtype, dim, dev)
        perm = torch.randperm(src.shape[d], device=dev)
        k = int(src.shape[d] * fraction)
        kept = perm[:k]
        out_shape = list(src.shape)
        out_shape[d] = k
        same_bytes = torch.empty(out_shape, dtype=dtype, device=dev)
        expected = src.index_select(d, kept)
        if not torch.equal(ops.ordered_gather(src, perm, k, d), expected):
            raise AssertionError(f"{label}: ordered_gather disagrees with index_select")
        times = interleaved_medians(
            {
                "gather": lambda: ops.ordered_gather(src, perm, k, d),
                "index_select": lambda: src.index_select(d, kept),
                "copy": lambda: same_bytes.clone(),
                "fallback": lambda: ops.reference_ordered_gather(src, perm, k, d),
            },
            reps=reps,
            sync=sync,
        )
        rows.append(
            {
                "name": f"gather {label} [{dev.type}, {ops.backend()}]",
                "gather_ms": times["gather"] * 1e3,
                "index_select_ms": times["index_select"] * 1e3,
                "copy_ms": times["copy"] * 1e3,
                "fallback_ms": times["fallback"] * 1e3,
                "MB_out": same_bytes.numel() * same_bytes.element_size() / 1e6,
                "gather/copy": times["gather"] / times["copy"],
                "gather/index_select": times["gather"] / times["index_select"],
            }
        )
    return rows


if __name__ == "__main__":
    from _timing import keep_freed_memory
    from run_all import print_table

    keep_freed_memory()
    print_table(run())
