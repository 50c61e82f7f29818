"""Context parallelism (``--context-parallel-size``): elastic training steps under CP (alone and
with TP + SP) reproduce one rank on the same tokens: the same budgets and router choices, the
same per-budget losses and the same model and router gradients, through the Mamba layers
(Megatron's all-to-all between sequence and head shards), the attention layers (our SDPA
attention over K/V gathered from the CP group) and the MoE / MLP layers; a heterogeneous
(per-layer) choice included."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
CASES = "elastic_plugin.testing.elastic_cases"
LOSS_RTOL = 1e-5
GRAD_ATOL = 2e-6  # as tests/test_elastic_multirank.py bounds the TP/PP/EP layouts


@pytest.fixture(scope="module")
def cp_references(rank_pools, tmp_path_factory):
    made: dict[tuple, str] = {}

    def get(pattern=None, heterogeneous=False) -> str:
        key = (pattern, heterogeneous)
        if key not in made:
            work = tmp_path_factory.mktemp("cp_ref")
            rank_pools.get(1).run(
                f"{CASES}:make_elastic_reference",
                config_path=CONFIG,
                workdir=str(work),
                pattern=pattern,
                heterogeneous=heterogeneous,
            )
            made[key] = str(work)
        return made[key]

    return get


def _check(rank_pools, cp_references, world, pattern=None, heterogeneous=False, **layout):
    work = cp_references(pattern, heterogeneous)
    results = rank_pools.get(world).run(
        f"{CASES}:check_elastic",
        config_path=CONFIG,
        workdir=work,
        pattern=pattern,
        heterogeneous=heterogeneous,
        **layout,
    )
    ref_trace = {(it, mb): (b, c) for it, mb, b, c in results[0]["ref_trace"]}
    budgets_seen = set()
    for r in results:
        for it, mb, budget, choice in r["trace"]:
            assert ref_trace[(it, mb)] == (budget, choice), (r["rank"], it, mb)
            budgets_seen.add(budget)
        for got, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert set(got) == set(ref)
            for budget, value in ref.items():
                assert got[budget] == pytest.approx(value, rel=LOSS_RTOL), (r["rank"], got, ref)
        assert r["grad_max_abs"] > 1e-4, r
        assert r["grad_max_abs_diff"] <= GRAD_ATOL, r
        assert r["router_grad_max_abs"] > 0, "the router got no gradient"
        assert r["router_grad_max_abs_diff"] <= GRAD_ATOL * max(1.0, r["router_grad_max_abs"]), r
    assert len(budgets_seen) > 1, "only one budget drawn: the elastic layers were not exercised"
    return results


def test_context_parallel(rank_pools, cp_references):
    """CP=2: Mamba, attention, MoE and MLP layers (tiny's "M*E-M*E-")."""
    _check(rank_pools, cp_references, 2, cp=2)


def test_context_parallel_heterogeneous(rank_pools, cp_references):
    """CP=2 with a per-layer choice of every axis."""
    _check(rank_pools, cp_references, 2, heterogeneous=True, cp=2)


def test_context_parallel_tensor_parallel(rank_pools, cp_references):
    """CP=2 x TP=2 + SP on 4 ranks (tiny's 2 Mamba groups: one per TP rank, so CP needs 4
    groups: the pattern without Mamba keeps attention, MoE and MLP under CP x TP)."""
    _check(rank_pools, cp_references, 4, pattern="*E-*E-", cp=2, tp=2, sequence_parallel=True)
