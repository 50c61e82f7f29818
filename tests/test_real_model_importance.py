"""Weight-magnitude importance of a gated (SwiGLU) MLP, the FFN of every Llama/Qwen model: fc1
holds the gate rows then the up rows, and neuron i's magnitude is the sum over both (it was the
fc1 row count, 2 x ffn, so ``reorder --method ffn=magnitude`` indexed past the FFN on the real
SmolLM2 model). Unit tier: a tiny Llama-shaped Megatron model, against the formula and reorder."""

from __future__ import annotations

import torch

from elastic_plugin.models.config import ModelConfig

LLAMA = ModelConfig(
    hybrid_layer_pattern="*-*-",
    hidden_size=48,
    vocab_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=40,
    activation="swiglu",
    position_embedding_type="rope",
    max_sequence_length=32,
    untie_embeddings_and_output_weights=False,
).validate()


def test_gated_ffn_magnitude_sums_gate_and_up_rows_of_each_neuron():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.importance.magnitude import weight_magnitudes
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=3)
    model = build_model_chunks(LLAMA, Layout(), wrap_ddp=False)[0][0]
    stats = weight_magnitudes(model)["ffn_weight"]
    layers = [
        layer
        for layer in model.decoder.layers
        if hasattr(getattr(layer, "mlp", None), "linear_fc1")
    ]
    assert len(layers) == len(stats) == 2
    for layer in layers:
        w = layer.mlp.linear_fc1.weight.detach().double()
        assert w.shape[0] == 2 * LLAMA.ffn_hidden_size  # gate then up
        gate, up = w[: LLAMA.ffn_hidden_size], w[LLAMA.ffn_hidden_size :]
        got = stats[int(layer.layer_number)]
        assert got.shape == (LLAMA.ffn_hidden_size,)
        assert torch.allclose(got, gate.pow(2).sum(1) + up.pow(2).sum(1))
