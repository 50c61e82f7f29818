"""Set-up and bookkeeping for the fault-injection suite (``tests/test_faults.py``): a small elastic
config, a reordered start checkpoint, seeded fault choices, and the checks of what a killed run
left on disk."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY_ELASTIC = ROOT / "examples" / "configs" / "tiny_elastic.yaml"
TRAIN_ITERS = 6
SAVE_INTERVAL = 2  # saves at 2, 4, 6: three arrivals at each save point
SAVES = TRAIN_ITERS // SAVE_INTERVAL


def write_config(path: Path) -> Path:
    """tiny_elastic.yaml with a short schedule and a small task (so a run takes seconds)."""
    config = yaml.safe_load(TINY_ELASTIC.read_text())
    config["training"].update(
        seq_length=64,
        micro_batch_size=4,
        global_batch_size=4,
        train_iters=TRAIN_ITERS,
        eval_iters=1,
        eval_interval=TRAIN_ITERS,
        log_interval=1,
        lr_warmup_iters=1,
    )
    config["data"].update(num_train=200, num_valid=20)
    config["elastic"]["curriculum"] = [
        {"iters": 3, "seq_length": 32},
        {"iters": 3, "budget_probs": [0.5, 0.3, 0.2]},
    ]
    path.write_text(yaml.safe_dump(config))
    return path


def init_checkpoint(config_path: str, out: str) -> str:
    """1 rank: a random tiny model saved as a reordered checkpoint, the start of every run."""
    from elastic_plugin.models.config import load_config
    from tests.support.elastic_cases import write_init_checkpoint

    write_init_checkpoint(load_config(config_path), Path(out))
    return out


def pick_faults(seed: str, world: int, count: int, first: str = "step") -> list[str]:
    """``count`` seeded ``ELASTIC_PLUGIN_FAULT`` specs, alternating (from ``first``: "step" or
    "save") a kill of one random rank at a random training step and a kill of every rank at a
    random point of a random checkpoint save. ``save.pointer`` runs on rank 0 only, so a
    one-rank kill there targets rank 0."""
    from elastic_plugin.compat.faults import POINTS

    rng = random.Random(seed)
    save_points = [p for p in POINTS if p.startswith("save.")]
    specs = []
    for i in range(count):
        if (i + (first == "save")) % 2 == 0:
            specs.append(f"train.step@{rng.randint(2, TRAIN_ITERS)}:rank={rng.randrange(world)}")
        else:
            point = rng.choice(save_points)
            specs.append(f"{point}@{rng.randint(1, SAVES)}:rank=all")
    return [f"{spec}:action=kill" for spec in specs]


def loss_trace(out: Path) -> dict[int, dict[str, float]]:
    """Iteration -> per-budget train loss from a run's metrics file (the resumed run's file
    holds each iteration once: training rewrites it from the save it continues)."""
    trace: dict[int, dict[str, float]] = {}
    for line in (out / "elastic_metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("train_loss"):
            assert record["iteration"] not in trace, f"iteration {record['iteration']} twice"
            trace[record["iteration"]] = record["train_loss"]
    return trace


def published_state(out: Path) -> dict[str, Any]:
    """What a killed run left under checkpoints/elastic: each published save verified (and its
    bytes when damaged), the pointer, and leftovers of unfinished saves."""
    from elastic_plugin.checkpoint.history import LATEST_FILE, iteration_dirs
    from elastic_plugin.checkpoint.integrity import verify_directory
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.models.config import ConfigError

    stage = out / "checkpoints" / "elastic"
    saves, lost = {}, 0
    for _, path in iteration_dirs(stage):
        try:
            verify_directory(path, read_checkpoint_meta(path))
            saves[path.name] = "verified"
        except ConfigError as exc:
            saves[path.name] = str(exc)
            lost += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    latest = stage / LATEST_FILE
    return {
        "saves": saves,
        "latest": latest.read_text().strip() if latest.is_file() else None,
        "leftovers": sorted(p.name for p in stage.glob("*.tmp")) if stage.is_dir() else [],
        "bytes_lost": lost,
    }
