"""Budgets cut from a quantized (FP8 / NVFP4) full model: the quantized nested checkpoint.

The reference is the plain slicing (``slice_hf_state``, itself tested against Megatron's slicing):
dequantizing a budget cut from the quantized parent must give exactly the parent's dequantized
weights cut to that budget, scales carried over, and NVFP4 cuts that keep whole 16-value blocks
(refused, or kept in high precision, where a budget would cut through one)."""

from __future__ import annotations

import pytest
import torch

from elastic_plugin.export.quantize import same_bits


@pytest.fixture(scope="module")
def tiny_megatron():
    from elastic_plugin.export.hf import megatron_to_hf
    from tests.support.inference_cases import tiny_inference_model

    model, cfg = tiny_inference_model(seed=17)
    return model, cfg, megatron_to_hf(model.state_dict(), cfg)


@pytest.fixture(scope="module")
def tiny_hf(tiny_megatron):
    _, cfg, hf = tiny_megatron
    return cfg, hf


# mamba_head_dim 16 of 16: every input cut keeps whole blocks
ALIGNED = {
    "embedding": 96,
    "ffn": 192,
    "shared_ffn": 64,
    "attention_heads": 2,
    "mamba_heads": 4,
    "mamba_head_dim": 16,
    "experts": 4,
}


def _choices():
    from tests.support.export_cases import PER_LAYER, SMALL

    return {"aligned": ALIGNED, "small": SMALL, "per_layer": PER_LAYER}


def test_nvfp4_alignment_is_found_from_the_config(tiny_hf):
    """Only the Mamba out_proj of layers sliced to mamba_head_dim 8 (of 16) cuts through NVFP4
    blocks; the policy refuses it naming the axis and the way out, or keeps it in BF16."""
    from elastic_plugin.export.quant_slicing import check_unaligned, unaligned_weights
    from elastic_plugin.models.config import ConfigError
    from tests.support.export_cases import PER_LAYER, SMALL

    cfg, _ = tiny_hf
    assert unaligned_weights(cfg, {"aligned": ALIGNED}) == {}
    small = unaligned_weights(cfg, {"0.4": SMALL})
    mamba = [f"model.layers.{i}.mixer.out_proj.weight" for i in (0, 4)]  # "M*E-M*E-"
    assert sorted(small) == mamba
    assert "mamba_heads / mamba_head_dim" in small[mamba[0]] and "budget 0.4" in small[mamba[0]]
    # per layer: mamba_head_dim [16, 8] -> only the second Mamba layer
    assert sorted(unaligned_weights(cfg, {"0.77": PER_LAYER})) == mamba[1:]
    with pytest.raises(ConfigError, match="--nvfp4-unaligned high-precision"):
        check_unaligned(cfg, "nvfp4", {"0.4": SMALL}, "error")
    check_unaligned(cfg, "nvfp4", {"0.4": SMALL}, "high-precision")
    check_unaligned(cfg, "fp8", {"0.4": SMALL}, "error")  # FP8 has no blocks
    with pytest.raises(ConfigError, match="--nvfp4-unaligned 'keep'.*error, high-precision"):
        check_unaligned(cfg, "nvfp4", {"0.4": SMALL}, "keep")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_budget_cut_from_the_quantized_parent_is_the_parents_values_cut(tiny_hf, fmt):
    from elastic_plugin.export.hf_slicing import slice_hf_state
    from elastic_plugin.export.quant_slicing import quantize_nested, slice_quantized_state
    from elastic_plugin.export.quantize import dequantize_state_dict

    cfg, full = tiny_hf
    choices = _choices()
    quantized, quant_config = quantize_nested(full, cfg, fmt, choices, "high-precision")
    parent = dequantize_state_dict(quantized, quant_config)
    excluded = quant_config["quantization"]["exclude_modules"]
    if fmt == "nvfp4":  # the unaligned Mamba out_proj stay in high precision, for every budget
        assert {"model.layers.0.mixer.out_proj", "model.layers.4.mixer.out_proj"} <= set(excluded)
    else:
        assert not any("out_proj" in m for m in excluded)
    for name, choice in choices.items():
        sliced = slice_quantized_state(quantized, cfg, choice, fmt)
        got = dequantize_state_dict(sliced, quant_config)
        expected = slice_hf_state(parent, cfg, choice)
        assert set(got) == set(expected), name
        for key in expected:
            assert torch.equal(got[key], expected[key]), (name, key)
        for key, scale in sliced.items():  # per-tensor scales carry over
            if key.endswith(("weight_scale_2", "input_scale")) or (
                fmt == "fp8" and key.endswith("weight_scale")
            ):
                assert torch.equal(scale, quantized[key]), key
        q_proj = "model.layers.1.mixer.q_proj.weight"
        assert sliced[q_proj].dtype == quantized[q_proj].dtype  # still quantized


