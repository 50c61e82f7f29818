"""``bench/bench_safe_load.py``: its quickest run (tiny model, one repetition) in a worker rank
gives the load and metadata rows with consistent ratios. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest


def test_quickest_run_gives_consistent_rows(rank_pools):
    (rows,) = rank_pools.get(1).run("bench.bench_safe_load:run", quick=True, reps=1)
    by = {r["name"]: r for r in rows}
    assert set(by) == {"tiny/load", "tiny/metadata"}
    for r in rows:
        for key, value in r.items():
            if key != "name":
                assert math.isfinite(value) and value > 0, (r, key)
    load, metadata = by["tiny/load"], by["tiny/metadata"]
    assert load["pickles"] > 1  # .metadata and the .distcp byte items (_extra_state)
    assert load["load/nocheck"] == pytest.approx(load["load_ms"] / load["nocheck_ms"])
    assert load["check/load"] == pytest.approx(load["check_ms"] / load["nocheck_ms"])
    assert metadata["check/unpickle"] == pytest.approx(
        metadata["check_ms"] / metadata["unpickle_ms"]
    )
