"""Context parallelism (``--context-parallel-size``): elastic training steps under CP (alone,
with PP and with TP + SP) reproduce one rank on the same tokens: the same budgets and router choices, the
same per-budget losses and the same model and router gradients, through the Mamba layers
(Megatron's all-to-all between sequence and head shards), the attention layers (our SDPA
attention over K/V gathered from the CP group, RoPE at the global positions) and the MoE / MLP
layers; a heterogeneous (per-layer) choice included. CP x PP and CP x TP on 4 ranks, and all
three (CP=2 x TP=2 x PP=2) on 8."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
CASES = "tests.support.elastic_cases"
LOSS_RTOL = 1e-5
GRAD_ATOL = 2e-6  # as tests/test_elastic_multirank.py bounds the TP/PP/EP layouts


def _variant(tmp_path_factory, name: str, old: str, new: str) -> str:
    """tiny.yaml with one line changed."""
    text = Path(CONFIG).read_text()
    assert old in text
    path = tmp_path_factory.mktemp("cp_config") / f"{name}.yaml"
    path.write_text(text.replace(old, new))
    return str(path)


@pytest.fixture(scope="module")
def four_group_config(tmp_path_factory) -> str:
    """4 Mamba groups: under TP=2 x CP=2 each CP rank scans one whole group."""
    return _variant(
        tmp_path_factory, "four_groups", "  mamba_num_groups: 2\n", "  mamba_num_groups: 4\n"
    )


@pytest.fixture(scope="module")
def rope_config(tmp_path_factory) -> str:
    """RoPE: each CP rank's chunks rotate at their global positions."""
    return _variant(
        tmp_path_factory,
        "rope",
        "  position_embedding_type: none\n",
        "  position_embedding_type: rope\n",
    )


@pytest.fixture(scope="module")
def cp_references(rank_pools, tmp_path_factory):
    made: dict[tuple, str] = {}

    def get(config, pattern=None, heterogeneous=False) -> str:
        key = (config, pattern, heterogeneous)
        if key not in made:
            work = tmp_path_factory.mktemp("cp_ref")
            rank_pools.get(1).run(
                f"{CASES}:make_elastic_reference",
                config_path=config,
                workdir=str(work),
                pattern=pattern,
                heterogeneous=heterogeneous,
            )
            made[key] = str(work)
        return made[key]

    return get


def _check(
    rank_pools, cp_references, world, config=CONFIG, pattern=None, heterogeneous=False, **layout
):
    work = cp_references(config, pattern, heterogeneous)
    results = rank_pools.get(world).run(
        f"{CASES}:check_elastic",
        config_path=config,
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


def test_context_parallel_pipeline_heterogeneous_rope(rank_pools, cp_references, rope_config):
    """CP=2 x PP=2 on 4 ranks, a per-layer choice of every axis, RoPE."""
    _check(rank_pools, cp_references, 4, config=rope_config, heterogeneous=True, cp=2, pp=2)


def test_context_parallel_tensor_parallel(rank_pools, cp_references, four_group_config):
    """CP=2 x TP=2 + SP on 4 ranks, every layer kind."""
    _check(
        rank_pools,
        cp_references,
        4,
        config=four_group_config,
        cp=2,
        tp=2,
        sequence_parallel=True,
    )


def test_context_tensor_and_pipeline_parallel_on_eight_ranks(
    rank_pools, cp_references, four_group_config
):
    """CP=2 x TP=2 + SP x PP=2 on 8 ranks: every layer kind, each stage a Mamba, an attention,
    an MoE and an MLP layer."""
    _check(
        rank_pools,
        cp_references,
        8,
        config=four_group_config,
        cp=2,
        tp=2,
        pp=2,
        sequence_parallel=True,
    )
