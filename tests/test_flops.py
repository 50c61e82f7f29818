"""Model FLOPs (``models/flops.py``) against ``torch.utils.flop_counter.FlopCounterMode`` counting
one forward pass of the real Megatron-Core model of every budget's nested architecture.

FlopCounterMode counts ``mm``/``addmm``/``bmm``/``baddbmm`` (every linear layer, the SSD scan's
matmuls and einsums, the score products of Megatron's unfused attention), ``convolution`` (the
Mamba conv1d) and SDPA kernels (the full ``s x s`` square, causal or not; the CPU flash kernel the
local spec's ``SDPAAttention`` runs has no formula in torch, so the test maps it to torch's own
``sdpa_flop_count``), and attributes them to the module that ran them; we compare the total, every decoder layer and every
component **exactly**. Left out by both (not matrix products, so neither counts them): bias adds,
norms, activations, softmax, rotary, routing (top-k, permutation, unpermutation), the scan's
discretisation (softplus, ``exp`` decays, segment sums), the ``D`` skip and the ``silu(z)`` gate.
The embedding lookup is 0 FLOPs for both.

Budgets: ``tiny_elastic.yaml``'s budgets and candidate sizes, resolved on each model; for every
budget the first and last feasible homogeneous choice (``elastic.freeze.feasible_choices``, grid
order) plus the smallest choice. Per-layer (heterogeneous) widths run on the elastic model in
sliced mode, whose router computes every expert's logit (``full_router=True``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from elastic_plugin.models.config import ConfigError, load_config
from elastic_plugin.models.flops import (
    COMPONENTS,
    FlopCount,
    forward_flops,
    ssd_scan_flops,
    training_flops,
)

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
ELASTIC = yaml.safe_load((CONFIGS / "tiny_elastic.yaml").read_text())["elastic"]
TINY = load_config(CONFIGS / "tiny.yaml").model
# Dense attention: GQA with head_dim = hidden / heads, swiglu MLP, biases (addmm: the bias is not
# a FLOP), rotary, tied embeddings.
DENSE = dataclasses.replace(
    TINY,
    hybrid_layer_pattern="*-*-",
    num_attention_heads=8,
    num_query_groups=2,
    kv_channels=None,
    activation="swiglu",
    add_bias_linear=True,
    moe_shared_expert_intermediate_size=0,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=False,
).validate()
# MoE: 6 experts top-3, gated experts, no shared expert, softmax router, allgather dispatcher;
# one Mamba group and chunks of 16, so a 40-token sequence pads its last chunk.
MOE = dataclasses.replace(
    TINY,
    hybrid_layer_pattern="*EME",
    num_moe_experts=6,
    moe_router_topk=3,
    moe_ffn_hidden_size=64,
    moe_shared_expert_intermediate_size=0,
    moe_router_score_function="softmax",
    moe_router_enable_expert_bias=False,
    moe_token_dispatcher_type="allgather",
    activation="swiglu",
    mamba_num_groups=1,
    mamba_chunk_size=16,
).validate()
SEQ, BATCH = 40, 2  # not a multiple of either chunk size (32, 16): the padded scan is counted


# --------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def megatron():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=5)


def _build(model_cfg):
    from elastic_plugin.parallel import Layout, build_model_chunks

    return build_model_chunks(model_cfg, Layout(), wrap_ddp=False)[0][0]


def _measure(model, model_cfg, seq: int = SEQ, batch: int = BATCH) -> FlopCount:
    """One forward under FlopCounterMode, sorted into ``COMPONENTS`` by the module that ran it."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    gen = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq), generator=gen)
    position = torch.arange(seq).expand(batch, seq)
    # SDPA's CPU flash kernel has no formula in torch: give it torch's own SDPA one (GQA aware)
    cpu_flash = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
        )
    }
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=cpu_flash) as counter:
        model(tokens, position, None)
    counts = counter.get_flop_counts()
    by_path = {
        tuple(name.split(".")[1:]): {str(op): n for op, n in ops.items()}
        for name, ops in counts.items()
        if name != "Global"
    }
    total = lambda path: sum(by_path.get(path, {}).values())  # noqa: E731
    leaf = {
        ("self_attention", "linear_qkv"): "attention_qkv",
        ("self_attention", "core_attention"): "attention_scores",
        ("self_attention", "linear_proj"): "attention_proj",
        ("mlp", "router"): "moe_router",
        ("mlp", "experts"): "moe_experts",
        ("mlp", "shared_experts"): "moe_shared_expert",
    }
    breakdown = dict.fromkeys(COMPONENTS, 0)
    per_layer = []
    for i, kind in enumerate(model_cfg.layer_types):
        layer = ("decoder", "layers", str(i))
        per_layer.append(total(layer))
        for sub, component in leaf.items():
            breakdown[component] += total(layer + sub)
        if kind == "mlp":
            breakdown["mlp"] += total(layer + ("mlp",))
        if kind == "mamba":
            # by op: the scan's matmuls and einsums are bmm, the conv a convolution, the
            # projections mm (attributed to in_proj / out_proj when called as modules; the
            # elastic mixer calls their forward functions, so they land on the mixer)
            mixer = by_path[layer + ("mixer",)]
            breakdown["mamba_conv1d"] += mixer.get("aten.convolution", 0)
            breakdown["mamba_scan"] += mixer.get("aten.bmm", 0) + mixer.get("aten.baddbmm", 0)
            proj = mixer.get("aten.mm", 0) + mixer.get("aten.addmm", 0)
            breakdown["mamba_out_proj"] += proj - total(layer + ("mixer", "in_proj"))
            breakdown["mamba_in_proj"] += total(layer + ("mixer", "in_proj"))
    breakdown["embedding"] = total(("embedding",))
    breakdown["output_layer"] = total(("output_layer",))
    grand = sum(counts["Global"].values())
    # nothing counted outside the decoder layers, the embedding and the output layer
    assert grand == sum(per_layer) + breakdown["embedding"] + breakdown["output_layer"]
    counted_ops = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.convolution"}
    counted_ops.add("aten._scaled_dot_product_flash_attention_for_cpu")
    assert set(map(str, counts["Global"])) <= counted_ops, counts["Global"]
    return FlopCount(grand, breakdown, tuple(per_layer))


