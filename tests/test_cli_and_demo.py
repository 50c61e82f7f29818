"""The ``elastic-plugin`` entry point and the main job's first stage (teacher training):
bad input fails before any work; a short run trains, plots and checkpoints; the checkpoint
gives the same validation loss when loaded under another parallel layout; torchrun works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_plugin.checkpoint.history import resolve_checkpoint
from elastic_plugin.checkpoint.meta import read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny.yaml"
NANO = ROOT / "examples" / "configs" / "nemotron_nano_v3.yaml"
CLI = [sys.executable, "-m", "elastic_plugin.cli"]


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.integration
def test_params_json_for_nemotron_nano_v3():
    proc = run_cli("params", "--config", str(NANO), "--json")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout)
    assert counts["total"] == pytest.approx(31.6e9, rel=0.015)
    assert counts["active"] == pytest.approx(3.6e9, rel=0.015)


@pytest.mark.integration
def test_info_json_reports_backends():
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["megatron_core"] == "0.19.2"
    assert info["device"] == "cpu" and info["distributed_backend"] == "gloo"
    assert info["mamba_ops"].startswith("pytorch")
    assert info["extension"]["backend"] in ("cpp", "cpp+cuda", "pytorch")
    # no GPU here: both the elastic student and a frozen teacher get the local spec, with why
    assert {role: spec.split(" ")[0] for role, spec in info["layer_spec"].items()} == {
        "student": "local",
        "teacher": "local",
    }


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--tensor-model-parallel-size", "3"], "num_attention_heads=4 is not divisible"),
        (["--train-iters", "0"], "--train-iters=0"),
        (
            ["--data-path", "/nonexistent/prefix", "--tokenizer", "x.json"],
            "--data-path /nonexistent/prefix",
        ),
        (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible"),
    ],
)
@pytest.mark.integration
def test_train_rejects_bad_input_before_work(tmp_path, args, needle):
    out = tmp_path / "out"
    proc = run_cli("train", "--config", str(TINY), "--out", str(out), *args, timeout=600)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert not out.exists(), "nothing may be written for bad input"


@pytest.mark.integration
def test_train_rejects_unknown_config_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        TINY.read_text().replace("hidden_size: 128", "hidden_size: 128\n  hiden_size: 3")
    )
    proc = run_cli("train", "--config", str(bad), "--out", str(tmp_path / "o"), timeout=600)
    assert proc.returncode == 2 and "hiden_size" in proc.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short teacher run of the tiny model (single process, as `make demo QUICK=1`)."""
    out = tmp_path_factory.mktemp("demo")
    proc = run_cli(
        "train",
        "--config",
        str(TINY),
        "--out",
        str(out),
        "--quick",
        "--train-iters",
        "40",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(proc.stdout[proc.stdout.index("{") :])


@pytest.mark.integration
def test_short_teacher_run_trains_plots_and_checkpoints(trained):
    out, summary = trained
    metrics = [
        json.loads(line) for line in (out / "teacher_metrics.jsonl").read_text().splitlines()
    ]
    losses = [m["train_loss"] for m in metrics if "train_loss" in m]
    assert len(losses) >= 3 and losses[-1] < 0.6 * losses[0], losses
    assert summary["valid_loss"] is not None and summary["valid_loss"] < 3.0
    assert (out / "teacher_loss.png").stat().st_size > 10_000
    ckpt = out / "checkpoints" / "teacher"  # Megatron-LM's layout: iter_NNNNNNN + the pointer
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    meta = json.loads((ckpt / "iter_0000040" / "elastic_meta.json").read_text())
    assert meta["iteration"] == 40 and meta["kind"] == "teacher"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000040",
        "latest_checkpointed_iteration.txt",
    ]
    assert (out / "data" / "train_text_document.bin").is_file()


@pytest.mark.integration
def test_checkpoint_gives_same_loss_under_other_layouts(trained, rank_pools):
    out, _ = trained
    kwargs = dict(ckpt_dir=str(out / "checkpoints" / "teacher"), data_dir=str(out / "data"))
    pool = rank_pools.get(1)
    (reference,) = pool.run("tests.support.cases:eval_loss_from_checkpoint", **kwargs)
    pool = rank_pools.get(2)
    tp = pool.run(
        "tests.support.cases:eval_loss_from_checkpoint",
        tp=2,
        sequence_parallel=True,
        **kwargs,
    )
    pp = pool.run("tests.support.cases:eval_loss_from_checkpoint", pp=2, **kwargs)
    ep = pool.run("tests.support.cases:eval_loss_from_checkpoint", ep=2, **kwargs)
    assert reference is not None and reference < 3.0
    for losses in (tp, pp, ep):
        assert losses == [pytest.approx(reference, rel=1e-5)] * 2


