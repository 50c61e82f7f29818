"""ordered_gather vs torch.index_select vs a plain copy of the same number of bytes.

The copy (``clone`` of a contiguous tensor shaped like the output) is what moving the kept
bytes costs at best; the target is gather time <= 1.25 x copy time (>= 0.8x copy speed).

That target assumes the gather reads only the kept bytes. Gathering along a tensor's contiguous
axis (a weight's input columns, or the rows of a transposed view) cannot: a random half of the
elements of a 64-byte line still needs the whole line, so nearly every source line is read.
``traffic_x`` = (source bytes that must be read + output bytes written) / (2 x output bytes): the
memory traffic of the gather over the copy's, its best possible ``gather/copy`` when both are
memory-bound (1.5 for half the columns). ``gather/bound`` = (gather/copy) / traffic_x: 1.0 is
as fast as the memory system allows.
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


def _make_src(
    shape: tuple[int, ...], dtype: torch.dtype, dim: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    if dim == -1:  # a transposed view: gather its rows, which are strided in memory
        return torch.randn(shape, device=device).to(dtype).t(), 0
    return torch.randn(shape, device=device).to(dtype), dim


def min_source_bytes(src: torch.Tensor, dim: int, kept: torch.Tensor) -> int:
    """Bytes of ``src`` any gather of ``kept`` along ``dim`` must read: whole 64-byte lines
    where ``dim`` is the contiguous axis (rows assumed line-aligned), else the kept bytes."""
    es = src.element_size()
    out_bytes = src.numel() // src.shape[dim] * kept.numel() * es
    if src.stride(dim) != 1:
        return out_bytes
    lines_per_row = torch.unique(kept.cpu() * es // 64).numel()
    return src.numel() // src.shape[dim] * lines_per_row * 64


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
        out_bytes = same_bytes.numel() * same_bytes.element_size()
        traffic = (min_source_bytes(src, d, kept) + out_bytes) / (2 * out_bytes)
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
                "traffic_x": traffic,
                "gather/bound": times["gather"] / times["copy"] / traffic,
            }
        )
    return rows


if __name__ == "__main__":
    from _timing import keep_freed_memory
    from run_all import print_table

    keep_freed_memory()
    print_table(run())