def _budget_choices(model_cfg) -> list[dict[str, int]]:
    """First and last feasible homogeneous choice of every budget, then the smallest choice."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.freeze import feasible_choices
    from elastic_plugin.models.axes import model_axes

    axes = model_axes(model_cfg)
    raw = {**ELASTIC, "sizes": {k: v for k, v in ELASTIC["sizes"].items() if k in axes}}
    resolved = ElasticConfig.from_dict(raw).resolve(model_cfg)
    cost = ElasticCost(model_cfg, resolved)
    out: list[dict[str, int]] = []
    for budget in resolved.budgets:
        feasible = feasible_choices(resolved, cost, budget)
        for choice in (feasible[0], feasible[-1]):
            if choice not in out:
                out.append(choice)
    if resolved.smallest_choice() not in out:
        out.append(resolved.smallest_choice())
    return out


# ------------------------------------------------------------------ exact vs FlopCounterMode
@pytest.mark.parametrize("name", ["tiny", "dense", "moe"])
def test_every_budget_matches_flop_counter_exactly(megatron, name):
    from elastic_plugin.models.axes import model_for_choice

    model_cfg = {"tiny": TINY, "dense": DENSE, "moe": MOE}[name]
    choices = _budget_choices(model_cfg)
    assert len(choices) >= 3
    totals = []
    for choice in choices:
        nested = model_for_choice(model_cfg, choice)
        expected = forward_flops(model_cfg, SEQ, BATCH, choice)
        # the nested config counts the same as the choice on the full config
        assert forward_flops(nested, SEQ, BATCH) == expected
        measured = _measure(_build(nested), nested)
        assert measured.breakdown == expected.breakdown, (choice, measured, expected)
        assert measured.per_layer == expected.per_layer, choice
        assert measured.total == expected.total, choice
        totals.append(expected.total)
    full = forward_flops(model_cfg, SEQ, BATCH)
    assert all(t <= full.total for t in totals) and min(totals) < 0.6 * full.total


def test_heterogeneous_choice_matches_the_sliced_elastic_model(megatron):
    """Per-layer widths on the tiny model: the elastic layers in sliced mode compute exactly the
    counted GEMMs of every layer at its own width (the router over all experts)."""
    from elastic_plugin.nested.choice import choice_sizes
    from tests.support.elastic_model import make_elastic

    choice = {
        "embedding": 96,
        "ffn": [128, 256],
        "shared_ffn": [64, 128],
        "attention_heads": [2, 4],
        "mamba_heads": [4, 8],
        "mamba_head_dim": [16, 8],
        "experts": [4, 6],
    }
    sizes = choice_sizes(TINY, choice)  # the checked per-layer sizes the slicers use
    assert sizes["mamba_heads"] == {1: 4, 5: 8} and sizes["experts"] == {3: 4, 7: 6}
    model = _build(TINY)
    state, _ = make_elastic(model, TINY, ELASTIC["sizes"], ELASTIC["budgets"])
    state.set_sizes(choice)
    try:
        measured = _measure(model, TINY)
    finally:
        state.clear()
    expected = forward_flops(TINY, SEQ, BATCH, choice, full_router=True)
    projections = lambda b: {  # noqa: E731
        **b,
        "mamba_in_proj": b["mamba_in_proj"] + b["mamba_out_proj"],
        "mamba_out_proj": 0,
    }
    assert projections(measured.breakdown) == projections(expected.breakdown)
    assert measured.per_layer == expected.per_layer
    assert measured.total == expected.total
    # each layer counts at its own width: equal to that layer in the homogeneous model
    for number, kind in enumerate(TINY.layer_types, start=1):
        homogeneous = {
            axis: per_layer[number] if number in per_layer else per_layer[None]
            for axis, per_layer in sizes.items()
            if number in per_layer or None in per_layer
        }
        same = forward_flops(TINY, SEQ, BATCH, homogeneous, full_router=True)
        assert expected.per_layer[number - 1] == same.per_layer[number - 1], (number, kind)
    # without full_router only the routers shrink, to the active experts
    nested = forward_flops(TINY, SEQ, BATCH, choice)
    assert expected.total - nested.total == 2 * SEQ * BATCH * 96 * ((8 - 4) + (8 - 6))


@pytest.mark.parametrize(
    "seq, chunk, heads, head_dim, groups, state",
    [(1, 32, 4, 8, 2, 16), (40, 16, 4, 8, 1, 8), (64, 32, 6, 4, 3, 4), (20, 64, 2, 16, 2, 8)],
)
def test_ssd_scan_formula_matches_the_executed_scan(seq, chunk, heads, head_dim, groups, state):
    """The scan term alone, on the pure-PyTorch chunked scan Megatron's mixer runs on CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    from elastic_plugin.compat.mamba_ops import mamba_chunk_scan_combined

    b = 3
    x = torch.randn(b, seq, heads, head_dim)
    dt = torch.rand(b, seq, heads)
    bc = [torch.randn(b, seq, groups, state) for _ in range(2)]
    with FlopCounterMode(display=False) as counter:
        mamba_chunk_scan_combined(x, dt, -torch.rand(heads), *bc, chunk, D=torch.ones(heads))
    assert counter.get_total_flops() == b * ssd_scan_flops(
        seq, heads, head_dim, groups, state, chunk
    )


