"""Pure-PyTorch Mamba-2 SSD scan on CPU: chunked form vs the full L x L quadratic form.

The chunked scan is what makes Megatron's ``MambaMixer`` usable on CPU without ``mamba_ssm``
(docs/design.md, "Mamba on a CPU"; the quadratic form was half the forward time for 30% of the
FLOPs). Rows give
forward+backward time per chunk size relative to the quadratic form (chunk = L), same inputs.
"""

from __future__ import annotations

import torch
from _timing import interleaved_medians, synchronizer

from elastic_plugin.compat.mamba_ops import ssd_chunk_scan

SHAPES = [  # (batch, length, heads, head_dim, state, groups)
    (2, 512, 8, 32, 64, 2),
    (4, 256, 8, 16, 16, 2),  # the tiny demo model's Mamba shape at seq 256
]
CHUNKS = (32, 64, 128)


def _inputs(b: int, l: int, h: int, p: int, n: int, g: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, l, h, p, generator=gen, requires_grad=True)
    dt = (torch.rand(b, l, h, generator=gen) * 0.1 + 0.01).requires_grad_()
    A = (-torch.rand(h, generator=gen) - 0.5).requires_grad_()
    B = torch.randn(b, l, g, n, generator=gen, requires_grad=True)
    C = torch.randn(b, l, g, n, generator=gen, requires_grad=True)
    return [x, dt, A, B, C]


def run(device: str | None = None, reps: int = 7) -> list[dict]:
    if device not in (None, "cpu"):
        return []  # the CPU fallback; on GPUs mamba_ssm's Triton kernels are used
    rows = []
    for b, l, h, p, n, g in SHAPES:
        args = _inputs(b, l, h, p, n, g)

        def step(chunk: int) -> None:
            y, _ = ssd_chunk_scan(*args, chunk_size=chunk)
            y.sum().backward()

        reference = ssd_chunk_scan(*args, chunk_size=l)[0]
        for chunk in CHUNKS:
            diff = (ssd_chunk_scan(*args, chunk_size=chunk)[0] - reference).abs().max().item()
            if diff > 1e-3 * reference.abs().max().item():
                raise AssertionError(f"chunk {chunk} disagrees with the quadratic form: {diff}")
        candidates = {f"chunk{c}": (lambda c=c: step(c)) for c in CHUNKS}
        candidates["quadratic"] = lambda: step(l)
        times = interleaved_medians(candidates, reps=reps, sync=synchronizer(torch.device("cpu")))
        row: dict = {"name": f"mamba SSD fwd+bwd b{b} L{l} h{h} p{p} n{n} [cpu]"}
        row.update({f"{k}_ms": round(v * 1e3, 2) for k, v in times.items()})
        row.update(
            {
                f"{k}/quadratic": round(v / times["quadratic"], 3)
                for k, v in times.items()
                if k != "quadratic"
            }
        )
        rows.append(row)
    return rows
