"""Calibrated activation scales (elastic_plugin.export.calibrate) on a tiny random transformers
NemotronH with every layer kind (Mamba, attention, MoE with a shared expert, MLP): the amaxes are
the plain max|input| of each module, they are exactly the ``input_scale`` ModelOpt's own
``export_hf_checkpoint`` writes, the caller's model is not touched, and the activation fake quant
is ModelOpt's (bitwise, FP8), restores the model exactly and costs FP8 less than NVFP4."""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_plugin.export.calibrate import (
    activation_fake_quant,
    calibrate_input_amax,
    input_scale,
    nvfp4_fake_quant,
)
from elastic_plugin.export.quantize import FORMATS
from elastic_plugin.models.config import ConfigError

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHForCausalLM"):
    pytest.skip("transformers has no NemotronH", allow_module_level=True)

BOUND = {"fp8": 448.0, "nvfp4": 6.0 * 448.0}
MOE = "model.layers.2.mixer"


def _modelopt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("modelopt.torch.quantization")


@pytest.fixture(scope="module")
def model() -> nn.Module:
    cfg = transformers.NemotronHConfig(
        vocab_size=128,
        hidden_size=128,
        layers_block_type=["mamba", "attention", "moe", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=128,
    )
    torch.manual_seed(0)
    return transformers.NemotronHForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 32), generator=g) for _ in range(3)]


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    """Held-out evaluation tokens (not in the calibration batches)."""
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def amaxes(model, batches) -> dict[str, dict[str, float]]:
    """calibrate_input_amax of the model on the batches, per format."""
    _modelopt()
    return {fmt: calibrate_input_amax(model, batches, fmt) for fmt in FORMATS}


@pytest.fixture(params=FORMATS)
def calibrated(request, amaxes) -> tuple[str, dict[str, float]]:
    return request.param, amaxes[request.param]


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def _forward_loop(batches):
    def loop(m: nn.Module) -> None:
        with torch.no_grad():
            for b in batches:
                m(input_ids=b, use_cache=False)

    return loop


def _hook_amax(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, float]:
    """max|input| of every Linear but lm_head, of each experts stack's up_proj (the experts'
    hidden_states) and down_proj (its act_fn's output), over the batches; Linears fed one and
    the same tensor in a forward (q/k/v) get the max over that group."""
    amax: dict[str, float] = {}
    groups: dict[str, set[str]] = {}
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}

    def record(name: str, x: torch.Tensor) -> None:
        amax[name] = max(amax.get(name, 0.0), x.detach().abs().max().item())

    def linear_hook(name):
        def hook(module, args):
            record(name, args[0])
            seen.setdefault(id(args[0]), (args[0], []))[1].append(name)

        return hook

    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            handles.append(m.register_forward_pre_hook(linear_hook(name)))
        if type(m).__name__ == "NemotronHExperts":
            handles.append(
                m.register_forward_pre_hook(lambda mod, a, n=name: record(f"{n}.up_proj", a[0]))
            )
            handles.append(
                m.act_fn.register_forward_hook(
                    lambda mod, a, out, n=name: record(f"{n}.down_proj", out)
                )
            )
    try:
        with torch.no_grad():
            for b in batches:
                seen.clear()
                model(input_ids=b, use_cache=False)
                for _, names in seen.values():
                    for n in names:
                        groups.setdefault(n, set()).update(names)
    finally:
        for h in handles:
            h.remove()
    return {n: max(amax[g] for g in groups.get(n, {n})) for n in amax}