@pytest.mark.integration
def test_train_under_torchrun_with_tensor_parallel(tmp_path, trained):
    """The user path: torchrun + the CLI, TP=2 with SP on 2 ranks, reusing the data."""
    out_seed, _ = trained
    out = tmp_path / "tr"
    out.mkdir()
    shutil.copytree(out_seed / "data", out / "data")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "elastic_plugin.cli",
        "train",
        "--config",
        str(TINY),
        "--out",
        str(out),
        "--quick",
        "--train-iters",
        "12",
        "--no-progress",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    meta = read_checkpoint_meta(out / "checkpoints" / "teacher")
    assert meta["layout"]["tp"] == 2 and summary["iterations"] == 12
    assert summary["train_loss"] < 4.0


@pytest.mark.integration
def test_importance_and_reorder_cli_keep_the_function(trained, tmp_path, rank_pools):
    out, _ = trained
    scores = tmp_path / "scores.pt"
    proc = run_cli(
        "importance",
        "--ckpt",
        str(out / "checkpoints" / "teacher"),
        "--out",
        str(scores),
        "--num-samples",
        "32",
        "--micro-batch-size",
        "8",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "embedding, ffn, shared_ffn, attention_heads, mamba, experts" in proc.stdout
    reordered = tmp_path / "reordered"
    proc = run_cli(
        "reorder",
        "--ckpt",
        str(out / "checkpoints" / "teacher"),
        "--scores",
        str(scores),
        "--out",
        str(reordered),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = resolve_checkpoint(reordered)  # at the teacher's iteration, permutations inside
    meta = json.loads((saved / "elastic_meta.json").read_text())
    assert saved.name == f"iter_{meta['iteration']:07d}" and meta["reordered"] is True
    assert "permutations.safetensors" in meta["files"]  # digested with the weights
    from elastic_plugin.importance.reorder import Permutations

    assert Permutations.load(saved / "permutations.safetensors").embedding is not None
    data = dict(data_dir=str(out / "data"))
    pool = rank_pools.get(1)
    (teacher,) = pool.run(
        "tests.support.cases:eval_loss_from_checkpoint",
        ckpt_dir=str(out / "checkpoints" / "teacher"),
        **data,
    )
    (same,) = pool.run(
        "tests.support.cases:eval_loss_from_checkpoint", ckpt_dir=str(reordered), **data
    )
    pool = rank_pools.get(2)
    tp2 = pool.run(
        "tests.support.cases:eval_loss_from_checkpoint",
        ckpt_dir=str(reordered),
        tp=2,
        sequence_parallel=True,
        **data,
    )
    assert same == pytest.approx(teacher, rel=1e-5)
    assert tp2 == [pytest.approx(teacher, rel=1e-5)] * 2


@pytest.mark.integration
def test_importance_cli_rejects_short_calibration_and_missing_ckpt(trained, tmp_path):
    out, _ = trained
    proc = run_cli(
        "importance",
        "--ckpt",
        str(out / "checkpoints" / "teacher"),
        "--out",
        str(tmp_path / "s.pt"),
        "--num-samples",
        "1000000",
        "--no-progress",
    )
    assert proc.returncode == 2 and "fewer than num_samples=1000000" in proc.stderr
    proc = run_cli(
        "reorder",
        "--ckpt",
        str(tmp_path / "nope"),
        "--scores",
        "x.pt",
        "--out",
        str(tmp_path / "o"),
    )
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr
    assert not (tmp_path / "s.pt").exists() and not (tmp_path / "o").exists()


@pytest.mark.integration
def test_importance_and_reorder_under_torchrun(trained, tmp_path, rank_pools):
    """The CLIs under torchrun: scores under TP=2+SP rank like one process; a reorder written
    under EP=2 keeps the teacher's validation loss."""

    from elastic_plugin.importance import ImportanceScores, rankings_agree

    out, _ = trained
    teacher = str(out / "checkpoints" / "teacher")

    def torchrun(*args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "elastic_plugin.cli",
            *args,
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    single, tp2 = tmp_path / "single.pt", tmp_path / "tp2.pt"
    proc = run_cli(
        "importance",
        "--ckpt",
        teacher,
        "--out",
        str(single),
        "--num-samples",
        "16",
        "--micro-batch-size",
        "8",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    torchrun(
        "importance",
        "--ckpt",
        teacher,
        "--out",
        str(tp2),
        "--num-samples",
        "16",
        "--micro-batch-size",
        "8",
        "--no-progress",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    )
    a, b = ImportanceScores.load(single), ImportanceScores.load(tp2)
    assert a.axes() == b.axes()
    assert rankings_agree(a.embedding, b.embedding)
    for axis in ("ffn", "attention_heads", "experts"):
        for layer in getattr(a, axis):
            assert torch.allclose(getattr(a, axis)[layer], getattr(b, axis)[layer], rtol=1e-5)
    reordered = tmp_path / "reordered_ep2"
    torchrun(
        "reorder",
        "--ckpt",
        teacher,
        "--scores",
        str(single),
        "--out",
        str(reordered),
        "--expert-model-parallel-size",
        "2",
    )
    data = dict(data_dir=str(out / "data"))
    (reference,) = rank_pools.get(1).run(
        "tests.support.cases:eval_loss_from_checkpoint", ckpt_dir=teacher, **data
    )
    (loss,) = rank_pools.get(1).run(
        "tests.support.cases:eval_loss_from_checkpoint", ckpt_dir=str(reordered), **data
    )
    assert loss == pytest.approx(reference, rel=1e-5)


def _teacher_config(tmp_path: Path) -> Path:
    """The tiny model with a 6-iteration schedule logged every iteration (one loss per step)."""
    import yaml

    cfg = yaml.safe_load(TINY.read_text())
    cfg["training"].update(
        train_iters=6,
        log_interval=1,
        eval_interval=3,
        eval_iters=1,
        micro_batch_size=4,
        global_batch_size=8,
        lr_warmup_iters=2,
    )
    cfg["data"].update(num_train=2000, num_valid=64)
    path = tmp_path / "teacher6.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trace(out: Path) -> list[float]:
    """Iteration, train and validation loss of every record, flattened (NaN where absent)."""
    lines = (out / "teacher_metrics.jsonl").read_text().splitlines()
    return [
        float(value if value is not None else "nan")
        for m in map(json.loads, lines)
        for value in (m["iteration"], m.get("train_loss"), m.get("valid_loss"))
    ]


@pytest.mark.integration
def test_train_saves_history_and_resumes_past_a_damaged_save(tmp_path):
    """`train --save-interval/--resume`: a teacher run preempted by SIGTERM (the scheduler's
    signal, injected at iteration 4) saves at that step boundary and exits 0; its newest save
    is then damaged, and the resumed run continues from the save before it and ends exactly
    where an uninterrupted run ends (same loss trace, bit-identical weights and optimizer
    state). (`--stop-after` is covered by test_elastic_cli's TP2 stop-and-resume.)"""
    from tests.support.integrity_cases import flip_middle

    config = _teacher_config(tmp_path)
    base = ["train", "--config", str(config), "--no-progress"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    proc = run_cli(*base, "--out", str(whole))
    assert proc.returncode == 0, proc.stderr[-4000:]

    preempt = {"ELASTIC_PLUGIN_FAULT": "train.step@4:action=preempt"}
    proc = run_cli(*base, "--out", str(part), "--save-interval", "2", env=preempt)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert stopped["preempted_by"] == "SIGTERM" and stopped["iterations"] == 4
    assert "stopped_at" in stopped
    stage = part / "checkpoints" / "teacher"
    assert sorted(p.name for p in stage.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert (stage / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    flip_middle(max((stage / "iter_0000004").glob("*.distcp"), key=lambda p: p.stat().st_size))

    proc = run_cli(*base, "--out", str(part))  # a rerun never overwrites saved training
    assert proc.returncode == 2 and "already holds a teacher checkpoint" in proc.stderr
    assert "pass --resume" in proc.stderr
    proc = run_cli(*base, "--out", str(part), "--resume", "--train-iters", "8")
    assert proc.returncode == 2 and "training.train_iters=6 (now 8)" in proc.stderr

    proc = run_cli(*base, "--out", str(part), "--resume", "--save-interval", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resume: skipped iter_0000004:" in proc.stdout
    assert "continuing from iter_0000002" in proc.stdout
    assert _trace(part) == pytest.approx(_trace(whole), rel=1e-6, nan_ok=True)
    assert _trace(part)[::3] == [1, 2, 3, 4, 5, 6]  # one trace, no repeated iterations
    # --keep-last 2 (the default): the damaged save was rewritten, the oldest pruned
    assert sorted(p.name for p in stage.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    done, ref = (
        json.loads(
            (d / "checkpoints" / "teacher" / "iter_0000006" / "elastic_meta.json").read_text()
        )
        for d in (part, whole)
    )
    # every weight and optimizer byte as uninterrupted (DCP's .metadata also holds the paths)
    data = sorted(name for name in ref["files"] if name != ".metadata")
    assert data and [done["files"][n] for n in data] == [ref["files"][n] for n in data]
    assert done["consumed_samples"] == 48

    proc = run_cli(*base, "--out", str(part), "--resume")  # finished: nothing to train
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert summary["already_trained"] is True and summary["iterations"] == 6
