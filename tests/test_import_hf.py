"""``elastic-plugin import``: a Hugging Face NemotronH directory as a teacher checkpoint.

The reference is transformers' own ``NemotronHForCausalLM``: a randomly initialised one (a
scaled-down Nemotron Nano v3: every layer kind, GQA, a shared expert, sigmoid routing with a
non-zero ``e_score_correction_bias`` and ``routed_scaling_factor`` 2.5), saved sharded by
``save_pretrained``, imported, and built again from the checkpoint gives transformers' logits;
exported again with our exporter it gives the input tensors bit for bit. Released configs map
to the published parameter counts, and bad input is refused before any weight is read."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NANO_CONFIG = FIXTURES / "nemotron_nano_v3_config.json"
SEQ = 40
TOL = 1e-4
_NOT_KWARGS = ("architectures", "model_type", "torch_dtype", "auto_map", "transformers_version")


def _nano_json() -> dict:
    return json.loads(NANO_CONFIG.read_text())


def _small_json(**changes) -> dict:
    """Nano v3's config.json, scaled down (every other field as released)."""
    raw = _nano_json()
    raw.update(
        hidden_size=64,
        vocab_size=256,
        hybrid_override_pattern="M*EM-E*E",
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        max_position_embeddings=512,
    )
    raw.update(changes)
    return raw


def _hf_model(raw: dict, seed: int = 0):
    """transformers' NemotronHForCausalLM of ``raw``, every weight perturbed (a wrong mapping
    shows) and a non-zero expert score correction bias."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**{k: v for k, v in raw.items() if k not in _NOT_KWARGS})
    model = NemotronHForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "t0"}))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A sharded save_pretrained directory (with a tokenizer), its tokens and logits."""
    work = tmp_path_factory.mktemp("hf_import")
    model = _hf_model(_small_json())
    path = work / "hf"
    model.save_pretrained(path, max_shard_size="60KB")
    _write_tokenizer(path)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, work / "reference.pt")
    return path, tokens, logits, work


@pytest.fixture(scope="module")
def imported(hf_dir):
    """The CLI's import of the fixture directory and its summary."""
    from elastic_plugin.cli import main

    path, _, _, work = hf_dir
    out = work / "teacher"
    target = [
        "--target-tensor-model-parallel-size",
        "2",
        "--target-expert-model-parallel-size",
        "2",
    ]
    assert main(["import", "--hf", str(path), "--out", str(out), "--no-progress", *target]) == 0
    return out


def _ours(ckpt: Path):
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout

    chunks, cfg, meta = build_from_checkpoint(ckpt, Layout())
    return chunks[0].eval(), cfg, meta


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


