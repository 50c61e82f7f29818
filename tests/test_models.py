"""Building Megatron-Core HybridModels from configs: the built model matches the arithmetic
parameter count, and bad configs fail early with the field named."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from elastic_plugin.models.config import ConfigError, config_from_dict, load_config
from elastic_plugin.models.counting import count_parameters

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def pool(rank_pools):
    return rank_pools.get(1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"activation": "swiglu", "moe_shared_expert_intermediate_size": 0},
        {"untie_embeddings_and_output_weights": False, "position_embedding_type": "rope"},
    ],
    ids=["tiny", "swiglu-no-shared", "tied-rope"],
)
def test_built_model_matches_arithmetic_count(pool, overrides):
    (built,) = pool.run(
        "tests.support.cases:built_parameter_counts", config_path=TINY, overrides=overrides
    )
    expected = count_parameters(replace(load_config(TINY).model, **overrides))
    assert {k: v for k, v in expected.breakdown.items() if v} == built
    assert sum(built.values()) == expected.total


def _raw() -> dict:
    import yaml

    return yaml.safe_load(Path(TINY).read_text())


def test_unknown_key_is_named():
    raw = _raw()
    raw["model"]["mamba_num_head"] = 4
    with pytest.raises(ConfigError, match="mamba_num_head.*allowed"):
        config_from_dict(raw)


def test_bad_pattern_symbol():
    raw = _raw()
    raw["model"]["hybrid_layer_pattern"] = "MX*"
    with pytest.raises(ConfigError, match="hybrid_layer_pattern"):
        config_from_dict(raw)


@pytest.mark.parametrize(
    "tp,pp,ep,field",
    [
        (4, 1, 1, "num_query_groups"),
        (1, 3, 1, "pipeline_model_parallel_size"),
        (1, 1, 3, "num_moe_experts"),
    ],
)
def test_layout_that_does_not_divide(tp, pp, ep, field):
    model = load_config(TINY).model
    with pytest.raises(ConfigError, match=field):
        model.check_parallel(tp, pp, ep)


def test_moe_with_tp_needs_sequence_parallel():
    from elastic_plugin.models.builder import transformer_config
    from elastic_plugin.models.config import Layout

    with pytest.raises(ConfigError, match="sequence_parallel"):
        transformer_config(load_config(TINY).model, Layout(tp=2))


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file"):
        load_config("/nonexistent/config.yaml")
