"""Parameter counting from a config (no weights) and the ``params`` CLI subcommand.

The expected numbers below are written out by hand from Megatron-Core 0.19.2's module
constructors (MambaMixer, SelfAttention, MLP, TopKRouter, SequentialMLP, SharedExpertMLP,
HybridModel), so a wrong formula in ``counting.py`` fails here rather than agreeing with itself.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_plugin.models.cli import main
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.counting import (
    COMPONENTS,
    component_of_parameter,
    count_parameters,
    count_parameters_per_layer,
    format_count,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny.yaml"
NANO = ROOT / "examples" / "configs" / "nemotron_nano_v3.yaml"


# ----------------------------------------------------------------- tiny: hand-computed layers
# tiny.yaml: hidden 128, vocab 128, 4 heads / 2 groups x kv 32, ffn 256, Mamba 8 heads x 16,
# 2 groups, state 16, conv 4; 8 experts top-2, expert ffn 128, shared 128; squared ReLU, no bias.
H = 128
TINY_MAMBA_MIXER = (
    H * (2 * 128 + 2 * 2 * 16 + 8)  # in_proj: z, x (d_inner 128 each), B, C (2 groups x 16), dt (8)
    + (128 + 2 * 2 * 16) * 4  # conv1d weight over x, B, C channels, kernel 4
    + (128 + 2 * 2 * 16)  # conv1d bias
    + 8
    + 8
    + 8  # A_log, D, dt_bias (per head)
    + 128  # gated RMSNorm over d_inner
    + 128 * H  # out_proj
)
TINY_ATTENTION = H * (4 + 2 * 2) * 32 + 4 * 32 * H  # linear_qkv, linear_proj
TINY_MLP = H * 256 + 256 * H  # fc1 (not gated), fc2
TINY_ROUTER = 8 * H
TINY_EXPERT = H * 128 + 128 * H
TINY_SHARED = H * 128 + 128 * H
TINY_LAYER = {  # each layer also has one RMSNorm (H) reading the residual stream
    "mamba": TINY_MAMBA_MIXER + H,
    "attention": TINY_ATTENTION + H,
    "mlp": TINY_MLP + H,
    "moe": TINY_ROUTER + 8 * TINY_EXPERT + TINY_SHARED + H,
}
TINY_LAYER_ACTIVE = {**TINY_LAYER, "moe": TINY_ROUTER + 2 * TINY_EXPERT + TINY_SHARED + H}


def test_tiny_hand_computed_numbers_are_what_we_think():
    # Guard the constants themselves (catches a typo in the expressions above).
    assert TINY_MAMBA_MIXER == 59_480
    assert TINY_LAYER == {"mamba": 59_608, "attention": 49_280, "mlp": 65_664, "moe": 296_064}
    assert TINY_LAYER_ACTIVE["moe"] == 99_456


def test_tiny_per_layer_matches_hand_computation(tiny):
    layers = count_parameters_per_layer(tiny)
    assert [d["kind"] for d in layers] == ["mamba", "attention", "moe", "mlp"] * 2
    assert [d["layer"] for d in layers] == list(range(8))
    for d in layers:
        assert d["params"] == TINY_LAYER[d["kind"]], d
        assert d["active"] == TINY_LAYER_ACTIVE[d["kind"]], d
    moe = layers[2]["components"]
    assert moe == {
        "moe_router": TINY_ROUTER,
        "moe_experts": 8 * TINY_EXPERT,
        "moe_shared_expert": TINY_SHARED,
        "norms": H,
    }
    assert layers[0]["components"] == {"mamba": TINY_MAMBA_MIXER, "norms": H}


def test_tiny_breakdown_matches_hand_computation(tiny):
    counts = count_parameters(tiny)
    expected = {
        "embedding": 128 * H,
        "output_layer": 128 * H,  # untied
        "mamba": 2 * TINY_MAMBA_MIXER,
        "attention": 2 * TINY_ATTENTION,
        "mlp": 2 * TINY_MLP,
        "moe_router": 2 * TINY_ROUTER,
        "moe_experts": 2 * 8 * TINY_EXPERT,
        "moe_shared_expert": 2 * TINY_SHARED,
        "norms": 8 * H + H,  # 8 layer pre-norms + final norm
    }
    assert counts.breakdown == expected
    assert counts.total == sum(expected.values()) == 974_128
    assert counts.active_breakdown == {**expected, "moe_experts": 2 * 2 * TINY_EXPERT}
    assert counts.active == 974_128 - 2 * 6 * TINY_EXPERT == 580_912
    assert tuple(counts.breakdown) == COMPONENTS


def test_layers_plus_embeddings_add_up_to_total(tiny, nano):
    for model in (tiny, nano):
        counts = count_parameters(model)
        layers = count_parameters_per_layer(model)
        outside = (
            counts.breakdown["embedding"] + counts.breakdown["output_layer"] + model.hidden_size
        )
        assert sum(d["params"] for d in layers) + outside == counts.total
        assert sum(d["active"] for d in layers) + outside == counts.active


# ---------------------------------------------------------------------------- Nemotron Nano v3
def test_nano_v3_matches_published_size(nano):
    counts = count_parameters(nano)
    assert abs(counts.total / 31.6e9 - 1) < 0.015, counts.total
    assert abs(counts.active / 3.6e9 - 1) < 0.015, counts.active
    # Exact values; equal to a meta-device HybridModel built with the local spec.
    assert counts.total == 31_577_937_344
    assert counts.active == 3_580_073_408


def test_nano_v3_layer_shapes(nano):
    layers = count_parameters_per_layer(nano)
    kinds = [d["kind"] for d in layers]
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (23, 23, 6)
    h = 2688
    mamba = h * (2 * 4096 + 2 * 8 * 128 + 64) + (4096 + 2048) * 5 + 3 * 64 + 4096 + 4096 * h + h
    assert layers[0]["params"] == mamba == 38_744_896
    attention = h * (32 + 2 * 2) * 128 + 32 * 128 * h + h
    assert layers[5]["params"] == attention
    expert = 2 * h * 1856  # squared ReLU: no gate
    moe_active = 128 * h + 6 * expert + 2 * h * 3712 + h
    assert layers[1]["active"] == moe_active == 80_169_600
    assert layers[1]["params"] == moe_active + 122 * expert


# --------------------------------------------------------------------- active vs total, options
def test_active_less_than_total_iff_moe(tiny):
    with_moe = count_parameters(tiny)
    assert with_moe.active < with_moe.total
    dense = dataclasses.replace(tiny, hybrid_layer_pattern="M*-M*-")
    counts = count_parameters(dense)
    assert counts.active == counts.total
    assert counts.breakdown["moe_experts"] == counts.breakdown["moe_router"] == 0
    # top-k == number of experts: every expert is touched, so active == total again.
    all_experts = count_parameters(dataclasses.replace(tiny, moe_router_topk=8))
    assert all_experts.active == all_experts.total


def test_swiglu_and_biases_change_count_as_expected(tiny):
    # Megatron forbids biases in the shared expert, so compare models without one.
    base = dataclasses.replace(tiny, moe_shared_expert_intermediate_size=0)
    b = count_parameters(base)
    assert b.total == 974_128 - 2 * TINY_SHARED

    swiglu = count_parameters(dataclasses.replace(base, activation="swiglu"))
    # fc1 doubles: +H*ffn per dense MLP layer and +H*moe_ffn per expert.
    assert swiglu.total - b.total == 2 * (H * 256) + 2 * 8 * (H * 128)
    assert swiglu.active - b.active == 2 * (H * 256) + 2 * 2 * (H * 128)

    both = count_parameters(dataclasses.replace(base, activation="swiglu", add_bias_linear=True))
    per_attention = (4 + 2 * 2) * 32 + H  # qkv bias rows + proj bias
    per_mlp = 2 * 256 + H  # gated fc1 bias + fc2 bias
    per_router = 8
    per_expert = 2 * 128 + H
    assert both.breakdown["attention"] - swiglu.breakdown["attention"] == 2 * per_attention
    assert both.breakdown["mlp"] - swiglu.breakdown["mlp"] == 2 * per_mlp
    assert both.breakdown["moe_router"] - swiglu.breakdown["moe_router"] == 2 * per_router
    assert both.breakdown["moe_experts"] - swiglu.breakdown["moe_experts"] == 2 * 8 * per_expert
    assert both.breakdown["mamba"] == swiglu.breakdown["mamba"]  # MambaMixer never has biases
    assert both.total - swiglu.total == 2 * (per_attention + per_mlp + per_router + 8 * per_expert)
    assert both.active - swiglu.active == 2 * (
        per_attention + per_mlp + per_router + 2 * per_expert
    )


def test_tied_embeddings_have_no_output_layer(tiny):
    tied = count_parameters(dataclasses.replace(tiny, untie_embeddings_and_output_weights=False))
    assert tied.breakdown["output_layer"] == 0
    assert tied.total == 974_128 - 128 * H


def test_shared_expert_with_bias_is_rejected(tiny):
    with pytest.raises(ConfigError, match="moe_shared_expert_intermediate_size.*add_bias_linear"):
        count_parameters(dataclasses.replace(tiny, add_bias_linear=True))


def test_bad_model_arguments_are_rejected(tiny):
    with pytest.raises(TypeError, match="ModelConfig"):
        count_parameters({"hidden_size": 128})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model.mamba_num_groups"):
        count_parameters_per_layer(dataclasses.replace(tiny, mamba_num_groups=3))


def test_component_of_parameter_names():
    cases = {
        "embedding.word_embeddings.weight": "embedding",
        "output_layer.weight": "output_layer",
        "decoder.final_norm.weight": "norms",
        "decoder.layers.0.norm.weight": "norms",
        "decoder.layers.0.mixer.norm.weight": "mamba",  # gated norm inside the mixer
        "decoder.layers.0.mixer.in_proj.weight": "mamba",
        "decoder.layers.0.mixer.in_proj.layer_norm_weight": "norms",  # TE-fused pre-norm
        "decoder.layers.0.mixer.A_log": "mamba",
        "decoder.layers.1.input_layernorm.weight": "norms",
        "decoder.layers.1.self_attention.linear_qkv.weight": "attention",
        "decoder.layers.2.pre_mlp_layernorm.weight": "norms",
        "decoder.layers.2.mlp.router.weight": "moe_router",
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight": "moe_experts",
        "decoder.layers.2.mlp.shared_experts.linear_fc2.weight": "moe_shared_expert",
        "decoder.layers.3.mlp.linear_fc1.bias": "mlp",
    }
    for name, component in cases.items():
        assert component_of_parameter(name) == component, name
    with pytest.raises(ValueError, match="matches no component"):
        component_of_parameter("decoder.something_else.weight")


def test_format_count():
    assert format_count(31_577_937_344) == "31.58B"
    assert format_count(3_580_073_408) == "3.58B"
    assert format_count(352_321_536) == "352.32M"
    assert format_count(1_152) == "1.15K"
    assert format_count(999) == "999"


# ------------------------------------------------------------------------------------- the CLI
def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_plugin.models.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.integration
def test_cli_json_subprocess():
    proc = _run_cli("params", "--config", str(NANO), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["total"] == 31_577_937_344 and out["active"] == 3_580_073_408
    assert isinstance(out["total"], int) and isinstance(out["active"], int)
    assert out["breakdown"]["moe_experts"]["active"] < out["breakdown"]["moe_experts"]["total"]


def test_cli_table(capsys):
    assert main(["params", "--config", str(TINY)]) == 0
    text = capsys.readouterr().out
    assert "TOTAL" in text and "974.13K" in text and "580.91K" in text
    assert "moe_experts" in text and "974,128" in text


def test_cli_unknown_key_exits_2_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text().replace("mamba_num_heads:", "mamba_num_head:"))
    assert main(["params", "--config", str(bad), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "mamba_num_head" in captured.err and "unknown key" in captured.err


@pytest.mark.integration
def test_cli_missing_file_exits_2_naming_it(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = _run_cli("params", "--config", str(missing))
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and proc.stdout == ""


def test_cli_invalid_yaml_exits_2(tmp_path, capsys):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["params", "--config", str(bad)]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.integration
def test_cli_import_is_light():
    code = (
        "import sys, elastic_plugin.models.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
