"""``elastic_plugin::kd_row_stats`` / ``kd_grad``: the C++ kernels against the FP64 truth and the
PyTorch references (fp32 and bf16 logits, vocabularies that are and are not multiples of the
SIMD width, a teacher with ``-inf`` logits, temperatures), errors naming the argument, and
``opcheck``. The loss built on them is tested in ``test_elastic_losses.py``."""

from __future__ import annotations

import pytest
import torch

import elastic_plugin.ops as ops
from elastic_plugin.ops._kd_loss import (
    kd_grad,
    kd_row_stats,
    reference_kd_grad,
    reference_kd_row_stats,
)

needs_kernel = pytest.mark.skipif(
    not ops.INFO.uses_extension, reason="the C++ extension is not built"
)


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, vocab, generator=gen) * 3
    t = s + torch.randn(rows, vocab, generator=gen)  # related distributions, KL ~ 0.5
    return s.to(dtype), t.to(dtype)


def _truth(s: torch.Tensor, t: torch.Tensor, temperature: float) -> dict[str, torch.Tensor]:
    """The statistics and the gradient direction in FP64 from the same (rounded) inputs."""
    s64, t64 = s.double() / temperature, t.double() / temperature
    m_s, m_t = s64.amax(-1), t64.amax(-1)
    e_t = torch.exp(t64 - m_t[:, None])
    cross = torch.where(e_t > 0, e_t * (t64 - s64), torch.zeros_like(e_t))
    stats = torch.stack(
        [m_s, torch.exp(s64 - m_s[:, None]).sum(-1), m_t, e_t.sum(-1), cross.sum(-1)]
    )
    lse = torch.stack([torch.logsumexp(s64, -1), torch.logsumexp(t64, -1)])
    diff = torch.softmax(s64, -1) - torch.softmax(t64, -1)
    return {"stats": stats, "lse": lse, "diff": diff}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 8, 61, 4096])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_kernel_matches_fp64_truth_and_the_reference(dtype, vocab, temperature):
    """Stats to ~2e-6 relative of FP64 (sums kept in double), the gradient to 2e-6 of its
    largest entry, and both as close to the truth as the PyTorch reference or closer."""
    s, t = _logits(37, vocab, dtype, seed=vocab)
    truth = _truth(s, t, temperature)
    stats = kd_row_stats(s, t, temperature)
    ref_stats = reference_kd_row_stats(s, t, temperature)
    assert stats.dtype == torch.float64 and stats.shape == (5, 37)
    torch.testing.assert_close(stats, truth["stats"], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(stats, ref_stats, rtol=2e-6, atol=1e-6)

    lse = truth["lse"].float()
    scale = torch.rand(37, generator=torch.Generator().manual_seed(1)) + 0.5
    grad = kd_grad(s, t, lse, scale, temperature)
    ref_grad = reference_kd_grad(s, t, lse, scale, temperature)
    assert grad.dtype == dtype and grad.shape == s.shape
    expected = truth["diff"] * scale.double()[:, None]
    tol = 2e-6 * expected.abs().max().item() if dtype == torch.float32 else 8e-3
    assert (grad.double() - expected).abs().max().item() <= tol
    assert (grad.double() - ref_grad.double()).abs().max().item() <= tol


@needs_kernel
def test_kernel_teacher_minus_infinity_adds_nothing():
    s, t = _logits(9, 30, torch.float32, seed=3)
    t[:, -7:] = float("-inf")  # a masked vocabulary tail
    stats = kd_row_stats(s, t, 1.0)
    truth = _truth(s, t, 1.0)
    assert torch.isfinite(stats).all()
    torch.testing.assert_close(stats, truth["stats"], rtol=2e-6, atol=1e-6)
    grad = kd_grad(s, t, truth["lse"].float(), torch.ones(9), 1.0)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), truth["diff"], rtol=0, atol=1e-6)


@needs_kernel
def test_kernel_is_deterministic_across_thread_counts():
    """Rows are independent: one thread or two give the same bits."""
    s, t = _logits(64, 1000, torch.float32, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kd_row_stats(s, t, 1.3)
        torch.set_num_threads(2)
        two = kd_row_stats(s, t, 1.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_arguments_name_what_is_wrong():
    s, t = _logits(3, 8, torch.float32, seed=5)
    with pytest.raises(ValueError, match="one shape"):
        kd_row_stats(s, t[:, :4], 1.0)
    with pytest.raises(TypeError, match="float32 or both bfloat16"):
        kd_row_stats(s, t.double(), 1.0)
    if ops.INFO.uses_extension:
        with pytest.raises(ValueError, match="lse must be float32 \\[2, rows=3\\]"):
            kd_grad(s, t, torch.zeros(3), torch.ones(3), 1.0)
        with pytest.raises(ValueError, match="temperature must be > 0"):
            kd_row_stats(s, t, 0.0)


@needs_kernel
def test_opcheck():
    s, t = _logits(4, 16, torch.float32, seed=6)
    torch.library.opcheck(torch.ops.elastic_plugin.kd_row_stats.default, (s, t, 1.5))
    lse = torch.zeros(2, 4)
    torch.library.opcheck(torch.ops.elastic_plugin.kd_grad.default, (s, t, lse, torch.ones(4), 1.5))