def test_an_nvfp4_cut_through_a_block_is_refused_naming_the_axis(tiny_hf):
    from elastic_plugin.export.quant_slicing import slice_quantized_state
    from elastic_plugin.export.quantize import quantize_state_dict
    from elastic_plugin.models.config import ConfigError
    from tests.support.export_cases import SMALL

    cfg, full = tiny_hf
    quantized, _ = quantize_state_dict(full, "nvfp4")  # every weight quantized, out_proj too
    with pytest.raises(ConfigError, match="out_proj.*mamba_heads / mamba_head_dim.*multiples"):
        slice_quantized_state(quantized, cfg, SMALL, "nvfp4")
    with pytest.raises(ConfigError, match="without a slicing rule"):
        slice_quantized_state({**quantized, "extra.weight": torch.ones(2, 2)}, cfg, ALIGNED, "fp8")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_slicing_the_files_equals_slicing_in_memory(tiny_hf, fmt, tmp_path):
    """Read from a sharded quantized directory (experts per expert on disk, only the kept ones
    read) == the in-memory slice; the sliced exclude_modules list only modules still there."""
    from elastic_plugin.checkpoint.hub import from_hub
    from elastic_plugin.export.hf import hf_config, write_hf_checkpoint
    from elastic_plugin.export.quant_slicing import (
        quantize_nested,
        slice_quant_config,
        slice_quantized_files,
        slice_quantized_state,
    )

    cfg, full = tiny_hf
    choices = _choices()
    quantized, quant_config = quantize_nested(full, cfg, fmt, choices, "high-precision")
    write_hf_checkpoint(
        tmp_path,
        quantized,
        hf_config(full, cfg, "fp32"),
        "fp32",
        quant_config=quant_config,
        max_shard_bytes=60_000,
    )
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    for name, choice in choices.items():
        expected = from_hub(slice_quantized_state(quantized, cfg, choice, fmt))
        got = slice_quantized_files(tmp_path, cfg, choice, fmt)
        assert set(got) == set(expected), name
        for key in expected:
            assert same_bits(got[key], expected[key]), key
        kept = slice_quant_config(quant_config, got)["quantization"]["exclude_modules"]
        assert "lm_head" in kept
        assert not [m for m in kept if ".experts.7." in m or ".experts.5." in m]  # dropped


def test_input_scales_follow_the_calibration(tiny_hf):
    from elastic_plugin.export.quant_slicing import slice_quantized_state, with_input_scales
    from elastic_plugin.export.quantize import input_scale, quantize_state_dict
    from elastic_plugin.models.config import ConfigError

    cfg, full = tiny_hf
    quantized, _ = quantize_state_dict(full, "fp8")
    sliced = slice_quantized_state(quantized, cfg, ALIGNED, "fp8")
    amax = {"model.layers.1.mixer.q_proj": 3.0, "model.layers.2.mixer.experts.up_proj": 5.0}
    scaled = with_input_scales(sliced, amax, "fp8")
    assert torch.equal(scaled["model.layers.1.mixer.q_proj.input_scale"], input_scale(3.0, "fp8"))
    experts = sorted(k for k in scaled if k.endswith("up_proj.input_scale") and "experts." in k)
    assert len(experts) == ALIGNED["experts"]  # each kept expert, none past the budget
    assert float(scaled[experts[0]]) == pytest.approx(5.0 / 448)
    with pytest.raises(ConfigError, match="not a module of this model"):
        with_input_scales(sliced, {"model.layers.1.mixer.nope": 1.0}, "fp8")


