"""FP8 / NVFP4 weight quantization (elastic_plugin.export.quantize): the E2M1 rounding rule, exact
round trips, analytic error bounds, byte layout, the state-dict layout ModelOpt's unified HF
checkpoint uses, and (when it imports) bitwise agreement with ModelOpt's own quantizers."""

from __future__ import annotations

import warnings

import pytest
import torch

from elastic_plugin.export.quantize import (
    DEFAULT_QUANTIZED,
    E2M1_VALUES,
    FORMATS,
    bytes_per_weight,
    dequantize_fp8,
    dequantize_nvfp4,
    dequantize_state_dict,
    pack_e2m1,
    quantize_fp8,
    quantize_nvfp4,
    quantize_state_dict,
    quantized_weight_bytes,
    round_e2m1,
    tensor_bytes,
    unpack_e2m1,
)
from elastic_plugin.models.config import ConfigError

E4M3 = torch.float8_e4m3fn


def _e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1_VALUES)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def _rel_err(w: torch.Tensor, dq: torch.Tensor) -> float:
    return ((w.float() - dq).abs().mean() / w.float().abs().mean()).item()


# ------------------------------------------------------------------------------ E2M1 rounding
def test_every_e2m1_code_point_rounds_to_itself_with_its_sign_bit() -> None:
    grid = torch.tensor(E2M1_VALUES)
    assert round_e2m1(grid).tolist() == list(range(8))
    assert round_e2m1(-grid[1:]).tolist() == [8 + c for c in range(1, 8)]
    assert torch.equal(_e2m1_value(round_e2m1(-grid)), -grid)


def test_e2m1_midpoints_go_to_the_even_code_and_neighbours_to_the_nearest() -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # ties: between codes (c, c+1) the even one wins
    assert round_e2m1(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert round_e2m1(-mids).tolist() == [8, 10, 10, 12, 12, 14, 14]
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 10.0))
    assert round_e2m1(below).tolist() == list(range(7))
    assert round_e2m1(above).tolist() == list(range(1, 8))
    # saturation beyond 6; tiny negatives keep their sign ("-0", code 8)
    assert round_e2m1(torch.tensor([6.5, 100.0, -7.0, -1e-6, 0.0])).tolist() == [7, 7, 15, 8, 0]


