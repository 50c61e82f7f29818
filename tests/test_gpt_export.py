"""FP8 / NVFP4 exports of GPT-family models (Llama with tied embeddings, Qwen3-MoE with gated
experts and a dense layer, Mixtral's renamed experts), in ModelOpt's quantized HF layout.

References nobody here wrote: ModelOpt's own ``mtq.quantize`` + ``export_hf_checkpoint`` of the
same transformers model (tensor names, bits, input scales and excluded modules equal), ModelOpt's
own FP8 input fake quant (logits equal bit for bit), transformers' classes (logits of the
dequantized export). The slicing reference is the plain HF-side slicing (``slice_hf_state``,
tested against Megatron's in tests/test_families.py). Unit tier: models built in-process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import warnings
from pathlib import Path

import pytest
import torch

from elastic_plugin.export.quantize import same_bits
from elastic_plugin.models.config import ModelConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
FORMATS = ("fp8", "nvfp4")


def _mixtral() -> ModelConfig:
    """Mixtral: every layer MoE, experts stored as block_sparse_moe.experts.{e}.w1/w3/w2."""
    model = load_config(CONFIGS / "tiny_qwen3_moe.yaml").model
    return dataclasses.replace(
        model, hybrid_layer_pattern="*E*E", qk_layernorm=False, kv_channels=None
    ).validate()


MODELS = {
    "llama": lambda: load_config(CONFIGS / "tiny_llama.yaml").model,
    "qwen3_moe": lambda: load_config(CONFIGS / "tiny_qwen3_moe.yaml").model,
    "mixtral": _mixtral,
}
# budgets whose input cuts keep whole NVFP4 blocks (hidden 128 -> 96 / 64, heads 4 -> 2 of 32
# channels, FFN 256 -> 128), one per layer where the model has layers of an axis
CHOICES = {
    "llama": {
        "small": {"embedding": 64, "attention_heads": 2, "ffn": 128},
        "per_layer": {"embedding": 96, "attention_heads": [2, 4, 4, 2], "ffn": [128, 256, 192, 64]},
    },
    "qwen3_moe": {
        "small": {"embedding": 64, "attention_heads": 2, "ffn": 128, "experts": 4},
        "per_layer": {"embedding": 96, "attention_heads": [4, 2, 2, 4], "experts": [8, 4, 6]},
    },
    "mixtral": {"small": {"embedding": 64, "attention_heads": 2, "experts": 4}},
}


@pytest.fixture(scope="module")
def megatron():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=5)


def _modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("modelopt.torch.quantization")


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, megatron):
    """(name, ModelConfig, our Megatron model perturbed, its transformers tensors)."""
    from elastic_plugin.export.hf import megatron_to_hf
    from elastic_plugin.parallel import Layout, build_model_chunks
    from tests.support.inference_cases import perturb_

    cfg = MODELS[request.param]()
    torch.manual_seed(11)
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0]
    perturb_(model, seed=11, scale=0.05)
    model.eval()
    return request.param, cfg, model, megatron_to_hf(model.state_dict(), cfg)


def _batches(cfg: ModelConfig) -> list[torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5))
    return list(tokens.split(2))


# ------------------------------------------------------------------------------ ModelOpt's layout
@pytest.mark.parametrize("fmt", FORMATS)
def test_full_model_export_is_what_modelopt_exports(case, fmt, tmp_path):
    """The transformers model of our tensors, quantized by ModelOpt itself (``mtq.quantize`` with
    calibration, ``export_hf_checkpoint``) and by us (weights quantized once, ModelOpt-calibrated
    input scales): the same names on disk, the same bits, the same excluded modules. Gated
    experts are written per expert as gate_proj / up_proj sharing their expert's scales, q/k/v
    and a dense gate/up share NVFP4's global scale, a tied lm_head is listed but not stored."""
    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.export.calibrate import calibrate_input_amax
    from elastic_plugin.export.hf import build_hf_model, hf_config, write_hf_checkpoint
    from elastic_plugin.export.quant_slicing import quantize_nested, with_input_scales

    name, cfg, _, full = case
    mtq = _modelopt()
    from modelopt.torch.export import export_hf_checkpoint

    config = hf_config(full, cfg, "fp32")
    batches = _batches(cfg)
    reference = build_hf_model(config, full, torch.float32)
    reference.config.architectures = list(config["architectures"])

    def forward_loop(model):
        with torch.no_grad():
            for batch in batches:
                model(batch)

    with contextlib.redirect_stdout(io.StringIO()):
        mtq.quantize(
            reference, mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG, forward_loop
        )
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
    if name == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight_scale" in ours
    mine = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())["quantization"]
    their = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    assert (mine["quant_algo"], mine.get("group_size")) == (
        their["quant_algo"],
        their.get("group_size"),
    )
    assert {m.split(".\x00")[0] for m in their["exclude_modules"]} == set(mine["exclude_modules"])
    if not cfg.untie_embeddings_and_output_weights:
        assert "lm_head" in mine["exclude_modules"] and "lm_head.weight" not in ours


