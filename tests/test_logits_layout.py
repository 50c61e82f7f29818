"""``models.logits.batch_major_logits``: the same logits and gradients as Megatron's own layout,
without its ``[tokens, vocab]`` transpose copies (the output is the output layer's own memory)."""

from __future__ import annotations

import pytest
import torch

from elastic_plugin.models.logits import batch_major_logits, output_layer_of


@pytest.fixture(scope="module")
def tiny_model():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import ModelConfig
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=3)

    cfg = ModelConfig(
        hybrid_layer_pattern="*-", hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, vocab_size=96, mamba_num_heads=0, num_moe_experts=0,
        activation="swiglu", normalization="RMSNorm", position_embedding_type="rope",
    )  # fmt: skip
    (model,), _ = build_model_chunks(cfg, Layout(), wrap_ddp=False)
    return model


def _forward_backward(model, tokens, upstream):
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, None)
    (logits * upstream).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_batch_major_logits_equal_megatrons_and_skip_the_copy(tiny_model):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (3, 10), generator=gen)
    upstream = torch.randn(3, 10, 96, generator=gen)
    ref_logits, ref_grads = _forward_backward(tiny_model, tokens, upstream)

    produced = []
    layer = output_layer_of(tiny_model)
    handle = layer.register_forward_hook(lambda m, a, out: produced.append(out[0]))
    try:
        with batch_major_logits(tiny_model):
            logits, grads = _forward_backward(tiny_model, tokens, upstream)
    finally:
        handle.remove()
    assert logits.shape == (3, 10, 96) and logits.is_contiguous()
    assert logits.data_ptr() == produced[0].data_ptr()  # no copy after the output layer
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
    for name, grad in ref_grads.items():  # the weight gradient sums the tokens in another order
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6 * scale, msg=name)
    # outside the block the model computes as Megatron does again (hooks removed)
    again, _ = _forward_backward(tiny_model, tokens, upstream)
    assert torch.equal(again, ref_logits)
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_without_logits_returns_the_final_hidden_states_and_skips_the_output_layer(tiny_model):
    from elastic_plugin.models.logits import without_logits

    tokens = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7).expand_as(tokens)
    layer = output_layer_of(tiny_model)
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            logits = tiny_model(tokens, positions, None)  # the output layer runs: seen[0]
            with without_logits(tiny_model):
                hidden = tiny_model(tokens, positions, None)
            again = tiny_model(tokens, positions, None)
    finally:
        handle.remove()
    assert len(seen) == 2  # not called inside the block
    assert hidden.shape == (2, 7, 32)
    assert torch.equal(hidden, seen[0].transpose(0, 1))  # the output layer's input, [b, s, h]
    assert output_layer_of(tiny_model) is layer and torch.equal(again, logits)