def test_packing_puts_the_even_element_in_the_low_nibble() -> None:
    row = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6]])
    packed, block_scale, global_scale = quantize_nvfp4(row)
    # amax 6 -> the block scale is exactly 448, the values land on themselves
    assert block_scale.float().item() == 448.0
    assert global_scale.item() == pytest.approx(6 / 2688)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 8)
    assert packed[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x7F]
    assert torch.equal(unpack_e2m1(packed), round_e2m1(row))
    codes = torch.randint(0, 16, (3, 4, 32), dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


# ------------------------------------------------------------------------------ exact round trips
def test_fp8_representable_tensors_round_trip_exactly() -> None:
    torch.manual_seed(0)
    grid = torch.randn(64, 48).mul(100).clamp(-448, 448).to(E4M3).float()
    grid[0, 0] = 448.0  # amax 448 -> scale 1
    for shift in (1.0, 2.0**-10, 2.0**6):  # power-of-two scales stay exact
        w = grid * shift
        q, scale = quantize_fp8(w)
        assert scale.item() == shift
        assert torch.equal(dequantize_fp8(q, scale), w)


def test_nvfp4_representable_tensors_round_trip_exactly() -> None:
    torch.manual_seed(1)
    g = 2.0**-12
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    codes[:, ::16] = 7  # every block holds a 6 -> its block scale is recovered exactly
    scales = torch.rand(8, 4).mul(400).add(1).to(E4M3)
    scales[0, 0] = 448.0  # the largest block scale is 448 -> the global scale is g
    w = (_e2m1_value(codes).view(8, 4, 16) * scales.float().unsqueeze(-1) * g).view(8, 64)
    packed, block_scale, global_scale = quantize_nvfp4(w)
    assert global_scale.item() == g
    assert torch.equal(block_scale.float(), scales.float())
    assert torch.equal(_e2m1_value(unpack_e2m1(packed)), _e2m1_value(codes))
    assert torch.equal(dequantize_nvfp4(packed, block_scale, global_scale), w)


# ------------------------------------------------------------------------------ error bounds
def test_fp8_error_is_within_half_an_e4m3_step() -> None:
    torch.manual_seed(2)
    w = torch.randn(256, 256) * torch.logspace(-4, 0, 256)  # spans normal and subnormal E4M3
    q, scale = quantize_fp8(w)
    assert q.dtype == E4M3 and scale.dim() == 0 and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(w.abs().max().item() / 448, rel=1e-6)
    err = (dequantize_fp8(q, scale) - w).abs()
    normal = w.abs() / scale >= 2.0**-6  # E4M3 normals: 3 mantissa bits, step 2^-3 relative
    assert normal.any() and (~normal).any()
    assert (err[normal] <= w.abs()[normal] / 16 * (1 + 1e-6)).all()
    # subnormals: absolute step 2^-9 (times the scale)
    assert (err[~normal] <= scale * 2.0**-10 * (1 + 1e-6)).all()


def test_nvfp4_error_is_within_half_a_grid_step_of_each_block() -> None:
    torch.manual_seed(3)
    w = torch.randn(128, 256) * torch.logspace(-3, 0, 128).unsqueeze(1)
    packed, block_scale, global_scale = quantize_nvfp4(w)
    assert packed.shape == (128, 128) and block_scale.shape == (128, 16) and global_scale.dim() == 0
    assert global_scale.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-6)
    blocks = w.view(128, 16, 16)
    exact = blocks.abs().amax(-1) / (6 * global_scale)
    normal = exact >= 2.0**-6  # a normal E4M3 block scale is within 2^-4 of the exact one
    assert (((block_scale.float() - exact).abs() <= exact / 16 * (1 + 1e-6)) | ~normal).all()
    s = (block_scale.float() * global_scale).unsqueeze(-1)  # the block's effective scale
    y = blocks.abs() / s
    half_step = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    err = (dequantize_nvfp4(packed, block_scale, global_scale).view(128, 16, 16) - blocks).abs()
    assert (err <= half_step * s * (1 + 1e-5)).all()
    assert (y <= 6.0 * 16 / 15 + 1e-5).all()  # block scale rounding: saturation stays tiny


def test_mean_relative_errors_of_gaussian_weights() -> None:
    torch.manual_seed(4)
    w = torch.randn(256, 256)
    fp8 = _rel_err(w, dequantize_fp8(*quantize_fp8(w)))
    nvfp4 = _rel_err(w, dequantize_nvfp4(*quantize_nvfp4(w)))
    # FP8: <= 1/16 per element, ~2.3% on average; NVFP4: ~9% (4-bit values, 16-value blocks)
    assert 0.01 < fp8 < 0.035
    assert 0.06 < nvfp4 < 0.12


def test_zero_blocks_and_all_zero_tensors_stay_finite_and_zero() -> None:
    w = torch.randn(4, 64)
    w[1] = 0.0
    w[2, 16:32] = 0.0
    w[3, 32:48] *= 1e-9  # a block too small for E4M3: its scale clamps to the smallest, 2^-9
    packed, block_scale, global_scale = quantize_nvfp4(w)
    assert block_scale[1].float().eq(1.0).all() and block_scale[2, 1].float().item() == 1.0
    assert block_scale[3, 2].float().item() == 2.0**-9
    assert unpack_e2m1(packed)[3, 32:48].eq(torch.where(w[3, 32:48] < 0, 8, 0)).all()
    dq = dequantize_nvfp4(packed, block_scale, global_scale)
    assert dq[1].eq(0).all() and dq[2, 16:32].eq(0).all()
    zero = torch.zeros(8, 32)
    for dq in (dequantize_fp8(*quantize_fp8(zero)), dequantize_nvfp4(*quantize_nvfp4(zero))):
        assert torch.isfinite(dq).all() and dq.eq(0).all()
    q, scale = quantize_fp8(zero)
    assert torch.isfinite(scale) and scale.item() > 0
    packed, block_scale, global_scale = quantize_nvfp4(zero)
    assert torch.isfinite(block_scale.float()).all() and global_scale.item() > 0
    assert packed.eq(0).all()


