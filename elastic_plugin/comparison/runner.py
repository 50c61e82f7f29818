"""Make the separately trained models by running the plugin's own stages as subprocesses:
``elastic-train`` (one fixed architecture distilled from the teacher) and ``train`` (from
scratch). One process per model keeps every run as a user would launch it (its own Megatron
state, seed and data feed) and lets an interrupted comparison continue: a model whose
``result.json`` exists is not trained again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from elastic_plugin.comparison.configs import distil_config, scratch_config
from elastic_plugin.comparison.plan import RunSpec

__all__ = ["CompareData", "SizeSource", "copy_data", "run_totals", "train_run"]

RESULT_FILE = "result.json"
DATA_FILES = ("tokenizer.json", "heldout.jsonl", "meta.json")


@dataclass(frozen=True)
class CompareData:
    """The comparison's own copy of the elastic run's data (training writes index caches next
    to the data, and the source run's folder is not ours to write into)."""

    train_prefix: str
    valid_prefix: str
    tokenizer: str
    prepared_dir: str


def copy_data(train_prefix: str, valid_prefix: str, tokenizer: str, out: Path) -> CompareData:
    """Copy the two indexed datasets, the tokenizer and (when present) the held-out problems
    into ``out`` (written to a temporary folder, then renamed); reused when already there."""
    if not (out / "tokenizer.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for prefix, name in (
            (train_prefix, "train_text_document"),
            (valid_prefix, "valid_text_document"),
        ):
            for ext in (".bin", ".idx"):
                shutil.copyfile(prefix + ext, tmp / (name + ext))
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        source = Path(valid_prefix).parent
        for name in DATA_FILES[1:]:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        tmp.rename(out)
    return CompareData(
        str(out / "train_text_document"),
        str(out / "valid_text_document"),
        str(out / "tokenizer.json"),
        str(out),
    )


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_plugin.cli", *args]


@dataclass(frozen=True)
class SizeSource:
    """What every separate model of one size starts from: the elastic run's config, the size's
    architecture (``choice``) and its cost fraction, the importance-ordered teacher, the data."""

    config: Mapping[str, Any]
    choice: Mapping[str, int]
    cost_fraction: float
    reordered: Path
    data: CompareData
    # the elastic run's own schedule flags (e.g. --lr): a distillation alone trains with them
    schedule_flags: tuple[str, ...] = ()


def _command(spec: RunSpec, run_dir: Path, source: SizeSource) -> list[str]:
    data = source.data
    data_flags = [
        "--data-path",
        data.train_prefix,
        "--valid-data-path",
        data.valid_prefix,
        "--tokenizer",
        data.tokenizer,
        "--no-progress",
    ]
    cfg_path = run_dir / "config.yaml"
    assert spec.seed is not None  # a trained route
    if spec.route == "prune_distil":
        cfg = distil_config(
            source.config, source.choice, source.cost_fraction, spec.seed, spec.iters
        )
        cfg_path.write_text(yaml.safe_dump(cfg))
        return _cli(
            "elastic-train",
            "--ckpt",
            str(source.reordered),
            "--config",
            str(cfg_path),
            "--out",
            str(run_dir),
            "--train-iters",
            str(spec.iters),
            "--eval-interval",
            str(spec.iters),
            "--log-interval",
            str(min(10, spec.iters)),
            *source.schedule_flags,
            *data_flags,
        )
    cfg = scratch_config(source.config, source.choice, spec.seed, spec.iters)
    cfg_path.write_text(yaml.safe_dump(cfg))
    return _cli("train", "--config", str(cfg_path), "--out", str(run_dir), *data_flags)


def _summary(stdout: str) -> dict[str, Any]:
    """The JSON summary a training command prints last on stdout."""
    start = stdout.find("\n{")
    text = stdout[start + 1 :] if start >= 0 else stdout[stdout.index("{") :]
    return json.loads(text)


def run_totals(metrics: Path) -> dict[str, float] | None:
    """A run's training cost from its metrics file: ``seconds`` (the steps' own time, summed
    over the logged windows: no start-up, evaluation or save) and ``tflop`` (the model FLOPs
    of those steps, ``models.flops``: teacher forward passes included for distillation). The
    same measure for the elastic run, a distillation and a from-scratch run; FLOPs do not
    depend on how loaded the machine was."""
    from elastic_plugin.compat.host import throughput_totals

    if not metrics.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    totals = throughput_totals(records)
    if totals is None:
        return {"seconds": 0.0, "tflop": 0.0}
    return {"seconds": totals["seconds"], "tflop": totals["model_flops"] / 1e12}


def train_run(
    spec: RunSpec, runs_dir: Path, source: SizeSource, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train ``spec``'s model (or read its earlier result): ``{checkpoint, seconds, ...}``.
    ``seconds`` / ``tflop``: the training steps' time and FLOPs (:func:`run_totals`);
    ``wall_s`` includes process start-up, data and model loading, evaluation and the save."""
    run_dir = runs_dir / spec.name
    done = run_dir / RESULT_FILE
    if done.is_file():  # made before with the same iterations (another --scale retrains)
        earlier = json.loads(done.read_text())
        if earlier.get("iters") == spec.iters:
            return earlier
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-made run starts again
    run_dir.mkdir(parents=True)
    cmd = _command(spec, run_dir, source)
    began = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - began
    (run_dir / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{spec.name}: `{' '.join(cmd[2:])}` failed (exit {proc.returncode}); "
            f"the end of its stderr:\n{proc.stderr[-3000:]}"
        )
    summary = _summary(proc.stdout)
    stage = "elastic" if spec.route == "prune_distil" else "teacher"
    totals = run_totals(run_dir / f"{stage}_metrics.jsonl") or {}
    result = {
        **asdict(spec),
        "name": spec.name,
        "checkpoint": str(run_dir / "checkpoints" / stage),
        "seconds": totals.get("seconds", float(summary.get("seconds") or wall)),
        "tflop": totals.get("tflop"),
        "wall_s": round(wall, 1),
        "train_valid_loss": summary.get("valid_loss"),
    }
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.rename(done)
    log(f"{spec.name}: {spec.iters} iterations, {result['seconds']:.0f} s")
    return result
