"""``SDPAAttention`` (models/attention.py) against Megatron's ``DotProductAttention``: the same
forward output and the same gradients w.r.t. q, k, v (FP32: max abs diff <= 1e-5) for causal
attention without a mask, explicit boolean masks (standard causal, padding + causal with fully
masked rows, padding only), GQA, fewer active query heads (as the elastic attention runs them),
query-key layer scaling; bf16 inputs within a bf16 tolerance; dropout under Megatron's RNG
tracker; unsupported options refused. Then a whole tiny HybridModel ('M*-M*-') built with each
core attention from the same seed: same logits, same gradients, same checkpoint keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml"
FP32_TOL = 1e-5
# bf16 keeps 8 significant bits (spacing 2^-7 relative): both implementations round q.k, the
# probabilities and the output at different points. Tolerance on bf16 results: max abs diff
# <= 2^-6 (two bf16 spacings) x the largest magnitude of the FP32 result (measured: <= 0.7%).
BF16_RTOL = 2.0**-6


@pytest.fixture(scope="module")
def megatron():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=7)


def _config(heads: int = 8, groups: int = 2, d: int = 16, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=4,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _pair(config, layer_number: int = 1, mask_type=None, **kwargs):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from elastic_plugin.models.attention import SDPAAttention

    args = dict(
        config=config,
        layer_number=layer_number,
        attn_mask_type=mask_type or AttnMaskType.causal,
        attention_type="self",
        **kwargs,
    )
    return SDPAAttention(**args), DotProductAttention(**args)


def _inputs(s: int, b: int, heads: int, groups: int, d: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=gen)
    k = torch.randn(s, b, groups, d, generator=gen)
    v = torch.randn(s, b, groups, d, generator=gen)
    grad = torch.randn(s, b, heads * d, generator=gen)
    return [t.to(dtype) for t in (q, k, v, grad)]


def _run(module, q, k, v, grad, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _max_diffs(module_a, module_b, inputs, mask) -> list[float]:
    got, want = _run(module_a, *inputs, mask), _run(module_b, *inputs, mask)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    return [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want)]


def _causal(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]


def _left_padding(s: int, b: int) -> torch.Tensor:
    """Megatron's convention (True = masked): row i left-padded by 3*i keys."""
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for i in range(b):
        pad[i, ..., : 3 * i] = True
    return pad


