"""``elastic-plugin import --megatron``: a Megatron-LM torch_dist checkpoint as a teacher.

The checkpoints are Megatron-LM's own: ``megatron.training.arguments`` parses and validates a
small hybrid model's command line (every layer kind, GQA, a shared expert, sigmoid routing with
an expert bias and a top-k scaling factor) and ``megatron.training.checkpointing.
save_checkpoint`` writes iteration 10 (``tests.support.megatron_import_cases``, in its own process),
once with Transformer Engine's fused norm names and once with the local specs' separate ones.
Both import to a teacher whose logits are the source model's; bad input exits 2 naming it
before any weight is read, and writes nothing.

The same process writes two checkpoints of Megatron-LM's own ``GPTModel`` built as
``pretrain_gpt.py`` builds it (Llama-like: Llama 3.1 RoPE scaling, untied, layers stored stacked
under TE's fused norm names; Qwen-like: QK layernorm, q/k/v bias, free kv_channels, tied, MoE and
dense layers mixed with a shared expert, per-layer keys under the local norm names): imported as
our ``*-`` / ``*E`` pattern they give the GPTModel's logits."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # a module fixture runs Megatron-LM in a fresh interpreter

TOL = 1e-5


@pytest.fixture(scope="module")
def megatron_dirs(tmp_path_factory) -> Path:
    """``te/`` and ``local/`` Megatron-LM save directories and ``reference.pt``."""
    work = tmp_path_factory.mktemp("megatron")
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.megatron_import_cases", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return work


def _stored_keys(save_dir: Path) -> set[str]:
    from megatron.core import dist_checkpointing

    return set(dist_checkpointing.load_tensors_metadata(str(save_dir / "iter_0000010")))


def _logits(ckpt: Path, tokens: torch.Tensor):
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout

    (model,), cfg, meta = build_from_checkpoint(ckpt, Layout())
    model.eval()
    with torch.no_grad():
        out = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    return out, cfg, meta


@pytest.mark.parametrize(
    ("form", "norm_key"),
    [
        ("te", "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"),
        ("local", "decoder.layers.1.input_layernorm.weight"),
        ("gpt_dense", "decoder.layers.self_attention.linear_qkv.layer_norm_weight"),  # stacked
        ("gpt_moe", "decoder.layers.2.pre_mlp_layernorm.weight"),
    ],
)
def test_imported_teacher_gives_the_source_logits(megatron_dirs, form, norm_key, tmp_path):
    from elastic_plugin.cli import main
    from tests.support.megatron_import_cases import gpt_model_config, source_model_config

    source = megatron_dirs / form
    keys = _stored_keys(source)
    assert norm_key in keys, sorted(k for k in keys if "norm" in k)
    out = tmp_path / "teacher"
    assert main(["import", "--megatron", str(source), "--out", str(out), "--no-progress"]) == 0
    gpt = form.startswith("gpt")
    ref = torch.load(megatron_dirs / (f"reference_{form}.pt" if gpt else "reference.pt"))
    logits, cfg, meta = _logits(out, ref["tokens"])
    diff = float((logits - ref["logits"]).abs().max())
    print(f"{form}: max |imported - source| = {diff:.3g}")
    assert diff <= TOL
    assert cfg.model == (gpt_model_config(form) if gpt else source_model_config())
    assert meta["imported_from"]["model_class"] == ("GPTModel" if gpt else "HybridModel")
    assert meta["kind"] == "teacher"
    assert meta["imported_from"]["iteration"] == 10
    assert meta["imported_from"]["megatron"] == str(source.resolve())


def test_a_gpt_checkpoint_saved_under_tp2_imports_with_its_logits(rank_pools, tmp_path):
    """GPTModel saved by Megatron-LM's save_checkpoint on 2 ranks at TP=2 (stacked layers, each
    rank its own shards) imports at TP=1 with the logits the 2 ranks computed."""
    from elastic_plugin.cli import main
    from tests.support.megatron_import_cases import gpt_model_config

    work = tmp_path / "work"
    work.mkdir()
    ranks = rank_pools.get(2).run(
        "tests.support.megatron_import_cases:write_gpt_tp2_case", work=str(work)
    )
    assert [r["local_vocab"] for r in ranks] == [64, 64]  # really split over TP
    out = tmp_path / "teacher"
    source = work / "gpt_tp2"
    assert main(["import", "--megatron", str(source), "--out", str(out), "--no-progress"]) == 0
    ref = torch.load(work / "reference_gpt_tp2.pt")
    logits, cfg, meta = _logits(out, ref["tokens"])
    diff = float((logits - ref["logits"]).abs().max())
    print(f"gpt TP=2 -> TP=1: max |imported - source| = {diff:.3g}")
    assert diff <= TOL
    assert cfg.model == gpt_model_config("gpt_dense")
    assert meta["imported_from"]["saved_layout"]["tensor_model_parallel_size"] == 2


def test_saved_args_defaults_map_as_megatron_builds_them():
    from elastic_plugin.export.megatron_import import model_config_from_megatron_args

    args = {
        "hybrid_override_pattern": "M*M-",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 1,  # ignored: group_query_attention is off
        "group_query_attention": False,
        "kv_channels": 16,
        "ffn_hidden_size": 256,
        "mamba_num_heads": None,  # MambaMixer: 2 * hidden_size / mamba_head_dim
        "mamba_head_dim": 16,
        "mamba_num_groups": 2,
        "mamba_state_dim": 16,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "rotary_base": 500000,
        "padded_vocab_size": 256,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": False,
        "swiglu": True,
        "num_experts": None,
        "moe_router_score_function": "softmax",
    }
    model = model_config_from_megatron_args(args)
    assert model.mamba_num_heads == 8 and model.query_groups == 4 and model.gated_mlp
    assert model.position_embedding_type == "rope" and model.rotary_base == 500000
    assert not model.untie_embeddings_and_output_weights and model.num_moe_experts == 0


def test_gpt_args_map_as_megatron_builds_them():
    """GPTModel args (no hybrid pattern): layers as ``*-`` / ``*E`` pairs by moe_layer_freq,
    QK layernorm, q/k/v bias (implied by add_bias_linear), RoPE scaling, the norm epsilon."""
    from elastic_plugin.export.megatron_import import model_config_from_megatron_args

    args = {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "group_query_attention": True,
        "num_query_groups": 2,
        "kv_channels": 24,
        "ffn_hidden_size": 96,
        "swiglu": True,
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-6,
        "position_embedding_type": "rope",
        "rotary_base": 500000,
        "use_rope_scaling": True,
        "rope_scaling_factor": 32.0,
        "qk_layernorm": True,
        "add_qkv_bias": True,
        "add_bias_linear": False,
        "padded_vocab_size": 256,
        "untie_embeddings_and_output_weights": True,
        "num_experts": 8,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 32,
        "moe_layer_freq": 2,
    }
    model = model_config_from_megatron_args(args)
    assert model.hybrid_layer_pattern == "*E*-*E*-" and model.head_dim == 24
    assert model.qk_layernorm and model.add_qkv_bias and not model.add_bias_linear
    assert (model.rope_scaling, model.rope_scaling_factor) == (True, 32.0)
    assert model.layernorm_epsilon == 1e-6 and model.query_groups == 2
    dense = model_config_from_megatron_args({**args, "num_experts": None, "add_bias_linear": True})
    assert dense.hybrid_layer_pattern == "*-" * 4 and not dense.add_qkv_bias
    mixed = model_config_from_megatron_args({**args, "moe_layer_freq": [0, 1, 1, 0]})
    assert mixed.hybrid_layer_pattern == "*-*E*E*-"


def _write_args(iter_dir: Path, **changes) -> None:
    """Replace the saved args (the legacy ``common.pt`` form, which Megatron-Core reads first)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    for name, value in changes.items():
        setattr(common["args"], name, value)
    torch.save(common, iter_dir / "common.pt")


