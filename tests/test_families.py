"""GPT-family models (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral) through the Hugging Face side.

The reference is transformers' own classes: a randomly initialised model of a scaled-down config
of each family (GQA, odd sizes, the family's options), saved sharded by ``save_pretrained``, is
imported in-process (``elastic-plugin import --hf``); our Megatron model gives transformers'
logits and greedy tokens; exported again with no training it is the input bit for bit and loads
in ``AutoModelForCausalLM`` with no missing or unexpected keys; a homogeneous budget cut on the
Megatron side and exported loads in stock transformers with our nested model's logits, and the
HF-side slicing of the full export gives that budget's tensors. Released configs (fixtures, no
weights) count as transformers counts them; bad input is refused before any weight is read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOL = 1e-4
SEQ = 12
VOCAB = 96
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=40,
    num_hidden_layers=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2)

# name -> (architecture, config kwargs, a homogeneous budget's choice)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, int]]] = {
    "llama": (
        "LlamaForCausalLM",
        {**_BASE, "rope_theta": 5000.0},
        {"embedding": 32, "attention_heads": 4, "ffn": 24},
    ),
    "llama_tied": (  # tied, with Llama 3.1's RoPE scaling (a scaled-down factor)
        "LlamaForCausalLM",
        {
            **_BASE,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        {"embedding": 32, "attention_heads": 4, "ffn": 24},
    ),
    "llama31": (
        "LlamaForCausalLM",
        {
            **_BASE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        {"embedding": 32, "attention_heads": 4, "ffn": 24},
    ),
    "qwen2": ("Qwen2ForCausalLM", dict(_BASE), {"embedding": 32, "attention_heads": 4, "ffn": 24}),
    "qwen3_tied": (
        "Qwen3ForCausalLM",
        {**_BASE, "head_dim": 12, "tie_word_embeddings": True},
        {"embedding": 32, "attention_heads": 4, "ffn": 24},
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        {
            **_BASE,
            **_MOE,
            "num_hidden_layers": 3,
            "head_dim": 12,
            "num_experts": 4,
            "moe_intermediate_size": 24,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
        {"embedding": 32, "attention_heads": 4, "experts": 2, "ffn": 24},
    ),
    "mixtral": (
        "MixtralForCausalLM",
        {**_BASE, **_MOE, "num_local_experts": 4, "intermediate_size": 24},
        {"embedding": 32, "attention_heads": 4, "experts": 2},
    ),
}


def _hf_model(architecture: str, kwargs: dict[str, Any], seed: int = 0):
    """transformers' ``architecture`` of ``kwargs``, every weight perturbed (norms too, so a
    wrong mapping shows)."""
    import transformers

    cls = getattr(transformers, architecture)
    torch.manual_seed(seed)
    model = cls(cls.config_class(**kwargs)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _ours_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def _greedy(step, tokens: torch.Tensor, n: int = 4) -> torch.Tensor:
    """``n`` greedy tokens, recomputing the whole prefix each step (no cache on either side)."""
    out = tokens
    for _ in range(n):
        out = torch.cat([out, step(out)[:, -1:].argmax(-1)], dim=1)
    return out[:, tokens.shape[1] :]


def _export(model, cfg, out: Path) -> dict[str, Any]:
    from elastic_plugin.export.hf import hf_config, megatron_to_hf, write_hf_checkpoint

    hf = megatron_to_hf(model.state_dict(), cfg)
    config = hf_config(hf, cfg, "fp32", {"pad": 0, "bos": 1, "eos": 2})
    out.mkdir()
    write_hf_checkpoint(out, hf, config, "fp32", max_shard_bytes=40_000)
    return config


def _load_stock(path: Path):
    """The export as stock transformers loads it: ``AutoModelForCausalLM.from_pretrained``
    finds every weight (no missing or unexpected key) and holds exactly the weights of the
    model ``load_hf_model`` builds (the stock class of config.json, constructed eagerly), which
    is the one returned. Why not from_pretrained's own model: in a process where
    ``enable_cpu_megatron()`` wrapped torch's factory functions, transformers' meta-device
    construction leaves the non-persistent RoPE ``inv_freq`` buffer uninitialised
    (``elastic_plugin/compat/cpu.py``'s device patches); in a fresh process both agree exactly."""
    from transformers import AutoModelForCausalLM

    from elastic_plugin.export.hf import load_hf_model

    stock, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = load_hf_model(path)
    assert type(model) is type(stock)
    ours, theirs = model.state_dict(), stock.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    if model.config.tie_word_embeddings:
        assert stock.lm_head.weight.data_ptr() == stock.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="module")
