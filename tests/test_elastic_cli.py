"""The user-facing entry points of elastic training: ``elastic-plugin elastic-train``, the example
config, ``examples/pretrain_elastic.py`` (Megatron-LM's loop) and the SLURM launchers.

Bad input must fail with exit code 2 and a message naming the flag before anything is built; a
real run under torchrun (TP=2 + SP) trains, checkpoints, plots, and resumes where it stopped; the
Megatron-LM script composes with Megatron-LM's parser and its forward step distils from a teacher
that computes what the student computes at full width; the launchers build command lines our
parser (and torchrun's) accept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic_plugin.checkpoint.meta import read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny.yaml"
TINY_ELASTIC = ROOT / "examples" / "configs" / "tiny_elastic.yaml"
PRETRAIN = ROOT / "examples" / "pretrain_elastic.py"
SLURM = ROOT / "examples" / "slurm"
CLI = [sys.executable, "-m", "elastic_plugin.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
PREFIX = "elastic-plugin elastic-train: error: "


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**ENV, **(env or {})},
    )


def torchrun(*args: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--standalone",
        "-m",
        "elastic_plugin.cli",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


def json_out(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout[proc.stdout.index("{") :])


# ------------------------------------------------------------------------------ the config
def test_tiny_elastic_config_loads_resolves_and_keeps_the_tiny_model():
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.models.config import load_config

    cfg, tiny = load_config(TINY_ELASTIC), load_config(TINY)
    assert (cfg.model, cfg.training, cfg.data) == (tiny.model, tiny.training, tiny.data)
    ecfg = ElasticConfig.from_dict(cfg.elastic, source=str(TINY_ELASTIC))
    assert ecfg.budgets == (1.0, 0.77, 0.4) and ecfg.budget_metric == "total_params"
    assert [s.budget_probs for s in ecfg.curriculum] == [None, (0.2, 0.3, 0.5)]
    assert (
        ecfg.router.freeze_after == 500
        and ecfg.router.freeze_select == "loss"
        and sum(s.iters for s in ecfg.curriculum) == 1500
    )
    for tp, ep in ((1, 1), (2, 2)):
        resolved = ecfg.resolve(cfg.model, tp, ep)
        assert resolved.axes["ffn"].candidates == (256, 192, 128)
        assert resolved.axes["attention_heads"].candidates == (4, 2)
        assert resolved.axes["experts"].candidates == (8, 6, 4)


# ------------------------------------------------------------------------------ bad input
def _write_ckpt(path: Path, config: dict, **meta) -> Path:
    """What the input checks read of a checkpoint: its metadata (no weights needed)."""
    path.mkdir(parents=True)
    (path / "elastic_meta.json").write_text(json.dumps({"config": config, **meta}))
    (path / "metadata.json").write_text("{}")
    return path


@pytest.fixture()
def fake(tmp_path):
    """A reordered and a plain checkpoint of the tiny model, plus a place for --out."""
    config = yaml.safe_load(TINY.read_text())
    reordered = _write_ckpt(tmp_path / "reordered", config, kind="reordered", reordered=True)
    plain = _write_ckpt(tmp_path / "plain", config, kind="teacher", reordered=False)
    return {
        "tmp": tmp_path,
        "reordered": str(reordered),
        "plain": str(plain),
        "out": str(tmp_path / "out"),
        "config": config,
    }


@pytest.fixture()
def no_training(monkeypatch):
    """In-process runs of the CLI: reaching the training part is a test failure."""
    from elastic_plugin.elastic import command

    def refuse(*_args, **_kwargs):
        raise AssertionError("bad input reached the training part")

    monkeypatch.setattr(command, "train", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def _yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _bad_cases(f: dict) -> list[tuple[list[str], dict, str]]:
    """(arguments, environment, text the error must contain)."""
    tmp, ck = f["tmp"], f["reordered"]
    incomplete = tmp / "incomplete"
    incomplete.mkdir()
    (incomplete / "elastic_meta.json").write_text(json.dumps({"config": f["config"]}))
    other_model = {**f["config"], "model": {**f["config"]["model"], "hidden_size": 64}}
    bad_elastic = {**f["config"], "elastic": {"budgets": [0.5, 1.0]}}
    long_stage = {**f["config"], "elastic": {"curriculum": [{"iters": 5, "seq_length": 256}]}}
    return [
        (["--ckpt", str(tmp / "missing")], {}, f"--ckpt {tmp / 'missing'}: no such checkpoint"),
        (["--ckpt", str(incomplete)], {}, "not a complete checkpoint"),
        (
            ["--ckpt", f["plain"], "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            {"WORLD_SIZE": "2"},
            "run `elastic-plugin importance",
        ),
        (
            ["--ckpt", ck, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            {},
            "world size 1 is not divisible by --tensor-model-parallel-size (2)",
        ),
        (
            ["--ckpt", ck, "--expert-model-parallel-size", "3"],
            {"WORLD_SIZE": "3"},
            "model.num_moe_experts=8 is not divisible by the expert-parallel size 3",
        ),
        (
            ["--ckpt", ck, "--tensor-model-parallel-size", "2"],
            {"WORLD_SIZE": "2"},
            "need --sequence-parallel",
        ),
        (
            ["--ckpt", ck, "--context-parallel-size", "0"],
            {},
            "--context-parallel-size=0: must be an int >= 1",
        ),
        (
            ["--ckpt", ck, "--context-parallel-size", "2"],
            {},
            "x --context-parallel-size (2)",
        ),
        (
            ["--ckpt", ck, "--context-parallel-size", "4"],
            {"WORLD_SIZE": "4"},
            "--context-parallel-size=4 must divide the Mamba groups per tensor-parallel rank",
        ),
        (
            ["--ckpt", ck, "--context-parallel-size", "2", "--seq-length", "30"],
            {"WORLD_SIZE": "2"},
            "--context-parallel-size=2 needs a sequence length divisible by 2 x 2 = 4",
        ),
        (
            ["--ckpt", ck, "--elastic-budgets", "1.0", "0.1"],
            {},
            "--elastic-budgets: elastic.budgets: budget 0.1 is not reachable",
        ),
        (
            ["--ckpt", ck, "--config", _yaml(tmp / "bad.yaml", bad_elastic)],
            {},
            f"--config {tmp / 'bad.yaml'}: elastic.budgets=[0.5, 1.0]",
        ),
        (
            ["--ckpt", ck, "--config", _yaml(tmp / "other.yaml", other_model)],
            {},
            "its model differs from the checkpoint's (model.hidden_size: 64 vs 128)",
        ),
        (
            ["--ckpt", ck, "--elastic-soft-masks"],
            {},
            "--elastic-soft-masks needs --elastic-mode masked",
        ),
        (["--ckpt", ck, "--teacher-ckpt", str(tmp / "nope")], {}, f"--teacher-ckpt {tmp / 'nope'}"),
        (["--ckpt", ck, "--train-iters", "0"], {}, "--train-iters=0 must be > 0"),
        (["--ckpt", ck, "--lr", "1e-4", "--min-lr", "1e-3"], {}, "--min-lr=0.001 must be <= --lr"),
        (
            ["--ckpt", ck, "--global-batch-size", "24"],
            {},
            "--global-batch-size=24 must be a multiple of --micro-batch-size=16",
        ),
        (
            ["--ckpt", ck, "--seq-length", "512"],
            {},
            "--seq-length=512 exceeds model.max_sequence_length",
        ),
        (
            ["--ckpt", ck, "--config", _yaml(tmp / "long.yaml", long_stage)],
            {},
            "elastic.curriculum[0].seq_length=256 exceeds --seq-length=128",
        ),
        (
            ["--ckpt", ck, "--data-path", "/nonexistent/prefix", "--tokenizer", "t.json"],
            {},
            "--data-path /nonexistent/prefix",
        ),
        (["--ckpt", ck, "--bf16", "--fp16"], {}, "--bf16 and --fp16 are mutually exclusive"),
        (["--ckpt", ck, "--fp16"], {}, "--fp16 is not supported"),
        (["--ckpt", ck, "--recompute-method", "uniform"], {}, "--recompute-method needs"),
        (
            ["--ckpt", ck, "--recompute-granularity", "full"],
            {},
            "--recompute-granularity full needs --recompute-method",
        ),
        (
            ["--ckpt", ck, "--recompute-granularity", "selective", "--recompute-num-layers", "2"],
            {},
            "--recompute-num-layers contradicts --recompute-granularity selective",
        ),
        (
            [
                "--ckpt",
                ck,
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "99",
            ],
            {},
            "--recompute-num-layers=99 exceeds the",
        ),  # fmt: skip
        (["--ckpt", ck, "--recompute-granularity", "some"], {}, "allowed: full, selective"),
    ]


def test_bad_input_exits_2_naming_the_flag_before_any_work(fake, no_training, monkeypatch, capsys):
    from elastic_plugin.cli import main

    for args, env, needle in _bad_cases(fake):
        for key in ("WORLD_SIZE",):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        rc = main(["elastic-train", *args, "--out", fake["out"]])
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        assert err.startswith(PREFIX), err
        assert needle in err, (needle, err)
        assert not Path(fake["out"]).exists(), "nothing may be written for bad input"


def test_a_curriculum_in_tokens_is_counted_in_the_runs_iterations(fake, monkeypatch, capsys):
    """A stage of tokens lasts ceil(tokens / (global batch x its sequence length)) iterations of
    this run: 16 x 64 x 1000 tokens at sequence length 64 are 1000 iterations, 16 x 128 x 300 at
    the run's 128 are 300, so the stages cover 1300 iterations, more than the run's 300 (warned)."""
    from elastic_plugin.cli import main
    from elastic_plugin.elastic import command
    from elastic_plugin.elastic.config import CurriculumStage

    seen = []
    monkeypatch.setattr(command, "train", lambda inputs, args: seen.append(inputs) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    stages = [{"tokens": 16 * 64 * 1000, "seq_length": 64}, {"tokens": 16 * 128 * 300}]
    config = {**fake["config"], "elastic": {"curriculum": stages}}
    path = _yaml(fake["tmp"] / "tokens.yaml", config)
    rc = main(
        ["elastic-train", "--ckpt", fake["reordered"], "--config", path, "--out", fake["out"]]
    )
    assert rc == 0, capsys.readouterr().err
    ecfg, sched = seen[0].ecfg, seen[0].schedule
    assert (sched["global_batch_size"], sched["seq_length"], sched["train_iters"]) == (
        16,
        128,
        300,
    )
    assert ecfg.curriculum_in_iterations(16, 128) == (
        CurriculumStage(1000, None, 64),
        CurriculumStage(300),
    )
    err = capsys.readouterr().err
    assert "elastic.curriculum covers 1300 iterations but the run has 300" in err


@pytest.mark.integration
def test_bad_input_in_a_fresh_process_imports_no_megatron(fake):
    """The exit code and message as a user sees them, and proof that no model code ran."""
    code = (
        "import sys; from elastic_plugin.cli import main; rc = main(sys.argv[1:]); "
        "print('megatron' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "elastic-train",
            "--ckpt",
            fake["reordered"],
            "--out",
            fake["out"],
            "--elastic-experts-sizes",
            "8",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(PREFIX) and "--elastic-experts-sizes" in proc.stderr
    assert proc.stdout.strip() == "False"


def _write_elastic_run(f: dict, iteration: int, train_iters: int, **layout) -> Path:
    """An elastic checkpoint's metadata in --out as train_elastic writes it."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.schedule import STUDENT_DEFAULTS
    from elastic_plugin.parallel import Layout

    out = Path(f["out"])
    meta = {
        "kind": "elastic",
        "iteration": iteration,
        "consumed_samples": 16 * iteration,
        "layout": dataclasses.asdict(Layout(**layout)),
        "config": {**f["config"], "elastic": ElasticConfig().to_dict()},
        "elastic": {"choices": {"1": {"ffn": 256}}},
        "teacher_valid_loss": 1.5,
        "scheduler": {
            "max_lr": STUDENT_DEFAULTS["lr"],
            "min_lr": STUDENT_DEFAULTS["min_lr"],
            "lr_decay_steps": train_iters,
        },
    }
    _write_ckpt(out / "checkpoints" / "elastic", meta.pop("config"), **meta)
    (out / "elastic_metrics.jsonl").write_text(
        json.dumps({"iteration": iteration, "valid_loss": {"1": 1.6, "0.77": 1.7}}) + "\n"
    )
    return out