@pytest.mark.integration
def test_imported_teacher_gives_transformers_logits(hf_dir, imported):
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta

    path, tokens, reference, _ = hf_dir
    model, cfg, meta = _ours(imported)
    diff = (_logits(model, tokens) - reference).abs().max().item()
    print(f"max |ours - transformers| = {diff:.2e} (logits up to {reference.abs().max():.2f})")
    assert diff <= TOL
    assert cfg.model.moe_router_topk_scaling_factor == 2.5
    assert cfg.model.moe_router_enable_expert_bias and cfg.model.hybrid_layer_pattern == "M*EM-E*E"
    # the check can fail: without the routed scaling factor the logits move
    model.config.moe_router_topk_scaling_factor = None
    assert (_logits(model, tokens) - reference).abs().max().item() > 1e-2
    model.config.moe_router_topk_scaling_factor = 2.5

    assert read_checkpoint_meta(imported) == meta and meta["kind"] == "teacher"
    assert meta["imported_from"]["hf"] == str(path.resolve())
    assert meta["layout"]["tp"] == 1 and meta["config"]["model"]["vocab_size"] == 256
    tokenizer = Path(meta["tokenizer"])
    assert tokenizer == imported.resolve() / "iter_0000000" / "hf_tokenizer" / "tokenizer.json"
    assert "hf_tokenizer/tokenizer.json" in meta["files"]  # digested with the weights
    assert tokenizer.read_bytes() == (path / "tokenizer.json").read_bytes()
    assert (tokenizer.parent / "generation_config.json").is_file()
    assert not imported.with_name(imported.name + ".tmp").exists()
    assert (imported / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert not imported.with_name(imported.name + ".tmp").exists()


VARIANTS = {
    # transformers' NemotronH ties no weights: a stored lm_head is used, and imported untied
    "tied_config_no_conv_bias": {"tie_word_embeddings": True, "use_conv_bias": False},
    "dense_legacy_list": {
        "hybrid_override_pattern": None,
        "num_hidden_layers": None,
        "layers_block_type": ["mamba", "attention", "mlp", "mamba", "mlp"],
    },
    # a shared expert size of 0 builds one of intermediate_size in transformers
    "top1_shared_size_0": {
        "moe_shared_expert_intermediate_size": 0,
        "num_experts_per_tok": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_nemotron_h_forms_import_exactly(variant, tmp_path):
    from elastic_plugin.export.hf_import import import_hf

    raw = {k: v for k, v in _small_json(**VARIANTS[variant]).items() if v is not None}
    raw.update({k: None for k in ("sliding_window", "moe_latent_size")})
    model = _hf_model(raw)
    model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(tokens).logits
    summary = import_hf(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    ours, cfg, _ = _ours(tmp_path / "ckpt")
    assert (_logits(ours, tokens) - reference).abs().max().item() <= TOL
    if variant.startswith("tied"):
        assert cfg.model.untie_embeddings_and_output_weights
        assert any("lm_head" in note for note in summary["notes"])
        assert not ours.state_dict()["decoder.layers.0.mixer.conv1d_bias"].any()
    if variant.startswith("top1"):
        assert cfg.model.moe_shared_expert_intermediate_size == 96


def _export(model, cfg, out: Path, dtype: str) -> dict:
    from elastic_plugin.export.hf import hf_config, megatron_to_hf, write_hf_checkpoint

    hf = megatron_to_hf(model.state_dict(), cfg)
    config = hf_config(hf, cfg, dtype)
    out.mkdir()
    write_hf_checkpoint(out, hf, config, dtype, max_shard_bytes=60_000)
    return config


def _same_tensors(a: Path, b: Path) -> None:
    from elastic_plugin.checkpoint.hub import read_hub_tensors

    ours, theirs = read_hub_tensors(a), read_hub_tensors(b)
    assert set(ours) == set(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key


@pytest.mark.integration
def test_import_then_export_gives_the_input_bit_for_bit(hf_dir, imported, tmp_path):
    from elastic_plugin.cli import main
    from elastic_plugin.families import model_config_from_hf

    path, _, _, _ = hf_dir
    model, cfg, _ = _ours(imported)
    config = _export(model, cfg.model, tmp_path / "fp32", "fp32")
    _same_tensors(tmp_path / "fp32", path)
    assert config["routed_scaling_factor"] == 2.5
    assert model_config_from_hf(config) == cfg.model

    # a bf16 checkpoint (router kept in fp32, as transformers stores it) through an fp32 import
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "hf_bf16"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(
        bf16, max_shard_size="60KB"
    )
    out = tmp_path / "teacher_bf16"
    assert main(["import", "--hf", str(bf16), "--out", str(out), "--no-progress"]) == 0
    model, cfg, _ = _ours(out)
    _export(model, cfg.model, tmp_path / "bf16", "bf16")
    _same_tensors(tmp_path / "bf16", bf16)


@pytest.mark.integration
def test_released_configs_map_to_the_published_counts():
    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.config import load_config
    from elastic_plugin.models.counting import count_parameters, format_count

    nano = model_config_from_hf(_nano_json())
    counts = count_parameters(nano)
    assert (format_count(counts.total), format_count(counts.active)) == ("31.58B", "3.58B")
    assert (counts.total, counts.active) == (31_577_937_344, 3_580_073_408)
    yaml = load_config(FIXTURES.parent.parent / "examples/configs/nemotron_nano_v3.yaml").model
    assert count_parameters(yaml).total == counts.total
    assert nano.moe_router_topk_scaling_factor == 2.5 and nano.query_groups == 2

    dense_pattern = "M-M-M-MM-M-M*-M-M-M*-M-M-MM*-MMM-M-M-MM-M-M-M*-M-M-M*"
    dense = {
        **{k: v for k, v in _nano_json().items() if not k.startswith(("moe_", "n_", "num_exp"))},
        "hidden_size": 4096,
        "intermediate_size": 21504,
        "mamba_num_heads": 128,
        "num_key_value_heads": 8,
        "n_groups": 8,
    }
    del dense["hybrid_override_pattern"], dense["num_hidden_layers"]
    names = {"M": "mamba", "*": "attention", "-": "mlp"}  # the legacy list names
    dense["layers_block_type"] = [names[s] for s in dense_pattern]
    reference = _transformers_counts([_nano_json(), dense])
    for raw, expected in zip((_nano_json(), dense), reference):
        ours = count_parameters(model_config_from_hf(raw))
        assert ours.total == expected
    ours = count_parameters(model_config_from_hf(dense))
    assert ours.total == ours.active and ours.breakdown["moe_experts"] == 0
    print(f"dense Nemotron-H-like: {format_count(ours.total)}")


def _transformers_counts(configs: list[dict]) -> list[int]:
    """transformers' own parameter counts of ``configs`` (models built on the meta device, in a
    fresh interpreter: once Megatron's CPU adaptations are on, factories ignore the meta device)."""
    script = (
        "import json, sys, torch\n"
        "from transformers import NemotronHConfig, NemotronHForCausalLM\n"
        "out = []\n"
        "for raw in json.loads(sys.stdin.read()):\n"
        "    with torch.device('meta'):\n"
        "        model = NemotronHForCausalLM(NemotronHConfig(**raw))\n"
        "    out.append(sum(p.numel() for p in model.parameters()))\n"
        "print(json.dumps(out))\n"
    )
    kwargs = [{k: v for k, v in raw.items() if k not in _NOT_KWARGS} for raw in configs]
    run = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(kwargs), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _bad(kind: str):
    """(mutation of a copy of the HF directory, text the error must contain)."""

    def config(**changes):
        def mutate(path: Path) -> None:
            raw = json.loads((path / "config.json").read_text())
            raw.update(changes)
            (path / "config.json").write_text(json.dumps(raw))

        return mutate

    def shard(path: Path, n: int = 3) -> Path:
        return path / f"model-{n:05d}-of-{len(list(path.glob('model-*'))):05d}.safetensors"

    def index(path: Path, edit) -> None:
        file = path / "model.safetensors.index.json"
        raw = json.loads(file.read_text())
        edit(raw["weight_map"])
        file.write_text(json.dumps(raw))

    def unknown_key(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        file = shard(path)
        tensors = load_file(str(file))
        tensors["backbone.layers.0.mixer.lora_A.weight"] = torch.zeros(4, 64)
        save_file(tensors, str(file))
        index(path, lambda m: m.update({"backbone.layers.0.mixer.lora_A.weight": file.name}))

    def truncate(path: Path) -> None:
        file = shard(path)
        file.write_bytes(file.read_bytes()[:-100])

    cases = {
        "missing_shard": (lambda p: shard(p).unlink(), "which is not in"),
        "index_names_missing_file": (
            lambda p: index(p, lambda m: m.update({next(iter(m)): "model-00099.safetensors"})),
            "names model-00099.safetensors, which is not in",
        ),
        "truncated_shard": (truncate, "truncated"),
        "unknown_key": (unknown_key, "lora_A.weight'] have no place in the model"),
        "shape_contradicts_config": (
            config(intermediate_size=80),
            "has shape [64, 96], but config.json implies [64, 80] (from intermediate_size",
        ),
        "config_names_missing_experts": (config(n_routed_experts=10), "experts.8.up_proj"),
        "architecture": (config(architectures=["LlamaForCausalLM"]), "unsupported architecture"),
        "model_type": (config(model_type="llama"), "unsupported architecture model_type='llama'"),
        "n_group": (config(n_group=2), "n_group=2 is not supported (group-limited"),
        "mtp": (config(num_nextn_predict_layers=1), "num_nextn_predict_layers=1"),
        "latent_moe": (config(moe_latent_size=16), "moe_latent_size=16"),
        "sliding_window": (config(sliding_window=128), "sliding_window=128"),
        "dt_clamp": (config(time_step_limit=[0.01, 1.0]), "time_step_limit=[0.01, 1.0]"),
        "activation": (config(mlp_hidden_act="silu"), "mlp_hidden_act='silu'"),
        "norm_topk_prob": (config(norm_topk_prob=False), "norm_topk_prob=False"),
        "mamba_eps": (config(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06"),
        "unknown_field": (config(attn_logit_softcapping=30.0), "attn_logit_softcapping"),
        "legacy_conflict": (config(mamba_n_groups=4), "mamba_n_groups=4 and n_groups=2 disagree"),
    }
    return cases[kind]


BAD = [
    "missing_shard",
    "index_names_missing_file",
    "truncated_shard",
    "unknown_key",
    "shape_contradicts_config",
    "config_names_missing_experts",
    "architecture",
    "model_type",
    "n_group",
    "mtp",
    "latent_moe",
    "sliding_window",
    "dt_clamp",
    "activation",
    "norm_topk_prob",
    "mamba_eps",
    "unknown_field",
    "legacy_conflict",
]


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Reading a tensor fails the test: every check runs on config.json and headers alone."""
    import safetensors
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the input was checked")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_is_refused_before_any_weight_is_read(kind, hf_dir, tmp_path, request):
    from elastic_plugin.export.hf_import import plan_import
    from elastic_plugin.models.config import ConfigError

    source = tmp_path / "hf"
    shutil.copytree(hf_dir[0], source)
    mutate, message = _bad(kind)
    mutate(source)
    request.getfixturevalue("no_weight_reads")
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        plan_import(source, out)
    assert message in str(err.value), str(err.value)
    assert not out.exists() and not list(tmp_path.glob("out.*"))


def test_out_and_dtype_are_checked(hf_dir, tmp_path, no_weight_reads):
    from elastic_plugin.export.hf_import import plan_import
    from elastic_plugin.models.config import ConfigError

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        plan_import(hf_dir[0], tmp_path / "out")
    with pytest.raises(ConfigError, match="--dtype 'fp16': allowed: fp32, bf16"):
        plan_import(hf_dir[0], tmp_path / "new", "fp16")
    with pytest.raises(ConfigError, match="must not be inside --hf"):
        plan_import(hf_dir[0], hf_dir[0] / "ckpt")
    assert (tmp_path / "out" / "old.txt").read_text() == "keep me"


def test_target_layout_is_checked_before_any_weight_is_read(
    hf_dir, tmp_path, capsys, no_weight_reads
):
    """--target-*-parallel-size: a layout the imported sizes cannot split under exits 2 naming
    the field and the flag; nothing is written."""
    from elastic_plugin.cli import main

    out = tmp_path / "out"
    for flags, needle in (
        (["--target-tensor-model-parallel-size", "3"], "the tensor-parallel size 3"),
        (["--target-expert-model-parallel-size", "3"], "model.num_moe_experts"),
        (["--target-pipeline-model-parallel-size", "0"], "--target-pipeline-model-parallel-size 0"),
    ):
        rc = main(["import", "--hf", str(hf_dir[0]), "--out", str(out), *flags])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err, (flags, err)
        assert not out.exists() and not list(tmp_path.glob("out.*"))


@pytest.mark.integration
def test_cli_reports_bad_input_before_megatron_is_imported(hf_dir, tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(hf_dir[0], source)
    _bad("n_group")[0](source)
    script = (
        "import sys\n"
        "from elastic_plugin.cli import main\n"
        f"rc = main(['import', '--hf', {str(source)!r}, '--out', {str(tmp_path / 'o')!r}])\n"
        "print('megatron loaded:', any(m.startswith('megatron') for m in sys.modules))\n"
        "sys.exit(rc)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert "elastic-plugin import: error:" in run.stderr and "n_group=2" in run.stderr
    assert "megatron loaded: False" in run.stdout


def test_params_counts_an_hf_config(hf_dir, capsys):
    from elastic_plugin.cli import main

    assert main(["params", "--hf", str(NANO_CONFIG), "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert (counts["total"], counts["active"]) == (31_577_937_344, 3_580_073_408)
    assert main(["params", "--hf", str(hf_dir[0])]) == 0
    assert "TOTAL" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one source only
        main(["params", "--hf", str(hf_dir[0]), "--config", "x.yaml"])


@pytest.mark.integration
def test_imported_teacher_loads_under_tp2_ep2(hf_dir, imported, rank_pools):
    """Written at TP=1, the import loads under TP=2 x EP=2 with the same logits."""
    results = rank_pools.get(4).run(
        "tests.support.import_cases:tp_ep_logits_case",
        ckpt=str(imported),
        reference=str(hf_dir[3] / "reference.pt"),
    )
    print("TP=2 EP=2 max |ours - transformers| per rank:", [r["max_abs_diff"] for r in results])
    assert all(r["local_vocab"] == 128 for r in results)
    assert all(r["max_abs_diff"] <= TOL for r in results)