# ------------------------------------------------------------------------------ budgets
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_budget_cut_from_the_quantized_parent_is_the_parents_values_cut(case, fmt, tmp_path):
    """In memory and from a sharded directory's files (only the kept experts read): dequantized,
    a budget's cut is the dequantized parent cut by the plain slicing; per-tensor scales carry
    over; the sliced exclude_modules lists only modules still there."""
    from elastic_plugin.export.hf import hf_config, write_hf_checkpoint
    from elastic_plugin.export.hf_slicing import slice_hf_state
    from elastic_plugin.export.quant_slicing import (
        quantize_nested,
        slice_quant_config,
        slice_quantized_files,
        slice_quantized_state,
    )
    from elastic_plugin.export.quantize import dequantize_state_dict
    from elastic_plugin.families import family_for_model

    name, cfg, _, full = case
    choices = CHOICES[name]
    quantized, quant_config = quantize_nested(full, cfg, fmt, choices, "error")
    parent = dequantize_state_dict(quantized, quant_config)
    assert sorted(parent) == sorted(full)  # experts restacked into gate_up_proj / down_proj
    write_hf_checkpoint(
        tmp_path,
        quantized,
        hf_config(full, cfg, "fp32"),
        "fp32",
        quant_config=quant_config,
        max_shard_bytes=100_000,
    )
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    family = family_for_model(cfg)
    for label, choice in choices.items():
        expected = slice_hf_state(parent, cfg, choice)
        sliced = slice_quantized_state(quantized, cfg, choice, fmt)
        from_files = slice_quantized_files(tmp_path, cfg, choice, fmt)
        assert sorted(from_files) == sorted(family.from_hub(family.to_hub(sliced))), label
        for key, tensor in from_files.items():
            assert same_bits(tensor, family.from_hub(family.to_hub(sliced))[key]), (label, key)
        got = dequantize_state_dict(sliced, quant_config)
        assert sorted(got) == sorted(expected), label
        for key in expected:
            assert torch.equal(got[key], expected[key]), (label, key)
        for key, scale in sliced.items():
            if key.endswith(("weight_scale_2", "input_scale")) or (
                fmt == "fp8" and key.endswith("weight_scale")
            ):
                assert torch.equal(scale, quantized[key]), key
        kept = slice_quant_config(quant_config, from_files)["quantization"]["exclude_modules"]
        assert "model.embed_tokens" in kept
        assert ("lm_head" in kept) == ("lm_head" in quant_config["quantization"]["exclude_modules"])


def test_an_nvfp4_cut_through_a_block_is_refused_naming_the_axis(case):
    from elastic_plugin.export.quant_slicing import check_unaligned, unaligned_weights
    from elastic_plugin.models.config import ConfigError

    name, cfg, _, _ = case
    bad = {"embedding": 88}  # 88 of 128 hidden channels: not whole 16-value blocks
    found = unaligned_weights(cfg, {"0.6": bad})
    assert found and all("embedding axis" in why for why in found.values())
    assert "model.layers.0.self_attn.q_proj.weight" in found
    with pytest.raises(ConfigError, match="--nvfp4-unaligned high-precision"):
        check_unaligned(cfg, "nvfp4", {"0.6": bad}, "error")
    check_unaligned(cfg, "fp8", {"0.6": bad}, "error")


