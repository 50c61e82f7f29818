"""Sliced-mode GEMM and batched reordering, measured side by side.

GEMM (``prefix_linear``: ``x[..., :k] @ w[:n, :k].T`` read in place), at keep fractions
0.5 and 0.77, for column-parallel (n < N) and row-parallel (k < K) use, fp32 and bf16:

* ``masked/dense``: against a GEMM on a pre-sliced contiguous copy of the same size (what a
  genuinely smaller model pays); target <= 1.05, i.e. >= 0.95x its speed.
* ``full_mask/masked``: the full-width GEMM followed by a mask (the masking approach) over
  ours; expected ~ 1 / keep fraction.

Batched gather (``ordered_gather_many``) against a loop of ``ordered_gather`` over the same
tensors: ``many/loop`` (< 1 is better), for a large FFN layer and for many small tensors.
Run: ``python bench/bench_masked_gemm.py`` or ``python bench/run_all.py --only masked_gemm``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians, synchronizer  # noqa: E402

import elastic_plugin.ops as ops  # noqa: E402

KEEP_FRACTIONS = (0.5, 0.77)
DTYPES = (torch.float32, torch.bfloat16)


def _gemm_rows(dev: torch.device, reps: int, tokens: int, width: int) -> list[dict]:
    sync = synchronizer(dev)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype in DTYPES:
        x = torch.randn(tokens, width, generator=gen).to(dtype).to(dev)
        w = torch.randn(width, width, generator=gen).to(dtype).to(dev)
        big_n, big_k = w.shape
        for keep in KEEP_FRACTIONS:
            kept = max(1, round(width * keep))
            for mode, n, k in (("col", kept, big_k), ("row", big_n, kept)):
                x_dense = x[:, :k].contiguous()  # pre-sliced copies: not timed
                w_dense = w[:n, :k].contiguous()
                out_mask = (torch.arange(big_n, device=dev) < n).to(dtype)
                in_mask = (torch.arange(big_k, device=dev) < k).to(dtype)
                if mode == "col":

                    def full_mask() -> torch.Tensor:
                        return F.linear(x, w) * out_mask
                else:

                    def full_mask() -> torch.Tensor:
                        return F.linear(x * in_mask, w)

                got = ops.prefix_linear(x, w, None, n, k)
                want = F.linear(x_dense, w_dense)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * k**0.5):
                    raise AssertionError(
                        f"prefix_linear disagrees with the dense GEMM ({mode}, {dtype})"
                    )
                times = interleaved_medians(
                    {
                        "masked": lambda: ops.prefix_linear(x, w, None, n, k),
                        "dense": lambda: F.linear(x_dense, w_dense),
                        "full_mask": full_mask,
                    },
                    reps=reps,
                    sync=sync,
                )
                rows.append(
                    {
                        "name": f"gemm {str(dtype).removeprefix('torch.')} {mode} keep {keep} "
                        f"x[{tokens},{width}] w[{width},{width}] [{dev.type}, {ops.backend()}]",
                        "masked_ms": times["masked"] * 1e3,
                        "dense_ms": times["dense"] * 1e3,
                        "full_mask_ms": times["full_mask"] * 1e3,
                        "masked/dense": times["masked"] / times["dense"],
                        "full_mask/masked": times["full_mask"] / times["masked"],
                        "1/keep": 1.0 / keep,
                    }
                )
    return rows


def _gather_rows(dev: torch.device, reps: int, width: int) -> list[dict]:
    sync = synchronizer(dev)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ffn = 2 * width

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(dev)

    cases = [
        # An FFN layer reordered by its neuron ranking: fc1 rows, fc1 bias, fc2 columns.
        ("ffn layer bf16", [rand(ffn, width), rand(ffn), rand(width, ffn)], [0, 0, 1], ffn),
        # Many small tensors sharing one ranking (per-head/per-channel tables of a layer stack).
        (
            "48 small fp32",
            [rand(width // 8, 64, dtype=torch.float32) for _ in range(48)],
            [0] * 48,
            width // 8,
        ),
    ]
    rows = []
    for label, tensors, dims, size in cases:
        perm = torch.randperm(size, generator=gen).to(dev)
        k = round(size * 0.77)
        got = ops.ordered_gather_many(tensors, perm, k, dims)
        if not all(
            torch.equal(g, t.index_select(d, perm[:k])) for g, t, d in zip(got, tensors, dims)
        ):
            raise AssertionError(f"{label}: ordered_gather_many disagrees with index_select")
        times = interleaved_medians(
            {
                "many": lambda: ops.ordered_gather_many(tensors, perm, k, dims),
                "loop": lambda: [ops.ordered_gather(t, perm, k, d) for t, d in zip(tensors, dims)],
            },
            reps=reps,
            sync=sync,
        )
        rows.append(
            {
                "name": f"gather_many {label} keep 0.77 [{dev.type}, {ops.backend()}]",
                "many_ms": times["many"] * 1e3,
                "loop_ms": times["loop"] * 1e3,
                "many/loop": times["many"] / times["loop"],
            }
        )
    return rows


def run(
    device: str | None = None, reps: int = 9, tokens: int = 512, width: int = 4096
) -> list[dict]:
    """GEMM rows (x[tokens, width] @ w[width, width]^T prefixes), then batched-gather rows.

    The default 512 tokens (not 2048) keeps a full fp32 GEMM near 0.1 s on 2 CPU cores;
    the ratios do not depend on the token count once the GEMM is compute-bound.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _gemm_rows(dev, reps, tokens, width) + _gather_rows(dev, reps, width)


if __name__ == "__main__":
    from _timing import keep_freed_memory
    from run_all import print_table

    keep_freed_memory()
    print_table(run())
