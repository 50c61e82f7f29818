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


# ---------------------------------------------------------------- counting = built model
@pytest.mark.parametrize("name", list(MODELS))
def test_counting_equals_built_model(megatron, name):
    """``counting`` per component, ``planning.params`` (one rank) and the budget loss' cost at the
    full size all equal the built Megatron model's ``sum(p.numel())``; tied embeddings once."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.models.counting import component_of_parameter, count_parameters
    from elastic_plugin.planning.params import stage_params

    cfg = MODELS[name]
    model = _build(cfg)
    built: dict[str, int] = {}
    for key, param in model.named_parameters():
        component = component_of_parameter(key)
        built[component] = built.get(component, 0) + param.numel()
    total = sum(p.numel() for p in model.parameters())
    count = count_parameters(cfg)
    assert count.total == total
    assert {k: v for k, v in count.breakdown.items() if v} == built
    tied = not cfg.untie_embeddings_and_output_weights
    assert count.breakdown["output_layer"] == (0 if tied else cfg.vocab_size * cfg.hidden_size)
    (stage,) = stage_params(cfg, tp=1, pp=1, ep=1)
    assert stage.model == total
    assert sorted(stage.dense) == sorted(p.numel() for p in model.parameters())
    resolved = ElasticConfig.from_dict({"budgets": [1.0]}).resolve(cfg)
    assert ElasticCost(cfg, resolved, metric="total_params").full == total


def test_flops_of_the_options():
    """The options add no GEMM FLOPs (``models/flops.py``); a head_dim change does."""
    from elastic_plugin.models.flops import forward_flops

    plain = forward_flops(LLAMA, SEQ, 2).total
    for name in ("llama-tied", "llama-qkv_bias", "llama-rope_scaling"):
        assert forward_flops(MODELS[name], SEQ, 2).total == plain
    qk = forward_flops(MODELS["llama-qk_norm"], SEQ, 2).breakdown
    d, heads, groups = 16, LLAMA.num_attention_heads, LLAMA.query_groups
    assert qk["attention_qkv"] == 4 * 2 * (2 * SEQ) * LLAMA.hidden_size * (heads + 2 * groups) * d


# ------------------------------------------- importance -> reorder -> elastic == extracted
LLAMA_SIZES = {"embedding": [72, 48], "ffn": [88, 44], "attention_heads": [6, 4]}
LLAMA_SMALL = {"embedding": 48, "ffn": 44, "attention_heads": 4}
MOE_SIZES = {"embedding": [64, 48], "ffn": [72, 36], "attention_heads": [4, 2], "experts": [6, 4]}
MOE_SMALL = {"embedding": 48, "ffn": 36, "attention_heads": 2, "experts": 4}
PIPELINE = ["llama-tied", "llama-qk_norm", "llama-qkv_bias", "llama-rope_scaling", "llama-all"]
PIPELINE += ["qwen3_moe", "qwen3_moe-tied-bias"]


def _attention_tensors(model) -> dict[str, torch.Tensor]:
    """Every q/k norm weight and qkv bias, by name (cloned)."""
    return {
        key: value.detach().clone()
        for key, value in model.named_parameters()
        if "_layernorm." in key and "self_attention" in key or key.endswith("linear_qkv.bias")
    }


@pytest.mark.parametrize("name", PIPELINE)
def test_importance_reorder_elastic_and_extracted(megatron, name):
    """Importance collected on calibration batches, reordering keeps the function (q/k norms
    untouched, qkv bias moved with its query heads, tied weights permuted once), and at a reduced
    budget the elastic forward equals the extracted nested model's, whose parameters are counted
    exactly; a tied model's nested model is tied and its embedding gradient is the elastic one's
    active block."""
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.importance import collect_importance
    from elastic_plugin.importance.reorder import Permutations, apply_permutations
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.model import nested_model
    from tests.support.elastic_model import make_elastic
    from tests.support.equivalence import (
        NUM_MICROBATCHES,
        REF_MICRO_BATCH,
        SEQ_LEN,
        dp_shard,
        reference_batches,
    )

    cfg = MODELS[name]
    moe = cfg.count("moe") > 0
    sizes, small = (MOE_SIZES, MOE_SMALL) if moe else (LLAMA_SIZES, LLAMA_SMALL)
    model = _build(cfg)
    tokens, position = _tokens(cfg)
    with torch.no_grad():
        before = model(tokens, position, None)
    scores = collect_importance(
        [model],
        dp_shard(reference_batches(cfg)),
        REF_MICRO_BATCH * NUM_MICROBATCHES,
        SEQ_LEN,
        REF_MICRO_BATCH,
        progress=False,
    )
    perms = Permutations.from_scores(scores, cfg.query_groups, cfg.mamba_num_groups)
    assert not torch.equal(perms.embedding, torch.arange(cfg.hidden_size))
    moved_heads = [n for n, p in perms.attention_heads.items() if not torch.equal(p, p.sort()[0])]
    assert moved_heads  # some query heads really move within their group
    attention_before = _attention_tensors(model)
    word = model.embedding.word_embeddings.weight
    word_before = word.detach().clone()
    apply_permutations(model, perms)
    model.eval()
    with torch.no_grad():
        after = model(tokens, position, None)
    reorder_diff = (after - before).abs().max().item()
    scale = before.abs().max().item()
    print(f"{name}: reorder max |diff| = {reorder_diff:.2e} (logits up to {scale:.1f})")
    assert reorder_diff <= TOL * max(1.0, scale)
    assert torch.equal(word, word_before[:, perms.embedding])  # permuted once, tied or not
    for key, value in _attention_tensors(model).items():
        if "_layernorm." in key:
            assert torch.equal(value, attention_before[key]), key  # head_dim-sized: untouched
        else:
            number = int(key.split(".")[2]) + 1
            moves = number in moved_heads
            assert torch.equal(value, attention_before[key]) != moves, key  # with the heads
    if not cfg.untie_embeddings_and_output_weights:
        assert model.output_layer.weight is None
        assert model.shared_embedding_or_output_weight() is word

    state, resolved = make_elastic(model, cfg, sizes, budgets=(1.0, 0.75))
    state.set_sizes(small)
    elastic = model(tokens, position, None)
    state.clear()
    plain, small_cfg = nested_model(model, cfg, small)
    assert small_cfg.qk_layernorm == cfg.qk_layernorm and small_cfg.head_dim == cfg.head_dim
    assert small_cfg.untie_embeddings_and_output_weights == cfg.untie_embeddings_and_output_weights
    nested = plain(tokens, position, None)
    diff = (nested - elastic).abs().max().item()
    print(f"{name}: elastic vs extracted at {small}: max |diff| = {diff:.2e}")
    assert diff <= TOL
    assert (elastic - after).abs().max().item() > 1e-3  # the budget really changed the model
    assert sum(p.numel() for p in plain.parameters()) == count_parameters(small_cfg).total
    cost = ElasticCost(cfg, resolved, metric="total_params")  # the budget loss' count
    assert cost.of_choice(small) == count_parameters(small_cfg).total
    for key, value in plain.named_parameters():
        if "_layernorm." in key and "self_attention" in key:  # kept whole
            assert torch.equal(value, model.get_parameter(key)), key
    if not cfg.untie_embeddings_and_output_weights:
        assert plain.output_layer.weight is None
        assert plain.shared_embedding_or_output_weight() is plain.embedding.word_embeddings.weight
        # backward: the tied weight's gradient (input lookup + logits) is the active block's
        h = small["embedding"]
        state.set_sizes(small)
        model.zero_grad(set_to_none=True)
        elastic.pow(2).mean().backward()
        state.clear()
        nested.pow(2).mean().backward()
        got = model.embedding.word_embeddings.weight.grad
        want = plain.embedding.word_embeddings.weight.grad
        torch.testing.assert_close(got[:, :h], want, rtol=1e-4, atol=1e-6)
        assert torch.count_nonzero(got[:, h:]) == 0


# --------------------------------------------------------------------- Megatron-LM flags
def test_megatron_lm_flags_name_the_options():
    """The printed architecture flags are Megatron-LM's own (its parser gives each flag the dest
    we check), describe every option, and a launch missing one is refused naming it."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from elastic_plugin.elastic.megatron_lm_args import (
        arch_flags,
        check_arch_args,
        render_arch_flags,
    )

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dest_of = {s: a.dest for a in parser._actions for s in a.option_strings}
    cfg = dataclasses.replace(MODELS["llama-all"], rope_scaling_factor=32.0)
    flags = render_arch_flags(cfg)
    assert [(f.flag, f.dest) for f in arch_flags(cfg) if dest_of.get(f.flag) != f.dest] == []
    for flag in ("--qk-layernorm", "--add-qkv-bias", "--use-rope-scaling"):
        assert flag in flags
    assert flags[flags.index("--rope-scaling-factor") + 1] == "32.0"
    assert flags[flags.index("--kv-channels") + 1] == "16"
    assert "--untie-embeddings-and-output-weights" not in flags  # tied
    args, _ = parser.parse_known_args(flags)
    assert args.qk_layernorm and args.add_qkv_bias and args.use_rope_scaling
    assert args.rope_scaling_factor == 32.0 and not args.untie_embeddings_and_output_weights
    check_arch_args(args, cfg, "ckpt")
    for flag, dest in (("--qk-layernorm", "qk_layernorm"), ("--add-qkv-bias", "add_qkv_bias")):
        wrong = argparse.Namespace(**{**vars(args), dest: False})
        with pytest.raises(ConfigError, match=flag):
            check_arch_args(wrong, cfg, "ckpt")

    plain = render_arch_flags(LLAMA)
    assert "--untie-embeddings-and-output-weights" in plain
    for flag in ("--qk-layernorm", "--add-qkv-bias", "--use-rope-scaling", "--rope-scaling-factor"):
        assert flag not in plain
    args, _ = parser.parse_known_args(plain)
    check_arch_args(args, LLAMA, "ckpt")
    scaled = argparse.Namespace(**{**vars(args), "use_rope_scaling": True})
    with pytest.raises(ConfigError, match="--use-rope-scaling"):
        check_arch_args(scaled, LLAMA, "ckpt")


