"""``bench/bench_slice.py``: its quickest run (tiny model, one repetition) in a worker rank gives
one row per budget with consistent ratios. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest


def test_quickest_run_gives_consistent_rows(rank_pools):
    (rows,) = rank_pools.get(1).run("bench.bench_slice:run", quick=True, reps=1, models=("tiny",))
    by = {r["name"]: r for r in rows}
    assert set(by) == {f"tiny/{p}/b{b}" for p in ("bf16", "fp8", "nvfp4") for b in ("1", "0.4")}
    for r in rows:
        for key in ("slice_ms", "copy_ms", "slice/copy", "nested/separate"):
            assert math.isfinite(r[key]) and r[key] > 0, (r, key)
        assert r["slice/copy"] == pytest.approx(r["slice_ms"] / r["copy_ms"])
        full = by[r["name"].rsplit("/", 1)[0] + "/b1"]
        # the nested directory holds the full model once: about the full budget's export
        assert r["nested_MB"] == pytest.approx(full["MB"], rel=0.05)
        assert r["nested/separate"] < 1.0
    for precision in ("bf16", "fp8", "nvfp4"):
        assert by[f"tiny/{precision}/b0.4"]["MB"] < 0.5 * by[f"tiny/{precision}/b1"]["MB"]
    # quantized directories are smaller: NVFP4 < FP8 < BF16
    assert by["tiny/nvfp4/b1"]["MB"] < by["tiny/fp8/b1"]["MB"] < by["tiny/bf16/b1"]["MB"]
