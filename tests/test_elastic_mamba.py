"""Elastic Mamba mixer (``elastic_plugin.elastic.layers.mamba``) on a real Megatron ``MambaMixer``:
full width == Megatron's forward; sliced == masked with hard masks; sliced == a genuinely
smaller mixer holding the active blocks; mask gradients == finite differences; TP=2 + SP ==
the single-rank result. Cases run in the shared rank pools (``elastic_mamba_cases``)."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
CASES = "tests.support.elastic_mamba_cases"
# tiny.yaml: hidden 128, 8 Mamba heads in 2 groups (4 per group), head dim 16
K, P, H = 3, 10, 80  # active heads per group, head dim, hidden (none of them a power of 2)
RTOL = 1e-5


def _run(pools, case: str, **kwargs):
    """A single-rank case, run on both ranks of the 2-rank pool (one pool start-up for the
    whole file); both ranks must agree exactly (deterministic)."""
    first, second = pools.get(2).run(f"{CASES}:{case}", config_path=CONFIG, **kwargs)
    if case != "timing":
        assert first == second
    return (first,)


@pytest.mark.parametrize("mem_eff", [True, False], ids=["fused", "unfused"])
def test_full_width_equals_megatron_forward(rank_pools, mem_eff):
    (r,) = _run(rank_pools, "full_matches_megatron", mem_eff=mem_eff)
    assert r["out_scale"] > 0.1 and r["min_param_grad"] > 0
    assert r["out"] <= RTOL and r["out_explicit_sizes"] <= RTOL
    assert r["inference_no_cache"] <= RTOL
    if mem_eff:  # packed sequences: equal to Megatron, and packing really changes the result
        assert r["packed"] <= RTOL and r["packed_vs_unpacked"] > 1e-3
    assert r["x_grad"] <= RTOL
    for name, d in r["param_grads"].items():
        assert d <= RTOL, (name, d)


@pytest.mark.parametrize("mem_eff", [True, False], ids=["fused", "unfused"])
def test_sliced_equals_masked_with_hard_masks(rank_pools, mem_eff):
    (r,) = _run(rank_pools, "sliced_matches_masked", k=K, p=P, h=H, mem_eff=mem_eff)
    assert r["out_shape"] == [40, 2, H]
    assert r["out_scale"] > 0.1
    assert r["out"] <= RTOL and r["x_grad"] <= RTOL
    assert r["masked_out_beyond_h"] == 0.0
    for name, d in r["param_grads"].items():
        assert d <= RTOL, (name, d)  # whole tensors: both zero outside the active block
        assert r["sliced_grad_outside_block"][name] == 0.0, name
        assert r["sliced_grad_inside_block"][name] > 0.0, name


@pytest.mark.parametrize(
    "mem_eff,d_has_hdim", [(True, False), (False, True)], ids=["fused", "unfused-D-per-channel"]
)
def test_sliced_equals_smaller_megatron_mixer(rank_pools, mem_eff, d_has_hdim):
    (r,) = _run(
        rank_pools,
        "sliced_matches_smaller_mixer",
        k=K,
        p=P,
        h=H,
        mem_eff=mem_eff,
        d_has_hdim=d_has_hdim,
    )
    groups, state = 2, 16
    assert r["shapes"] == {
        "small_in_proj": [2 * K * groups * P + 2 * groups * state + K * groups, H],
        "small_heads": K * groups,
        "small_groups": groups,
        "active_in_proj_rows": 2 * K * groups * P + 2 * groups * state + K * groups,
    }
    assert r["cached"] and r["index_sets_match_layout"]
    assert r["out_scale"] > 0.1
    assert r["out"] <= RTOL and r["x_grad"] <= RTOL
    for name, d in r["param_grads"].items():
        assert d <= RTOL, (name, d)


def test_mask_gradients_match_finite_differences(rank_pools):
    (r,) = _run(rank_pools, "mask_gradients_match_finite_differences", k=K, p=P, h=H)
    for name in ("head_mask", "channel_mask", "hidden_mask"):
        assert r[name]["scale"] > 1e-3, (name, r[name])
        assert r[name]["rel"] <= 1e-6, (name, r[name])


def test_bad_arguments_raise_clear_errors(rank_pools):
    (msgs,) = _run(rank_pools, "bad_arguments_raise")
    assert msgs["heads_per_group"].startswith("ConfigError") and "[1, 4]" in msgs["heads_per_group"]
    assert msgs["head_dim"].startswith("ConfigError") and "head_dim=0" in msgs["head_dim"]
    assert msgs["hidden_active"].startswith("ConfigError")
    assert "hidden_states" in msgs["hidden_active"]
    assert msgs["head_mask"].startswith("ConfigError") and "(2,)" in msgs["head_mask"]
    assert msgs["inference"].startswith("NotImplementedError") and "cache" in msgs["inference"]


@pytest.mark.integration
def test_tensor_and_sequence_parallel_match_single_rank(rank_pools):
    results = rank_pools.get(2).run(
        f"{CASES}:tp_sp_matches_single_rank", config_path=CONFIG, k=K, p=P, h=H
    )
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["weights_equal"], r
        assert r["out_shape"] == [40, 2, H]  # 80 tokens split over 2 ranks (SP)
        assert r["megatron_full_out"] <= RTOL and r["megatron_full_grads"] <= RTOL, r
        assert r["sliced_out"] <= RTOL and r["sliced_x_grad"] <= RTOL, r
        for name, d in r["sliced_param_grads"].items():
            assert d <= RTOL, (name, d)
        assert r["masked_out"] <= RTOL, r
        assert max(r["mask_grads"]) <= RTOL, r


def test_timing_sliced_vs_full(rank_pools, capsys):
    """Reported only (timings on a shared CPU are too noisy to assert on)."""
    (t,) = _run(rank_pools, "timing")
    assert t["full_ms"] > 0
    with capsys.disabled():
        print(
            f"\n[elastic mamba fwd+bwd, half heads/group & half head dim] full "
            f"{t['full_ms']:.1f} ms, sliced {t['sliced_ms']:.1f} ms, plain smaller mixer "
            f"{t['small_ms']:.1f} ms; sliced/full {t['sliced_over_full']:.2f}, "
            f"small/full {t['small_over_full']:.2f}, sliced/small {t['sliced_over_small']:.2f}"
        )