S, B = 24, 3
MASKS = {
    "causal, no mask": lambda: None,
    "standard causal mask": lambda: _causal(S).expand(B, 1, S, S),
    "padding + causal mask (fully masked rows)": lambda: _causal(S) | _left_padding(S, B),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("heads,groups", [(8, 2), (4, 4), (4, 1)])
def test_matches_dot_product_attention(megatron, mask_name, heads, groups):
    config = _config(heads, groups)
    sdpa, reference = _pair(config)
    diffs = _max_diffs(sdpa, reference, _inputs(S, B, heads, groups, 16), MASKS[mask_name]())
    assert max(diffs) <= FP32_TOL, (mask_name, diffs)


def test_padding_mask_without_causal(megatron):
    from megatron.core.transformer.enums import AttnMaskType

    sdpa, reference = _pair(_config(), mask_type=AttnMaskType.padding)
    inputs = _inputs(S, B, 8, 2, 16, seed=1)
    assert max(_max_diffs(sdpa, reference, inputs, _left_padding(S, B))) <= FP32_TOL
    # no mask on a padding module: full attention
    assert max(_max_diffs(sdpa, reference, inputs, None)) <= FP32_TOL


def test_softmax_scale_and_query_key_layer_scaling(megatron):
    config = _config(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)
    sdpa, reference = _pair(config, layer_number=3, softmax_scale=0.37)
    assert sdpa.softmax_scale == pytest.approx(reference.softmax_scale)  # read by inference
    assert max(_max_diffs(sdpa, reference, _inputs(S, B, 8, 2, 16, seed=2), None)) <= FP32_TOL


@pytest.mark.parametrize("per_group", [1, 3])
def test_fewer_active_query_heads(megatron, per_group):
    """What ``elastic.layers.modules._heads_active`` does: the attributes say fewer heads for
    one forward and the query carries only the active heads (K/V keep every group)."""
    groups, d = 2, 16
    sdpa, reference = _pair(_config(heads=8, groups=groups, d=d))
    active = per_group * groups
    for module in (sdpa, reference):
        module.num_attention_heads_per_partition = active
        module.hidden_size_per_partition = active * d
    inputs = _inputs(S, B, active, groups, d, seed=3)
    for mask in (None, _causal(S) | _left_padding(S, B)):
        assert max(_max_diffs(sdpa, reference, inputs, mask)) <= FP32_TOL
    out = sdpa(*inputs[:3], None)
    assert out.shape == (S, B, active * d)


def test_bf16_inputs(megatron):
    """SDPA runs in the input dtype (bf16 out, bf16 gradients); output and gradients agree with
    Megatron's bf16 path and with the FP32 result within BF16_RTOL of their magnitude."""
    sdpa, reference = _pair(_config(bf16=True, params_dtype=torch.bfloat16))
    sdpa32, _ = _pair(_config())
    inputs = _inputs(S, B, 8, 2, 16, seed=4)
    bf16 = [t.bfloat16() for t in inputs]
    for mask in (None, _causal(S) | _left_padding(S, B)):
        got, want = _run(sdpa, *bf16, mask), _run(reference, *bf16, mask)
        exact = _run(sdpa32, *inputs, mask)
        for g, w, e in zip(got, want, exact):
            assert g.dtype == torch.bfloat16
            tol = BF16_RTOL * e.abs().max().item()
            assert (g.float() - w.float()).abs().max().item() <= tol
            assert (g.float() - e).abs().max().item() <= tol


def test_dropout_uses_megatrons_rng_tracker_in_training_only(megatron):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    sdpa, _ = _pair(_config(attention_dropout=0.3))
    sdpa_plain, reference = _pair(_config())
    q, k, v, _ = _inputs(S, B, 8, 2, 16, seed=5)
    sdpa.eval()
    assert torch.equal(sdpa(q, k, v, None), sdpa_plain(q, k, v, None))  # eval: no dropout
    sdpa.train()
    outs = []
    for _ in range(2):
        model_parallel_cuda_manual_seed(11)
        default_state = torch.get_rng_state()
        outs.append(sdpa(q, k, v, None))
        # the tracker's fork ran the dropout: the default generator is untouched
        assert torch.equal(torch.get_rng_state(), default_state)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - sdpa_plain(q, k, v, None)).abs().max() > 1e-3


