"""FP8 GEMMs of elastic linears (``elastic.fp8_gemm``) on the real tiny HybridModel (TP=1).

References: the op (``ops.fp8_prefix_linear`` on a contiguous copy of the active block), the
straight-through gradients of the unquantized GEMM, the extracted nested model run in FP8 (a
sliced FP8 model must quantize exactly the blocks the extracted one holds), and the
``torch._scaled_mm`` path (the CUDA path without Transformer Engine) against the emulation.
TP=2 vs one rank is in test_elastic_multirank.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SIZES = {
    "embedding": [1.0, 0.5],
    "ffn": [1.0, 0.5],
    "shared_ffn": [1.0, 0.5],
    "attention_heads": [1.0, 0.5],
    "mamba_heads": [1.0, 0.5],
    "mamba_head_dim": [1.0, 0.5],
    "experts": [1.0, 0.5],
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    from elastic_plugin.ops._fp8 import relative_error

    return relative_error(a, b)


# ------------------------------------------------------------------------- the linear alone
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_linear_forward_is_the_op_and_backward_is_straight_through(scaling):
    from elastic_plugin import ops
    from elastic_plugin.elastic.layers.fp8 import Fp8Recipe, fp8_linear

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=gen, requires_grad=True)
    x = torch.randn(3, 5, 32, generator=gen, requires_grad=True)
    block = weight[:16, :32]  # the active prefix, a strided view of the parameter
    y = fp8_linear(x, block, Fp8Recipe(scaling, "emulate"))
    expected = ops.fp8_prefix_linear(x.detach(), block.detach().contiguous(), 16, 32, scaling)
    assert torch.equal(y, expected)
    assert _relative(y, x.detach() @ block.detach().t()) > 1e-3  # FP8 rounding really happened

    grad_out = torch.randn(3, 5, 16, generator=gen)
    gx, gw = torch.autograd.grad(y, (x, weight), grad_out)
    ref_x = x.detach().clone().requires_grad_()
    ref_w = weight.detach().clone().requires_grad_()
    ref_y = ref_x @ ref_w[:16, :32].t()
    rx, rw = torch.autograd.grad(ref_y, (ref_x, ref_w), grad_out)
    assert torch.allclose(gx, rx, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)
    assert gw[16:].abs().max() == 0 and gw[:, 32:].abs().max() == 0  # outside the block


def test_recipe_and_context_errors_name_the_allowed_values():
    from elastic_plugin.elastic.layers.fp8 import active_recipe, fp8_gemm

    with pytest.raises(ValueError, match=r"scaling must be one of \('tensor', 'row'\)"):
        with fp8_gemm("e5m2"):
            pass
    with pytest.raises(ValueError, match="method must be one of"):
        with fp8_gemm("row", method="cublas"):
            pass
    assert active_recipe() is None
    with fp8_gemm("row") as outer:
        with fp8_gemm("off"):
            assert active_recipe() is None  # e.g. a teacher forward inside a student's context
        assert active_recipe() == outer
    assert active_recipe() is None


def test_amax_reduce_hook_sets_the_scale_and_must_keep_its_shape():
    from elastic_plugin.ops import quantize_e4m3

    t = torch.linspace(-1, 1, 12).reshape(3, 4)
    _, scales = quantize_e4m3(t, "row", amax_reduce=lambda amax: torch.full_like(amax, 4.0))
    assert torch.equal(scales, torch.full((3, 1), 4.0 / 448))
    with pytest.raises(
        ValueError, match=r"amax_reduce must return a tensor of the amax's shape \[3, 1\]"
    ):
        quantize_e4m3(t, "row", amax_reduce=lambda amax: amax.reshape(-1))


# -------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def setup():
    from tests.support.elastic_model import make_elastic
    from tests.support.inference_cases import tiny_inference_model

    model, model_cfg = tiny_inference_model(seed=5)
    state, resolved = make_elastic(model, model_cfg, SIZES)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 48), generator=gen)
    position = torch.arange(48).expand(2, 48)
    return model, model_cfg, state, resolved, tokens, position


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_sliced_fp8_model_equals_the_extracted_model_in_fp8(setup, scaling):
    """The sliced forward quantizes each active block with the block's own amax: exactly what
    the extracted nested model (holding only those blocks) computes in FP8."""
    from elastic_plugin.elastic.layers.fp8 import fp8_gemm
    from elastic_plugin.nested.model import nested_model
    from tests.support.elastic_model import make_elastic

    model, model_cfg, state, resolved, tokens, position = setup
    choice = resolved.smallest_choice()
    small, small_cfg = nested_model(model, model_cfg, choice)
    make_elastic(small, small_cfg)  # full width only: the plain model's linears, via FP8
    state.set_sizes(choice)
    try:
        with torch.no_grad():
            sliced_plain = model(tokens, position, None)
            with fp8_gemm(scaling, "emulate"):
                sliced = model(tokens, position, None)
    finally:
        state.clear()
    with torch.no_grad():
        extracted_plain = small(tokens, position, None)
        with fp8_gemm(scaling, "emulate"):
            extracted = small(tokens, position, None)
    assert torch.allclose(sliced_plain, extracted_plain, atol=2e-5, rtol=1e-5)
    assert _relative(sliced, sliced_plain) > 1e-3  # FP8 changed the logits ...
    assert _relative(sliced, sliced_plain) < 0.5  # ... by FP8's rounding (0.23 measured), not more
    assert _relative(sliced, extracted) < 1e-5, _relative(sliced, extracted)


def test_every_block_linear_runs_fp8_but_not_the_output_layer(setup, monkeypatch):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from elastic_plugin.elastic.layers import fp8

    model, _, state, resolved, tokens, position = setup
    # a linear asks runs_fp8(itself) right before its GEMM: attribute each FP8 GEMM to the last
    # module that asked (gathered weights are copies, so the weight cannot name its module)
    asked: list[torch.nn.Module] = []
    seen: set[int] = set()
    original_runs, original_linear = fp8.runs_fp8, fp8.fp8_linear

    def runs_spy(module):
        asked.append(module)
        return original_runs(module)

    def linear_spy(x, weight, *args, **kwargs):
        seen.add(id(asked[-1]))
        return original_linear(x, weight, *args, **kwargs)

    monkeypatch.setattr(fp8, "runs_fp8", runs_spy)
    monkeypatch.setattr(fp8, "fp8_linear", linear_spy)
    linears = {
        name: id(m)
        for name, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    }
    for sizes in (None, resolved.smallest_choice()):  # the full model and a sliced one
        seen.clear()
        if sizes is not None:
            state.set_sizes(sizes)
        try:
            with torch.no_grad(), fp8.fp8_gemm("row", "emulate"):
                model(tokens, position, None)
        finally:
            state.clear()
        ran = {name for name, ptr in linears.items() if ptr in seen}
        assert "output_layer" not in ran
        missing = {n for n in set(linears) - ran - {"output_layer"} if ".local_experts." not in n}
        assert not missing, missing  # every non-expert block linear (experts: those given tokens)
        assert any(".local_experts." in n for n in ran)
        assert any(".mixer.in_proj" in n for n in ran) and any(".mixer.out_proj" in n for n in ran)


def test_scaled_mm_path_equals_the_emulation_and_gradients_flow(setup, monkeypatch):
    """method='scaled_mm' is the CUDA path without Transformer Engine; torch runs it on CPU too.
    Every GEMM of the model is checked against the emulation on the same inputs (through the
    whole model, a last-bit difference can flip an E4M3 rounding and grow layer by layer)."""
    import elastic_plugin.ops as fp8_ops
    from elastic_plugin.elastic.layers.fp8 import fp8_gemm

    model, _, state, resolved, tokens, position = setup
    calls = []
    original = fp8_ops.fp8_prefix_linear

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(fp8_ops, "fp8_prefix_linear", spy)
    state.set_sizes(resolved.smallest_choice())
    try:
        model.zero_grad(set_to_none=True)
        with fp8_gemm("tensor", "scaled_mm"):
            out = model(tokens, position, None)
        out.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        plain = model(tokens, position, None)
        plain.float().pow(2).mean().backward()
        plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        state.clear()
        model.zero_grad(set_to_none=True)
    assert len(calls) > 20 and all(kwargs["method"] == "scaled_mm" for _, kwargs, _ in calls)
    for args, kwargs, got in calls:
        emulated = original(*args, **{**kwargs, "method": "emulate"})
        assert _relative(got, emulated) < 1e-5
    # straight-through: every parameter the plain model trains gets a gradient, close to the plain one
    assert set(grads) == set(plain_grads)
    total = torch.cat([g.flatten() for g in grads.values()])
    total_plain = torch.cat([plain_grads[n].flatten() for n in grads])
    assert 1e-4 < _relative(total, total_plain) < 0.5


def test_fp8_gemm_config_field_and_flag():
    from elastic_plugin.elastic.args import add_elastic_args, elastic_config_from_args
    from elastic_plugin.elastic.config import ElasticConfig, ElasticConfigError

    assert ElasticConfig().fp8_gemm == "off"
    cfg = ElasticConfig.from_dict({"fp8_gemm": "row"})
    assert ElasticConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ElasticConfigError, match=r"fp8_gemm.*allowed: off, tensor, row"):
        ElasticConfig.from_dict({"fp8_gemm": "e4m3"})
    import argparse

    parser = add_elastic_args(argparse.ArgumentParser())
    args = parser.parse_args(["--elastic-fp8-gemm", "tensor"])
    assert elastic_config_from_args(args).fp8_gemm == "tensor"
    with pytest.raises(ElasticConfigError, match="--elastic-fp8-gemm"):
        elastic_config_from_args(parser.parse_args(["--elastic-fp8-gemm", "bf16"]))


def test_bench_fp8_gemm_runs_quick():
    import sys

    bench_dir = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench_dir)
    try:
        import bench_fp8_gemm
    finally:
        sys.path.remove(bench_dir)
    rows = bench_fp8_gemm.run(reps=1, quick=True)
    assert len(rows) == 2 * len(bench_fp8_gemm.KEEP_FRACTIONS)
    for row in rows:
        assert row["fp8/dense"] > 0 and row["fp8_tflops"] > 0, row
        assert torch.cuda.is_available() or "emulate" in row["name"], row  # CPU: the emulation