def imported_families(tmp_path_factory):
    """``get(name)``: one family imported once per module (the per-family tests and the
    multi-rank test share the imports)."""
    cache: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in cache:
            cache[name] = _import_family(name, tmp_path_factory)
        return cache[name]

    return get


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, imported_families):
    return imported_families(request.param)


def _import_family(name: str, tmp_path_factory) -> dict[str, Any]:
    """One family: the transformers model saved sharded, imported in-process; our model."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.cli import main
    from elastic_plugin.parallel import Layout

    architecture, kwargs, choice = FAMILIES[name]
    work = tmp_path_factory.mktemp(name)
    reference = _hf_model(architecture, kwargs)
    reference.save_pretrained(work / "hf", max_shard_size="40KB")
    assert (work / "hf" / "model.safetensors.index.json").is_file()  # sharded
    out = work / "teacher"
    assert main(["import", "--hf", str(work / "hf"), "--out", str(out), "--no-progress"]) == 0
    chunks, cfg, meta = build_from_checkpoint(out, Layout())
    return {
        "name": name,
        "work": work,
        "reference": reference,
        "ours": chunks[0].eval(),
        "model": cfg.model,
        "meta": meta,
        "choice": choice,
    }


@pytest.mark.integration  # the import saves through Megatron's spawned checkpoint writer
def test_import_gives_transformers_logits_and_greedy_tokens(family_case):
    tokens = _tokens()
    reference, ours = family_case["reference"], family_case["ours"]
    with torch.no_grad():
        expected = reference(tokens).logits
    got = _ours_logits(ours, tokens)
    diff = (got - expected).abs().max().item()
    print(f"{family_case['name']}: max |ours - transformers| = {diff:.2e}")
    assert diff <= TOL
    assert torch.equal(
        _greedy(lambda t: _ours_logits(ours, t), tokens),
        _greedy(lambda t: reference(t).logits, tokens),
    )
    meta = family_case["meta"]
    assert meta["imported_from"]["architecture"] == FAMILIES[family_case["name"]][0]
    model = family_case["model"]
    assert model.activation == "swiglu" and model.position_embedding_type == "rope"
    assert model.untie_embeddings_and_output_weights == (not family_case["name"].endswith("tied"))
    options = {
        "llama31": ("rope_scaling", True),
        "qwen2": ("add_qkv_bias", True),
        "qwen3_tied": ("kv_channels", 12),
        "qwen3_moe": ("hybrid_layer_pattern", "*E*-*E"),
    }
    if family_case["name"] in options:
        field, value = options[family_case["name"]]
        assert getattr(model, field) == value
    if family_case["name"].startswith("qwen3"):
        assert model.qk_layernorm


def test_every_family_under_tp2_sp_and_ep2_gives_transformers_logits(
    imported_families, rank_pools, tmp_path
):
    """Each import (written at TP=1) loaded under TP=2 + sequence parallel, MoE families also
    under EP=2 (4 ranks; dense families run 2 data-parallel replicas): transformers' logits
    (fp32, <= 1e-4) and greedy tokens on every rank, in one rank-pool case."""
    cases = []
    for name in sorted(FAMILIES):
        case = imported_families(name)
        tokens, reference = _tokens(), case["reference"]
        with torch.no_grad():
            logits = reference(tokens).logits
        greedy = _greedy(lambda t: reference(t).logits, tokens)
        path = tmp_path / f"{name}.pt"
        torch.save({"tokens": tokens, "logits": logits, "greedy": greedy}, path)
        moe = case["model"].num_moe_experts > 0
        cases.append(
            {
                "name": name,
                "ckpt": str(case["work"] / "teacher"),
                "reference": str(path),
                "ep": 2 if moe else 1,
            }
        )
    ranks = rank_pools.get(4).run("tests.support.family_cases:families_tp_sp_case", cases=cases)
    for rank, results in enumerate(ranks):
        for result, case in zip(results, cases, strict=True):
            name = result["name"]
            print(f"rank {rank} {name}: max |ours - transformers| = {result['max_abs_diff']:.2e}")
            assert result["max_abs_diff"] <= TOL, (rank, name)
            assert result["greedy_equal"], (rank, name)
            assert result["tp"] == 2 and result["sequence_parallel"], (rank, name)
            experts = imported_families(name)["model"].num_moe_experts
            assert result["local_experts"] == experts // case["ep"], (rank, name)


@pytest.mark.integration  # the import saves through Megatron's spawned checkpoint writer
def test_import_then_export_is_the_input_and_loads_in_transformers(family_case, tmp_path):
    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.families import model_config_from_hf

    work, model = family_case["work"], family_case["model"]
    config = _export(family_case["ours"], model, tmp_path / "export")
    assert model_config_from_hf(config) == model
    ours, theirs = read_hub_tensors(tmp_path / "export"), read_hub_tensors(work / "hf")
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
    stock = _load_stock(tmp_path / "export")
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(stock(tokens).logits, family_case["reference"](tokens).logits)
    if not model.untie_embeddings_and_output_weights:  # tied stays tied
        assert "lm_head.weight" not in ours and config["tie_word_embeddings"]


@pytest.mark.integration  # the import saves through Megatron's spawned checkpoint writer
def test_a_budget_exports_as_a_stock_model_with_our_nested_logits(family_case, tmp_path):
    """A homogeneous choice cut on the Megatron side (``nested.slicing``), built as the plain
    smaller model and exported: transformers gives its logits; the HF-side cut of the full
    model (in memory and from the files) is the same tensors."""
    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.export.hf import megatron_to_hf
    from elastic_plugin.export.hf_slicing import slice_hf_state, slice_hub_files
    from elastic_plugin.families import family_for_model
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.nested.slicing import nested_state_dict
    from elastic_plugin.parallel import Layout, build_model_chunks

    full, model, choice = family_case["ours"], family_case["model"], family_case["choice"]
    small = model_for_choice(model, choice)
    state = nested_state_dict(full, model, choice)
    (plain,), _ = build_model_chunks(small, Layout(), wrap_ddp=False)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    plain.eval()
    _export(plain, small, tmp_path / "budget")
    tokens = _tokens()
    stock = _load_stock(tmp_path / "budget")
    with torch.no_grad():
        diff = (stock(tokens).logits - _ours_logits(plain, tokens)).abs().max().item()
    print(f"{family_case['name']} budget {choice}: max |transformers - ours| = {diff:.2e}")
    assert diff <= TOL
    assert stock.config.hidden_size == choice["embedding"]

    family = family_for_model(model)
    exported = family.from_hub(read_hub_tensors(tmp_path / "budget"))
    full_hf = megatron_to_hf(full.state_dict(), model)
    for cut in (
        slice_hf_state(full_hf, model, choice),
        slice_hub_files(family_case["work"] / "hf", model, choice),
    ):
        assert sorted(cut) == sorted(exported)
        for key, tensor in exported.items():
            assert torch.equal(cut[key], tensor), key


# ------------------------------------------------------------------------------ released configs
RELEASED = {
    "llama_3_1_8b_config.json": (8_030_261_248, 8_030_261_248),
    "qwen3_8b_config.json": (8_190_735_360, 8_190_735_360),
    "qwen3_30b_a3b_config.json": (30_532_122_624, 3_353_032_704),
    "mixtral_8x7b_config.json": (46_702_792_704, 12_879_925_248),
}


@pytest.mark.parametrize("fixture", sorted(RELEASED))
def test_params_hf_counts_released_configs_as_transformers(fixture, capsys):
    from elastic_plugin.cli import main

    assert main(["params", "--hf", str(FIXTURES / fixture), "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert (counts["total"], counts["active"]) == RELEASED[fixture]


@pytest.mark.parametrize("fixture", sorted(RELEASED))
def test_released_counts_are_transformers_own(fixture):
    """RELEASED is what transformers counts: its model built on the meta device (no memory),
    total = its parameters (a tied head once), active = total less the routed experts that
    top-k leaves idle ((E - k) / E of each layer's expert stack)."""
    import transformers

    raw = json.loads((FIXTURES / fixture).read_text())
    cls = getattr(transformers, raw["architectures"][0])
    config = cls.config_class.from_dict(raw)
    with torch.device("meta"):
        model = cls(config)
    total = sum(p.numel() for p in model.parameters())
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    idle = 0
    for name, module in model.named_modules():
        if experts and name.endswith(".experts"):
            stack = sum(p.numel() for p in module.parameters())
            idle += stack - stack // experts * config.num_experts_per_tok
    assert (total, total - idle) == RELEASED[fixture]


def test_released_configs_map_their_options():
    from elastic_plugin.families import model_config_from_hf

    def read(name: str):
        return model_config_from_hf(json.loads((FIXTURES / name).read_text()))

    llama = read("llama_3_1_8b_config.json")
    assert (llama.rope_scaling, llama.rope_scaling_factor, llama.rotary_base) == (True, 8.0, 500000)
    assert llama.hybrid_layer_pattern == "*-" * 32 and llama.query_groups == 8
    qwen3 = read("qwen3_8b_config.json")
    assert qwen3.qk_layernorm and not qwen3.rope_scaling and qwen3.kv_channels is None
    moe = read("qwen3_30b_a3b_config.json")
    assert moe.hybrid_layer_pattern == "*E" * 48 and moe.kv_channels == 128
    assert moe.moe_router_score_function == "softmax" and moe.num_moe_experts == 128
    mixed = json.loads((FIXTURES / "qwen3_30b_a3b_config.json").read_text())
    mixed.update(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)
    assert model_config_from_hf(mixed).hybrid_layer_pattern == "*-*E*-*E"
    mixtral = read("mixtral_8x7b_config.json")
    assert mixtral.moe_ffn_hidden_size == 14336 and mixtral.rotary_base == 1_000_000


# ------------------------------------------------------------------------------ bad input
def _llama_json(**changes: Any) -> dict[str, Any]:
    raw = json.loads((FIXTURES / "llama_3_1_8b_config.json").read_text())
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None or k in changes}


