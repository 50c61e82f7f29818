"""``bench/bench_elastic_llama.py``: the benchmarked model is what ``import --hf`` builds from its
Llama 3.1-shaped config.json, and bad arguments are refused before anything is built. Timing
itself is not tested (``python bench/bench_elastic_llama.py`` prints the ratios)."""

from __future__ import annotations

import pytest

from bench import bench_elastic_llama as bench
from elastic_plugin.models.config import ConfigError


def test_the_model_is_the_llama_family_mapping():
    from elastic_plugin.families import family_for_model

    cfg = bench.llama_model().cfg
    assert family_for_model(cfg).architecture == "LlamaForCausalLM"
    assert cfg.hybrid_layer_pattern == "*-" * 4 and cfg.query_groups == 2
    assert cfg.rope_scaling and not cfg.untie_embeddings_and_output_weights
    sizes = bench.fraction_sizes(cfg, 0.5)
    assert (sizes["embedding"], sizes["ffn"], sizes["attention_heads"]) == (
        192,
        512,
        4,
    )  # 6 heads in 2 groups: even counts


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fractions": (0.5, 1.0)}, "fractions"),
        ({"fractions": ()}, "fractions"),
        ({"reps": 0}, "reps"),
    ],
)
def test_bad_arguments_raise_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        bench.measure(**kwargs)
