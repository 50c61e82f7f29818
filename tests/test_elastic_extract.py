"""``elastic-plugin extract``: the nested model of a budget, cut from a (tiny, briefly trained)
elastic checkpoint, is a plain Megatron-Core checkpoint: loaded by plain Megatron code (no elastic
module), at TP=1 and TP=2, it gives the elastic model's logits at that budget. Bad input exits 2
before any work and writes nothing; an interrupted save leaves no complete-looking output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_plugin.checkpoint.history import resolve_checkpoint

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
HERE = "test_elastic_extract"
TOL = 1e-5
INTERPOLATED = 0.6
TOKENS = 24
# every axis at its smallest candidate: what a converged router picks for the 0.4 budget (two
# training iterations leave the router near its initialisation, which barely shrinks anything)
SMALL = {
    "embedding": 64,
    "ffn": 128,
    "shared_ffn": 64,
    "attention_heads": 2,
    "mamba_heads": 4,
    "mamba_head_dim": 8,
    "experts": 4,
}


# ------------------------------------------------------------------------------ rank cases
def _tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (2, TOKENS), generator=gen), torch.arange(TOKENS).expand(
        2, TOKENS
    )


def _plain_model(out: Path, layout):
    """Plain Megatron-Core: a HybridModel from the saved config, dist-checkpoint loaded."""
    from megatron.core import dist_checkpointing

    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.parallel import build_model_chunks, initialize_layout

    out = resolve_checkpoint(out)  # the stage's newest save (Megatron-LM's latest pointer)
    meta = json.loads((out / "elastic_meta.json").read_text())
    cfg = config_from_dict(meta["config"])
    initialize_layout(layout)
    model = build_model_chunks(cfg.model, layout, wrap_ddp=False)[0][0]
    state = dist_checkpointing.load(model.sharded_state_dict(), str(out))
    model.load_state_dict(state, strict=True)
    return model, cfg, meta


def _logits(model, vocab: int) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens, position = _tokens(vocab)
    model.eval()
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(model(tokens, position, None)).clone()


def extract_case(workdir: str) -> dict:
    """1 rank: train a tiny elastic checkpoint (2 iterations), extract every trained budget and
    one interpolated budget, compare with the elastic model; then an interrupted extraction."""
    from megatron.core import dist_checkpointing

    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.model import build_elastic_chunks, router_of
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.parallel import Layout, initialize_layout
    from tests.support import elastic_cases as ec

    work = Path(workdir)
    cfg = ec._experiment(CONFIG, None)
    # extraction follows the stored table
    ckpt = ec.train_tiny_elastic(cfg, work, choices={"0.4": SMALL})
    meta = json.loads((ckpt / "elastic_meta.json").read_text())
    vocab = cfg.model.vocab_size

    initialize_layout(Layout())
    resolved = ElasticConfig.from_dict(meta["config"]["elastic"]).resolve(cfg.model)
    chunks, state, _ = build_elastic_chunks(ckpt, Layout(), resolved, wrap_ddp=False)
    elastic = chunks[0]
    picks = router_of(elastic).choose(INTERPOLATED, interpolate=True)
    interp_choice = {n: s.candidates[picks[n][0]] for n, s in resolved.axes.items()}
    choices = {
        **{float(k): v for k, v in meta["elastic"]["choices"].items()},
        INTERPOLATED: interp_choice,
    }
    references, full = {}, _logits(elastic, vocab)
    for budget, choice in choices.items():
        state.set_sizes(choice)
        references[budget] = (_logits(elastic, vocab), choice)
    state.clear()

    results = []
    for budget, (reference, choice) in references.items():
        out = work / f"nested_{budget:g}"
        summary = extract_nested(ckpt, budget, out, interpolate=budget == INTERPOLATED)
        model, small_cfg, saved = _plain_model(out, Layout())
        torch.save({"logits": reference, "choice": choice}, work / f"ref_{budget:g}.pt")
        results.append(
            {
                "budget": budget,
                "choice": choice,
                "summary": summary,
                "meta_kind": saved["kind"],
                "meta_choice": saved["choice"],
                "has_elastic_section": "elastic" in saved["config"],
                "hidden": small_cfg.model.hidden_size,
                "reordered": saved.get("reordered"),
                "classes": sorted(
                    {f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()}
                ),
                "num_params": sum(p.numel() for p in model.parameters()),
                "diff": (_logits(model, vocab) - reference).abs().max().item(),
                "vs_full": (reference - full).abs().max().item(),
                "tmp_left": out.with_name(out.name + ".tmp").exists(),
            }
        )

    # interrupted: the dist-checkpoint save dies after writing a file into <out>.tmp
    out = work / "interrupted"
    original = dist_checkpointing.save

    def dying_save(state_dict, directory, *args, **kwargs):
        (Path(directory) / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("killed mid-save")

    dist_checkpointing.save = dying_save
    try:
        extract_nested(ckpt, 0.4, out)
        interrupted = "no error"
    except RuntimeError as exc:
        interrupted = str(exc)
    finally:
        dist_checkpointing.save = original
    after_crash = {"out": out.exists(), "tmp": out.with_name(out.name + ".tmp").exists()}
    rerun = extract_nested(ckpt, 0.4, out)
    model, _, _ = _plain_model(out, Layout())
    rerun_diff = (_logits(model, vocab) - references[0.4][0]).abs().max().item()
    # a target layout the interpolated choice cannot split under, found after the router ran
    try:
        extract_nested(ckpt, INTERPOLATED, work / "bad_target", interpolate=True, target=(1, 1, 16))
        target_error = ""
    except ConfigError as exc:
        target_error = str(exc)
    return {
        "ckpt": str(ckpt),
        "results": results,
        "interrupted": interrupted,
        "after_crash": after_crash,
        "rerun_out": rerun["out"],
        "rerun_diff": rerun_diff,
        "rerun_tmp_left": out.with_name(out.name + ".tmp").exists(),
        "bad_target_exists": (work / "bad_target").exists(),
        "target_error": target_error,
    }


def tp2_case(workdir: str, budget: float) -> dict:
    """2 ranks: the extracted checkpoint under TP=2 (plain Megatron) vs the elastic logits."""
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    model, cfg, _ = _plain_model(
        work / f"nested_{budget:g}", Layout(tp=2, sequence_parallel=True)
    )  # MoE + TP needs SP
    ref = torch.load(work / f"ref_{budget:g}.pt")
    logits = _logits(model, cfg.model.vocab_size)
    local = sum(p.numel() for p in model.parameters())
    return {
        "diff": (logits - ref["logits"]).abs().max().item(),
        "local_params": local,
        "tp": model.config.tensor_model_parallel_size,
    }


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def extracted(rank_pools, tmp_path_factory):
    work = tmp_path_factory.mktemp("extract")
    (result,) = rank_pools.get(1).run(f"{HERE}:extract_case", workdir=str(work))
    return work, result


@pytest.mark.integration
def test_extracted_model_is_plain_megatron_with_the_elastic_logits(extracted):
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.config import load_config
    from elastic_plugin.models.counting import count_parameters

    _, r = extracted
    model_cfg = load_config(CONFIG).model
    budgets = [row["budget"] for row in r["results"]]
    assert sorted(budgets) == sorted([1.0, 0.77, 0.4, INTERPOLATED])
    for row in r["results"]:
        print(
            f"budget {row['budget']:g}: {row['choice']} max |plain - elastic| = {row['diff']:.2e}"
        )
        assert row["diff"] <= TOL, row
        elastic = [
            c
            for c in row["classes"]
            if c.startswith("elastic_plugin.elastic.") or "Elastic" in c or "BudgetRouter" in c
        ]
        assert not elastic, elastic
        assert "megatron.core.models.hybrid.hybrid_model.HybridModel" in row["classes"]
        assert row["meta_kind"] == "extracted" and not row["has_elastic_section"]
        assert row["meta_choice"] == row["choice"] == row["summary"]["choice"]
        assert row["summary"]["interpolated"] == (row["budget"] == INTERPOLATED)
        assert row["hidden"] == row["choice"]["embedding"]
        counts = count_parameters(model_for_choice(model_cfg, row["choice"]))
        assert row["summary"]["params"] == {"total": counts.total, "active": counts.active}
        assert row["num_params"] == counts.total
        assert row["summary"]["bytes"] > 4 * counts.total  # float32 weights on disk
        assert row["reordered"] is True and not row["tmp_left"]
    smallest = min(r["results"], key=lambda row: row["budget"])
    assert smallest["choice"] == SMALL
    assert smallest["summary"]["params"]["total"] < 0.5 * count_parameters(model_cfg).total
    assert smallest["vs_full"] > 1e-3  # the nested model really differs from the full one


@pytest.mark.integration
def test_interrupted_extraction_leaves_no_output_and_reruns(extracted):
    _, r = extracted
    assert r["interrupted"] == "killed mid-save"
    assert r["after_crash"] == {"out": False, "tmp": True}
    assert r["rerun_diff"] <= TOL and not r["rerun_tmp_left"]
    assert r["target_error"].startswith("--target-expert-model-parallel-size 16:")
    assert "num_moe_experts" in r["target_error"] and not r["bad_target_exists"]


@pytest.mark.integration
def test_extracted_checkpoint_loads_under_tensor_parallel(rank_pools, extracted):
    work, r = extracted
    budget = 0.4
    results = rank_pools.get(2).run(f"{HERE}:tp2_case", workdir=str(work), budget=budget)
    total = next(row for row in r["results"] if row["budget"] == budget)["num_params"]
    for res in results:
        assert res["tp"] == 2 and res["diff"] <= TOL, res
        assert res["local_params"] < total  # really sharded


# ------------------------------------------------------------------------------ CLI input
def _fake_ckpt(path: Path, **meta_changes) -> Path:
    """An elastic checkpoint's metadata (no weights: every check happens before loading)."""
    from elastic_plugin.models.config import load_config
    from tests.support.elastic_cases import ELASTIC

    path.mkdir(parents=True)
    cfg = load_config(CONFIG)
    small = {
        "embedding": 64,
        "ffn": 128,
        "shared_ffn": 64,
        "attention_heads": 2,
        "mamba_heads": 4,
        "mamba_head_dim": 8,
        "experts": 4,
    }
    meta = {
        "kind": "elastic",
        "layout": {"tp": 1, "pp": 1, "ep": 1},
        "config": cfg.to_dict() | {"elastic": ELASTIC},
        "elastic": {
            "budgets": [1.0, 0.77, 0.4],
            "choices": {"1": {**small, "embedding": 128}, "0.77": small, "0.4": small},
        },
    }
    meta.update(meta_changes)
    (path / "elastic_meta.json").write_text(json.dumps(meta))
    (path / "metadata.json").write_text("{}")
    return path