BAD = {
    "architecture": (
        _llama_json(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"),
        "unsupported architecture architectures=['DeepseekV3ForCausalLM']",
    ),
    "mla": (_llama_json(q_lora_rank=1536), "q_lora_rank=1536 is not supported"),
    "sinks": (_llama_json(use_sinks=True), "use_sinks=True is not supported"),
    "rope_yarn": (
        _llama_json(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "rope_scaling.rope_type='yarn' is not supported",
    ),
    "llama3_factors": (
        _llama_json(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 4096,
            }
        ),
        "rope_scaling.original_max_position_embeddings=4096 is not supported",
    ),
    "attention_bias": (_llama_json(attention_bias=True), "attention_bias=True is not supported"),
    "unknown": (_llama_json(foo_scale=2), "foo_scale=2"),
}
QWEN_BAD = {
    "sliding": ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    "norm_topk": ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported"),
}
_SLIDING_TYPES = ["full_attention", "sliding_attention"]
# the unsupported features in each other family's released config: (fixture, changes, message)
OTHER_BAD = {
    "llama_window": (
        "llama_3_1_8b_config.json",
        {"sliding_window": 4096},
        "sliding_window=4096 is not supported (sliding-window attention",
    ),
    "llama_layer_types": (
        "llama_3_1_8b_config.json",
        {"layer_types": _SLIDING_TYPES * 16},
        "layer_types[1]='sliding_attention' is not supported (sliding-window attention",
    ),
    "llama_nope": (
        "llama_3_1_8b_config.json",
        {"no_rope_layers": [1, 0] * 16},
        "no_rope_layers=[1, 0, 1",
    ),
    "qwen3_mla": ("qwen3_8b_config.json", {"kv_lora_rank": 512}, "kv_lora_rank=512 is not supp"),
    "qwen3_dynamic_rope": (
        "qwen3_8b_config.json",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_scaling.rope_type='dynamic' is not supported",
    ),
    "qwen3_layer_types": (
        "qwen3_8b_config.json",
        {"layer_types": ["full_attention"] * 35 + ["sliding_attention"]},
        "layer_types[35]='sliding_attention' is not supported",
    ),
    "qwen3_moe_layer_types": (
        "qwen3_30b_a3b_config.json",
        {"layer_types": _SLIDING_TYPES * 24},
        "layer_types[1]='sliding_attention' is not supported",
    ),
    "qwen3_moe_sinks": (
        "qwen3_30b_a3b_config.json",
        {"attention_sinks": True},
        "attention_sinks=True is not supported (attention sinks",
    ),
    "mixtral_window": (
        "mixtral_8x7b_config.json",
        {"sliding_window": 4096},
        "sliding_window=4096 is not supported",
    ),
    "mixtral_mla": ("mixtral_8x7b_config.json", {"q_lora_rank": 64}, "q_lora_rank=64 is not supp"),
    "mixtral_yarn": (
        "mixtral_8x7b_config.json",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "rope_scaling.rope_type='yarn' is not supported",
    ),
    "mixtral_sinks": ("mixtral_8x7b_config.json", {"sinks": True}, "sinks=True is not supported"),
}


@pytest.mark.parametrize("kind", sorted(BAD) + sorted(QWEN_BAD) + sorted(OTHER_BAD))
def test_bad_configs_are_refused_naming_the_field(kind, tmp_path, monkeypatch):
    """Refused by plan_import before any weight is read (the weights here are not even
    there), with the field and value; nothing written."""
    from elastic_plugin.export.hf_import import plan_import
    from elastic_plugin.families import supported_architectures
    from elastic_plugin.models.config import ConfigError

    if kind in BAD:
        raw, message = BAD[kind]
    elif kind in OTHER_BAD:
        fixture, changes, message = OTHER_BAD[kind]
        raw = {**json.loads((FIXTURES / fixture).read_text()), **changes}
    else:
        raw = json.loads((FIXTURES / "qwen3_30b_a3b_config.json").read_text())
        raw.update(QWEN_BAD[kind][0])
        message = QWEN_BAD[kind][1]
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        plan_import(source, tmp_path / "out")
    text = str(err.value)
    assert message in text, text
    if kind == "architecture":
        assert text.index("unsupported architecture") < 80 and len(text) < 800, text
        assert all(arch in text for arch in supported_architectures())
    assert not (tmp_path / "out").exists()


@pytest.mark.integration  # the import saves through Megatron's spawned checkpoint writer
def test_an_export_no_family_holds_names_the_field(family_case):
    import dataclasses

    from elastic_plugin.export.hf_compat import check_hf_compatible
    from elastic_plugin.models.config import ConfigError

    model = family_case["model"]
    check_hf_compatible(model)
    with pytest.raises(ConfigError, match=r"model\.activation='squared_relu'"):
        check_hf_compatible(dataclasses.replace(model, activation="squared_relu"))


@pytest.mark.integration  # the import saves through Megatron's spawned checkpoint writer
def test_a_truncated_shard_is_refused_before_reading(family_case, tmp_path):
    from elastic_plugin.export.hf_import import plan_import
    from elastic_plugin.models.config import ConfigError

    source = tmp_path / "hf"
    shutil.copytree(family_case["work"] / "hf", source)
    shard = sorted(source.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="truncated"):
        plan_import(source, tmp_path / "out")
