"""GPT-family options on real Megatron-Core modules, in this process (no rank pool): tied
embeddings (Llama 3.2, SmolLM2), per-head QK layernorm with ``kv_channels != hidden / heads``
(Qwen3), a qkv-only bias (Qwen2) and Llama 3.1's RoPE scaling, on a Llama-shaped ``*-*-*-*-``
(SwiGLU, RoPE, GQA, odd sizes) and a Qwen3-MoE-shaped ``*E*-*E`` (softmax router, top-k, dense
and MoE layers mixed).

Each option: builds; its parameters are exactly what ``counting`` / ``planning.params`` /
``ElasticCost`` say; importance + reordering keeps the function; the elastic forward at a reduced
budget equals the extracted nested model's forward; and the Megatron-LM flags name it. References
nobody here wrote: transformers' llama3 RoPE init, Megatron's own ``SelfAttention`` (QK norm and
qkv bias applied where Megatron applies them), Megatron-LM's argument parser.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from elastic_plugin.models.config import ConfigError, ModelConfig

TOL = 1e-5
LLAMA = ModelConfig(
    hybrid_layer_pattern="*-*-*-*-",
    hidden_size=72,
    vocab_size=96,
    num_attention_heads=6,
    num_query_groups=2,
    ffn_hidden_size=88,
    activation="swiglu",
    position_embedding_type="rope",
    rotary_base=500000,
    max_sequence_length=64,
).validate()
QWEN3_MOE = ModelConfig(
    hybrid_layer_pattern="*E*-*E",
    hidden_size=64,
    vocab_size=80,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=24,  # != 64 / 4
    ffn_hidden_size=72,
    num_moe_experts=6,
    moe_router_topk=2,
    moe_ffn_hidden_size=40,
    moe_router_score_function="softmax",
    activation="swiglu",
    position_embedding_type="rope",
    rotary_base=1000000,
    qk_layernorm=True,
    max_sequence_length=64,
).validate()
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "tied": {"untie_embeddings_and_output_weights": False},
    "qk_norm": {"qk_layernorm": True, "kv_channels": 16},  # head_dim 16 != 72 / 6
    "qkv_bias": {"add_qkv_bias": True},
    "rope_scaling": {"rope_scaling": True, "rope_scaling_factor": 32.0},
    "all": {
        "untie_embeddings_and_output_weights": False,
        "qk_layernorm": True,
        "kv_channels": 16,
        "add_qkv_bias": True,
        "rope_scaling": True,
    },
}
MODELS = {
    **{f"llama-{name}": dataclasses.replace(LLAMA, **o).validate() for name, o in OPTIONS.items()},
    "qwen3_moe": QWEN3_MOE,
    "qwen3_moe-tied-bias": dataclasses.replace(
        QWEN3_MOE, untie_embeddings_and_output_weights=False, add_qkv_bias=True
    ).validate(),
}
SEQ = 24


# ------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def megatron():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=7)


def _build(cfg: ModelConfig, seed: int = 1) -> torch.nn.Module:
    """The model with every parameter perturbed (norms != 1, biases != 0): a tensor that is
    sliced or permuted wrongly changes the output."""
    from elastic_plugin.parallel import Layout, build_model_chunks

    torch.manual_seed(seed)
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.eval()
    return model


def _tokens(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).expand(2, SEQ)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_scaling": True, "position_embedding_type": "none"}, "rope_scaling"),
        ({"rope_scaling": True, "rope_scaling_factor": 0.0}, "rope_scaling_factor"),
        ({"rope_scaling_factor": -8.0}, "rope_scaling_factor"),
        ({"rope_scaling_factor": float("nan")}, "rope_scaling_factor"),
        ({"rope_scaling_factor": "8"}, "rope_scaling_factor"),
        ({"qk_layernorm": "yes"}, "qk_layernorm"),
        ({"add_qkv_bias": 1}, "add_qkv_bias"),
        ({"qk_layernorm": True, "hybrid_layer_pattern": "----"}, "qk_layernorm"),
        ({"add_qkv_bias": True, "hybrid_layer_pattern": "----"}, "add_qkv_bias"),
    ],
)
def test_bad_gpt_options_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=f"model.{field}"):
        dataclasses.replace(LLAMA, **changes).validate()


def test_gpt_options_from_yaml_dict():
    from elastic_plugin.models.config import config_from_dict

    raw = {"model": {**dataclasses.asdict(LLAMA), **OPTIONS["all"]}}
    cfg = config_from_dict(raw).model
    assert cfg.qk_layernorm and cfg.add_qkv_bias and cfg.rope_scaling
    assert not cfg.untie_embeddings_and_output_weights and cfg.head_dim == 16


# ------------------------------------------------------------------------------- builder
@pytest.mark.parametrize("name", ["llama-plain", "llama-tied", "llama-qk_norm", "llama-qkv_bias"])
def test_built_options(megatron, name):
    from elastic_plugin.models.norms import HeadRMSNorm

    cfg = MODELS[name]
    model = _build(cfg)
    attn = model.decoder.layers[0].self_attention
    d, rows = cfg.head_dim, (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
    assert tuple(attn.linear_qkv.weight.shape) == (rows, cfg.hidden_size)
    assert (attn.linear_qkv.bias is not None) == cfg.add_qkv_bias
    assert attn.linear_proj.bias is None  # qkv-only bias (Qwen2)
    if cfg.add_qkv_bias:
        assert tuple(attn.linear_qkv.bias.shape) == (rows,)
    for norm in (attn.q_layernorm, attn.k_layernorm):
        assert (norm is not None) == cfg.qk_layernorm
        if norm is not None:
            assert isinstance(norm, HeadRMSNorm) and tuple(norm.weight.shape) == (d,)
    keys = set(model.state_dict())
    word = model.embedding.word_embeddings.weight
    if cfg.untie_embeddings_and_output_weights:
        assert "output_layer.weight" in keys
        assert model.output_layer.weight.data_ptr() != word.data_ptr()
    else:
        assert "output_layer.weight" not in keys and model.output_layer.weight is None
        assert model.shared_embedding_or_output_weight() is word
        # the logits are the final hidden states times the word embeddings
        tokens, position = _tokens(cfg)
        captured = {}
        handle = model.decoder.final_norm.register_forward_hook(
            lambda _m, _i, out: captured.setdefault("h", out)
        )
        with torch.no_grad():
            logits = model(tokens, position, None)
        handle.remove()
        expected = (captured["h"] @ word.T).transpose(0, 1)
        assert (logits - expected).abs().max().item() <= TOL


def test_rope_scaling_equals_transformers_llama3():
    """Megatron's scaled inverse frequencies in the built model equal transformers' llama3 RoPE
    init (``modeling_rope_utils``), over low, medium and high frequencies (head_dim 128, theta
    500000, factor 32: Llama 3.2's)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=7)
    cfg = dataclasses.replace(
        LLAMA, hybrid_layer_pattern="*-", kv_channels=128, rope_scaling=True
    ).validate()
    cfg = dataclasses.replace(cfg, rope_scaling_factor=32.0).validate()
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0]
    plain = build_model_chunks(
        dataclasses.replace(cfg, rope_scaling=False), Layout(), wrap_ddp=False
    )[0][0]
    hf = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": float(cfg.rotary_base),
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    ours = model.rotary_pos_emb.inv_freq
    unscaled = plain.rotary_pos_emb.inv_freq
    assert ours.shape == reference.shape == (64,)
    torch.testing.assert_close(ours, reference.to(ours.dtype), rtol=1e-6, atol=0)
    ratio = unscaled / ours
    assert (ratio - 1).abs().min() < 1e-6  # high frequencies unchanged
    assert (ratio - 32).abs().min() < 1e-4  # low frequencies divided by the factor
    assert ((ratio > 1.001) & (ratio < 31.99)).any()  # the smoothed band in between
    # the forward uses them: positions x frequencies
    freqs = model.rotary_pos_emb(SEQ).reshape(SEQ, -1)
    expected = torch.outer(torch.arange(SEQ, dtype=torch.float32), ours)
    torch.testing.assert_close(freqs[:, :64], expected)
    assert not torch.equal(freqs, plain.rotary_pos_emb(SEQ).reshape(SEQ, -1))