def test_megatron_lm_hybrid_provider_gets_the_rope_scaling(megatron):
    """Megatron-LM's hybrid builder ignores ``--use-rope-scaling``: the elastic wrapper gives the
    model the checkpoint's scaled frequencies (and changes no weight)."""
    from elastic_plugin.elastic.megatron_lm_args import align_rotary

    scaled_cfg = MODELS["llama-rope_scaling"]
    user_built = _build(LLAMA)  # what an unscaling provider builds
    weights = {k: v.clone() for k, v in user_built.state_dict().items() if torch.is_tensor(v)}
    tokens, position = _tokens(LLAMA)
    with torch.no_grad():
        before = user_built(tokens, position, None)
    assert not align_rotary(user_built, LLAMA)  # nothing to do without scaling
    assert align_rotary(user_built, scaled_cfg)
    reference = _build(scaled_cfg)
    assert torch.equal(user_built.rotary_pos_emb.inv_freq, reference.rotary_pos_emb.inv_freq)
    assert not align_rotary(user_built, scaled_cfg)  # already scaled
    state = user_built.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    with torch.no_grad():
        after = user_built(tokens, position, None)
        expected = reference(tokens, position, None)
    assert not torch.equal(after, before)
    assert (after - expected).abs().max().item() <= TOL  # same seed, same weights


