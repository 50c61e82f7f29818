"""Elastic losses (vocab-parallel KL, budget loss) against direct references, and the metrics log."""

from __future__ import annotations

import json

import pytest
import torch

from elastic_plugin.elastic.losses import budget_loss, distillation_loss_func, vocab_parallel_kl
from elastic_plugin.elastic.metrics import ElasticMetrics
from elastic_plugin.models.config import ConfigError
from tests.support.loss_cases import random_logits, reference_kl

CASES = "tests.support.loss_cases"


# ---------------------------------------------------------------- vocab_parallel_kl, one rank


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("shape", [(2, 3, 11), (4, 2, 7), (5, 32)])
def test_kl_matches_kl_div_and_its_gradient(shape, temperature):
    student, teacher = random_logits(shape, seed=3)
    upstream = torch.rand(shape[:-1], generator=torch.Generator().manual_seed(4))

    ref_s = student.clone().requires_grad_(True)
    ref = reference_kl(ref_s, teacher, temperature)
    (ref * upstream).sum().backward()

    s = student.clone().requires_grad_(True)
    t = teacher.clone().requires_grad_(True)
    kl = vocab_parallel_kl(s, t, temperature)
    (kl * upstream).sum().backward()

    assert kl.shape == shape[:-1] and kl.dtype == torch.float32
    assert ref.max() > 0.1  # non-trivial distributions
    torch.testing.assert_close(kl, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s.grad, ref_s.grad, rtol=1e-6, atol=1e-6)
    assert t.grad is None


def test_kl_gradient_in_float64_matches_autograd_exactly():
    """In float64 the analytic backward must agree with autograd of the reference to ~1e-12."""
    student, teacher = (x.double() for x in random_logits((3, 9), seed=5))
    ref_s = student.clone().requires_grad_(True)
    reference_kl(ref_s, teacher, 1.5).sum().backward()
    # our math runs in fp32; compare the fp32 result against the fp64 truth
    s = student.float().requires_grad_(True)
    vocab_parallel_kl(s, teacher.float(), 1.5).sum().backward()
    torch.testing.assert_close(s.grad.double(), ref_s.grad, rtol=1e-5, atol=1e-6)


def test_kl_is_zero_for_identical_logits_and_positive_otherwise():
    student, teacher = random_logits((4, 6, 13), seed=11)
    assert vocab_parallel_kl(student, student.clone(), 1.3).abs().max() == 0
    assert (vocab_parallel_kl(student, teacher, 1.3) > 0).all()


def test_kl_bf16_student_gets_bf16_grad_and_fp32_loss():
    student, teacher = random_logits((2, 17), seed=2)
    s = student.bfloat16().requires_grad_(True)
    kl = vocab_parallel_kl(s, teacher.bfloat16(), 1.0)
    kl.sum().backward()
    assert kl.dtype == torch.float32 and s.grad.dtype == torch.bfloat16
    ref = reference_kl(student.bfloat16().float(), teacher.bfloat16().float(), 1.0)
    torch.testing.assert_close(kl, ref, rtol=1e-6, atol=1e-6)


def test_kl_handles_masked_teacher_vocab_entries():
    """A teacher logit of -inf (e.g. padded vocab) contributes nothing, not NaN."""
    student, teacher = random_logits((3, 8), seed=9)
    teacher[:, -2:] = float("-inf")
    kl = vocab_parallel_kl(student, teacher, 1.0)
    assert torch.isfinite(kl).all()
    ref = reference_kl(student, teacher.clamp_min(-1e4), 1.0)
    torch.testing.assert_close(kl, ref, rtol=1e-6, atol=1e-6)


def test_kl_rejects_bad_input():
    s, t = random_logits((2, 5), seed=0)
    with pytest.raises(ConfigError, match="temperature"):
        vocab_parallel_kl(s, t, temperature=0.0)
    with pytest.raises(ValueError, match="same shape"):
        vocab_parallel_kl(s, t[:, :4], 1.0)


def test_distillation_loss_func_masks_tokens_and_accepts_transposed_mask():
    student, teacher = random_logits((6, 2, 10), seed=1)  # [s, b, V] as Megatron's output layer
    mask = torch.zeros(2, 6)  # [b, s]
    mask[0, :3] = 1
    mask[1, 4] = 1
    loss_sum, n, report = distillation_loss_func(mask, student, teacher, temperature=2.0)
    ref = reference_kl(student, teacher, 2.0)
    expected = ref[:3, 0].sum() + ref[4, 1]
    torch.testing.assert_close(loss_sum, expected)
    assert int(n) == 4
    torch.testing.assert_close(report["kd loss"], torch.stack([expected, torch.tensor(4.0)]))
    with pytest.raises(ValueError, match="loss_mask"):
        distillation_loss_func(torch.ones(3, 3), student, teacher, 1.0)


