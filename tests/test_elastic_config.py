"""ElasticConfig parsing/validation, candidate resolution, the differentiable cost, and the flags.

Costs are checked against ``models/counting.py`` on the *reduced* plain configs (which
``test_counting.py`` checks against hand-written Megatron module sizes), and the memory metric
against numbers written out by hand, so the elastic formulas cannot just agree with themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch
import yaml

from elastic_plugin.elastic.args import (
    add_elastic_args,
    elastic_config_from_args,
    load_elastic_yaml,
)
from elastic_plugin.elastic.config import (
    AxisSpec,
    CurriculumStage,
    ElasticConfig,
    MemorySpec,
    RouterConfig,
)
from elastic_plugin.elastic.cost import ElasticCost
from elastic_plugin.models.axes import ELASTIC_AXES, model_for_choice
from elastic_plugin.models.config import ConfigError, load_config
from elastic_plugin.models.counting import count_parameters, count_parameters_per_layer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny.yaml"
NANO = ROOT / "examples" / "configs" / "nemotron_nano_v3.yaml"


# ------------------------------------------------------------------------------- parsing
def test_defaults_and_empty_section():
    cfg = ElasticConfig.from_dict({})
    assert cfg == ElasticConfig() == ElasticConfig.from_dict(None)
    assert cfg.budgets == (1.0, 0.77, 0.4)
    assert (cfg.budget_metric, cfg.mode, cfg.teacher) == ("total_params", "sliced", "frozen")
    assert cfg.memory == MemorySpec(batch_size=1, seq_length=4096, precision="bf16")
    assert cfg.router == RouterConfig(
        hidden_size=256,
        temperature=(1.0, 0.05),
        logit_scale=(1.0, 10.0),
        anneal_iters=None,
        hard=True,
        lr_mult=100.0,
    )
    assert cfg.sizes == {} and cfg.curriculum == () and not cfg.heterogeneous
    assert (cfg.kd_temperature, cfg.budget_loss_weight, cfg.ce_weight_full) == (1.0, 1.0, 0.0)
    assert cfg.interpolate is False


FULL = {
    "budgets": [1.0, 0.6],
    "budget_metric": "memory",
    "memory": {"batch_size": 4, "seq_length": 1024, "precision": "fp8"},
    "sizes": {"ffn": [1.0, 0.5], "experts": [8, 4], "embedding": [128, 0.5]},
    "heterogeneous": True,
    "router": {
        "hidden_size": 64,
        "temperature": [2.0, 0.1],
        "logit_scale": [1.0, 5.0],
        "anneal_iters": 300,
        "freeze_after": 250,
        "freeze_select": "likelihood",
        "freeze_candidates": 8,
        "hard": False,
        "lr_mult": 50.0,
    },
    "curriculum": [
        {"iters": 200, "budget_probs": None, "seq_length": None},
        {"iters": 100, "budget_probs": [0.7, 0.3], "seq_length": 256},
    ],
    "mode": "masked",
    "teacher": "self",
    "kd_temperature": 2.0,
    "kd_chunk_tokens": 512,
    "budget_loss_weight": 0.5,
    "ce_weight_full": 0.1,
    "interpolate": True,
    "fp8_gemm": "row",
}


def test_from_dict_to_dict_round_trip():
    cfg = ElasticConfig.from_dict(FULL, source="x.yaml")
    assert cfg.budgets == (1.0, 0.6) and cfg.memory.precision == "fp8"
    assert cfg.router.temperature == (2.0, 0.1) and cfg.router.hard is False
    assert cfg.router.freeze_after == 250
    assert cfg.curriculum == (CurriculumStage(200), CurriculumStage(100, (0.7, 0.3), 256))
    assert cfg.sizes["embedding"] == (128, 0.5)
    assert cfg.to_dict() == FULL
    again = ElasticConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg


def test_curriculum_stages_in_tokens_count_iterations_of_the_batch():
    """The published recipe states its stages in tokens: a stage of ``tokens`` lasts
    ceil(tokens / (global batch x its sequence length)) iterations; configs in iterations keep
    their layout (no ``tokens`` key)."""
    raw = {
        "budgets": [1.0, 0.6],
        "curriculum": [{"tokens": 1000}, {"tokens": 2048, "seq_length": 256, "budget_probs": [0.8, 0.2]}],
    }  # fmt: skip
    cfg = ElasticConfig.from_dict(raw)
    assert cfg.curriculum == (
        CurriculumStage(tokens=1000.0),
        CurriculumStage(budget_probs=(0.8, 0.2), seq_length=256, tokens=2048.0),
    )
    assert cfg.curriculum_in_iterations(4, 64) == (  # ceil(1000 / 256), 2048 / (4 x 256)
        CurriculumStage(4),
        CurriculumStage(2, (0.8, 0.2), 256),
    )
    assert [s.token_count(4, 64) for s in cfg.curriculum_in_iterations(4, 64)] == [1024, 2048]
    assert cfg.to_dict()["curriculum"][0] == {
        "iters": None, "budget_probs": None, "seq_length": None, "tokens": 1000.0,
    }  # fmt: skip
    assert ElasticConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    assert "tokens" not in ElasticConfig.from_dict(FULL).to_dict()["curriculum"][0]
    iters_only = ElasticConfig.from_dict({"budgets": [1.0, 0.6], "curriculum": [{"iters": 7}]})
    assert iters_only.curriculum_in_iterations(4, 64) == iters_only.curriculum


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"iters": 5, "tokens": 100}, r"elastic.curriculum\[0\]: sets both of iters and tokens"),
        ({"iters": None, "seq_length": 64}, r"elastic.curriculum\[0\]: sets neither"),
        ({"seq_length": 64}, r"elastic.curriculum\[0\].iters: missing; allowed: a positive "
                             r"integer \(or tokens"),
        ({"tokens": 0}, r"elastic.curriculum\[0\].tokens=0; allowed: a number > 0"),
        ({"tokens": "1e9"}, r"elastic.curriculum\[0\].tokens='1e9'; allowed: a number > 0"),
    ],
)  # fmt: skip
def test_curriculum_stage_takes_iters_or_tokens(stage, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig.from_dict({"budgets": [1.0, 0.6], "curriculum": [stage]})


@pytest.mark.parametrize(
    "raw, field, allowed",
    [
        ({"budget": [1.0]}, "budget", "allowed: budgets, budget_metric, memory, sizes"),
        ({"router": {"hidden": 3}}, "hidden", "allowed: hidden_size, temperature"),
        ({"memory": {"batch": 3}}, "batch", "allowed: batch_size, seq_length, precision"),
        ({"curriculum": [{"iters": 3, "prob": 1}]}, "prob", "allowed: iters, budget_probs"),
    ],
)
def test_unknown_keys_are_named(raw, field, allowed):
    section = {
        "budget": "elastic",
        "hidden": "elastic.router",
        "batch": "elastic.memory",
        "prob": r"elastic.curriculum\[0\]",
    }[field]
    with pytest.raises(ConfigError, match=f"^run.yaml: {section}: unknown key.*{field}.*{allowed}"):
        ElasticConfig.from_dict(raw, source="run.yaml")


@pytest.mark.parametrize(
    "raw, field, allowed",
    [
        ({"budgets": []}, "elastic.budgets", "strictly descending"),
        ({"budgets": [0.5, 1.0]}, "elastic.budgets", "strictly descending"),
        ({"budgets": [1.0, 1.0]}, "elastic.budgets", "strictly descending"),
        ({"budgets": [1.2, 0.5]}, "elastic.budgets", r"in \(0, 1\]"),
        ({"budgets": [1.0, 0.0]}, "elastic.budgets", r"in \(0, 1\]"),
        (
            {"budget_metric": "flops"},
            "elastic.budget_metric",
            "total_params, active_params, memory",
        ),
        ({"mode": "fast"}, "elastic.mode", "sliced, masked"),
        ({"teacher": "big"}, "elastic.teacher", "frozen, self"),
        ({"memory": {"precision": "int4"}}, "elastic.memory.precision", "bf16, fp8, nvfp4"),
        ({"memory": {"batch_size": 0}}, "elastic.memory.batch_size", "positive integer"),
        ({"curriculum": [{"iters": 0}]}, r"elastic.curriculum\[0\].iters", "positive integer"),
        (
            {"curriculum": [{"iters": 5}, {"iters": 5, "budget_probs": [0.5, 0.2, 0.2]}]},
            r"elastic.curriculum\[1\].budget_probs",
            "sum to 1",
        ),
        (
            {"curriculum": [{"iters": 5, "budget_probs": [0.5, 0.5]}]},
            r"elastic.curriculum\[0\].budget_probs",
            r"one per budget \(3",
        ),
        (
            {"curriculum": [{"iters": 5, "budget_probs": [1.5, -0.5, 0.0]}]},
            r"elastic.curriculum\[0\].budget_probs",
            ">= 0",
        ),
        ({"sizes": {"heads": [1.0]}}, "elastic.sizes.heads", "embedding, ffn, shared_ffn"),
        ({"sizes": {"ffn": [1.5]}}, "elastic.sizes.ffn", r"fractions in \(0, 1\]"),
        ({"sizes": {"ffn": [2.0]}}, "elastic.sizes.ffn", "positive integers"),
        ({"sizes": {"ffn": [0]}}, "elastic.sizes.ffn", "positive integers"),
        ({"sizes": {"ffn": []}}, "elastic.sizes.ffn", "non-empty"),
        ({"sizes": {"ffn": [True]}}, "elastic.sizes.ffn", "positive integers"),
        ({"router": {"temperature": [1.0]}}, "elastic.router.temperature", r"\[start, end\]"),
        ({"router": {"lr_mult": 0}}, "elastic.router.lr_mult", "> 0"),
        ({"router": {"hidden_size": 2.5}}, "elastic.router.hidden_size", "positive integer"),
        ({"kd_temperature": 0}, "elastic.kd_temperature", "> 0"),
        ({"ce_weight_full": -1}, "elastic.ce_weight_full", ">= 0"),
        ({"heterogeneous": "yes"}, "elastic.heterogeneous", "true, false"),
    ],
)
def test_model_independent_errors(raw, field, allowed):
    with pytest.raises(ConfigError, match=f"^run.yaml: {field}.*allowed.*{allowed}"):
        ElasticConfig.from_dict(raw, source="run.yaml")


# ------------------------------------------------------------------------------- resolve
def test_tiny_default_resolves_under_tp2_ep2_and_reaches_budgets(tiny):
    resolved = ElasticConfig().resolve(tiny, tp=2, ep=2)
    assert resolved.budgets == (1.0, 0.77, 0.4)
    cands = {name: spec.candidates for name, spec in resolved.axes.items()}
    # default fractions (1.0, 0.75, 0.5); 0.75 of 4 heads in 2 groups rounds to 2 per group
    assert cands == {
        "embedding": (128, 96, 64),
        "ffn": (256, 192, 128),
        "shared_ffn": (128, 96, 64),
        "attention_heads": (4, 2),
        "mamba_heads": (8, 6, 4),
        "mamba_head_dim": (16, 12, 8),
        "experts": (8, 6, 4),
    }
    cost = ElasticCost(tiny, resolved)
    assert cost.of_choice(resolved.largest_choice()) == cost.full
    assert cost.of_choice(resolved.smallest_choice()) / cost.full < 0.4


def test_axes_layers_units_and_choices(tiny, nano):
    r = ElasticConfig(heterogeneous=True).resolve(tiny)
    # pattern M*E-M*E-: Megatron's 1-based layer_number per kind
    layers = {name: spec.layers for name, spec in r.axes.items()}
    assert layers == {
        "embedding": (),
        "ffn": (4, 8),
        "shared_ffn": (3, 7),
        "attention_heads": (2, 6),
        "mamba_heads": (1, 5),
        "mamba_head_dim": (1, 5),
        "experts": (3, 7),
    }
    assert r.axes["attention_heads"] == AxisSpec(
        "attention_heads", 4, (4, 2), (2, 6), "query heads", 2
    )
    assert r.per_layer("ffn") and not r.per_layer("embedding")
    assert not ElasticConfig().resolve(tiny).per_layer("ffn")
    assert r.num_choices("embedding") == 3 and r.num_choices("attention_heads") == 2
    with pytest.raises(KeyError, match="axes: embedding"):
        r.num_choices("ffn_typo")
    rn = ElasticConfig().resolve(nano, tp=2, ep=8)
    assert "ffn" not in rn.axes  # no '-' layers
    assert len(rn.axes["experts"].layers) == nano.count("moe") == 23
    assert rn.axes["attention_heads"].layers == tuple(
        i + 1 for i, k in enumerate(nano.layer_types) if k == "attention"
    )


def test_fraction_resolution(tiny):
    sizes = {
        "ffn": [1.0, 0.5, 0.3],
        "attention_heads": [1.0, 0.5],
        "mamba_heads": [0.3, 1.0],
        "embedding": [0.001, 128],
        "experts": [1.0, 0.3],
        "mamba_head_dim": [16, 0.26],
        "shared_ffn": [0.001, 1.0],
    }
    r = ElasticConfig(sizes=sizes).resolve(tiny, tp=2, ep=2)
    cands = {name: spec.candidates for name, spec in r.axes.items()}
    assert cands == {
        "embedding": (128, 1),  # never 0
        "ffn": (256, 128, 76),  # 0.3*256 = 76.8 -> nearest multiple of TP=2: 76
        "shared_ffn": (128, 2),  # never 0: the smallest multiple of TP
        "attention_heads": (4, 2),
        "mamba_heads": (8, 2),  # 0.3*8 = 2.4 -> nearest multiple of 2 groups
        "mamba_head_dim": (16, 4),  # 0.26*16 = 4.16 -> 4
        "experts": (8, 2),  # 0.3*8 = 2.4 -> nearest multiple of EP=2
    }
    # user-chosen largest candidate below full is kept (and budget 1.0 then unreachable)
    r = ElasticConfig(budgets=(0.5,), sizes={"ffn": [128, 64]}).resolve(tiny, tp=2)
    assert r.axes["ffn"].candidates == (128, 64)


@pytest.mark.parametrize(
    "sizes, tp, ep, field, allowed",
    [
        (
            {"ffn": [256, 129]},
            2,
            1,
            "sizes.ffn",
            r"multiples of 2 \(the tensor-parallel size\) in \[2, 256\]",
        ),
        ({"ffn": [512]}, 1, 1, "sizes.ffn", r"in \[1, 256\]"),
        ({"shared_ffn": [128, 63]}, 2, 1, "sizes.shared_ffn", "multiples of 2"),
        (
            {"attention_heads": [4, 3]},
            1,
            1,
            "sizes.attention_heads",
            "multiples of 2 .*num_query_groups=2",
        ),
        ({"attention_heads": [4, 1]}, 1, 1, "sizes.attention_heads", r"in \[2, 4\]"),
        ({"attention_heads": [1.0, 0.75, 0.5]}, 1, 1, "sizes.attention_heads", r"in \[2, 4\]"),
        ({"mamba_heads": [8, 5]}, 1, 1, "sizes.mamba_heads", "multiples of 2 .*mamba_num_groups=2"),
        ({"mamba_head_dim": [17]}, 1, 1, "sizes.mamba_head_dim", r"in \[1, 16\]"),
        (
            {"experts": [8, 1]},
            1,
            1,
            "sizes.experts",
            "more experts dropped than top-k.*moe_router_topk=2",
        ),
        (
            {"experts": [8, 0.1]},
            1,
            1,
            "sizes.experts",
            r"0.1 \(-> 1\).*more experts dropped than top-k",
        ),
        ({"experts": [8, 3]}, 1, 2, "sizes.experts", "multiples of 2 .*expert-parallel size"),
    ],
)
def test_resolve_errors_name_field_and_allowed(tiny, sizes, tp, ep, field, allowed):
    cfg = ElasticConfig.from_dict({"sizes": sizes}, source="run.yaml")
    with pytest.raises(ConfigError, match=f"^run.yaml: elastic.{field}=.*{allowed}") as info:
        cfg.resolve(tiny, tp=tp, ep=ep)
    assert "allowed: multiples of" in str(info.value)


def test_duplicate_sizes_after_rounding(tiny):
    cfg = ElasticConfig(sizes={"attention_heads": (1.0, 0.75, 0.5)})
    with pytest.raises(
        ConfigError,
        match=r"resolves to \[4, 4, 2\] \(full 4\); sizes must be "
        r"distinct; allowed: multiples of 2",
    ):
        cfg.resolve(tiny)


def test_axis_the_model_lacks(nano):
    cfg = ElasticConfig.from_dict({"sizes": {"ffn": [1.0, 0.5]}}, source="run.yaml")
    with pytest.raises(
        ConfigError,
        match=r"elastic.sizes.ffn: this model has no ffn axis \(no '-'.*"
        r"allowed axes for this model: embedding, shared_ffn, "
        r"attention_heads, mamba_heads, mamba_head_dim, experts",
    ):
        cfg.resolve(nano, tp=2, ep=8)


def test_model_layout_is_checked_first(tiny):
    with pytest.raises(ConfigError, match="not divisible by the tensor-parallel size 3"):
        ElasticConfig().resolve(tiny, tp=3)


def test_unreachable_budgets(tiny):
    with pytest.raises(
        ConfigError,
        match=r"elastic.budgets: budget 0.1 is not reachable with "
        r"budget_metric=total_params: the smallest candidates "
        r"give 0.2592 of the full model; allowed: budgets >= 0.2592",
    ):
        ElasticConfig(budgets=(1.0, 0.1)).resolve(tiny)
    # memory at 4096 tokens: tiny's KV cache and weights do not shrink to 40%
    with pytest.raises(ConfigError, match="budget 0.4 is not reachable with budget_metric=memory"):
        ElasticConfig(budget_metric="memory").resolve(tiny)
    with pytest.raises(
        ConfigError, match=r"budget 0.99 is not reachable .*largest candidates give 0\.\d+"
    ):
        ElasticConfig(budgets=(0.99, 0.5), sizes={"ffn": [128, 64]}).resolve(tiny)
    # budget 1.0 is the parent: the full size of every axis must be a candidate
    with pytest.raises(ConfigError, match=r"sizes.ffn=\[128, 64\]: budget 1.0 is the full parent"):
        ElasticConfig(sizes={"ffn": [128, 64]}).resolve(tiny)


# ------------------------------------------------------------------------------- cost: exact
CHOICES_TINY = [
    {},
    {
        "embedding": 64,
        "ffn": 128,
        "shared_ffn": 64,
        "attention_heads": 2,
        "mamba_heads": 4,
        "mamba_head_dim": 8,
        "experts": 4,
    },
    {
        "embedding": 96,
        "ffn": 192,
        "attention_heads": 4,
        "mamba_heads": 6,
        "mamba_head_dim": 12,
        "experts": 6,
        "shared_ffn": 128,
    },
    {"embedding": 32, "mamba_head_dim": 3, "experts": 2},
]
CHOICES_NANO = [
    {},
    {
        "embedding": 2016,
        "shared_ffn": 2784,
        "attention_heads": 24,
        "mamba_heads": 48,
        "mamba_head_dim": 48,
        "experts": 96,
    },
    {
        "embedding": 1344,
        "shared_ffn": 1856,
        "attention_heads": 16,
        "mamba_heads": 32,
        "mamba_head_dim": 32,
        "experts": 64,
    },
    {"embedding": 2688, "experts": 64, "mamba_heads": 24},
]


def _sweep(cfg_path, choices, tp, ep):
    model = load_config(cfg_path).model
    resolved = ElasticConfig(budgets=(1.0,)).resolve(model, tp=tp, ep=ep)
    for metric in ("total_params", "active_params"):
        cost = ElasticCost(model, resolved, metric)
        for choice in choices:
            reduced = count_parameters(model_for_choice(model, choice))
            expected = reduced.total if metric == "total_params" else reduced.active
            assert cost.of_choice(choice) == expected, (metric, choice)
        assert cost.full == getattr(count_parameters(model), metric.split("_")[0])


def test_cost_equals_counting_tiny():
    _sweep(TINY, CHOICES_TINY, 2, 2)


def test_cost_equals_counting_nano():
    _sweep(NANO, CHOICES_NANO, 2, 8)


def test_experts_change_total_but_barely_active(tiny):
    r = ElasticConfig(budgets=(1.0,)).resolve(tiny)
    total, active = ElasticCost(tiny, r, "total_params"), ElasticCost(tiny, r, "active_params")
    two_layers, h, expert = 2, 128, 2 * 128 * 128
    assert total.full - total.of_choice({"experts": 4}) == two_layers * 4 * (expert + h)
    assert active.full - active.of_choice({"experts": 4}) == two_layers * 4 * h  # router rows only


@pytest.mark.parametrize("cfg_path, tp, ep", [(TINY, 1, 1), (NANO, 2, 8)])
def test_heterogeneous_cost_equals_per_layer_counts(cfg_path, tp, ep):
    model = load_config(cfg_path).model
    resolved = ElasticConfig(budgets=(1.0,), heterogeneous=True).resolve(model, tp=tp, ep=ep)
    rng = random.Random(0)
    for metric, key in (("total_params", "params"), ("active_params", "active")):
        cost = ElasticCost(model, resolved, metric)
        for _ in range(3):
            h = rng.choice(resolved.axes["embedding"].candidates)
            choice: dict[str, object] = {"embedding": h}
            per_layer: dict[int, dict[str, int]] = {}  # layer_number -> its reduced choice
            for name, spec in resolved.axes.items():
                if name == "embedding":
                    continue
                picks = [rng.choice(spec.candidates) for _ in spec.layers]
                choice[name] = picks
                for number, pick in zip(spec.layers, picks):
                    per_layer.setdefault(number, {"embedding": h})[name] = pick
            expected = 0
            for number in range(1, model.num_layers + 1):
                reduced = model_for_choice(model, per_layer.get(number, {"embedding": h}))
                expected += count_parameters_per_layer(reduced)[number - 1][key]
            outside = count_parameters(model_for_choice(model, {"embedding": h})).breakdown
            expected += outside["embedding"] + outside["output_layer"] + h  # + final norm
            assert cost.of_choice(choice) == expected


def test_memory_cost_by_hand(tiny):
    mem = MemorySpec(batch_size=3, seq_length=100, precision="nvfp4")
    r = ElasticConfig(budgets=(1.0,), budget_metric="memory", memory=mem).resolve(tiny)
    choice = {
        "embedding": 96,
        "ffn": 128,
        "shared_ffn": 64,
        "attention_heads": 2,
        "mamba_heads": 4,
        "mamba_head_dim": 8,
        "experts": 4,
    }
    params = count_parameters(model_for_choice(tiny, choice)).total
    weights = params * (0.5 + 1 / 16)  # NVFP4 value + one E4M3 scale per 16
    kv = 2 * (2 * 2 * 32 * 100 * 3 * 2)  # 2 attn layers: K+V, 2 groups, d 32, bf16
    ssm = 2 * (
        4 * 8 * 16 * 3 * 4  # 2 Mamba layers: fp32 SSM state
        + 3 * (4 * 8 + 2 * 2 * 16) * 3 * 2
    )  # + (kernel-1) x conv channels, bf16
    cost = ElasticCost(tiny, r)
    assert cost.of_choice(choice) == weights + kv + ssm
    full_params = count_parameters(tiny).total
    full_ssm = 2 * (8 * 16 * 16 * 3 * 4 + 3 * (128 + 64) * 3 * 2)
    for precision, nbytes in (("bf16", 2), ("fp8", 1), ("nvfp4", 0.5625)):
        c = ElasticCost(tiny, r, "memory", dataclasses.replace(mem, precision=precision))
        assert c.full == full_params * nbytes + kv + full_ssm


# ------------------------------------------------------------------------------- cost: grads
def _random_sizes(resolved, generator, per_layer):
    out = {}
    for name, spec in resolved.axes.items():
        shape = (len(spec.layers),) if per_layer and name != "embedding" else ()
        low = spec.candidates[-1]
        out[name] = (
            low + torch.rand(shape, generator=generator, dtype=torch.float64) * (spec.full - low)
        ).requires_grad_(True)
    return out


@pytest.mark.parametrize("metric", ["total_params", "active_params", "memory"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_gradients_match_finite_differences(tiny, metric, per_layer):
    r = dataclasses.replace(
        ElasticConfig(budgets=(1.0,)),
        heterogeneous=per_layer,
        budget_metric=metric,
        memory=MemorySpec(seq_length=8),
    ).resolve(tiny)
    cost = ElasticCost(tiny, r)
    sizes = _random_sizes(r, torch.Generator().manual_seed(1), per_layer)
    value = cost(sizes)
    assert value.dim() == 0 and value.dtype == torch.float64
    grads = torch.autograd.grad(value, list(sizes.values()))
    for (name, size), grad in zip(sizes.items(), grads):
        flat = size.detach().reshape(-1)
        for i in range(flat.numel()):
            step = torch.zeros_like(flat)
            step[i] = 0.5
            plus = {k: v.detach() for k, v in sizes.items()}
            minus = dict(plus)
            plus[name] = (flat + step).reshape(size.shape)
            minus[name] = (flat - step).reshape(size.shape)
            fd = (cost(plus) - cost(minus)).item()  # step 2 * 0.5
            assert grad.reshape(-1)[i].item() == pytest.approx(fd, rel=1e-9), (name, i)
            assert grad.reshape(-1)[i].item() > 0, (name, i)  # bigger width, bigger cost


def test_float32_sizes_get_gradients_and_fraction(tiny):
    r = ElasticConfig().resolve(tiny)
    cost = ElasticCost(tiny, r)
    h = torch.tensor(100.0, requires_grad=True)
    frac = cost.fraction({"embedding": h})
    frac.backward()
    assert h.grad is not None and h.grad.item() > 0
    assert 0 < frac.item() < 1


def test_expected_cost_of_independent_axes(tiny):
    """The router draws axes independently; C is multilinear in distinct axes, so plugging in the
    expected sizes gives the exact expected cost (enumerated over every joint choice)."""
    r = ElasticConfig().resolve(tiny)
    cost = ElasticCost(tiny, r)
    gen = torch.Generator().manual_seed(3)
    probs = {
        n: torch.softmax(torch.randn(len(s.candidates), generator=gen, dtype=torch.float64), 0)
        for n, s in r.axes.items()
    }
    names = list(r.axes)
    expected = 0.0
    for idx in itertools.product(*(range(r.num_choices(n)) for n in names)):
        p = 1.0
        for n, i in zip(names, idx):
            p *= probs[n][i].item()
        expected += p * cost.of_choice({n: r.axes[n].candidates[i] for n, i in zip(names, idx)})
    mean = {
        n: (probs[n] * torch.tensor(r.axes[n].candidates, dtype=torch.float64)).sum() for n in names
    }
    assert cost(mean).item() == pytest.approx(expected, rel=1e-12)


def test_cost_rejects_bad_inputs(tiny):
    r = ElasticConfig(heterogeneous=True).resolve(tiny)
    cost = ElasticCost(tiny, r)
    with pytest.raises(ConfigError, match="unknown axis heads.*axes of this model: embedding"):
        cost({"heads": torch.tensor(2.0)})
    with pytest.raises(
        ConfigError, match=r"sizes\['ffn'\] has shape \(3,\); allowed: \(\) or \(2,\)"
    ):
        cost({"ffn": torch.ones(3)})
    with pytest.raises(
        ConfigError, match=r"sizes\['embedding'\] has shape \(2,\); allowed: \(\) \(a 0-d"
    ):
        cost({"embedding": torch.ones(2)})
    with pytest.raises(ConfigError, match="must be integers"):
        cost.of_choice({"ffn": 1.5})


def test_model_for_choice_keeps_groups_and_head_dim(tiny):
    plain = dataclasses.replace(
        tiny, kv_channels=None, num_query_groups=None, num_attention_heads=4
    )  # head dim 128/4 = 32, 4 groups
    reduced = model_for_choice(plain, {"embedding": 96, "attention_heads": 4})
    assert (reduced.kv_channels, reduced.query_groups, reduced.hidden_size) == (32, 4, 96)
    reduced = model_for_choice(tiny, {"attention_heads": 2, "experts": 4})
    assert (
        reduced.num_attention_heads,
        reduced.num_query_groups,
        reduced.kv_channels,
        reduced.num_moe_experts,
    ) == (2, 2, 32, 4)
    with pytest.raises(ConfigError, match="choice axis 'heads'; allowed: embedding"):
        model_for_choice(tiny, {"heads": 2})
    with pytest.raises(ConfigError, match="moe_router_topk"):
        model_for_choice(tiny, {"experts": 1})


# ------------------------------------------------------------------------------- flags
def _parse(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron's parser
    return add_elastic_args(parser).parse_args(argv)


def test_flags_defaults_are_none_and_give_defaults():
    args = _parse([])
    assert all(v is None for k, v in vars(args).items() if k.startswith("elastic"))
    assert elastic_config_from_args(args) == ElasticConfig()
    assert {f"--elastic-{a.replace('_', '-')}-sizes" for a in ELASTIC_AXES} <= {
        a
        for action in add_elastic_args(argparse.ArgumentParser())._actions
        for a in action.option_strings
    }


def test_flags_override_yaml_override_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "hybrid_layer_pattern": "M"
                },  # an experiment config: its elastic section counts
                "elastic": {
                    "budgets": [1.0, 0.5],
                    "heterogeneous": True,
                    "kd_temperature": 3.0,
                    "router": {"hidden_size": 32, "lr_mult": 10.0},
                    "sizes": {"ffn": [1.0, 0.5]},
                },
            }
        )
    )
    args = _parse(
        [
            "--elastic-config",
            str(path),
            "--elastic-router-hidden-size",
            "64",
            "--no-elastic-heterogeneous",
            "--elastic-mamba-head-dim-sizes",
            "16",
            "0.5",
            "--elastic-curriculum",
            "200,100:0.5/0.5:256",
            "--elastic-temperature",
            "2",
            "0.1",
        ]
    )
    cfg = elastic_config_from_args(args)
    assert cfg.budgets == (1.0, 0.5) and cfg.kd_temperature == 3.0  # YAML over defaults
    assert cfg.router.hidden_size == 64 and cfg.router.lr_mult == 10.0  # flag over YAML, merged
    assert cfg.router.temperature == (2.0, 0.1) and cfg.router.logit_scale == (1.0, 10.0)
    assert cfg.heterogeneous is False  # --no- flag over YAML
    assert cfg.sizes == {"ffn": (1.0, 0.5), "mamba_head_dim": (16, 0.5)}  # int stays absolute
    assert cfg.curriculum == (CurriculumStage(200), CurriculumStage(100, (0.5, 0.5), 256))
    # base mapping < file < flags
    base = {"budgets": [1.0, 0.3], "teacher": "self", "router": {"anneal_iters": 7}}
    cfg = elastic_config_from_args(args, base=base)
    assert cfg.teacher == "self" and cfg.budgets == (1.0, 0.5) and cfg.router.anneal_iters == 7


def test_every_flag_round_trip():
    argv = [
        "--elastic-budgets",
        "1.0",
        "0.6",
        "--elastic-budget-metric",
        "memory",
        "--elastic-memory-batch-size",
        "4",
        "--elastic-memory-seq-length",
        "1024",
        "--elastic-memory-precision",
        "fp8",
        "--elastic-ffn-sizes",
        "1.0",
        "0.5",
        "--elastic-experts-sizes",
        "8",
        "4",
        "--elastic-embedding-sizes",
        "128",
        "0.5",
        "--elastic-heterogeneous",
        "--elastic-router-hidden-size",
        "64",
        "--elastic-router-lr-mult",
        "50",
        "--elastic-temperature",
        "2.0",
        "0.1",
        "--elastic-logit-scale",
        "1",
        "5",
        "--elastic-anneal-iters",
        "300",
        "--elastic-router-freeze-after",
        "250",
        "--elastic-router-freeze-select",
        "likelihood",
        "--elastic-router-freeze-candidates",
        "8",
        "--elastic-soft-masks",
        "--elastic-curriculum",
        "200,100:0.7/0.3:256",
        "--elastic-mode",
        "masked",
        "--elastic-teacher",
        "self",
        "--elastic-kd-temperature",
        "2",
        "--elastic-kd-chunk-tokens",
        "512",
        "--elastic-budget-loss-weight",
        "0.5",
        "--elastic-ce-weight-full",
        "0.1",
        "--elastic-interpolate",
        "--elastic-fp8-gemm",
        "row",
    ]
    assert elastic_config_from_args(_parse(argv)) == ElasticConfig.from_dict(FULL)


@pytest.mark.parametrize(
    "argv, flag, allowed",
    [
        (["--elastic-budgets", "0.4", "0.7"], "--elastic-budgets", "strictly descending"),
        (
            ["--elastic-budget-metric", "flops"],
            "--elastic-budget-metric",
            "total_params, active_params",
        ),
        (["--elastic-memory-precision", "int4"], "--elastic-memory-precision", "bf16, fp8, nvfp4"),
        (["--elastic-curriculum", "abc"], "--elastic-curriculum", r"ITERS\[:P1/P2"),
        (["--elastic-curriculum", "10:0.5/0.5"], "--elastic-curriculum", r"one per budget \(3"),
        (["--elastic-ffn-sizes", "1.5"], "--elastic-ffn-sizes", r"fractions in \(0, 1\]"),
        (["--elastic-temperature", "1", "0"], "--elastic-temperature", "> 0"),
        (["--elastic-anneal-iters", "0"], "--elastic-anneal-iters", "positive integer"),
        (
            ["--elastic-router-freeze-select", "best"],
            "--elastic-router-freeze-select",
            "likelihood, loss",
        ),
        (
            ["--elastic-router-freeze-select", "loss"],
            "--elastic-router-freeze-select",
            "needs router.freeze_after",
        ),
        (
            ["--elastic-router-freeze-after", "5", "--elastic-router-freeze-candidates", "0"],
            "--elastic-router-freeze-candidates",
            "positive integer",
        ),
    ],
)
def test_bad_flags_name_the_flag(argv, flag, allowed):
    with pytest.raises(ConfigError, match=f"^{flag}: .*{allowed}"):
        elastic_config_from_args(_parse(argv))


def test_loss_freeze_needs_homogeneous_choices():
    with pytest.raises(
        ConfigError,
        match=r"^run.yaml: elastic.router.freeze_select=loss searches "
        r"homogeneous choices; allowed with heterogeneous=true: "
        r"likelihood",
    ):
        ElasticConfig.from_dict(
            {"heterogeneous": True, "router": {"freeze_after": 5, "freeze_select": "loss"}},
            source="run.yaml",
        )


def test_resolve_errors_name_flag_or_file(tiny, tmp_path):
    cfg = elastic_config_from_args(_parse(["--elastic-ffn-sizes", "256", "129"]))
    with pytest.raises(ConfigError, match=r"^--elastic-ffn-sizes: elastic.sizes.ffn=\[256, 129\]"):
        cfg.resolve(tiny, tp=2)
    path = tmp_path / "e.yaml"
    path.write_text("budgets: [1.0, 0.1]\n")  # a top-level mapping is the elastic section
    cfg = elastic_config_from_args(_parse(["--elastic-config", str(path)]))
    with pytest.raises(ConfigError, match=f"^--elastic-config {path}: elastic.budgets: budget 0.1"):
        cfg.resolve(tiny)


def test_load_elastic_yaml(tmp_path):
    (tmp_path / "a.yaml").write_text("elastic:\n  budgets: [1.0, 0.5]\n")
    (tmp_path / "b.yaml").write_text("model: {hidden_size: 3}\n")
    (tmp_path / "c.yaml").write_text("mode: masked\n")
    assert load_elastic_yaml(tmp_path / "a.yaml") == {"budgets": [1.0, 0.5]}
    assert load_elastic_yaml(tmp_path / "b.yaml") == {}
    assert load_elastic_yaml(tmp_path / "c.yaml") == {"mode": "masked"}
    with pytest.raises(ConfigError, match="--elastic-config .*nope.yaml: no such file"):
        load_elastic_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="elastic.budget_metric"):
        ElasticConfig.from_dict({**load_elastic_yaml(tmp_path / "a.yaml"), "budget_metric": "x"})