# ------------------------------------------------------------------------------ calibration
def test_amax_is_the_max_abs_input_of_each_quantized_module(calibrated, model, batches) -> None:
    fmt, amax = calibrated
    expected = _hook_amax(model, batches)
    # every projection, the experts stacks by their 3-D parameter names; no lm_head, conv1d
    # or router gate (the defaults leave them in high precision)
    assert set(amax) == set(expected)
    assert {f"{MOE}.experts.up_proj", f"{MOE}.experts.down_proj"} <= set(amax)
    assert "model.layers.0.mixer.in_proj" in amax and "model.layers.1.mixer.q_proj" in amax
    for name, value in expected.items():
        assert amax[name] == value, name  # max is exact: the same fp32 number
    # q/k/v read one tensor; the shared expert and the routed experts read the same tokens
    # (every token reaches top-k >= 1 experts), so their scales agree with no unification
    qkv = {amax[f"model.layers.1.mixer.{p}_proj"] for p in "qkv"}
    assert len(qkv) == 1
    assert amax[f"{MOE}.shared_experts.up_proj"] == amax[f"{MOE}.experts.up_proj"]


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # inside ModelOpt's export
def test_amax_gives_modelopts_exported_input_scale_bit_for_bit(
    calibrated, model, batches, tmp_path: Path
) -> None:
    fmt, amax = calibrated
    mtq = _modelopt()
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors import safe_open

    ref = copy.deepcopy(model)
    ref.config.architectures = ["NemotronHForCausalLM"]
    cfg = mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG
    mtq.quantize(ref, cfg, _forward_loop(batches))
    export_hf_checkpoint(ref, export_dir=tmp_path)
    algo = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert algo["quant_algo"] == {"fp8": "FP8", "nvfp4": "NVFP4"}[fmt]

    written: dict[str, torch.Tensor] = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.endswith(".input_scale"):
                    written[k.removesuffix(".input_scale")] = h.get_tensor(k)

    n_experts = model.config.n_routed_experts
    expected: dict[str, float] = {}
    for key, value in amax.items():
        hub = "backbone." + key.removeprefix("model.")
        head, _, proj = hub.rpartition(".")
        if head.endswith(".experts"):  # one stack -> one scale per expert, all equal
            expected.update({f"{head}.{e}.{proj}": value for e in range(n_experts)})
        else:
            expected[hub] = value
    assert set(written) == set(expected)
    for name, scale in written.items():
        assert scale.dtype == torch.float32 and scale.dim() == 0, name
        # ModelOpt: FP8 amax / 448; NVFP4 amax / (6 * 448) -- one fp32 division
        assert torch.equal(scale, input_scale(expected[name], fmt)), name
        assert torch.equal(scale, torch.tensor(expected[name]) / BOUND[fmt]), name
        assert scale.item() * BOUND[fmt] == pytest.approx(expected[name], rel=1e-6)


def test_calibration_leaves_the_callers_model_unchanged(model, batches, tokens) -> None:
    _modelopt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = {n: type(m) for n, m in model.named_modules()}
    before = _logits(model, tokens)
    architectures = model.config.architectures
    calibrate_input_amax(model, batches[:1], "fp8")
    after_state = model.state_dict()
    assert after_state.keys() == state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in state.items())
    assert {n: type(m) for n, m in model.named_modules()} == kinds
    assert not any("quantizer" in n.lower() for n, _ in model.named_modules())
    assert model.config.architectures == architectures
    assert torch.equal(_logits(model, tokens), before)


# ------------------------------------------------------------------------------ fake quant
def test_fake_quant_perturbs_logits_boundedly_and_restores_them_exactly(
    calibrated, model, tokens
) -> None:
    fmt, amax = calibrated
    clean = _logits(model, tokens)
    with activation_fake_quant(model, amax, fmt) as fq:
        noisy = _logits(model, tokens)
    assert all(c == 1 for c in fq.calls.values()), fq.calls  # every hook fired once
    assert torch.equal(_logits(model, tokens), clean)
    rel = ((noisy - clean).norm() / clean.norm()).item()
    # Measured (this config, 4 model seeds): logits fp8 0.058-0.073, nvfp4 0.18-0.20. Per
    # quantized input the rms relative error is fp8 2.6% (3 mantissa bits: a uniform rounding
    # error of half a 2^-3 step, ~2^-3 / sqrt(12) / 1.4 relative) and nvfp4 9.5% (E2M1 under
    # E4M3 block scales; see the input tests); twelve such inputs in a row compound that about
    # sqrt(12)-fold in this untrained model. The bounds leave 2x headroom.
    assert 0 < rel < {"fp8": 0.15, "nvfp4": 0.4}[fmt], rel
    # the handle also works without `with`
    handle = activation_fake_quant(model, amax, fmt)
    assert torch.equal(_logits(model, tokens), noisy)
    handle.remove()
    handle.remove()
    assert torch.equal(_logits(model, tokens), clean)


def test_fp8_is_closer_than_nvfp4(model, amaxes, tokens) -> None:
    clean = _logits(model, tokens)
    errors = {}
    for fmt in FORMATS:
        with activation_fake_quant(model, amaxes[fmt], fmt):
            errors[fmt] = ((_logits(model, tokens) - clean).norm() / clean.norm()).item()
    assert errors["fp8"] < errors["nvfp4"] / 2, errors