def test_resume_checks_the_saved_run(fake, no_training, monkeypatch, capsys):
    from elastic_plugin.cli import main

    _write_elastic_run(fake, iteration=4, train_iters=300)
    base = ["elastic-train", "--ckpt", fake["reordered"], "--out", fake["out"]]
    cases = [
        ([], {}, "already holds an elastic checkpoint"),
        (
            ["--resume", "--elastic-budgets", "1.0", "0.5"],
            {},
            "other elastic settings (elastic.budgets)",
        ),
        (["--resume", "--train-iters", "100"], {}, "was trained with --train-iters 300, not 100"),
        (["--resume", "--bf16"], {}, "was trained in float32"),
        (
            ["--resume", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            {"WORLD_SIZE": "2"},
            "resume with the same layout flags",
        ),
    ]
    for args, env, needle in cases:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(PREFIX) and needle in err, err
        monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_resume_of_a_finished_run_reports_it_and_trains_nothing(fake, no_training, capsys):
    from elastic_plugin.cli import main

    _write_elastic_run(fake, iteration=300, train_iters=300)
    rc = main(["elastic-train", "--ckpt", fake["reordered"], "--out", fake["out"], "--resume"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert summary["already_finished"] and summary["iterations"] == 300
    assert summary["valid_loss"] == {"1": 1.6, "0.77": 1.7}
    assert summary["choices"] == {"1": {"ffn": 256}}


# ------------------------------------------------------------------------------ a real run
SMALL_TRAINING = {
    "seq_length": 64,
    "micro_batch_size": 4,
    "global_batch_size": 4,
    "train_iters": 6,
    "eval_iters": 1,
    "eval_interval": 6,
    "log_interval": 2,
    "lr_warmup_iters": 1,
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """teacher -> importance -> reorder through the CLIs, on a small copy of tiny_elastic.yaml."""
    run = tmp_path_factory.mktemp("elastic_cli")
    config = yaml.safe_load(TINY_ELASTIC.read_text())
    config["training"].update(SMALL_TRAINING)
    config["data"].update(num_train=400, num_valid=40)
    config["elastic"]["curriculum"] = [
        {"iters": 2, "seq_length": 32},
        {"iters": 2, "budget_probs": [0.5, 0.3, 0.2]},
    ]
    cfg_path = run / "small_elastic.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    timings = {}
    for name, args in (
        ("train", ["train", "--config", str(cfg_path), "--out", str(run), "--no-progress"]),
        (
            "importance",
            [
                "importance",
                "--ckpt",
                str(run / "checkpoints" / "teacher"),
                "--out",
                str(run / "scores.pt"),
                "--num-samples",
                "16",
                "--micro-batch-size",
                "4",
                "--no-progress",
            ],
        ),
        (
            "reorder",
            [
                "reorder",
                "--ckpt",
                str(run / "checkpoints" / "teacher"),
                "--scores",
                str(run / "scores.pt"),
                "--out",
                str(run / "checkpoints" / "reordered"),
            ],
        ),
    ):
        start = time.time()
        proc = run_cli(*args)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        timings[name] = time.time() - start
    return {
        "run": run,
        "config": cfg_path,
        "ckpt": run / "checkpoints" / "reordered",
        "timings": timings,
    }


@pytest.mark.integration
def test_elastic_train_profile_writes_each_ranks_steps_and_no_checkpoint(pipeline, tmp_path):
    """``--profile N`` (what a layout sweep runs), at TP2: N iterations, one record per iteration
    on every rank (its step time, budgets, tokens, TFLOP/s, peak memory), no evaluation and no
    checkpoint; a contradictory command line is refused before anything runs."""
    out = tmp_path / "profiled"
    base = ["elastic-train", "--ckpt", str(pipeline["ckpt"]), "--config", str(pipeline["config"]),
            "--out", str(out), "--train-iters", "6", "--no-progress"]  # fmt: skip
    for bad, needle in ((["--profile", "0"], "--profile=0 must be > 0"),
                        (["--profile", "2", "--stop-after", "1"], "drop --stop-after")):  # fmt: skip
        proc = run_cli(*base, *bad)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
    proc = torchrun(*base, "--profile", "3", "--log-interval", "1",
                    "--tensor-model-parallel-size", "2", "--sequence-parallel")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json_out(proc)
    assert summary["checkpoint"] is None and summary["iterations"] == 3 and summary["profile"]
    assert "stopped_at" not in summary and not (out / "checkpoints").exists()
    assert summary["teacher_valid_loss"] is None  # no evaluation
    from elastic_plugin.training.profile import read_profiles

    ranks = read_profiles(out)
    assert sorted(ranks) == [0, 1]
    for rank, rows in ranks.items():
        assert [r["iteration"] for r in rows] == [1, 2, 3] and all(r["rank"] == rank for r in rows)
        for row in rows:
            assert sum(row["budgets"].values()) >= 1
            assert set(row["budgets"]) <= {"1", "0.77", "0.4"}
            assert row["step_seconds"] > 0 and row["tflops_per_rank"] > 0
            assert row["tokens"] > 0 and row["peak_memory_gib"] > 0
    # the TP ranks of one replica run the same budgets on the same global batch
    for a, b in zip(ranks[0], ranks[1]):
        assert (a["budgets"], a["tokens"]) == (b["budgets"], b["tokens"])


@pytest.mark.integration
def test_elastic_train_under_torchrun_tp2_sp_checkpoints_plots_and_resumes(pipeline, tmp_path):
    out = tmp_path / "elastic"
    args = [
        "elastic-train",
        "--ckpt",
        str(pipeline["ckpt"]),
        "--config",
        str(pipeline["config"]),
        "--out",
        str(out),
        "--train-iters",
        "4",
        "--log-interval",
        "1",
        "--eval-interval",
        "4",
        "--eval-iters",
        "1",
        "--no-progress",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    first = torchrun(*args, "--stop-after", "2")
    assert first.returncode == 0, first.stderr[-4000:]
    stopped = json_out(first)
    assert stopped["iterations"] == 2 and "rerun with --resume" in stopped["stopped_at"]
    meta = read_checkpoint_meta(out / "checkpoints" / "elastic")
    assert (meta["iteration"], meta["consumed_samples"]) == (2, 8)

    second = torchrun(*args, "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    summary = json_out(second)
    assert summary["iterations"] == 4 and "stopped_at" not in summary
    assert set(summary["valid_loss"]) == {"1", "0.77", "0.4"}
    assert all(math.isfinite(v) and 0 < v < 6 for v in summary["valid_loss"].values())
    # the teacher is evaluated on the same batches in both jobs
    assert summary["teacher_valid_loss"] == pytest.approx(stopped["teacher_valid_loss"], rel=1e-6)
    assert set(summary["choices"]) == {"1", "0.77", "0.4"}

    meta = read_checkpoint_meta(out / "checkpoints" / "elastic")
    assert meta["kind"] == "elastic" and meta["iteration"] == 4 and meta["consumed_samples"] == 16
    assert meta["layout"]["tp"] == 2 and meta["layout"]["sequence_parallel"] is True
    assert meta["elastic"]["choices"] == summary["choices"]
    for sizes in meta["elastic"]["choices"].values():
        for axis, size in sizes.items():
            assert size in meta["elastic"]["axes"][axis]["candidates"]
    records = [
        json.loads(line) for line in (out / "elastic_metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4], "resume continues the same trace"
    assert records[-1]["valid_loss"] == summary["valid_loss"]
    for plot in summary["plots"]:
        assert Path(plot).stat().st_size > 10_000
    assert {Path(p).name for p in summary["plots"]} == {"elastic_loss.png", "elastic_router.png"}

    again = run_cli(*args, "--resume", env={"WORLD_SIZE": "2"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert json_out(again)["already_finished"] is True

    # every nested model, exported from the TP=2+SP checkpoint by one process, and measured
    assert meta["data"]["valid_data_path"] and Path(meta["tokenizer"]).is_file()
    exports = tmp_path / "exports"
    proc = run_cli(
        "export",
        "--ckpt",
        str(out / "checkpoints" / "elastic"),
        "--out",
        str(exports),
        "--eval-sequences",
        "4",
        # as make demo: calibrated activation scales, tiny's Mamba head dim 16 -> 12 kept in BF16
        "--calib-samples",
        "4",
        "--nvfp4-unaligned",
        "high-precision",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((exports / "exports.json").read_text())
    rows = {(r["budget"], r["precision"]): r for r in report["exports"]}
    assert set(rows) == {
        (b, p) for b in (1.0, 0.77, 0.4) for p in ("megatron", "bf16", "fp8", "nvfp4")
    }
    for budget in (1.0, 0.77, 0.4):
        bf16, fp8, nvfp4 = (rows[(budget, p)] for p in ("bf16", "fp8", "nvfp4"))
        assert nvfp4["bytes"] < fp8["bytes"] < bf16["bytes"] < rows[(budget, "megatron")]["bytes"]
        assert abs(fp8["valid_loss"] - bf16["valid_loss"]) < 0.05
        assert abs(nvfp4["valid_loss"] - bf16["valid_loss"]) < 0.2
        assert bf16["choice"] == meta["elastic"]["choices"][f"{budget:g}"]
        assert (exports / f"hf_{budget:g}_bf16" / "tokenizer.json").is_file()
    assert {(r["budget"], r["precision"]) for r in report["recovery"]} == {
        (b, p) for b in (1.0, 0.77, 0.4) for p in ("fp8", "nvfp4")
    }
    for precision in ("megatron", "bf16", "fp8", "nvfp4"):
        sizes = report["sizes"][precision]
        assert sizes["nested_bytes"] == rows[(1.0, precision)]["bytes"] and sizes["saving"] > 0.3
    assert "One nested checkpoint vs separate" in (exports / "exports.md").read_text()
    from elastic_plugin.export.hf import export_input_amax

    for precision in ("fp8", "nvfp4"):  # calibrated static activation scales, ModelOpt's form
        fmt, amax = export_input_amax(exports / f"hf_0.4_{precision}")
        assert fmt == precision and "model.layers.1.mixer.q_proj" in amax
    assert (exports / "exports.png").stat().st_size > 10_000

    # the demo report: accuracy per budget and precision, budget control, targets, plots
    proc = run_cli(
        "evaluate",
        "--ckpt",
        str(out / "checkpoints" / "elastic"),
        "--exports",
        str(exports),
        "--out",
        str(tmp_path / "report"),
        "--num-problems",
        "6",
        "--batch-size",
        "3",
        "--latency-problems",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["task"] == "products" and report["problems"] == 6
    assert [r["budget"] for r in report["budgets"]] == [1.0, 0.77, 0.4]
    for row in report["budgets"]:
        assert set(row["accuracy"]) == {"fp32", "bf16", "fp8", "nvfp4"}
        assert all(0 <= a <= 1 for a in row["accuracy"].values())
        assert row["latency_ms_batch1"] > 0 and row["export"]["nvfp4"]["bytes"] > 0
    kinds = [c["kind"] for c in report["budget_control"]]
    assert kinds[0] == "single" and kinds.count("elastic") == 3 and "capped" in kinds
    reference = report["budget_control"][0]
    assert reference["accuracy"] == report["budgets"][0]["accuracy"]["fp32"]
    assert report["targets"]["budget_control"]["setting"] == "think 0.4 -> answer 1"
    assert "met" in report["targets"]["retention_0.77"]
    assert {Path(p).name for p in report["plots"]} == {
        "accuracy_vs_params.png",
        "loss_per_budget.png",
        "accuracy_vs_latency.png",
    }
    assert "## Budget control" in (tmp_path / "report" / "report.md").read_text()


# ------------------------------------------------------------------------------ Megatron-LM script
@pytest.mark.integration
def test_pretrain_script_imports_without_side_effects_and_prints_arch_flags(fake):
    from elastic_plugin.models.config import config_from_dict

    code = (
        "import sys; sys.path.insert(0, 'examples'); import pretrain_elastic; "
        "from elastic_plugin.elastic import megatron_lm_pretrain as p; "
        "print('megatron' in sys.modules, 'torch' in sys.modules, p._SESSION)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "None"]
    proc = subprocess.run(
        [sys.executable, str(PRETRAIN), "--print-arch-flags", "--elastic-ckpt", fake["reordered"]],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    flags = shlex.split(proc.stdout)
    from elastic_plugin.elastic.megatron_lm_args import render_arch_flags

    assert flags == render_arch_flags(config_from_dict(fake["config"]).model)
    i = flags.index("--hybrid-layer-pattern")
    assert flags[i + 1] == "M*E-M*E-" and flags[flags.index("--num-experts") + 1] == "8"


def test_pretrain_script_refuses_an_evaluation_that_misses_budgets():
    """One budget per evaluation micro-batch: fewer micro-batches than budgets would log NaN
    for the budgets never reached; the flag is named, with the smallest that works."""
    import argparse

    from elastic_plugin.elastic import megatron_lm_args as pe
    from elastic_plugin.models.config import ConfigError

    def args(eval_iters: int, dp: int) -> argparse.Namespace:
        return argparse.Namespace(
            eval_iters=eval_iters, global_batch_size=4, micro_batch_size=2, data_parallel_size=dp
        )

    pe.check_eval_covers_budgets(args(2, 1), 3)  # 2 iterations x 2 micro-batches >= 3 budgets
    with pytest.raises(ConfigError, match=r"--eval-iters 2 evaluates 2 micro-batches .* >= 3"):
        pe.check_eval_covers_budgets(args(2, 2), 3)  # DP=2: one micro-batch per iteration


def pretrain_case(workdir: str) -> dict:
    """Rank-pool case (1 rank): Megatron-LM's parser with our flags, then model_provider and
    forward_step on the tiny model, against the teacher as an independent reference."""
    import argparse

    import torch
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.training.arguments import add_megatron_arguments, parse_args
    from megatron.training.global_vars import set_args

    from elastic_plugin.elastic import megatron_lm_args as pe
    from elastic_plugin.elastic import megatron_lm_pretrain as elastic
    from elastic_plugin.elastic.args import elastic_config_from_args
    from elastic_plugin.elastic.losses import vocab_parallel_kl
    from elastic_plugin.elastic.model import router_of
    from elastic_plugin.models.config import ConfigError, load_config
    from elastic_plugin.parallel import Layout, initialize_layout
    from tests.support.elastic_cases import write_init_checkpoint

    sys.path.insert(0, str(PRETRAIN.parent))
    import pretrain_elastic  # the example's model provider and get_batch, wrapped as a user's

    result: dict = {}
    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ours = pe.add_pretrain_elastic_args(argparse.ArgumentParser())
    option = lambda p: {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}  # noqa: E731
    result["clashes"] = sorted(option(megatron) & option(ours))
    pe.add_pretrain_elastic_args(megatron)  # argparse raises on any conflicting option string
    dest_of = {s: a.dest for a in megatron._actions for s in a.option_strings}
    cfg = load_config(TINY_ELASTIC)
    result["wrong_dests"] = [
        (f.flag, f.dest, dest_of.get(f.flag))
        for f in pe.arch_flags(cfg.model)
        if dest_of.get(f.flag) != f.dest
    ]

    ckpt = Path(workdir) / "init"
    write_init_checkpoint(cfg, ckpt)
    argv = [
        *pe.render_arch_flags(cfg.model),
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        "10",
        "--lr",
        "1e-3",
        "--elastic-ckpt",
        str(ckpt),
        "--elastic-budgets",
        "1.0",
        "0.77",
        "0.4",
        "--elastic-router-hidden-size",
        "32",
        "--elastic-curriculum",
        "4:0/0.5/0.5,6:0.5/0.3/0.2",  # the first micro-batch is routed (1.0 never is)
        "--some-unknown-flag",
    ]
    saved_argv = sys.argv
    sys.argv = ["pretrain_elastic.py", *argv]
    try:
        args = parse_args(
            extra_args_provider=pe.add_pretrain_elastic_args, ignore_unknown_args=True
        )
    finally:
        sys.argv = saved_argv
    result["budgets"] = args.elastic_budgets
    result["router_hidden"] = elastic_config_from_args(args, base=cfg.elastic).router.hidden_size
    pe.check_arch_args(args, cfg.model, str(ckpt))
    wrong = argparse.Namespace(**{**vars(args), "hidden_size": 64})
    try:
        pe.check_arch_args(wrong, cfg.model, str(ckpt))
        result["arch_error"] = None
    except ConfigError as exc:
        result["arch_error"] = str(exc)
    try:
        pe.elastic_setup(
            argparse.Namespace(**{**vars(args), "virtual_pipeline_model_parallel_size": 2})
        )
        result["pp_error"] = None
    except ConfigError as exc:
        result["pp_error"] = str(exc)

    try:
        pe.elastic_setup(argparse.Namespace(**{**vars(args), "elastic_router_freeze_after": 5}))
        result["freeze_error"] = None
    except ConfigError as exc:
        result["freeze_error"] = str(exc)
    try:
        pe.elastic_setup(argparse.Namespace(**{**vars(args), "elastic_teacher_ckpt": workdir}))
        result["teacher_error"] = None
    except ConfigError as exc:
        result["teacher_error"] = str(exc)

    args.params_dtype, args.curr_iteration = torch.float32, 0
    set_args(args)
    initialize_layout(Layout(), seed=1234)
    init_num_microbatches_calculator(0, None, 2, 2, 1)
    try:
        model = elastic.wrap_model_provider(pretrain_elastic.model_provider)(True, True)
        forward_step = elastic.elastic_forward_step(pretrain_elastic.get_batch)
        run = elastic.session()
        student_ids = {id(p) for p in model.parameters()}
        result["teacher_frozen_and_apart"] = all(
            not p.requires_grad and id(p) not in student_ids for p in run.teacher.parameters()
        )
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=g)
        batch = {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(2, 32),
            "attention_mask": None,
            "position_ids": torch.arange(32).expand(2, 32),
        }
        pos = batch["position_ids"]
        with torch.no_grad():
            teacher_logits = run.teacher(batch["tokens"], pos, None)
            run.step.state.clear()
            full = model(batch["tokens"], pos, None)
        result["teacher_vs_full_student"] = float((teacher_logits - full).abs().max())

        output, loss_fn = forward_step(iter([batch]), model)
        loss, num_tokens, report = loss_fn(output)
        with torch.no_grad():  # the same routed student again, against the teacher's logits
            again = model(batch["tokens"], pos, None)
            kd_ref = float(vocab_parallel_kl(again, teacher_logits).sum())
        result["loss"], result["num_tokens"] = float(loss.detach()), int(num_tokens)
        result["kd"], result["kd_ref"] = float(report["kd loss"][0]), kd_ref
        result["report_keys"] = sorted(report)
        loss.backward()
        router = router_of(model)
        result["router_grad"] = sum(
            float(p.grad.abs().sum()) for p in router.parameters() if p.grad is not None
        )
        result["teacher_grads"] = [p.grad for p in run.teacher.parameters() if p.grad is not None]

        model.eval()
        from elastic_plugin.elastic.train import choice_table

        table = choice_table(router, run.resolved)
        evals = []
        for _ in range(3):
            output, loss_fn = forward_step(iter([batch]), model)
            evals.append({k: v.tolist() for k, v in loss_fn(output)[2].items()})
        result["evals"] = evals
        with torch.no_grad():
            teacher_ce = float(
                run.teacher(batch["tokens"], pos, None, labels=batch["labels"]).sum()
            )
        result["full_is_chosen"] = table["1"] == run.resolved.full_choice()
        result["teacher_ce"] = teacher_ce
    finally:
        elastic.reset_session()
        destroy_num_microbatches_calculator()
        sys.path.remove(str(PRETRAIN.parent))
    return result


@pytest.mark.integration
def test_pretrain_script_composes_with_megatron_and_its_forward_step_distils(rank_pools, tmp_path):
    (r,) = rank_pools.get(1).run("test_elastic_cli:pretrain_case", workdir=str(tmp_path))
    assert r["clashes"] == [] and r["wrong_dests"] == []
    assert r["budgets"] == [1.0, 0.77, 0.4] and r["router_hidden"] == 32
    assert "--hidden-size (got 64, checkpoint: 128)" in r["arch_error"]
    assert "virtual pipeline stages" in r["pp_error"]
    assert "--num-layers-per-virtual-pipeline-stage" in r["pp_error"]
    assert r["teacher_error"].startswith("--elastic-teacher-ckpt ")
    assert r["freeze_error"].startswith("--elastic-router-freeze-after: ")  # the config's: a note
    assert "elastic-train" in r["freeze_error"]
    assert r["teacher_frozen_and_apart"]
    assert r["teacher_vs_full_student"] < 1e-5
    assert math.isfinite(r["loss"]) and r["num_tokens"] == 64
    assert r["report_keys"] == ["budget loss", "kd loss"]
    assert r["kd"] == pytest.approx(r["kd_ref"], rel=1e-5, abs=1e-6)
    assert r["router_grad"] > 0 and r["teacher_grads"] == []
    # evaluation: each budget once, its tokens counted once, zeros for the others
    per_budget = {k: [e[k] for e in r["evals"]] for k in r["evals"][0]}
    assert set(per_budget) == {"lm loss 1", "lm loss 0.77", "lm loss 0.4"}
    for rows in per_budget.values():
        assert sorted(row[1] for row in rows) == [0.0, 0.0, 64.0]
    if r["full_is_chosen"]:
        evaluated = next(row for row in per_budget["lm loss 1"] if row[1])
        assert evaluated[0] == pytest.approx(r["teacher_ce"], rel=1e-5)


def test_router_gets_its_own_learning_rate_in_megatron_lm():
    """Megatron-LM builds its optimizer from args; the script's wrapper adds the router's group."""
    import argparse

    from megatron.core.optimizer import ParamKey

    from elastic_plugin.elastic import megatron_lm_pretrain as pe

    base = lambda args: ("optimizer-config", {"standard": {"wd_mult": 0.0}})  # noqa: E731
    wrapped = pe.with_router_param_group(base, lambda args: 50.0)
    config, overrides = wrapped(argparse.Namespace(lr=2e-4, min_lr=2e-5))
    assert config == "optimizer-config" and overrides["standard"] == {"wd_mult": 0.0}
    router = overrides[ParamKey(attr="elastic_router")]
    assert router["max_lr"] == pytest.approx(1e-2) and router["min_lr"] == pytest.approx(1e-3)


# ------------------------------------------------------------------------------ SLURM launchers
def _dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    # a job's rendezvous comes from SLURM_* and MASTER_*: drop what this process (e.g. an
    # in-process init_distributed of an earlier test) has set
    launch_env = ("SLURM_", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(launch_env)}
    return subprocess.run(
        ["bash", str(SLURM / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**clean, "DRY_RUN": "1", **env},
    )


def _split_launch(command: str):
    """torchrun's namespace and ours, parsed by torchrun's and our own parsers."""
    from torch.distributed.run import get_args_parser

    from elastic_plugin.cli import build_parser

    tokens = shlex.split(command)
    assert tokens[0] == "torchrun"
    module = tokens.index("-m")
    launch = get_args_parser().parse_args(tokens[1:])
    ours = build_parser().parse_args(tokens[module + 2 :])
    assert tokens[module + 1] == "elastic_plugin.cli" and launch.module
    return launch, ours


def test_slurm_scripts_are_valid_bash():
    scripts = sorted(SLURM.glob("*.sbatch")) + sorted(SLURM.glob("*.sh"))
    assert {p.name for p in scripts} >= {"train_elastic.sbatch", "run_stage.sbatch", "pipeline.sh"}
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)


def test_train_elastic_sbatch_builds_a_command_our_parsers_accept():
    proc = _dry_run(
        "train_elastic.sbatch",
        "--elastic-mode",
        "masked",
        CKPT="/runs/r/reordered",
        OUT="/runs/r",
        TP="2",
        EP="2",
        SLURM_NNODES="2",
        GPUS_PER_NODE="4",
        SLURM_JOB_ID="77",
        MASTER_ADDR="node01",
        TRAIN_ITERS="500",
        EXTRA_ARGS="--elastic-budgets 1.0 0.5",
    )
    assert proc.returncode == 0, proc.stderr
    launch, args = _split_launch(proc.stdout)
    assert (launch.nnodes, launch.nproc_per_node) == ("2", "4")
    assert (launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_id) == (
        "c10d",
        "node01:29500",
        "77",
    )
    assert (
        args.command == "elastic-train"
        and args.ckpt == "/runs/r/reordered"
        and args.out == "/runs/r"
    )
    assert args.resume and args.train_iters == 500 and args.save_interval == 100
    assert (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
    ) == (2, 1, 2)
    assert args.sequence_parallel and args.use_distributed_optimizer
    assert args.elastic_budgets == [1.0, 0.5] and args.elastic_mode == "masked"
    missing = _dry_run("train_elastic.sbatch")
    assert missing.returncode != 0 and "CKPT" in missing.stderr


def test_pipeline_chains_the_stages_with_dependencies():
    proc = _dry_run("pipeline.sh", RUN="/runs/r", TP="2")
    assert proc.returncode == 0, proc.stderr
    submissions = [
        shlex.split(line) for line in proc.stderr.splitlines() if line.startswith("sbatch")
    ]
    assert [s[s.index("--job-name") + 1] for s in submissions] == [
        "elastic-teacher",
        "elastic-importance",
        "elastic-reorder",
        "elastic-train",
    ]
    assert "--dependency" not in submissions[0]
    for previous, current in zip(submissions, submissions[1:]):
        name = previous[previous.index("--job-name") + 1]
        assert current[current.index("--dependency") + 1] == f"afterok:<{name}>"
    stages = []
    for submission in submissions[:3]:  # run_stage.sbatch: its arguments are the stage's
        script = next(i for i, t in enumerate(submission) if t.endswith("run_stage.sbatch"))
        stage = _dry_run("run_stage.sbatch", *submission[script + 1 :], TP="2")
        assert stage.returncode == 0, stage.stderr
        _, args = _split_launch(stage.stdout)
        assert args.tensor_model_parallel_size == 2 and args.sequence_parallel
        stages.append(args)
    assert [a.command for a in stages] == ["train", "importance", "reorder"]
    assert stages[0].out == "/runs/r" and stages[1].ckpt == "/runs/r/checkpoints/teacher"
    assert stages[0].resume and stages[0].save_interval == 100  # a resubmitted teacher continues
    assert stages[2].scores == stages[1].out and stages[2].out == "/runs/r/checkpoints/reordered"
    export = submissions[3][submissions[3].index("--export") + 1]
    env = dict(item.split("=", 1) for item in export.split(",")[1:])
    assert env["CKPT"] == "/runs/r/checkpoints/reordered" and env["OUT"] == "/runs/r"
    _, elastic = _split_launch(_dry_run("train_elastic.sbatch", **env).stdout)
    assert elastic.ckpt == env["CKPT"] and elastic.resume