# -------------------------------------------------------------------------- conventions
def test_training_is_three_times_forward_and_four_with_recompute():
    choice = {"embedding": 64, "ffn": [128, 256], "experts": 4}
    forward = forward_flops(TINY, 128, 4, choice)
    train = training_flops(TINY, 128, 4, choice)
    assert train.total == 3 * forward.total
    assert train.breakdown == {k: 3 * v for k, v in forward.breakdown.items()}
    assert train.per_layer == tuple(3 * v for v in forward.per_layer)
    assert training_flops(TINY, 128, 4, choice, recompute=True).total == 4 * forward.total
    assert forward_flops(TINY, 128, 4).total * 4 == forward_flops(TINY, 128, 16).total


def test_causal_scores_count_the_unmasked_pairs():
    full = forward_flops(DENSE, 64, 2)
    causal = forward_flops(DENSE, 64, 2, causal_scores=True)
    pairs = 64 * 65 // 2
    per_layer = 2 * 2 * 2 * 8 * pairs * 16  # QK^T + AV, batch 2, 8 heads of 16
    assert causal.breakdown["attention_scores"] == 2 * per_layer  # two attention layers
    assert full.breakdown["attention_scores"] == 2 * per_layer * 64 * 64 // pairs
    assert {k: v for k, v in causal.breakdown.items() if k != "attention_scores"} == {
        k: v for k, v in full.breakdown.items() if k != "attention_scores"
    }
    assert training_flops(DENSE, 64, 2, causal_scores=True).total == 3 * causal.total