def test_attention_options_equal_megatron_gpt_layer(megatron):
    """Our hybrid ``*-`` pair with QK layernorm (head_dim != hidden / heads) and the qkv-only bias
    computes what Megatron-Core's own GPT layer (``get_gpt_layer_local_spec(qk_layernorm=True)``:
    torch's RMSNorm on q and k, unfused ``DotProductAttention``) computes with the same weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    cfg = MODELS["llama-all"]
    model = _build(cfg)
    attention_layer, mlp_layer = model.decoder.layers[0], model.decoder.layers[1]
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    reference = build_module(spec, config=model.config, layer_number=1)
    ours = {
        **{f"{k}": v for k, v in attention_layer.state_dict().items() if "mlp" not in k},
        **{k: v for k, v in mlp_layer.state_dict().items() if k.startswith(("mlp", "pre_mlp"))},
    }
    missing, unexpected = reference.load_state_dict(ours, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    assert not unexpected, unexpected
    assert reference.self_attention.linear_qkv.bias is not None
    assert tuple(reference.self_attention.q_layernorm.weight.shape) == (cfg.head_dim,)
    reference.eval()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(SEQ, 2, cfg.hidden_size, generator=gen)
    rope = model.rotary_pos_emb(SEQ)
    with torch.no_grad():
        expected, _ = reference(hidden, attention_mask=None, rotary_pos_emb=rope)
        mid, _ = attention_layer(hidden, attention_mask=None, rotary_pos_emb=rope)
        got, _ = mlp_layer(mid)
    diff = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    print(f"hybrid *- vs Megatron's GPT layer: max |diff| = {diff:.2e} (outputs up to {scale:.1f})")
    assert diff <= TOL * max(1.0, scale)  # SDPA vs Megatron's unfused softmax: rounding only
    # sharp: without the k norm's weight the outputs differ
    with torch.no_grad():
        attention_layer.self_attention.k_layernorm.weight.add_(0.5)
        moved, _ = mlp_layer(attention_layer(hidden, attention_mask=None, rotary_pos_emb=rope)[0])
        attention_layer.self_attention.k_layernorm.weight.sub_(0.5)
    assert (moved - expected).abs().max().item() > 1e-3