# ------------------------------------------------------------------------------ nested directories
@pytest.fixture(scope="module")
def quantized_nested(rank_pools, tmp_path_factory):
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
    (result,) = rank_pools.get(1).run(
        "tests.support.export_cases:quantized_nested_case",
        config_path=config,
        workdir=str(tmp_path_factory.mktemp("quantized_nested")),
    )
    return result


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_every_budget_sliced_from_a_quantized_nested_directory_is_its_own_export(
    quantized_nested, fmt
):
    """Bit for bit: weights, scales, calibrated input scales, config.json and
    hf_quant_config.json; load_nested computes exactly what the export computes."""
    r = quantized_nested["formats"][fmt]
    for label, row in r["rows"].items():
        assert row["exit"] == 0 and row["same_keys"] and row["bitwise"], (label, row)
        assert all(row["files_equal"].values()), (label, row["files_equal"])
        assert row["load_nested_vs_export"] == 0.0, (label, row)
        # every quantized module has its calibrated static input scale, this budget's own
        modules = {k.removesuffix(".weight_scale") for k in row["quantized"]}
        assert {k.removesuffix(".input_scale") for k in row["input_scales"]} == modules
        stored = {k: v for k, v in row["nested_amax"].items() if k in row["input_amax"]}
        assert row["input_amax"] == pytest.approx(stored, rel=1e-6)
        # ModelOpt calibrates every linear; a weight kept in high precision takes no scale
        assert set(row["nested_amax"]) - set(row["input_amax"]) <= set(r["exclude"])
    amax = {label: row["input_amax"] for label, row in r["rows"].items()}
    q_proj = "model.layers.1.mixer.q_proj"
    assert amax["1"][q_proj] != amax["0.4"][q_proj]  # calibrated per budget, not copied
    assert r["nested_bytes"] < sum(row["bytes_own"] for row in r["rows"].values())
    # NVFP4: the Mamba out_proj that budget 0.4 slices to mamba_head_dim 8 stay in BF16
    unaligned = {"model.layers.0.mixer.out_proj", "model.layers.4.mixer.out_proj"}
    assert (unaligned <= set(r["exclude"])) == (fmt == "nvfp4")


@pytest.mark.integration
def test_serve_check_passes_quantized_nested_and_calibrated_exports(quantized_nested):
    assert quantized_nested["serve_check"] == {"nested_nvfp4_0.4": 0, "hf_0.77_fp8": 0}


@pytest.mark.integration
def test_quantization_flags_are_refused_before_writing(quantized_nested):
    errors = quantized_nested["errors"]
    assert all(e["exit"] == 2 and not e["written"] for e in errors.values()), errors
    assert "--nvfp4-unaligned high-precision" in errors["nvfp4_unaligned"]["stderr"]
    assert "mamba_head_dim" in errors["nvfp4_unaligned"]["stderr"]
    assert "go with --quantize" in errors["calib_without_quantize"]["stderr"]
    assert "--calib-data" in errors["calib_data_missing"]["stderr"]
    assert "--calib-samples 999" in errors["calib_too_short"]["stderr"]
    assert "error, high-precision" in errors["bad_policy"]["stderr"]


# ------------------------------------------------------------------------------ ModelOpt's layout
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_full_budget_export_is_what_modelopt_exports(tiny_hf, fmt, tmp_path):
    """The same tiny_hf model quantized by ModelOpt itself (``mtq.quantize`` + calibration, then
    ``export_hf_checkpoint``) and by us (weights quantized once, ModelOpt-calibrated input
    scales): the same tensor names, the same tensors, the same quantization config."""
    import json

    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.export.calibrate import calibrate_input_amax
    from elastic_plugin.export.hf import build_hf_model, hf_config, write_hf_checkpoint
    from elastic_plugin.export.quant_slicing import quantize_nested, with_input_scales

    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_hf_checkpoint

    cfg, full = tiny_hf
    config = hf_config(full, cfg, "fp32")
    tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5))
    batches = list(tokens.split(2))

    reference = build_hf_model(config, full, torch.float32)
    reference.config.architectures = ["NemotronHForCausalLM"]
    default = mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG

    def forward_loop(model):
        with torch.no_grad():
            for batch in batches:
                model(batch)

    mtq.quantize(reference, default, forward_loop)
    export_hf_checkpoint(reference, export_dir=tmp_path / "modelopt")
    theirs = read_hub_tensors(tmp_path / "modelopt")

    model = build_hf_model(config, full, torch.float32)
    quantized, quant_config = quantize_nested(full, cfg, fmt, {}, "error")
    quantized = with_input_scales(quantized, calibrate_input_amax(model, batches, fmt), fmt)
    (tmp_path / "ours").mkdir()
    write_hf_checkpoint(tmp_path / "ours", quantized, config, "fp32", quant_config=quant_config)
    ours = read_hub_tensors(tmp_path / "ours")

    assert sorted(ours) == sorted(theirs)
    differ = [k for k in ours if not same_bits(ours[k], theirs[k].to(ours[k].dtype))]
    assert not differ, differ[:5]
    mine = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())["quantization"]
    their = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    assert mine["quant_algo"] == their["quant_algo"]
    assert mine.get("group_size") == their.get("group_size")
    # ModelOpt 0.47 on CPU appends a sentinel to each excluded name; the modules are the same
    assert {m.split(".\x00")[0] for m in their["exclude_modules"]} <= set(mine["exclude_modules"])


