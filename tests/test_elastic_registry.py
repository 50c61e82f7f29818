"""``elastify`` dispatches every decoder layer through registered layer rules
(``register_elastic_layer``): a new layer type is one registered class and no edit of ``elastify``;
a rule registered later takes precedence over a built-in one; a layer no rule matches is refused
before any module is changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml"
DENSE_MLP_INDEX = 3  # "M*E-M*E-": layer 4 is the first dense MLP layer


class CustomLayer(torch.nn.Module):
    """A decoder layer type the plugin knows nothing about."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.proj = torch.nn.Linear(4, 4)


@pytest.fixture
def tiny_elastic():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=5)
    model_cfg = load_config(CONFIG).model
    model = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)[0][0]
    return model_cfg, model


@pytest.fixture
def registered():
    """Register rules for one test only (the registry is process-wide)."""
    from elastic_plugin.elastic.layers import modules, register_elastic_layer

    added: list[type] = []

    def register(rule: type) -> type:
        added.append(register_elastic_layer(rule))
        return rule

    yield register
    for rule in added:
        modules._LAYER_RULES.remove(rule)


def _classes(model: torch.nn.Module) -> dict[str, type]:
    return {name: type(module) for name, module in model.named_modules()}


def test_a_layer_no_rule_matches_is_refused_before_anything_changes(tiny_elastic):
    from elastic_plugin.models.config import ConfigError
    from tests.support.elastic_model import make_elastic

    model_cfg, model = tiny_elastic
    model.decoder.layers[DENSE_MLP_INDEX] = CustomLayer(DENSE_MLP_INDEX + 1)
    before = _classes(model)
    with pytest.raises(
        ConfigError, match=r"layer type CustomLayer \(layer 4\).*register_elastic_layer"
    ):
        make_elastic(model, model_cfg)
    assert _classes(model) == before  # no module was swapped to its elastic class


def test_one_registered_class_makes_a_new_layer_type_elastic(tiny_elastic, registered):
    from tests.support.elastic_model import make_elastic

    model_cfg, model = tiny_elastic
    model.decoder.layers[DENSE_MLP_INDEX] = CustomLayer(DENSE_MLP_INDEX + 1)
    calls = []

    @registered
    class CustomRule:
        @staticmethod
        def matches(layer) -> bool:
            return isinstance(layer, CustomLayer)

        @staticmethod
        def elastify(layer, state) -> None:
            calls.append((layer.layer_number, state))

    state, _ = make_elastic(model, model_cfg)
    assert calls == [(DENSE_MLP_INDEX + 1, state)]
    mamba, attention = model.decoder.layers[0], model.decoder.layers[1]
    assert type(mamba.mixer).__name__ == "ElasticMambaMixer"  # the built-in rules still ran
    assert type(attention.self_attention.linear_qkv).__name__ == "ElasticColumnParallelLinear"


def test_a_later_rule_takes_precedence_over_the_built_in_one(tiny_elastic, registered):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from elastic_plugin.models.layers import hybrid_layer_kind
    from tests.support.elastic_model import make_elastic

    model_cfg, model = tiny_elastic
    seen = []

    @registered
    class FrozenDenseMLP:
        """Keeps dense MLP layers at full width (e.g. a user's choice)."""

        @staticmethod
        def matches(layer) -> bool:
            return hybrid_layer_kind(layer) == "mlp"

        @staticmethod
        def elastify(layer, state) -> None:
            seen.append(layer.layer_number)

    make_elastic(model, model_cfg)
    assert seen == [4, 8]
    dense = model.decoder.layers[DENSE_MLP_INDEX].mlp
    assert type(dense.linear_fc1) is ColumnParallelLinear  # the built-in MLP rule did not run
    moe = model.decoder.layers[2].mlp
    assert type(moe.router).__name__.startswith("Elastic")  # other kinds as before


def test_a_rule_needs_matches_and_elastify():
    from elastic_plugin.elastic.layers import register_elastic_layer

    no_matches = type("NoMatches", (), {"elastify": staticmethod(lambda layer, state: None)})
    with pytest.raises(TypeError, match=r"register_elastic_layer\(NoMatches\).*matches"):
        register_elastic_layer(no_matches)