# ------------------------------------------------------------------------------ activations
def test_fp8_fake_quant_equals_modelopts_model_with_weight_quant_disabled(case):
    """Our input fake quant (gated experts' down_proj through the F.linear it calls) computes
    what ModelOpt's own quantized model computes with its weight quantizers off, bit for bit;
    removing it restores the model exactly."""
    from elastic_plugin.export.calibrate import activation_fake_quant, calibrate_input_amax
    from elastic_plugin.export.hf import build_hf_model, hf_config

    _, cfg, _, full = case
    mtq = _modelopt()
    batches = _batches(cfg)
    model = build_hf_model(hf_config(full, cfg, "fp32"), full, torch.float32)
    amax = calibrate_input_amax(model, batches, "fp8")
    ref = copy.deepcopy(model)
    ref.config.architectures = [type(model).__name__]

    def forward_loop(m):
        with torch.no_grad():
            for batch in batches:
                m(batch)

    with contextlib.redirect_stdout(io.StringIO()):
        mtq.quantize(ref, mtq.FP8_DEFAULT_CFG, forward_loop)
        mtq.disable_quantizer(ref, "*weight_quantizer*")
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = ref(tokens).logits
        clean = model(tokens).logits
        with activation_fake_quant(model, amax, "fp8") as fq:
            got = model(tokens).logits
        after = model(tokens).logits
    assert all(n > 0 for n in fq.calls.values()), fq.calls
    assert torch.equal(got, expected)
    assert not torch.equal(got, clean) and torch.equal(after, clean)


@pytest.mark.parametrize("fmt", FORMATS)
def test_megatron_evaluation_quantizes_activations_as_transformers_does(case, fmt):
    """The evaluation's Megatron model with an export's static activation scales computes what
    the transformers model with the fake quant computes: q/k/v as one linear_qkv, a dense
    gate/up as one linear_fc1, every local expert; the hooks all fire."""
    from elastic_plugin.evaluation.models import megatron_activation_quant
    from elastic_plugin.export.calibrate import activation_fake_quant, calibrate_input_amax
    from elastic_plugin.export.hf import build_hf_model, hf_config

    _, cfg, model, full = case
    _modelopt()
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
    assert torch.equal(after, plain)
    # per token: the two models agree to float rounding before quantization (~1e-7), so FP8's
    # coarse grid can round one activation differently now and then, and causal attention carries
    # that to the rest of its sequence; a missed or wrong quantizer changes every token
    quant_effect = (reference - plain).norm(dim=-1) / plain.norm(dim=-1)
    mismatch = (ours - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert (quant_effect > 1e-3).all(), quant_effect
    assert (mismatch < 1e-4).float().mean() >= 0.75, mismatch
    assert mismatch.norm() < 0.25 * quant_effect.norm(), (mismatch, quant_effect)


# ------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_export_loads_with_its_dequantized_weights(case, fmt, tmp_path):
    """load_hf_model of a quantized directory: the family's transformers class holding exactly
    the dequantized weights; its logits are the plain model's within the format's error."""
    from elastic_plugin.export.hf import (
        build_hf_model,
        hf_config,
        load_hf_model,
        write_hf_checkpoint,
    )
    from elastic_plugin.export.quant_slicing import quantize_nested
    from elastic_plugin.export.quantize import dequantize_state_dict

    _, cfg, _, full = case
    quantized, quant_config = quantize_nested(full, cfg, fmt, {}, "error")
    config = hf_config(full, cfg, "fp32")
    write_hf_checkpoint(tmp_path, quantized, config, "fp32", quant_config=quant_config)
    loaded = load_hf_model(tmp_path)
    expected = dequantize_state_dict(quantized, quant_config)
    state = loaded.state_dict()
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    plain = build_hf_model(config, full, torch.float32)
    with torch.no_grad():
        a, b = loaded(tokens).logits, plain(tokens).logits
    rel = ((a - b).norm() / b.norm()).item()
    # weight-only error on these random models, measured: fp8 up to 0.10, nvfp4 up to 0.33
    assert 0 < rel < {"fp8": 0.2, "nvfp4": 0.5}[fmt], rel
