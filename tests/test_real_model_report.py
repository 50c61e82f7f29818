"""``make demo-real``'s report (elastic_plugin/demo_real/report.py, measure.py): every figure is
derived from the per-window numbers kept in report.json, and the derivations are the textbook
ones (perplexity = exp(token-weighted mean NLL), paired standard error = stdev of the per-window
differences / sqrt(windows)), computed here independently."""

from __future__ import annotations

import json
import math
import random

import pytest

from elastic_plugin.demo_real.measure import paired, summarize, window_stats
from elastic_plugin.demo_real.report import build_report, markdown, recompute


def _windows(rng: random.Random, n: int, scale: float) -> dict[str, list[float]]:
    count = [32.0] * n
    return {
        "nll": [32 * scale * (1 + 0.3 * rng.random()) for _ in range(n)],
        "correct": [float(rng.randint(5, 20)) for _ in range(n)],
        "count": count,
    }


@pytest.fixture
def report():
    rng = random.Random(0)
    windows = {"parent": _windows(rng, 8, 2.0)}
    for label, scale in (("1", 2.1), ("0.7", 2.6), ("0.5", 3.2)):
        for precision in ("fp32", "bf16", "fp8", "nvfp4"):
            windows[f"elastic/{precision}/{label}"] = _windows(rng, 8, scale)
        for order in ("ours", "magnitude"):
            windows[f"zero_shot/{order}/{label}"] = _windows(rng, 8, scale * 1.5)
    return build_report(
        windows=windows,
        params={"parent": 1000, "1": 1000, "0.7": 700, "0.5": 500},
        choices={},
        budgets=["1", "0.7", "0.5"],
        prompts=["Q?"],
        answers={"parent": ["A"], "1": ["A"], "0.7": ["B"], "0.5": ["C"]},
        decode={"parent": {"1": 10.0, "4": 30.0}, "0.5": {"1": 15.0, "4": 50.0}},
        data={"test_data": "x", "windows": 8, "seq_length": 32, "tokens": 256},
        training={"iterations": 2, "tokens": 128},
    )


def test_summary_and_paired_gap_match_their_formulas():
    rng = random.Random(1)
    a, b = _windows(rng, 6, 2.0), _windows(rng, 6, 2.5)
    s = summarize(a)
    assert s["perplexity"] == pytest.approx(math.exp(sum(a["nll"]) / sum(a["count"])))
    assert s["accuracy"] == pytest.approx(sum(a["correct"]) / sum(a["count"]))
    diffs = [(x - y) / 32 for x, y in zip(a["nll"], b["nll"])]
    mean = sum(diffs) / 6
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 5) / math.sqrt(6)
    gap = paired(a, b)["loss"]
    assert gap["diff"] == pytest.approx(mean) and gap["se"] == pytest.approx(se)


def test_window_stats_counts_argmax_hits_and_sums_nll():
    import torch

    torch.manual_seed(0)
    tokens = torch.randint(0, 7, (3, 6))
    table = torch.randn(7, 7)
    stats = window_stats(lambda x: table[x], tokens, batch_size=2)
    logp = torch.log_softmax(table[tokens[:, :-1]], -1)
    nll = -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1).sum(1)
    hits = (table[tokens[:, :-1]].argmax(-1) == tokens[:, 1:]).sum(1)
    assert stats["nll"] == pytest.approx(nll.tolist(), rel=1e-6)
    assert stats["correct"] == hits.double().tolist() and stats["count"] == [5.0] * 3


def test_every_printed_figure_is_recomputable_from_report_json(report):
    text = json.dumps(report)
    loaded = json.loads(text)
    again = recompute(loaded)
    for key in ("budgets_table", "routes", "importance_orders", "quantization", "decode_table"):
        assert json.dumps(again[key]) == json.dumps(loaded[key]), key
    md = markdown(loaded)
    for row in loaded["budgets_table"]:
        cell = (
            f"| {row['budget']} | {row['precision']} | {row['params']:,} | {row['perplexity']:.2f}"
        )
        assert cell in md
    assert f"{loaded['summary']['parent']['perplexity']:.2f}" in md
    # a tampered window changes what recompute derives (the check can fail)
    loaded["windows"]["elastic/fp32/0.5"]["nll"][0] += 10.0
    assert recompute(loaded)["budgets_table"] != report["budgets_table"]


def test_retention_and_speed_rows(report):
    rows = {(r["budget"], r["precision"]): r for r in report["budgets_table"]}
    parent = report["summary"]["parent"]
    r = rows[("0.5", "fp32")]
    assert r["accuracy_retention"] == pytest.approx(r["accuracy"] / parent["accuracy"])
    assert r["perplexity_ratio"] == pytest.approx(r["perplexity"] / parent["perplexity"])
    speed = {(r["model"], r["batch"]): r for r in report["decode_table"]}
    assert speed[("0.5", 4)]["speedup"] == pytest.approx(50 / 30)
    assert speed[("0.5", 1)]["param_ratio"] == pytest.approx(0.5)
