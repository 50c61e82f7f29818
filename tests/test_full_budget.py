"""Budget 1.0 is the full parent model by construction (issue 18.4): the router never shrinks it,
the freeze never trades it for a 0.97 model within tolerance, and before any training its
extracted model equals the reordered teacher exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")


def test_budget_one_is_the_parent(rank_pools, tmp_path):
    (r,) = rank_pools.get(1).run(
        "tests.support.full_budget_cases:full_budget_is_the_parent",
        config_path=CONFIG,
        workdir=str(tmp_path),
    )
    full = r["full_choice"]
    assert r["untrained_table"]["1"] == full
    assert r["trained_table"]["1"] == full  # frozen after 2 steps: still the parent
    assert r["feasible_full"] == [full]
    assert r["constrained_full"] == full
    assert r["untrained_table"]["0.4"] != full  # the router does shrink the others
    # zero steps: budget 1.0's extracted model is the teacher, tensor for tensor
    assert not r["missing"] and not r["shape_mismatch"], r
    assert r["num_params"] > 10
    assert r["max_diff"] == 0.0, r
    # the report row shows the parent's size: the largest of all budgets
    params = r["trained_params"]
    assert params["1"]["total"] > params["0.77"]["total"] > params["0.4"]["total"]


def test_budget_one_needs_the_full_sizes():
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.models.config import ConfigError, load_config

    model = load_config(CONFIG).model
    cfg = ElasticConfig.from_dict({"budgets": [1.0, 0.5], "sizes": {"ffn": [0.75, 0.5]}})
    with pytest.raises(ConfigError, match=r"sizes\.ffn.*budget 1.0 is the full parent"):
        cfg.resolve(model)
