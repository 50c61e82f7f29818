"""``bench/bench_slice.py``: its quickest run (tiny model, one repetition) in a worker rank gives
one row per budget with consistent ratios. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.export]


def test_quickest_run_gives_consistent_rows(rank_pools):
    (rows,) = rank_pools.get(1).run("bench.bench_slice:run", quick=True, reps=1, models=("tiny",))
    by = {r["name"]: r for r in rows}
    assert set(by) == {"tiny/b1", "tiny/b0.4"}
    for r in rows:
        for key in ("slice_ms", "copy_ms", "slice/copy", "nested/separate"):
            assert math.isfinite(r[key]) and r[key] > 0, (r, key)
        assert r["slice/copy"] == pytest.approx(r["slice_ms"] / r["copy_ms"])
        # the nested directory holds the full model once: about the full budget's export
        assert r["nested_MB"] == pytest.approx(by["tiny/b1"]["MB"], rel=0.05)
    assert by["tiny/b0.4"]["MB"] < 0.5 * by["tiny/b1"]["MB"]
    assert rows[0]["nested/separate"] < 1.0