def _bad(kind: str):
    """(mutate the copied save dir, extra CLI args, text the error must contain)."""
    iter_dir = "iter_0000010"

    def args(**changes):
        return lambda path: _write_args(path / iter_dir, **changes)

    table = {
        "no_tracker": (
            lambda p: (p / "latest_checkpointed_iteration.txt").unlink(),
            "no latest_checkpointed_iteration.txt",
        ),
        "tracker_text": (
            lambda p: (p / "latest_checkpointed_iteration.txt").write_text("best\n"),
            "expected an iteration number or 'release'",
        ),
        "missing_iter": (
            lambda p: (p / "latest_checkpointed_iteration.txt").write_text("20\n"),
            "iter_0000020 does not exist",
        ),
        "not_torch_dist": (
            lambda p: (p / iter_dir / "metadata.json").unlink(),
            "not a torch_dist checkpoint",
        ),
        "layernorm": (args(normalization="LayerNorm"), "normalization='LayerNorm' is not supp"),
        "group_routing": (
            args(moe_router_num_groups=2, moe_router_group_topk=1),
            "moe_router_num_groups=2 is not supported (group-limited routing",
        ),
        "score_function": (
            args(moe_router_score_function="sqrtsoftplus"),
            "moe_router_score_function='sqrtsoftplus' is not supported",
        ),
        "mla": (args(multi_latent_attention=True), "multi_latent_attention=True is not supp"),
        "mtp": (args(mtp_num_layers=1), "mtp_num_layers=1 is not supported"),
        "learned_positions": (
            args(position_embedding_type="learned_absolute"),
            "position_embedding_type='learned_absolute' is not supported",
        ),
        "not_hybrid": (  # read as a GPTModel: its tensors are not there
            args(hybrid_layer_pattern=None, hybrid_override_pattern=None),
            "so it is read as a GPTModel checkpoint",
        ),
        "sinks": (
            args(softmax_type="learnable"),
            "softmax_type='learnable' is not supported (attention sinks",
        ),
        "no_rope_layers": (args(no_rope_freq=4), "no_rope_freq=4 is not supported"),
        "capacity": (
            args(moe_expert_capacity_factor=1.0),
            "moe_expert_capacity_factor=1.0 is not supported",
        ),
        "hybrid_qk_norm": (args(qk_layernorm=True), "qk_layernorm=True is not supported"),
        "mtp_pattern": (
            args(hybrid_layer_pattern="M*-E/*-", hybrid_override_pattern=None),
            "hybrid_layer_pattern='M*-E/*-' is not supported",
        ),
        "no_padded_vocab": (args(padded_vocab_size=None), "padded_vocab_size is not set"),
        "shape_contradicts": (
            args(ffn_hidden_size=64),
            "'decoder.layers.2.mlp.linear_fc1.weight' is stored with (48, 32)",
        ),
        "gpt_moe_freq": (
            args(moe_layer_freq=[1, 0]),
            "moe_layer_freq=[1, 0] must be a positive integer or a list of num_layers=3",
        ),
        "gpt_qk_l2": (args(qk_l2_norm=True), "qk_l2_norm=True is not supported"),
        "gpt_mla": (args(multi_latent_attention=True), "multi_latent_attention=True is not supp"),
        "gpt_window": (args(window_size=(128, 0)), "window_size=(128, 0) is not supported"),
        "gpt_shape": (
            args(kv_channels=16),
            "'decoder.layers.0.self_attention.linear_proj.weight' is stored with (48, 72)",
        ),
    }
    return table[kind]


