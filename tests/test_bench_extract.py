"""``bench/bench_extract.py``: its quickest run (tiny model, one repetition) in a worker rank
gives one row per budget and format with consistent sizes and ratios. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest


def test_quickest_run_gives_consistent_rows(rank_pools):
    (rows,) = rank_pools.get(1).run("bench.bench_extract:run", quick=True, reps=1, models=("tiny",))
    by = {r["name"]: r for r in rows}
    assert set(by) == {
        f"tiny/b{b}/{f}"
        for b in ("1", "0.4")
        for f in ("megatron", "hf_bf16", "hf_nvfp4", "hf_fp8_calib")
    }
    for r in rows:
        for key in ("extract_ms", "copy_ms", "extract/copy", "extract_MB/s", "copy_MB/s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r, key)
        assert r["extract/copy"] == pytest.approx(r["extract_ms"] / r["copy_ms"])
        assert r["extract_MB/s"] == pytest.approx(r["MB"] / (r["extract_ms"] / 1e3), rel=1e-3)
    for budget in ("1", "0.4"):
        order = ("hf_nvfp4", "hf_fp8_calib", "hf_bf16", "megatron")
        sizes = [by[f"tiny/b{budget}/{f}"]["MB"] for f in order]
        assert sizes == sorted(sizes) and sizes[0] < 0.4 * sizes[2]
    assert by["tiny/b0.4/hf_bf16"]["MB"] < 0.5 * by["tiny/b1/hf_bf16"]["MB"]