def test_quantization_config_in_config_json_is_modelopts(tiny_hf, tmp_path):
    """config.json's quantization_config == ModelOpt's convert_hf_quant_config_format of our
    hf_quant_config.json; excluded modules are written in the Hub's names and read back in
    transformers' in-memory ones."""
    import json

    from elastic_plugin.export.hf import hf_config, read_quant_config, write_hf_checkpoint
    from elastic_plugin.export.quantize import quantize_state_dict

    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    cfg, full = tiny_hf
    for fmt in ("fp8", "nvfp4"):
        quantized, quant_config = quantize_state_dict(full, fmt)
        out = tmp_path / fmt
        out.mkdir()
        write_hf_checkpoint(out, quantized, hf_config(full, cfg, "fp32"), quant_config=quant_config)
        stored = json.loads((out / "hf_quant_config.json").read_text())
        excluded = stored["quantization"]["exclude_modules"]
        assert "backbone.layers.0.mixer.conv1d" in excluded and "lm_head" in excluded
        assert not any(m.startswith("model.") for m in excluded)
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"] == convert.convert_hf_quant_config_format(stored)
        assert config["quantization_config"]["quant_method"] == "modelopt"
        read_fmt, read = read_quant_config(out)
        assert read_fmt == fmt and read == quant_config


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_megatron_evaluation_quantizes_activations_as_transformers_does(tiny_megatron, fmt):
    """The evaluation's Megatron model with an export's static activation scales computes what
    the transformers model with ModelOpt's fake quant computes (same weights): q/k/v as one
    fused linear_qkv, every local expert, the shared expert; the hooks all fire."""
    from elastic_plugin.evaluation.models import megatron_activation_quant
    from elastic_plugin.export.calibrate import activation_fake_quant, calibrate_input_amax
    from elastic_plugin.export.hf import build_hf_model, hf_config

    model, cfg, full = tiny_megatron
    hf = build_hf_model(hf_config(full, cfg, "fp32"), full, torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    amax = calibrate_input_amax(hf, [tokens], fmt)
    position = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        plain = model(tokens, position, None).float()
        with activation_fake_quant(hf, amax, fmt):
            reference = hf(tokens).logits.float()
        handle = megatron_activation_quant(model, amax, fmt)
        try:
            ours = model(tokens, position, None).float()
        finally:
            handle.remove()
        after = model(tokens, position, None).float()
    assert all(n > 0 for n in handle.calls.values()), handle.calls
    assert torch.equal(after, plain)  # removed without a trace
    quant_effect = ((reference - plain).norm() / plain.norm()).item()
    mismatch = ((ours - reference).norm() / reference.norm()).item()
    assert quant_effect > 1e-3  # the quantization is really applied
    assert mismatch < 0.05 * quant_effect, (mismatch, quant_effect)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_fake_quant_of_an_empty_input_is_empty(fmt):
    """An expert no token was routed to gets a [0, ffn] input: passed through, no error."""
    from elastic_plugin.export.calibrate import input_fake_quant

    quant = input_fake_quant(3.0, fmt)
    empty = torch.zeros(0, 64)
    assert quant(empty).shape == (0, 64)
    x = torch.randn(4, 64)
    assert not torch.equal(quant(x), x)  # a real input is quantized