@pytest.fixture
def no_extraction(monkeypatch):
    import elastic_plugin.export.cli as cli

    def refuse(*_args, **_kwargs):
        raise AssertionError("bad input reached the extraction")

    monkeypatch.setattr(cli, "run_extraction", refuse)


def test_bad_input_exits_2_with_clear_messages_and_writes_nothing(tmp_path, no_extraction, capsys):
    from elastic_plugin.cli import main

    good = _fake_ckpt(tmp_path / "good")
    hetero = _fake_ckpt(
        tmp_path / "hetero",
        elastic={
            "budgets": [1.0, 0.5],
            "choices": {"1": {"ffn": [256, 256]}, "0.5": {"ffn": [256, 128]}},
        },
    )
    teacher = _fake_ckpt(tmp_path / "teacher", kind="reordered")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "metadata.json").write_text("{}")
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    (full_dir / "x").write_text("x")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    cases = [
        (["--ckpt", str(tmp_path / "nope")], "no such checkpoint directory"),
        (["--ckpt", str(incomplete)], "not a complete checkpoint"),
        (["--ckpt", str(teacher)], "kind='reordered', not an elastic checkpoint"),
        (["--budget", "0.6"], "--budget 0.6 was not trained; trained budgets: 1, 0.77, 0.4"),
        (
            ["--budget", "0.3", "--interpolate"],
            "--budget 0.3 is outside the trained range [0.4, 1]",
        ),
        (["--budget", "1.2", "--interpolate"], "outside the trained range"),
        (["--budget", "nan"], "not a number"),
        (
            ["--target-tensor-model-parallel-size", "4"],
            "--target-tensor-model-parallel-size 4: the extracted model (budget 0.4) does not split "
            "this way: model.num_attention_heads=2 is not divisible by the tensor-parallel size 4",
        ),
        (["--target-expert-model-parallel-size", "8"], "model.num_moe_experts=4"),
        (["--target-pipeline-model-parallel-size", "3"], "--target-pipeline-model-parallel-size 3"),
        (
            ["--target-tensor-model-parallel-size", "0"],
            "--target-tensor-model-parallel-size 0: must be >= 1",
        ),
        (["--ckpt", str(hetero), "--budget", "0.5"], "per-layer sizes (ffn=[256, 128])"),
        (["--out", str(full_dir)], f"--out {full_dir}: exists and is not an empty directory"),
        (["--out", str(good / "elastic_meta.json")], "exists and is not an empty directory"),
    ]
    for extra, message in cases:
        args = {"--ckpt": str(good), "--budget": "0.4", "--out": str(out)}
        flags = []
        for i, item in enumerate(extra):
            if item in args:
                args[item] = extra[i + 1]
            elif i == 0 or extra[i - 1] not in args:
                flags.append(item)
        argv = ["extract", *[x for kv in args.items() for x in kv], *flags]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("elastic-plugin extract: error: ") and message in err, (argv, err)
        assert not out.exists() and not Path(str(out) + ".tmp").exists()
    assert sorted(p.name for p in full_dir.iterdir()) == ["x"]
    # the same interpolated request is accepted at the input stage (the empty --out is fine too)
    from elastic_plugin.export.extract import plan_extraction

    plan = plan_extraction(good, 0.6, tmp_path / "empty", interpolate=True)
    assert plan.choice is None and plan.budget == 0.6
    plan = plan_extraction(good, 0.77, out, target=(2, 1, 4))
    assert plan.choice["attention_heads"] == 2 and plan.target == (2, 1, 4)


@pytest.mark.integration
def test_bad_input_in_a_fresh_process_imports_no_megatron(tmp_path):
    import subprocess
    import sys

    good = _fake_ckpt(tmp_path / "good")
    code = (
        "import sys; from elastic_plugin.cli import main; rc = main(['extract', '--ckpt', "
        f"{str(good)!r}, '--budget', '0.5', '--out', {str(tmp_path / 'o')!r}]); "
        "print(rc, 'megatron' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc
    assert "--budget 0.5 was not trained" in proc.stderr