# ------------------------------------------------------------------ TP=2 + SP == one rank
@pytest.mark.integration
def test_elastic_training_tp2_equals_one_rank(rank_pools, tmp_path):
    """Elastic training steps of the Llama shape with every option (tied embeddings, q/k norms,
    qkv bias, RoPE scaling) under TP=2 + SP reproduce one rank: the same routed budgets, losses
    and gradients, q/k norm weights (replicated, reduced over TP by Megatron) and the tied
    embedding (vocab-sharded, used by the elastic output layer) included."""
    import yaml

    cases = "tests.support.elastic_cases"
    model = dataclasses.replace(MODELS["llama-all"], num_attention_heads=8)  # 0.5 x 8 heads
    config = tmp_path / "llama_all.yaml"
    config.write_text(yaml.safe_dump({"model": dataclasses.asdict(model.validate())}))
    work = tmp_path / "work"
    work.mkdir()
    (reference,) = rank_pools.get(1).run(
        f"{cases}:make_elastic_reference", config_path=str(config), workdir=str(work)
    )
    assert reference["trace"] and len(reference["losses"]) == 3
    results = rank_pools.get(2).run(
        f"{cases}:check_elastic",
        config_path=str(config),
        workdir=str(work),
        tp=2,
        sequence_parallel=True,
    )
    ref_trace = {(it, mb): (b, c) for it, mb, b, c in reference["trace"]}
    budgets = set()
    for r in results:
        for it, mb, budget, choice in r["trace"]:
            assert ref_trace[(it, mb)] == (budget, choice)
            budgets.add(budget)
        for got, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert got.keys() == ref.keys()
            for budget, value in ref.items():
                assert got[budget] == pytest.approx(value, rel=1e-4)
        print(
            f"rank {r['rank']}: grad max |diff| {r['grad_max_abs_diff']:.1e} "
            f"({r['grad_worst_param']}), grads up to {r['grad_max_abs']:.1e}"
        )
        assert r["grad_max_abs"] > 1e-4
        assert r["grad_max_abs_diff"] <= 2e-6, r
    assert len(budgets) > 1  # reduced budgets were trained, not only the full model
