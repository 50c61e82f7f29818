"""``bench/bench_elastic_step.py``: its size rounding and FLOP count against hand formulas, and
its quickest measurement (tiny model, one fraction, one repetition) in a worker rank: the
expected rows, positive finite timings, consistent ratios and verdicts. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest

from bench import bench_elastic_step as bench
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import ConfigError


def _tiny():
    return bench.bench_model("tiny").cfg


def test_fraction_sizes_round_like_the_elastic_config():
    # tiny: hidden 128, ffn 256, shared 128, 4 q-heads / 2 groups, 8 Mamba heads / 2 groups,
    # 8 experts top-2
    cfg = _tiny()
    assert bench.fraction_sizes(cfg, 0.5) == {
        "embedding": 64,
        "ffn": 128,
        "shared_ffn": 64,
        "attention_heads": 2,
        "mamba_heads": 4,
        "mamba_head_dim": 16,
        "experts": 4,
    }
    # 0.4: heads round to the nearest multiple of the group count; experts never below top-k
    small = bench.fraction_sizes(cfg, 0.4)
    assert small["attention_heads"] == 2 and small["mamba_heads"] == 4 and small["experts"] == 3
    assert small["embedding"] == 51 and small["mamba_head_dim"] == 16
    assert bench.fraction_sizes(cfg, 0.1)["experts"] == 2


def _hand_flops(m, b: int, s: int) -> float:
    """Matmul FLOPs of one step written out layer by layer from the architecture."""
    h, d_in = m.hidden_size, m.mamba_num_heads * m.mamba_head_dim
    mamba = (
        h * (2 * d_in + 2 * m.mamba_num_groups * m.mamba_state_dim + m.mamba_num_heads) + d_in * h
    )
    q, kv = m.num_attention_heads * m.kv_channels, 2 * m.num_query_groups * m.kv_channels
    attention = h * (q + kv) + q * h
    moe = (
        m.num_moe_experts * h
        + m.moe_router_topk * 2 * h * m.moe_ffn_hidden_size
        + 2 * h * m.moe_shared_expert_intermediate_size
    )
    mlp = 2 * h * m.ffn_hidden_size
    kinds = {"M": mamba, "*": attention, "E": moe, "-": mlp}
    params = sum(kinds[c] for c in m.hybrid_layer_pattern) + h * m.vocab_size
    scores = m.hybrid_layer_pattern.count("*") * 4 * b * s * s * q
    return 3 * (2 * b * s * params + scores)


@pytest.mark.parametrize("fraction", [1.0, 0.77, 0.5, 0.4])
def test_matmul_flops_match_hand_count(fraction):
    cfg = _tiny()
    small = model_for_choice(cfg, bench.fraction_sizes(cfg, fraction)) if fraction < 1 else cfg
    assert bench.matmul_flops(small, 8, 128) == pytest.approx(_hand_flops(small, 8, 128), rel=1e-12)
    ratio = bench.matmul_flops(small, 8, 128) / bench.matmul_flops(cfg, 8, 128)
    assert (ratio == 1.0) if fraction == 1.0 else (0 < ratio < fraction)


def test_fraction_for_budget_hits_the_budget():
    cfg = _tiny()
    f = bench.fraction_for_budget(cfg, 0.5)
    got = bench.active_fraction(cfg, model_for_choice(cfg, bench.fraction_sizes(cfg, f)))
    assert 0.3 <= f <= 1.0 and abs(got - 0.5) < 0.05


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"model_names": ("huge",)}, "huge"),
        ({"fractions": (0.5, 1.0)}, "fractions"),
        ({"fractions": ()}, "fractions"),
        ({"reps": 0}, "reps"),
        ({"target_budget": 1.5}, "target_budget"),
    ],
)
def test_bad_arguments_raise_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        bench.measure(**kwargs)


def _finite_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_quickest_measurement_gives_the_expected_rows(rank_pools):
    (rows,) = rank_pools.get(1).run(
        "bench.bench_elastic_step:measure",
        model_names=("tiny",),
        fractions=(0.5,),
        target_budget=None,
        reps=1,
        warmup=0,
    )
    assert [r["name"] for r in rows] == [
        "elastic step tiny full budget b8xs128 [cpu]",
        "elastic step tiny f0.5 (f=0.5)",
    ]
    full, half = rows
    for key in ("plain_full_ms", "plain_copy_ms", "elastic_full_ms", "copy/plain"):
        assert _finite_positive(full[key]), key
    assert full["copy/plain"] == pytest.approx(full["plain_copy_ms"] / full["plain_full_ms"])
    assert full["overhead"] == pytest.approx(full["elastic_full_ms"] / full["plain_full_ms"])
    assert full["overhead<=1.05"] == ("PASS" if full["overhead"] <= 1.05 else "MISS")

    cfg = _tiny()
    small = model_for_choice(cfg, bench.fraction_sizes(cfg, 0.5))
    assert half["flop_ratio"] == pytest.approx(
        bench.matmul_flops(small, 8, 128) / bench.matmul_flops(cfg, 8, 128)
    )
    assert 0 < half["flop_ratio"] <= 1 and 0 < half["budget"] < 1
    assert half["plain_full_ms"] == full["plain_full_ms"]
    assert _finite_positive(half["sliced_ms"])
    for key in (
        "sliced/full",
        "sliced_st/full",
        "masked/full",
        "small/full",
        "sliced/flops",
        "sliced/small",
    ):
        assert _finite_positive(half[key]), key
    assert half["sliced/full"] == pytest.approx(half["sliced_ms"] / half["plain_full_ms"])
    assert half["sliced/flops"] == pytest.approx(half["sliced/full"] / half["flop_ratio"])
    assert half["sliced/small"] == pytest.approx(half["sliced/full"] / half["small/full"])
    assert half["flops<=1.15"] == ("PASS" if half["sliced/flops"] <= 1.15 else "MISS")
    assert half["small<=1.1"] == ("PASS" if half["sliced/small"] <= 1.10 else "MISS")