def test_refuses_unsupported_options(megatron):
    from megatron.core.packed_seq_params import PackedSeqParams

    from elastic_plugin.models.attention import SDPAAttention

    sdpa, _ = _pair(_config())
    q, k, v, _ = _inputs(8, 1, 8, 2, 16)
    with pytest.raises(ValueError, match="packed_seq_params"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="attention_bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1, 8, 8, 8))
    with pytest.raises(ValueError, match="boolean"):
        sdpa(q, k, v, torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="multiple of the key/value groups"):
        sdpa(q[:, :, :3], k, v, None)
    with pytest.raises(ValueError, match="softmax_type"):
        SDPAAttention(_config(softmax_type="off-by-one"), 1, sdpa.attn_mask_type, "self")
    assert list(sdpa.parameters()) == [] and sdpa.state_dict() == {}


def test_spec_choice(megatron):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from elastic_plugin.models.attention import SDPAAttention
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.models.specs import hybrid_stack_spec, local_hybrid_stack_spec

    def core(spec):
        attention = spec.submodules.attention_layer.submodules.self_attention
        return attention.submodules.core_attention

    assert core(local_hybrid_stack_spec()) is SDPAAttention
    assert core(hybrid_stack_spec(False)) is SDPAAttention
    assert core(local_hybrid_stack_spec("unfused")) is DotProductAttention
    assert core(hybrid_stack_spec(False, core_attention="unfused")) is DotProductAttention
    with pytest.raises(ConfigError, match="core_attention must be one of"):
        local_hybrid_stack_spec("flash")
    with pytest.raises(ConfigError, match="Transformer Engine"):
        hybrid_stack_spec(True, core_attention="sdpa")


def _build(model_cfg, core_attention: str, monkeypatch):
    from elastic_plugin.models import builder, specs
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout

    monkeypatch.setattr(
        builder,
        "hybrid_stack_spec",
        lambda use_te=None: specs.hybrid_stack_spec(use_te, core_attention=core_attention),
    )
    initialize_layout(Layout(), seed=21)
    return build_model_chunks(model_cfg, Layout(), wrap_ddp=False, use_te=False)[0][0]


def test_whole_model_same_logits_and_gradients(megatron, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from elastic_plugin.models.attention import SDPAAttention
    from elastic_plugin.models.config import load_config

    model_cfg = dataclasses.replace(load_config(CONFIG).model, hybrid_layer_pattern="M*-M*-")
    models = {name: _build(model_cfg, name, monkeypatch) for name in ("sdpa", "unfused")}
    cores = {
        name: {
            type(m) for m in model.modules() if isinstance(m, SDPAAttention | DotProductAttention)
        }
        for name, model in models.items()
    }
    assert cores == {"sdpa": {SDPAAttention}, "unfused": {DotProductAttention}}
    sdpa, unfused = models["sdpa"], models["unfused"]
    assert list(sdpa.state_dict()) == list(unfused.state_dict())  # checkpoint keys unchanged
    for (name, p), q in zip(sdpa.state_dict().items(), unfused.state_dict().values()):
        assert torch.equal(p, q) if torch.is_tensor(p) else p == q, name  # same seed, same weights

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 40), generator=gen)
    position = torch.arange(40).expand(2, 40)
    outputs = {}
    for name, model in models.items():
        logits = model(tokens, position, None)
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        outputs[name] = (logits.detach(), grads)
    (logits_a, grads_a), (logits_b, grads_b) = outputs["sdpa"], outputs["unfused"]
    assert (logits_a - logits_b).abs().max().item() <= FP32_TOL
    assert set(grads_a) == set(grads_b) and grads_a
    for name, grad in grads_a.items():
        assert (grad - grads_b[name]).abs().max().item() <= FP32_TOL, name


def test_selective_recompute_refuses_unfused_elastic_heads(megatron, monkeypatch):
    """Selective recomputation re-runs core attention after the elastic layer put the head
    count back; Megatron's DotProductAttention reads it from attributes, SDPA from shapes."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.layers import ElasticState, elastify
    from elastic_plugin.models import builder, specs
    from elastic_plugin.models.config import ConfigError, load_config
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout

    model_cfg = dataclasses.replace(load_config(CONFIG).model, hybrid_layer_pattern="M*-M*-")
    resolved = ElasticConfig.from_dict({"budgets": [1.0, 0.5]}).resolve(model_cfg)
    for core, refused in (("unfused", True), ("sdpa", False)):
        monkeypatch.setattr(
            builder,
            "hybrid_stack_spec",
            lambda use_te=None, core=core: specs.hybrid_stack_spec(use_te, core_attention=core),
        )
        initialize_layout(Layout(), seed=21)
        model = build_model_chunks(
            model_cfg, Layout(), wrap_ddp=False, use_te=False, recompute_granularity="selective"
        )[0][0]
        if refused:
            with pytest.raises(ConfigError, match="selective re-runs core attention"):
                elastify(model, ElasticState(resolved))
        else:
            elastify(model, ElasticState(resolved))