def test_fp8_fake_quant_equals_modelopts_model_with_weight_quant_disabled(
    model, batches, amaxes, tokens
) -> None:
    mtq = _modelopt()
    ref = copy.deepcopy(model)
    # (ModelOpt refuses a config with every weight quantizer off: disable them after calibrating)
    mtq.quantize(ref, mtq.FP8_DEFAULT_CFG, _forward_loop(batches))
    mtq.disable_quantizer(ref, "*weight_quantizer*")
    weight_quantizers = [
        m for n, m in ref.named_modules() if "weight_quantizer" in n and hasattr(m, "is_enabled")
    ]
    assert len(weight_quantizers) > 20 and not any(q.is_enabled for q in weight_quantizers)
    # ModelOpt's own calibrated input amaxes, read off its quantized model
    amax: dict[str, float] = {}
    for name, m in ref.named_modules():
        q = getattr(m, "input_quantizer", None)
        if q is not None and q.is_enabled:
            amax[name] = q.amax.item()
        if hasattr(m, "up_proj_input_quantizer"):
            amax[f"{name}.up_proj"] = m.up_proj_input_quantizer.amax.item()
            amax[f"{name}.down_proj"] = m.down_proj_input_quantizer.amax.item()
    assert amax == amaxes["fp8"]  # ModelOpt calibrates with quantization off

    expected = _logits(ref, tokens)
    with activation_fake_quant(model, amax, "fp8"):
        got = _logits(model, tokens)
    assert torch.equal(got, expected)
    assert not torch.equal(got, _logits(model, tokens))