BAD = [
    "no_tracker",
    "tracker_text",
    "missing_iter",
    "not_torch_dist",
    "layernorm",
    "group_routing",
    "score_function",
    "mla",
    "mtp",
    "learned_positions",
    "not_hybrid",
    "mtp_pattern",
    "no_padded_vocab",
    "shape_contradicts",
    "sinks",
    "no_rope_layers",
    "capacity",
    "hybrid_qk_norm",
    "gpt_moe_freq",
    "gpt_qk_l2",
    "gpt_mla",
    "gpt_window",
    "gpt_shape",
]


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Loading a weight fails the test: every check runs on the args and the metadata."""
    from megatron.core import dist_checkpointing

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the input was checked")

    monkeypatch.setattr(dist_checkpointing, "load", refuse)


def _run_import(argv: list[str], capsys) -> tuple[int, str]:
    from elastic_plugin.cli import main

    code = main(["import", *argv, "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_exits_2_before_any_weight_is_read(
    kind, megatron_dirs, tmp_path, capsys, request
):
    source = tmp_path / "megatron"
    shutil.copytree(megatron_dirs / ("gpt_moe" if kind.startswith("gpt") else "te"), source)
    mutate, message = _bad(kind)
    mutate(source)
    request.getfixturevalue("no_weight_reads")
    out = tmp_path / "out"
    code, err = _run_import(["--megatron", str(source), "--out", str(out)], capsys)
    assert code == 2, err
    assert message in err, err
    assert not out.exists() and not list(tmp_path.glob("out.*"))


def test_sources_and_out_are_checked(megatron_dirs, tmp_path, capsys, no_weight_reads):
    source = str(megatron_dirs / "te")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.txt").write_text("keep me")
    cases = [
        (
            ["--megatron", source, "--out", str(tmp_path / "full")],
            "already exists and is not empty",
        ),
        (["--megatron", source, "--out", f"{source}/teacher"], "must not be inside --megatron"),
        (
            ["--megatron", source, "--hf", source, "--out", str(tmp_path / "a")],
            "got both --hf and --megatron",
        ),
        (["--out", str(tmp_path / "b")], "got neither --hf nor --megatron"),
        (["--megatron", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c")], "no such dir"),
    ]
    for argv, message in cases:
        code, err = _run_import(argv, capsys)
        assert code == 2 and message in err, (argv, err)
    assert (tmp_path / "full" / "old.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
    assert not (megatron_dirs / "te" / "teacher").exists()