def test_narrower_choices_count_fewer_flops():
    full = forward_flops(TINY, 128)
    from tests.support.export_cases import SMALL as halves  # every axis halved

    for axis, size in halves.items():
        assert forward_flops(TINY, 128, choice={axis: size}).total < full.total, axis
    # narrowing one more axis at a time never adds FLOPs
    choice: dict[str, int] = {}
    previous = full.total
    for axis, size in halves.items():
        choice[axis] = size
        now = forward_flops(TINY, 128, choice=choice).total
        assert now < previous, axis
        previous = now
    # narrowing one layer changes that layer only
    one = forward_flops(TINY, 128, choice={"ffn": [256, 128]})
    assert one.per_layer[:7] == full.per_layer[:7] and one.per_layer[7] < full.per_layer[7]


def test_token_gemms_are_twice_the_active_gemm_weights(nano):
    """At one token, the GEMM FLOPs are 2 x the active parameters that are GEMM weights (no
    biases in these models): ties ``flops.py`` to ``counting.py`` on a model never built."""
    from elastic_plugin.models.counting import count_parameters

    for model_cfg in (TINY, nano, MOE):
        counts = count_parameters(model_cfg)
        m = model_cfg
        conv_dim = m.mamba_d_inner + 2 * m.mamba_num_groups * m.mamba_state_dim
        non_gemm_mamba = conv_dim * (m.mamba_conv_kernel + 1) + 3 * m.mamba_num_heads
        non_gemm_mamba += m.mamba_d_inner  # gated norm
        gemm_params = (
            counts.active
            - counts.breakdown["embedding"]
            - counts.breakdown["norms"]
            - m.count("mamba") * non_gemm_mamba
            + (0 if m.untie_embeddings_and_output_weights else m.vocab_size * m.hidden_size)
        )
        flops = forward_flops(model_cfg, 1)
        b = flops.breakdown
        gemms = flops.total - b["mamba_conv1d"] - b["mamba_scan"] - b["attention_scores"]
        assert gemms == 2 * gemm_params, model_cfg.hybrid_layer_pattern
    assert forward_flops(nano, 8192).to_dict()["total"] > 6e13  # ~3.6B active x 2 x 8192


def test_to_dict_and_bad_input():
    counted = forward_flops(TINY, 16, 2)
    as_dict = counted.to_dict()
    assert list(as_dict["breakdown"]) == list(COMPONENTS)
    assert as_dict["total"] == counted.total == sum(counted.breakdown.values())
    assert counted.breakdown["embedding"] == 0
    assert sum(as_dict["per_layer"]) + counted.breakdown["output_layer"] == counted.total
    with pytest.raises(ConfigError, match="not an elastic axis"):
        forward_flops(DENSE, 16, choice={"mamba_heads": 4})
    with pytest.raises(ConfigError, match="one per layer"):
        forward_flops(TINY, 16, choice={"ffn": [128]})
    with pytest.raises(ConfigError, match="multiples of 2"):
        forward_flops(TINY, 16, choice={"mamba_heads": 3})
    with pytest.raises(ConfigError, match="one global size"):
        forward_flops(TINY, 16, choice={"embedding": [64, 64]})
    with pytest.raises(ConfigError, match="seq_length"):
        forward_flops(TINY, 0)
    with pytest.raises(TypeError, match="ModelConfig"):
        forward_flops({"hidden_size": 8}, 16)
