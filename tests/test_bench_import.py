"""``bench/bench_import.py``: its quickest run (one model, one repetition) gives a row with
consistent ratios, and the import's memory beyond the model stays about one shard (no second
copy of the model). Behaviour, not speed."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.integration
def test_quickest_run_gives_consistent_rows():
    import bench_import

    (row,) = bench_import.run(quick=True, reps=1)
    assert row["name"] == "import/wide" and row["shards"] > 3
    for key in ("import_ms", "copy_ms", "import/copy", "peak_MB", "model_MB", "shard_MB"):
        assert math.isfinite(row[key]) and row[key] > 0, (row, key)
    assert row["import/copy"] == pytest.approx(row["import_ms"] / row["copy_ms"])
    assert row["extra/shard"] == pytest.approx(
        (row["peak_MB"] - row["model_MB"]) / row["shard_MB"], rel=1e-2, abs=1e-2
    )
    # the model is held once: what the import adds beyond it is a couple of shards at most
    assert row["peak_MB"] >= 0.9 * row["model_MB"]
    assert row["extra/shard"] < 2.5 and row["peak_MB"] < 1.5 * row["model_MB"]