# ---------------------------------------------------------------- chunked KD loss, one rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_kl_equals_unchunked_loss_and_gradient(dtype, chunk):
    """Chunk sizes that divide the tokens, leave a remainder, and exceed them; [s, b, V] logits."""
    student, teacher = random_logits((7, 3, 50), seed=21)
    student, teacher = student.to(dtype), teacher.to(dtype)
    upstream = torch.rand((7, 3), generator=torch.Generator().manual_seed(22))
    results = []
    for chunk_tokens in (None, chunk):
        s = student.clone().requires_grad_(True)
        kl = vocab_parallel_kl(s, teacher, 1.7, chunk_tokens=chunk_tokens)
        (kl * upstream).sum().backward()
        results.append((kl, s.grad))
    (ref, ref_grad), (kl, grad) = results
    assert kl.shape == (7, 3) and kl.dtype == torch.float32 and grad.dtype == dtype
    assert ref.min() > 0.1 and ref_grad.abs().max() > 1e-3
    torch.testing.assert_close(kl, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-6, atol=1e-9)


def test_chunked_kl_masked_teacher_vocab_and_identical_logits():
    student, teacher = random_logits((5, 12), seed=23)
    teacher[:, -3:] = float("-inf")
    s = student.clone().requires_grad_(True)
    kl = vocab_parallel_kl(s, teacher, 1.0, chunk_tokens=2)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(s.grad).all()
    torch.testing.assert_close(kl, vocab_parallel_kl(student, teacher, 1.0), rtol=1e-6, atol=0)
    assert vocab_parallel_kl(student, student.clone(), 1.3, chunk_tokens=2).abs().max() == 0


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "1024"])
def test_chunked_kl_rejects_bad_chunk_sizes(bad):
    s, t = random_logits((2, 5), seed=0)
    with pytest.raises(ConfigError, match=r"kd_chunk_tokens=.*allowed: a positive integer"):
        vocab_parallel_kl(s, t, 1.0, chunk_tokens=bad)


def test_chunk_size_knob_in_config_and_flag():
    import argparse

    from elastic_plugin.elastic.args import add_elastic_args, elastic_config_from_args
    from elastic_plugin.elastic.config import ElasticConfig

    assert ElasticConfig().kd_chunk_tokens == 1024
    cfg = ElasticConfig.from_dict({"kd_chunk_tokens": 256})
    assert cfg.kd_chunk_tokens == 256 and ElasticConfig.from_dict(cfg.to_dict()) == cfg
    parser = add_elastic_args(argparse.ArgumentParser())
    args = parser.parse_args(["--elastic-kd-chunk-tokens", "512"])
    assert elastic_config_from_args(args).kd_chunk_tokens == 512
    bad = parser.parse_args(["--elastic-kd-chunk-tokens", "0"])
    with pytest.raises(ConfigError, match=r"--elastic-kd-chunk-tokens.*positive integer"):
        elastic_config_from_args(bad)


# ---------------------------------------------------------------- vocab_parallel_kl, TP=2