def _captured_inputs(model, amax, fmt, tokens) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(raw, quantized) input of a Mamba in_proj, the attention o_proj, the experts' down_proj
    (act_fn output) and the MLP down_proj, inside the fake-quant context."""
    raw: dict[str, torch.Tensor] = {}
    got: dict[str, torch.Tensor] = {}
    handles = []
    with activation_fake_quant(model, amax, fmt):
        for name in (
            "model.layers.0.mixer.in_proj",
            "model.layers.1.mixer.o_proj",
            "model.layers.3.mixer.down_proj",
        ):
            m = model.get_submodule(name)
            handles.append(
                m.register_forward_pre_hook(
                    lambda mod, a, n=name: raw.__setitem__(n, a[0]), prepend=True
                )
            )
            handles.append(
                m.register_forward_pre_hook(lambda mod, a, n=name: got.__setitem__(n, a[0]))
            )
        act = model.get_submodule(f"{MOE}.experts.act_fn")
        key = f"{MOE}.experts.down_proj"
        handles.append(
            act.register_forward_hook(lambda mod, a, out: raw.__setitem__(key, out), prepend=True)
        )
        handles.append(act.register_forward_hook(lambda mod, a, out: got.__setitem__(key, out)))
        try:
            _logits(model, tokens)
        finally:
            for h in handles:
                h.remove()
    return {n: (raw[n], got[n]) for n in raw}


def test_fp8_inputs_are_e4m3_with_scale_amax_over_448(model, amaxes, tokens) -> None:
    amax = amaxes["fp8"]
    for name, (x, q) in _captured_inputs(model, amax, "fp8", tokens).items():
        a = torch.tensor(amax[name])
        assert not torch.equal(q, x)
        # ModelOpt's fake quant: x * (448 / amax) -> E4M3 -> * (1 / (448 / amax))
        mult = 448.0 / a
        e4m3 = (x * mult).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q, e4m3.float() * (1 / mult))
        # = (x / s) -> E4M3 -> * s, s = amax / 448, up to fp32 rounding of the scale
        s = a / 448.0
        hand = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        close = torch.isclose(q, hand, rtol=1e-6, atol=0)
        assert close.float().mean() > 0.999, name
        assert torch.allclose(q, hand, rtol=2**-3, atol=0), name  # a rare tie: one E4M3 step
        assert len(q.unique()) <= 255
        assert ((q - x).norm() / x.norm()).item() < 0.04  # measured 0.026


def test_nvfp4_inputs_are_modelopts_nvfp4_blocks(model, amaxes, tokens) -> None:
    amax = amaxes["nvfp4"]
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    for name, (x, q) in _captured_inputs(model, amax, "nvfp4", tokens).items():
        assert torch.equal(q, nvfp4_fake_quant(x, amax[name]))
        # ModelOpt's (CPU) real quantization + dequantization with the same global scale
        packed, scale, scale_2 = NVFP4QTensor.quantize(
            x.clone(), 16, weights_scaling_factor_2=input_scale(amax[name], "nvfp4")
        )
        deq = packed.dequantize(
            dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}
        )
        assert torch.equal(q, deq), name
        assert 0 < ((q - x).norm() / x.norm()).item() < 0.14  # measured 0.095
        # at most 8 magnitudes per 16-value block
        blocks = q.reshape(-1, 16).abs()
        assert all(len(b.unique()) <= 8 for b in blocks[:64])


def test_nvfp4_fake_quant_edge_cases() -> None:
    g = 6.0 * 448.0  # amax 2688 -> global scale 1: block scales are the E4M3 values themselves
    row = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6.0])
    assert torch.equal(nvfp4_fake_quant(row * 8, g), row * 8)  # block scale 48 / 6 = 8: exact
    # ties go to the even code, > 5 saturates; a zero block stays zero; a ragged tail is padded
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5] + [0.0] * 7 + [6.0])
    assert nvfp4_fake_quant(x, g).tolist() == [0, 1, 1, 2, 2, 4, 4, 6] + [0] * 7 + [6]
    assert torch.equal(nvfp4_fake_quant(torch.zeros(2, 32), 1.0), torch.zeros(2, 32))
    ragged = torch.randn(3, 20)
    assert nvfp4_fake_quant(ragged, 4.0).shape == (3, 20)
    assert torch.equal(nvfp4_fake_quant(ragged, 4.0)[:, :16], nvfp4_fake_quant(ragged[:, :16], 4.0))
    assert nvfp4_fake_quant(ragged.bfloat16(), 4.0).dtype == torch.bfloat16


# ------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_config_errors_naming_the_flags(model, batches, monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"--quantize must be one of fp8, nvfp4; got 'int8'"):
        calibrate_input_amax(model, batches, "int8")
    with pytest.raises(ConfigError, match=r"--calib-samples: calibration data .* is empty"):
        calibrate_input_amax(model, [], "fp8")
    with pytest.raises(ConfigError, match=r"--calib-samples: calibration data .* is empty"):
        calibrate_input_amax(model, iter(()), "nvfp4")
    with pytest.raises(ConfigError, match=r"--calib-samples: .* integer \[batch, seq\]"):
        calibrate_input_amax(model, [torch.randn(2, 8)], "fp8")
    with pytest.raises(ConfigError, match=r"--quantize must be one of"):
        activation_fake_quant(model, {}, "fp4")
    _modelopt()
    with pytest.raises(ConfigError, match=r"neither an nn.Linear"):
        activation_fake_quant(model, {"model.layers.0.mixer.conv1d": 1.0}, "fp8")
    with pytest.raises(ConfigError, match=r"neither an nn.Linear"):
        activation_fake_quant(model, {"model.layers.9.mixer.in_proj": 1.0}, "fp8")
    with pytest.raises(ConfigError, match=r"finite amax >= 0"):
        activation_fake_quant(model, {"model.layers.0.mixer.in_proj": float("nan")}, "fp8")
    assert not any(m._forward_pre_hooks for m in model.modules())  # nothing left on failure
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)
    with pytest.raises(ConfigError, match=r"--calib-samples needs nvidia-modelopt .*"):
        calibrate_input_amax(model, batches, "fp8")
    with pytest.raises(ConfigError, match=r"needs nvidia-modelopt"):
        activation_fake_quant(model, {}, "nvfp4")


def test_e2m1_magnitude_rounding_keeps_modelopts_boundaries():
    """The rounding of NVFP4 fake quant against ModelOpt's kernel's decision boundaries
    (``fp4_round_magnitude``: <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5,
    <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6) at every boundary, just beside it, and inside."""
    import torch

    from elastic_plugin.export.calibrate import _round_e2m1_magnitude

    bounds = [(0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
              (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0)]  # fmt: skip

    def expected(v: float) -> float:
        for bound, inclusive, value in bounds:
            if v < bound or (inclusive and v == bound):
                return value
        return 6.0

    points = torch.tensor([b for b, _, _ in bounds] + [0.0, 6.0, 7.5, 1e6])
    points = torch.cat([points, torch.nextafter(points, points + 1),
                        torch.nextafter(points, points - 1).clamp(min=0), torch.rand(4096) * 8])  # fmt: skip
    got = _round_e2m1_magnitude(points)
    assert got.tolist() == [expected(v) for v in points.tolist()]


def test_seq_length_flag_sets_calibration_and_validation_sequences() -> None:
    # export's --seq-length: the run's sequence length where the checkpoint's config holds the
    # YAML's (a run trained with --seq-length keeps the YAML's in its training section)
    import argparse

    from elastic_plugin.export.cli import _add_quant_args, _quant_options
    from elastic_plugin.export.extract import QuantOptions

    meta = {"config": {"training": {"seq_length": 512}}}
    assert QuantOptions().sequence_length(meta) == 512
    assert QuantOptions(seq_length=32).sequence_length(meta) == 32
    assert QuantOptions().sequence_length({"config": {}}) == 128
    parser = argparse.ArgumentParser()
    _add_quant_args(parser)
    assert _quant_options(parser.parse_args(["--seq-length", "64"])).sequence_length(meta) == 64
    with pytest.raises(ConfigError, match=r"--seq-length 0: must be >= 1"):
        _quant_options(parser.parse_args(["--seq-length", "0"]))