def test_negation_flips_only_the_sign() -> None:
    torch.manual_seed(5)
    w = torch.randn(16, 64)
    assert torch.equal(dequantize_fp8(*quantize_fp8(-w)), -dequantize_fp8(*quantize_fp8(w)))
    pos, neg = quantize_nvfp4(w.abs()), quantize_nvfp4(-w.abs())
    assert torch.equal(unpack_e2m1(neg[0]), unpack_e2m1(pos[0]) | 8)
    assert torch.equal(neg[1].float(), pos[1].float())
    assert torch.equal(dequantize_nvfp4(*neg), -dequantize_nvfp4(*pos))


def test_expert_stacks_get_one_scale_per_expert() -> None:
    torch.manual_seed(6)
    w = torch.randn(3, 24, 32) * torch.tensor([1.0, 10.0, 0.01]).view(3, 1, 1)
    q, scale = quantize_fp8(w)
    assert scale.shape == (3,)
    for e in range(3):
        qe, se = quantize_fp8(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and scale[e] == se
    assert torch.equal(dequantize_fp8(q, scale)[1], dequantize_fp8(*quantize_fp8(w[1])))
    packed, block_scale, global_scale = quantize_nvfp4(w)
    assert packed.shape == (3, 24, 16) and block_scale.shape == (3, 24, 2)
    assert global_scale.shape == (3,)
    for e in range(3):
        pe, be, ge = quantize_nvfp4(w[e])
        assert torch.equal(packed[e], pe) and torch.equal(block_scale[e].float(), be.float())
        assert global_scale[e] == ge
        assert torch.equal(
            dequantize_nvfp4(packed, block_scale, global_scale)[e], dequantize_nvfp4(pe, be, ge)
        )


# ------------------------------------------------------------------------------ state dicts
def _hf_state(in_dim: int = 64) -> dict[str, torch.Tensor]:
    """A small NemotronH-style state dict: Mamba, attention, MoE and MLP layers."""
    torch.manual_seed(7)
    h, f, e = 64, 32, 4
    r = lambda *s: torch.randn(*s, dtype=torch.bfloat16)  # noqa: E731
    return {
        "model.embeddings.weight": r(100, h),
        "model.layers.0.norm.weight": r(h),
        "model.layers.0.mixer.in_proj.weight": r(96, in_dim),
        "model.layers.0.mixer.conv1d.weight": r(48, 1, 4),
        "model.layers.0.mixer.conv1d.bias": r(48),
        "model.layers.0.mixer.A_log": r(4),
        "model.layers.0.mixer.D": r(4),
        "model.layers.0.mixer.dt_bias": r(4),
        "model.layers.0.mixer.norm.weight": r(32),
        "model.layers.0.mixer.out_proj.weight": r(h, 32),
        "model.layers.1.mixer.q_proj.weight": r(64, h),
        "model.layers.1.mixer.k_proj.weight": r(32, h),
        "model.layers.1.mixer.v_proj.weight": r(32, h),
        "model.layers.1.mixer.o_proj.weight": r(h, 64),
        "model.layers.2.mixer.gate.weight": r(e, h).float(),
        "model.layers.2.mixer.gate.e_score_correction_bias": torch.zeros(e),
        "model.layers.2.mixer.experts.up_proj": r(e, f, h),
        "model.layers.2.mixer.experts.down_proj": r(e, h, f),
        "model.layers.2.mixer.shared_experts.up_proj.weight": r(f, h),
        "model.layers.2.mixer.shared_experts.down_proj.weight": r(h, f),
        "model.layers.3.mixer.up_proj.weight": r(f, h),
        "model.layers.3.mixer.down_proj.weight": r(h, f),
        "model.norm_f.weight": r(h),
        "lm_head.weight": r(100, h),
    }


def test_default_quantized_picks_projections_only() -> None:
    state = _hf_state()
    picked = sorted(n for n in state if DEFAULT_QUANTIZED(n))
    assert picked == sorted(
        [
            "model.layers.0.mixer.in_proj.weight",
            "model.layers.0.mixer.out_proj.weight",
            "model.layers.1.mixer.q_proj.weight",
            "model.layers.1.mixer.k_proj.weight",
            "model.layers.1.mixer.v_proj.weight",
            "model.layers.1.mixer.o_proj.weight",
            "model.layers.2.mixer.experts.up_proj",
            "model.layers.2.mixer.experts.down_proj",
            "model.layers.2.mixer.shared_experts.up_proj.weight",
            "model.layers.2.mixer.shared_experts.down_proj.weight",
            "model.layers.3.mixer.up_proj.weight",
            "model.layers.3.mixer.down_proj.weight",
        ]
    )
    assert not DEFAULT_QUANTIZED("model.layers.0.mixer.in_proj.bias")
    assert DEFAULT_QUANTIZED("model.layers.2.mixer.experts.5.up_proj.weight")


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_layout_and_round_trip(fmt: str) -> None:
    state = _hf_state()
    tensors, config = quantize_state_dict(state, fmt)
    quant = config["quantization"]
    assert config["producer"]["name"] == "elastic_plugin"
    assert quant["quant_algo"] == {"fp8": "FP8", "nvfp4": "NVFP4"}[fmt]
    assert quant.get("group_size") == (16 if fmt == "nvfp4" else None)
    assert quant["exclude_modules"] == sorted(
        [
            "lm_head",
            "model.embeddings",
            "model.layers.0.mixer.conv1d",
            "model.layers.2.mixer.gate",
        ]
    )  # as ModelOpt's export lists them (test_export_quant_slicing checks against ModelOpt)
    # ModelOpt's names: per-expert modules, weight + weight_scale (+ weight_scale_2)
    assert "model.layers.2.mixer.experts.up_proj" not in tensors
    for module in ("model.layers.1.mixer.q_proj", "model.layers.2.mixer.experts.3.down_proj"):
        assert tensors[module + ".weight"].dtype == (E4M3 if fmt == "fp8" else torch.uint8)
        if fmt == "fp8":
            assert tensors[module + ".weight_scale"].shape == ()
            assert module + ".weight_scale_2" not in tensors
        else:
            assert tensors[module + ".weight_scale"].dtype == E4M3
            assert tensors[module + ".weight_scale_2"].shape == ()
    expert = state["model.layers.2.mixer.experts.down_proj"][3]
    quantize = quantize_fp8 if fmt == "fp8" else quantize_nvfp4
    assert torch.equal(
        tensors["model.layers.2.mixer.experts.3.down_proj.weight"].view(torch.uint8),
        quantize(expert)[0].view(torch.uint8),
    )
    for name in (
        "lm_head.weight",
        "model.embeddings.weight",
        "model.layers.2.mixer.gate.weight",
        "model.layers.0.mixer.A_log",
        "model.layers.0.mixer.conv1d.weight",
    ):
        assert tensors[name] is state[name]

    plain = dequantize_state_dict(tensors, config, dtype=torch.bfloat16)
    assert list(plain) == list(state)
    bound = 1 / 16 if fmt == "fp8" else 0.15
    for name, w in state.items():
        assert plain[name].shape == w.shape, name
        if DEFAULT_QUANTIZED(name):
            assert plain[name].dtype == torch.bfloat16
            assert 0 < _rel_err(w, plain[name].float()) < bound, name
        else:
            assert plain[name] is w


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_tensors_survive_safetensors(fmt: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    tensors, config = quantize_state_dict(_hf_state(), fmt)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "m.safetensors"))
    back = load_file(str(tmp_path / "m.safetensors"))
    assert back.keys() == tensors.keys()
    bits = lambda t: t.view(torch.uint8) if t.dtype == E4M3 else t  # noqa: E731
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(bits(back[name]), bits(t)), name


