"""training.recovery: what a resumed run must keep, the metrics trace it continues, and the
message a failed save leaves (the end-to-end resumes are in test_cli_and_demo / test_faults)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from elastic_plugin.checkpoint.history import write_latest
from elastic_plugin.models.config import ConfigError, load_config
from elastic_plugin.parallel import Layout
from elastic_plugin.training.recovery import (
    check_resumable_training,
    read_metrics,
    restart_metrics,
    save_failed_message,
)

TINY = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml"


def _saved_meta(cfg, layout: Layout) -> dict:
    return {
        "layout": dataclasses.asdict(layout),
        "params_dtype": "float32",
        "config": cfg.to_dict(),
    }


def test_a_resume_must_be_the_same_run():
    cfg = load_config(str(TINY))
    meta = _saved_meta(cfg, Layout())
    check_resumable_training(meta, cfg, Layout(), "resume: X")  # the same run: accepted
    cases = [
        (cfg, Layout(tp=2), "written with layout"),
        (
            dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, bf16=True)),
            Layout(),
            "trained in float32",
        ),
        (
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=64)),
            Layout(),
            "is another model: model.hidden_size differ",
        ),
        (
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_train=3000)),
            Layout(),
            "other data (--quick changes data.num_train): data.num_train differ",
        ),
        (
            dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, lr=1e-4)),
            Layout(),
            "training.lr=0.003 (now 0.0001)",
        ),
    ]
    for changed, layout, needle in cases:
        with pytest.raises(ConfigError) as err:
            check_resumable_training(meta, changed, layout, "resume: X")
        assert str(err.value).startswith("resume: X") and needle in str(err.value), err.value
    # a save from before context parallelism (no "cp" in its layout) resumes at CP=1 only
    older = {**meta, "layout": {k: v for k, v in meta["layout"].items() if k != "cp"}}
    check_resumable_training(older, cfg, Layout(), "resume: X")
    with pytest.raises(ConfigError, match="written with layout"):
        check_resumable_training(older, cfg, Layout(cp=2), "resume: X")
    # logging and evaluation may change on resume
    relogged = dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, log_interval=1, eval_interval=7)
    )
    check_resumable_training(meta, relogged, Layout(), "resume: X")


def test_restart_metrics_keeps_the_iterations_before_the_resumed_save(tmp_path):
    path = tmp_path / "teacher_metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"iteration": i, "train_loss": i / 10}) + "\n" for i in range(1, 7))
    )
    restart_metrics(path, 4)  # continuing from the save at iteration 3
    assert [r["iteration"] for r in read_metrics(path)] == [1, 2, 3]
    restart_metrics(path, 1)  # a fresh run starts an empty trace
    assert read_metrics(path) == [] and read_metrics(tmp_path / "missing.jsonl") == []


def test_a_failed_save_names_the_last_complete_one(tmp_path):
    stage = tmp_path / "out" / "checkpoints" / "teacher"
    error = OSError(28, "No space left on device")
    none = save_failed_message("elastic-plugin train", tmp_path / "out", stage, error)
    assert "no save was completed" in none and "rerun with --resume" in none
    stage.mkdir(parents=True)
    write_latest(stage, 40)
    last = save_failed_message("elastic-plugin train", tmp_path / "out", stage, error)
    assert "the last complete save is iteration 40" in last and "No space left" in last
