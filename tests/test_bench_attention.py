"""``bench/bench_attention.py``: its peak-memory probe on known allocations, and its run at tiny
sizes (one repetition): one row per length with positive timings, consistent ratios, outputs that
agree, SDPA's peak memory far below the unfused one's and growing slower. Behaviour, not speed."""

from __future__ import annotations

import math

import pytest
import torch

from bench import bench_attention as bench


def test_peak_bytes_replays_allocations_in_order():
    def allocate():
        a = torch.ones(1 << 18)  # 1 MiB of float32
        b = torch.ones(1 << 19)  # 2 MiB while a is alive: the peak
        del a, b
        c = torch.ones(1 << 19)  # 2 MiB alone: below the peak
        return c.sum()

    peak, result = bench.peak_bytes(allocate, torch.device("cpu"))
    assert peak == 3 << 20
    assert result.item() == 1 << 19


def test_tiny_run_gives_consistent_rows():
    rows = bench.run(reps=1, device="cpu", tokens=(128, 512))
    assert [r["name"] for r in rows] == [
        f"attention fwd+bwd b1 s{s} h8 g2 d64 [cpu]" for s in (128, 512)
    ]
    for r in rows:
        for key in ("sdpa_ms", "unfused_ms", "sdpa/unfused", "sdpa_MB", "unfused_MB"):
            assert math.isfinite(r[key]) and r[key] > 0, (r, key)
        assert r["sdpa/unfused"] == pytest.approx(r["sdpa_ms"] / r["unfused_ms"])
        assert r["mem sdpa/unfused"] == pytest.approx(r["sdpa_MB"] / r["unfused_MB"])
        assert float(r["max_diff"]) <= 1e-4
    small, large = rows
    # the unfused scores grow with s^2 (16x for 4x the tokens); SDPA's memory about linearly
    assert large["unfused_MB"] > 10 * small["unfused_MB"]
    assert large["sdpa_MB"] < 6 * small["sdpa_MB"]
    assert large["mem sdpa/unfused"] < 0.2
