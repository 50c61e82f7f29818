"""Elastic Megatron layers on the real tiny HybridModel (TP=1): a cleared state is Megatron's own
forward; for a hard choice, sliced (only the active prefix computed) and masked (full width x
prefix masks) give the same logits and the same parameter gradients on the active blocks; soft
masks give the router gradients on every axis; switched-off experts receive no tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml"
SIZES = {
    "embedding": [1.0, 0.5],
    "ffn": [1.0, 0.5],
    "shared_ffn": [1.0, 0.5],
    "attention_heads": [1.0, 0.5],
    "mamba_heads": [1.0, 0.5],
    "mamba_head_dim": [1.0, 0.5],
    "experts": [1.0, 0.5],
}


@pytest.fixture(scope="module")
def setup():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )
    from tests.support.elastic_model import make_elastic

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=3)
    model_cfg = load_config(CONFIG).model
    model = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)[0][0]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 48), generator=gen)
    position = torch.arange(48).expand(2, 48)
    with torch.no_grad():
        reference = model(tokens, position, None)
    state, resolved = make_elastic(model, model_cfg, SIZES)
    return model, state, resolved, tokens, position, reference


def _one_hot(resolved, small: set[str], requires_grad: bool = False) -> dict[str, torch.Tensor]:
    probs = {}
    for name, spec in resolved.axes.items():
        p = torch.zeros(1, len(spec.candidates))
        p[0, 1 if name in small else 0] = 1.0
        probs[name] = p.requires_grad_(requires_grad)
    return probs


def _grads(model, tokens, position):
    model.zero_grad(set_to_none=True)
    out = model(tokens, position, None)
    out.float().pow(2).mean().backward()
    return out.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_cleared_state_is_megatrons_forward(setup):
    model, state, _, tokens, position, reference = setup
    state.clear()
    with torch.no_grad():
        assert torch.equal(model(tokens, position, None), reference)
    assert type(model.decoder.layers[0].mixer).__name__ == "ElasticMambaMixer"
    assert type(model.output_layer).__name__ == "ElasticColumnParallelLinear"


@pytest.mark.parametrize(
    "small",
    [
        {"embedding"},
        {"ffn"},
        {"shared_ffn"},
        {"attention_heads"},
        {"mamba_heads"},
        {"mamba_head_dim"},
        {"experts"},
        set(SIZES),
    ],
)
def test_sliced_equals_masked_for_a_hard_choice(setup, small):
    from elastic_plugin.elastic.layers.state import MASKED, SLICED

    model, state, resolved, tokens, position, reference = setup
    probs = _one_hot(resolved, small)
    state.set_choice(probs, MASKED)
    masked, masked_grads = _grads(model, tokens, position)
    state.set_choice(probs, SLICED, with_masks=False)
    sliced, sliced_grads = _grads(model, tokens, position)
    state.clear()
    assert (masked - reference).abs().max() > 1e-3, "the smaller model should differ from the full"
    assert torch.allclose(sliced, masked, atol=2e-5, rtol=1e-5), (sliced - masked).abs().max()
    assert set(sliced_grads) == set(masked_grads)
    for name, grad in masked_grads.items():
        assert torch.allclose(sliced_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_sliced_mode_computes_less(setup):
    """The sliced GEMMs really shrink: count multiply-adds through the ops' shapes."""
    from torch.utils.flop_counter import FlopCounterMode

    from elastic_plugin.elastic.layers.state import MASKED, SLICED

    model, state, resolved, tokens, position, _ = setup
    probs = _one_hot(resolved, set(SIZES))
    flops = {}
    for mode in (MASKED, SLICED):
        state.set_choice(probs, mode, with_masks=mode == MASKED)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(tokens, position, None)
        flops[mode] = counter.get_total_flops()
    state.clear()
    assert flops[SLICED] < 0.45 * flops[MASKED], flops


def test_soft_masks_give_every_axis_a_router_gradient(setup):
    from elastic_plugin.elastic.layers.state import MASKED

    model, state, resolved, tokens, position, _ = setup
    probs = {}
    for name, spec in resolved.axes.items():
        probs[name] = torch.full(
            (1, len(spec.candidates)), 1.0 / len(spec.candidates), requires_grad=True
        )
    state.set_choice(probs, MASKED)
    out = model(tokens, position, None)
    out.float().pow(2).mean().backward()
    state.clear()
    for name, p in probs.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_switched_off_experts_get_no_tokens(setup):
    from elastic_plugin.elastic.layers.state import SLICED

    model, state, resolved, tokens, position, _ = setup
    routers = [
        layer.mlp.router
        for layer in model.decoder.layers
        if hasattr(getattr(layer, "mlp", None), "router")
    ]
    maps = []
    originals = [r.routing for r in routers]

    def spy(router, original):
        def run(logits, *args, **kwargs):
            probs, routing_map = original(logits, *args, **kwargs)
            maps.append((probs.detach(), routing_map.detach()))
            return probs, routing_map

        return run

    for r, orig in zip(routers, originals):
        r.routing = spy(r, orig)
    try:
        state.set_choice(_one_hot(resolved, {"experts"}), SLICED, with_masks=False)
        with torch.no_grad():
            model(tokens, position, None)
    finally:
        state.clear()
        for r in routers:
            del r.routing
    active = resolved.axes["experts"].candidates[1]
    assert len(maps) == len(routers) > 0
    for probs, routing_map in maps:
        assert routing_map[:, active:].sum() == 0
        assert routing_map[:, :active].sum() == routing_map.shape[0] * 2  # top-2 of the active
        assert probs[:, active:].abs().sum() == 0