def test_nvfp4_leaves_non_divisible_input_dims_unquantized_and_excluded() -> None:
    state = _hf_state(in_dim=72)  # in_proj input dim 72 is not a multiple of 16
    tensors, config = quantize_state_dict(state, "nvfp4")
    name = "model.layers.0.mixer.in_proj"
    assert tensors[name + ".weight"] is state[name + ".weight"]
    assert name + ".weight_scale" not in tensors
    assert name in config["quantization"]["exclude_modules"]
    assert tensors["model.layers.0.mixer.out_proj.weight"].dtype == torch.uint8
    assert torch.equal(
        dequantize_state_dict(tensors, config)[name + ".weight"], state[name + ".weight"]
    )
    with pytest.raises(ValueError, match="divide by 16"):
        quantize_nvfp4(state[name + ".weight"])
    tensors, config = quantize_state_dict(state, "fp8")  # FP8 has no block constraint
    assert (
        tensors[name + ".weight"].dtype == E4M3
        and name not in config["quantization"]["exclude_modules"]
    )


def test_unpicked_experts_are_written_per_expert_and_excluded() -> None:
    state = _hf_state()
    tensors, config = quantize_state_dict(
        state, "fp8", lambda n: not n.endswith(".mixer.experts.up_proj") and DEFAULT_QUANTIZED(n)
    )
    excluded = config["quantization"]["exclude_modules"]
    assert [m for m in excluded if ".experts." in m] == [
        f"model.layers.2.mixer.experts.{e}.up_proj" for e in range(4)
    ]
    assert tensors["model.layers.2.mixer.experts.1.up_proj.weight"].dtype == torch.bfloat16
    plain = dequantize_state_dict(tensors, config)
    assert torch.equal(
        plain["model.layers.2.mixer.experts.up_proj"], state["model.layers.2.mixer.experts.up_proj"]
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_input_amax_becomes_modelopt_input_scales(fmt: str) -> None:
    state = _hf_state()
    amax = {"model.layers.1.mixer.q_proj": 12.0, "model.layers.2.mixer.experts.up_proj": 3.0}
    tensors, config = quantize_state_dict(state, fmt, input_amax=amax)
    div = 448.0 if fmt == "fp8" else 6 * 448.0
    assert tensors["model.layers.1.mixer.q_proj.input_scale"].item() == pytest.approx(12 / div)
    for e in range(4):
        assert tensors[
            f"model.layers.2.mixer.experts.{e}.up_proj.input_scale"
        ].item() == pytest.approx(3 / div)
    assert "model.layers.1.mixer.k_proj.input_scale" not in tensors
    assert "model.layers.1.mixer.q_proj.input_scale" not in dequantize_state_dict(tensors, config)
    with pytest.raises(ConfigError, match="lm_head"):
        quantize_state_dict(state, fmt, input_amax={"lm_head": 1.0})


def test_bytes_match_the_formula() -> None:
    state = _hf_state()
    for fmt, per in (("fp8", 1.0), ("nvfp4", 0.5 + 1 / 16)):
        tensors, _ = quantize_state_dict(state, fmt)
        picked = {n: w for n, w in state.items() if DEFAULT_QUANTIZED(n)}
        rest = {n: w for n, w in state.items() if n not in picked}
        expected = tensor_bytes(rest) + sum(
            quantized_weight_bytes(tuple(w.shape), fmt) for w in picked.values()
        )
        assert tensor_bytes(tensors) == expected
        w = torch.randn(256, 256)
        q = quantize_fp8(w) if fmt == "fp8" else quantize_nvfp4(w)
        assert tensor_bytes(dict(enumerate(q))) / w.numel() == bytes_per_weight(fmt, w.numel())
        assert bytes_per_weight(fmt, w.numel()) == per + 4 / 65536
        assert bytes_per_weight(fmt) == per
    assert quantized_weight_bytes((4, 32, 64), "nvfp4") == 4 * (32 * 64 * 9 // 16 + 4)
    assert tensor_bytes({"a": torch.zeros(3, 5, dtype=torch.bfloat16)}) == 30


def test_bad_format_and_bad_picks_are_config_errors() -> None:
    for bad in ("int4", "FP8", ""):
        with pytest.raises(ConfigError, match=r"--quantize must be one of fp8, nvfp4"):
            quantize_state_dict(_hf_state(), bad)
    with pytest.raises(ConfigError, match="--quantize"):
        bytes_per_weight("mxfp4")
    with pytest.raises(ConfigError, match="A_log"):
        quantize_state_dict(_hf_state(), "fp8", lambda n: n.endswith("A_log"))
    with pytest.raises(ConfigError, match="quant_algo"):
        dequantize_state_dict({}, {"quantization": {"quant_algo": "W4A16_AWQ"}})


# ------------------------------------------------------------------------------ ModelOpt
def _modelopt():
    """ModelOpt's qtensors, or a skip naming why they do not import."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    except Exception as exc:  # noqa: BLE001 (any import failure means: not available here)
        pytest.skip(f"nvidia-modelopt does not import: {type(exc).__name__}: {exc}")
    return FP8QTensor, NVFP4QTensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_modelopt_bitwise(dtype: torch.dtype) -> None:
    _, NVFP4QTensor = _modelopt()
    torch.manual_seed(8)
    w = (torch.randn(96, 256) * torch.logspace(-2, 1, 96).unsqueeze(1)).to(dtype)
    w[3, :16] = 0.0  # a zero block
    w[4] *= 1e-5  # E4M3-subnormal block scales
    w[6, 16:32] *= 1e-9  # block scale clamped up to 2^-9
    packed, block_scale, global_scale = quantize_nvfp4(w)
    ref, ref_scale, ref_scale_2 = NVFP4QTensor.quantize(w.clone(), 16)
    assert torch.equal(packed, ref._quantized_data)
    assert torch.equal(block_scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert torch.equal(global_scale, ref_scale_2.float())
    ref_dq = ref.dequantize(
        dtype=torch.float32, scale=ref_scale, double_scale=ref_scale_2, block_sizes={-1: 16}
    )
    assert torch.equal(dequantize_nvfp4(packed, block_scale, global_scale), ref_dq)


def test_e2m1_rounding_matches_modelopt_including_ties() -> None:
    _, NVFP4QTensor = _modelopt()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat(
        [
            mids,
            -mids,
            torch.tensor(E2M1_VALUES),
            torch.randn(4096) * 3,
            torch.tensor([-1e-7, 6.5, -9.0]),
        ]
    )
    assert torch.equal(round_e2m1(x), NVFP4QTensor._cast_fp4(x.clone()).to(torch.uint8))


def test_fp8_matches_modelopt() -> None:
    FP8QTensor, _ = _modelopt()
    torch.manual_seed(9)
    w = torch.randn(128, 96) * torch.logspace(-3, 0, 96)
    q, scale = quantize_fp8(w)
    ref, ref_scale = FP8QTensor.quantize(w.clone())
    assert torch.equal(q.view(torch.uint8), ref._quantized_data.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    assert torch.equal(
        dequantize_fp8(q, scale), ref.dequantize(dtype=torch.float32, scale=ref_scale)
    )
    # bf16 weights: ModelOpt's export divides by the fp32 scale in bf16 (0-d type promotion);
    # the fp32 division here differs by at most one E4M3 step
    wb = w.to(torch.bfloat16)
    qb, sb = quantize_fp8(wb)
    ref_b = (wb / sb).to(E4M3)
    steps = (qb.view(torch.uint8).to(torch.int16) - ref_b.view(torch.uint8).to(torch.int16)).abs()
    assert steps.max().item() <= 1