@pytest.mark.integration
@pytest.mark.parametrize("use_default_group,chunk_tokens", [(True, None), (False, None), (True, 4)])
def test_kl_under_tensor_parallel_matches_single_rank(rank_pools, use_default_group, chunk_tokens):
    """Unchunked, and chunked (4 tokens of 15: a remainder) with its batched collectives."""
    shape = (3, 5, 16)
    results = rank_pools.get(2).run(
        f"{CASES}:tp_kl_matches_reference",
        tp=2,
        shape=shape,
        temperature=2.0,
        seed=7,
        use_default_group=use_default_group,
        chunk_tokens=chunk_tokens,
    )
    assert sorted(r["tp_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["tp_world"] == 2
        assert r["kl_shape"] == list(shape[:-1])
        assert r["kl_min"] > 1e-2
        assert r["kl_max_rel_diff"] <= 1e-6, r
        assert r["grad_max_abs"] > 1e-3
        assert r["grad_max_rel_diff"] <= 1e-6, r
        assert r["local_grad_max_abs_diff"] <= 1e-6 * r["grad_max_abs"], r
        assert r["teacher_grad_is_none"]
        assert r["self_kl_max_abs"] == 0.0


# ---------------------------------------------------------------- budget loss


def test_budget_loss_formula_and_gradient_sign():
    full, budget = 1000.0, 0.5
    for value, expected, sign in ((600.0, 0.2, 1.0), (400.0, 0.2, -1.0), (250.0, 0.5, -1.0)):
        cost = torch.tensor(value, requires_grad=True)
        loss = budget_loss(cost, budget, full)
        loss.backward()
        assert loss.item() == pytest.approx(expected)
        # over budget -> gradient pushes cost down; under budget -> up; magnitude 1/(b*C_full)
        assert cost.grad.item() == pytest.approx(sign / (budget * full))
    assert budget_loss(torch.tensor(500.0), budget, full).item() == 0.0
    batch = budget_loss(torch.tensor([500.0, 750.0]), budget, full)
    torch.testing.assert_close(batch, torch.tensor([0.0, 0.5]))


def test_budget_loss_rejects_bad_budget():
    with pytest.raises(ConfigError, match="budget"):
        budget_loss(torch.tensor(1.0), 0.0, 10.0)
    with pytest.raises(ConfigError, match="full_cost"):
        budget_loss(torch.tensor(1.0), 0.5, -1.0)


# ---------------------------------------------------------------- metrics


class FakeWriter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, value, step) -> None:
        self.calls.append((tag, value, step))


def _record(it: int) -> dict:
    return {
        "train_loss": {0.5: 2.0 / (it + 1), 1.0: torch.tensor(1.0 / (it + 1))},
        "budget_loss": {0.5: 0.1, 1.0: 0.0},
        **({"valid_loss": {0.5: 1.5, 1.0: 0.8}} if it % 2 == 1 else {}),
        "choices": {
            0.5: {"ffn": 128, "mamba_heads": [4, 6]},
            1.0: {"ffn": 256, "mamba_heads": [8, 8]},
        },
        "temperature": 1.0 - 0.1 * it,
        "logit_scale": 1.0 + it,
        "lr": 1e-4,
    }


def test_metrics_jsonl_and_writer(tmp_path):
    writer = FakeWriter()
    metrics = ElasticMetrics(tmp_path, budgets=[0.5, 1.0], writer=writer)
    for it in range(3):
        metrics.log(it, _record(it))
    lines = (tmp_path / "elastic_metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["iteration"] == 0
    assert first["train_loss"] == {"0.5": 2.0, "1": 1.0}
    assert first["choices"]["0.5"]["mamba_heads"] == [4, 6]
    assert metrics.history()[2]["temperature"] == pytest.approx(0.8)
    tags = {(tag, step): value for tag, value, step in writer.calls}
    assert tags[("loss/budget_0.5", 0)] == 2.0
    assert tags[("loss/budget_1", 2)] == pytest.approx(1 / 3)
    assert tags[("valid_loss/budget_1", 1)] == 0.8
    assert ("valid_loss/budget_1", 0) not in tags
    assert tags[("budget_loss/budget_0.5", 1)] == 0.1
    assert tags[("choice/budget_0.5/ffn", 0)] == 128
    assert tags[("choice/budget_0.5/mamba_heads/layer_1", 0)] == 6
    assert tags[("temperature", 1)] == pytest.approx(0.9)
    assert tags[("lr", 2)] == 1e-4
    assert len(writer.calls) == 3 * 13 + 2  # 13 numeric leaves per record, +2 valid on it=1


def test_metrics_plots_without_tensorboard(tmp_path):
    pytest.importorskip("matplotlib")
    metrics = ElasticMetrics(tmp_path, budgets=[0.5, 1.0])  # no writer, no tensorboard here
    assert metrics.plot() == []  # nothing logged yet
    for it in range(4):
        metrics.log(it, _record(it))
    paths = metrics.plot()
    assert [p.name for p in paths] == ["elastic_loss.png", "elastic_router.png"]
    for p in paths:
        assert p.stat().st_size > 1000
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_choice_fractions_use_full_sizes(tmp_path):
    metrics = ElasticMetrics(
        tmp_path, budgets=[0.5, 1.0], writer=FakeWriter(), full_sizes={"ffn": 512}
    )
    metrics.log(0, _record(0))
    fractions = metrics._fractions(metrics.history())
    assert fractions["ffn"]["0.5"] == ([0], [0.25])  # given full size
    assert fractions["mamba_heads"]["0.5"] == ([0], [5 / 8])  # per-layer mean / largest seen
