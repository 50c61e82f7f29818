"""``bench/bench_checkpoint_hash.py``: its quickest run (tiny model, one repetition) in a worker
rank gives the save, load and hash rows with consistent ratios. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest


def test_quickest_run_gives_consistent_rows(rank_pools):
    (rows,) = rank_pools.get(1).run(
        "bench.bench_checkpoint_hash:run", quick=True, reps=1, models=("tiny",)
    )
    by = {r["name"]: r for r in rows}
    hashes = ("sha256", "blake2b", "crc32", "read")
    assert set(by) == {"tiny/save", "tiny/load", *(f"tiny/hash/{h}" for h in hashes)}
    for r in rows:
        assert r["MB"] == by["tiny/save"]["MB"] > 1, r  # the tiny model's fp32 weights: ~4 MB
        for key, value in r.items():
            if key != "name":
                assert math.isfinite(value) and value > 0, (r, key)
    save, load = by["tiny/save"], by["tiny/load"]
    assert save["save/nodigest"] == pytest.approx(save["save_ms"] / save["nodigest_ms"])
    assert save["record/save"] == pytest.approx(save["record_ms"] / save["nodigest_ms"])
    assert save["history/save"] == pytest.approx(save["history_ms"] / save["save_ms"])
    assert load["load/noverify"] == pytest.approx(load["load_ms"] / load["noverify_ms"])
    assert load["verify/load"] == pytest.approx(load["verify_ms"] / load["noverify_ms"])
    for h in hashes:
        r = by[f"tiny/hash/{h}"]
        assert r["MB_s"] == pytest.approx(r["MB"] / (r["hash_ms"] / 1e3), rel=1e-3)
        assert r["x/read"] == pytest.approx(r["hash_ms"] / by["tiny/hash/read"]["hash_ms"])
