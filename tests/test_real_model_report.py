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
        for order in ("ours", "magnitude", "random"):
            windows[f"zero_shot/{order}/{label}"] = _windows(rng, 8, scale * 1.5)
        if label != "1":
            windows[f"distil_alone/{label}"] = _windows(rng, 8, scale * 1.1)
            windows[f"minitron/{label}"] = _windows(rng, 8, scale * 1.2)
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
        curve={
            "parent_loss": 2.0,
            "points": {
                "0.7": [[100, 3.0], [200, 2.8], [400, 2.6]],
                "0.5": [[100, 4.0], [200, 4.1]],
            },
        },
        budget_control=CONTROL,
        route_costs={
            r: {"total_flops": 1e15, "total_tokens": 1000, "flops_by_kind": {}}
            for r in ("elastic", "minitron", "alone")
        },  # fmt: skip
        screening=SCREENING,
    )


SCREENING = {
    "budget_metric": "total_params",
    "tokens_per_candidate": 64,
    "choices": {"0.5": {"sizes": {"embedding": 8, "ffn": 16}, "loss": 3.25}},
    "ablation": {"0.5": [
        {"cut": "screened", "sizes": {"embedding": 8, "ffn": 16}, "cost_fraction": 0.49,
         "reaches": True, "loss": 3.25, "perplexity": 25.8},
        {"cut": "FFN", "sizes": {"embedding": 16, "ffn": 4}, "cost_fraction": 0.5,
         "reaches": True, "loss": 3.5, "perplexity": 33.1},
        {"cut": "depth", "sizes": {}, "layers_kept": 2, "dropped_layers": [3, 4],
         "cost_fraction": 0.5, "reaches": True, "loss": 4.0, "perplexity": 54.6},
    ]},
}  # fmt: skip


CONTROL = {
    "questions": ["Q1?", "Q2?"],
    "accepted": [["a"], ["b"]],
    "draft_tokens": 4,
    "answer_tokens": 10,
    "routes": [
        {"route": "parent", "correct": [True, True], "replies": ["a", "b"],
         "prompt_tokens": [20, 30], "new_tokens": [10, 6], "seconds": [1.0, 0.6]},
        {"route": "0.5", "correct": [False, True], "replies": ["x", "b"],
         "prompt_tokens": [20, 30], "new_tokens": [10, 10], "seconds": [0.5, 0.5]},
        {"route": "0.5->parent", "correct": [True, False], "replies": ["a", "y"],
         "prompt_tokens": [20, 30], "new_tokens": [10, 3], "seconds": [0.9, 0.2]},
    ],
}  # fmt: skip


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
    for key in ("budgets_table", "routes", "importance_orders", "quantization", "decode_table",
                "curve_table", "control_table"):  # fmt: skip
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


def test_routes_and_orders_cover_every_route_and_order(report):
    assert {r["route"] for r in report["routes"]} == {
        "zero_shot/ours", "zero_shot/magnitude", "zero_shot/random", "distil_alone",
    }  # fmt: skip
    assert not any(r["route"] == "distil_alone" and r["budget"] == "1" for r in report["routes"])
    gap = {(r["budget"], r["versus"]): r["ours_minus"] for r in report["importance_orders"]}
    w = report["windows"]
    assert gap[("0.5", "random")] == paired(w["zero_shot/ours/0.5"], w["zero_shot/random/0.5"])
    md = markdown(report)
    assert "| 0.5 | random |" in md and "| 0.7 | distil_alone |" in md


def test_curve_fit_predicts_tokens_to_goal_from_a_log_linear_fit(report):
    rows = {r["budget"]: r for r in report["curve_table"]}
    r = rows["0.7"]
    assert r["x_parent"] == pytest.approx([math.exp(1.0), math.exp(0.8), math.exp(0.6)])
    # the three points lie on loss = a + b ln(t) with b = -0.2 / ln 2
    b = -0.2 / math.log(2)
    assert r["slope_per_e"] == pytest.approx(b)
    target = 2.0 + math.log(1.25)  # the 0.7 goal: 1.25x the parent's perplexity
    assert r["tokens_to_goal"] == pytest.approx(400 * math.exp((target - 2.6) / b))
    # rising: no prediction
    assert rows["0.5"]["slope_per_e"] > 0 and rows["0.5"]["tokens_to_goal"] is None
    assert "Validation perplexity against training tokens" in markdown(report)


def test_budget_control_rows_count_answers_time_and_arithmetic(report):
    from elastic_plugin.inference.budget_control import arithmetic_ratio

    rows = {r["route"]: r for r in report["control_table"]}
    assert (rows["parent"]["correct"], rows["0.5"]["correct"]) == (2, 1)
    switched = rows["0.5->parent"]
    assert switched["time_vs_parent"] == pytest.approx(1.1 / 1.6)
    # prompt 25, draft min(10, 4) and min(3, 4) -> 3.5, answer 6.5 - 3.5; parent alone 8 tokens
    want = arithmetic_ratio(25, 3.5, 3.0, 0.5, alone_think=0.0, alone_answer=8.0)
    assert switched["arithmetic_ratio"] == pytest.approx(want)
    assert rows["parent"]["arithmetic_ratio"] is None
    assert "| 0.5->parent | 1/2 |" in markdown(report)


def test_method_table_sets_every_route_against_the_goals_and_the_elastic_model(report):
    from elastic_plugin.demo_real.method_report import GOALS

    rows = {(r["route"], r["budget"]): r for r in report["method_table"]}
    assert set(rows) == {("elastic", b) for b in ("1", "0.7", "0.5")} | {
        (route, b) for route in ("minitron", "alone") for b in ("0.7", "0.5")
    }
    w = report["windows"]
    parent = summarize(w["parent"])["perplexity"]
    r = rows[("minitron", "0.5")]
    assert r["x_parent"] == pytest.approx(summarize(w["minitron/0.5"])["perplexity"] / parent)
    assert r["goal_met"] == (r["x_parent"] <= GOALS["0.5"] == 2.0)
    assert r["minus_elastic"] == paired(w["minitron/0.5"], w["elastic/fp32/0.5"])["loss"]
    assert rows[("elastic", "0.7")]["minus_elastic"] is None
    assert GOALS == {"1": 1.02, "0.7": 1.25, "0.5": 2.0}
    md = markdown(report)
    assert "Does the method pay?" in md and "| 0.5 | minitron |" in md
    assert "| minitron | 1.000 | 1,000 |" in md
    # where each budget started (the screening's pick) and the ablation at 0.5
    assert "| 0.5 | embedding 8, ffn 16 (3.250) |" in md
    assert "keeps the most (one kind of cut alone): FFN" in md


def test_route_curves_count_the_flops_each_route_spent_before_each_evaluation(tmp_path):
    """Elastic: importance + search first, then its training spread over the iterations;
    alone: one size after another; minitron: each candidate's search run, then the final."""
    from elastic_plugin.demo_real.method_report import route_curves

    def metrics(path, rows):
        path.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"iteration": it, "valid_loss": v}) for it, v in rows]
        (path / "elastic_metrics.jsonl").write_text("\n".join(lines) + "\n")
        return str(path / "checkpoints" / "elastic")

    def route(name, sizes, costs, kinds):
        (tmp_path / name).mkdir()
        record = {"route": name, "sizes": sizes, "costs": costs, "flops_by_kind": kinds}
        (tmp_path / name / "route.json").write_text(json.dumps(record))

    metrics(tmp_path / "run", [(5, {"1": 2.0, "0.7": 3.0}), (10, {"1": 1.9, "0.7": 2.5})])
    route("elastic", {}, [], {"importance": 10.0, "search": 5.0, "train": 100.0})
    a07 = metrics(tmp_path / "a07", [(4, {"0.7": 2.8})])
    a05 = metrics(tmp_path / "a05", [(2, {"0.5": 3.3})])
    route(
        "alone",
        {"0.7": {"checkpoint": a07, "flops": 40.0}, "0.5": {"checkpoint": a05, "flops": 50.0},
         "1": {"checkpoint": None, "flops": 0.0}},
        [{"name": "0.7 alone", "detail": {"flops_per_iter": 10.0}},
         {"name": "0.5 alone", "detail": {"flops_per_iter": 25.0}}],
        {"importance": 10.0, "search": 0.0, "train": 90.0},
    )  # fmt: skip
    ffn = metrics(tmp_path / "ffn", [(1, {"0.5": 3.5})])
    depth = metrics(tmp_path / "depth", [(1, {"0.5": 3.4})])
    final = metrics(tmp_path / "final", [(3, {"0.5": 3.1})])
    route(
        "minitron",
        {"0.5": {"checkpoint": final, "flops": 70.0, "architecture": {"winner": "depth+ffn"},
                 "detail": {"candidates": {"ffn": {"checkpoint": ffn, "flops": 20.0},
                                           "depth+ffn": {"checkpoint": depth, "flops": 15.0}}}}},
        [{"name": "0.5 ffn search", "detail": {"flops_per_iter": 18.0}},
         {"name": "0.5 depth+ffn search", "detail": {"flops_per_iter": 12.0}},
         {"name": "0.5 depth+ffn final", "flops": 35.0, "detail": {"flops_per_iter": 10.0}}],
        {"importance": 30.0, "search": 35.0, "train": 35.0},
    )  # fmt: skip
    curves = route_curves(tmp_path, tmp_path / "run" / "elastic_metrics.jsonl")
    assert curves["elastic"] == {"0.7": [[15.0 + 50.0, 3.0], [15.0 + 100.0, 2.5]]}
    assert curves["alone"] == {"0.7": [[10.0 + 40.0, 2.8]], "0.5": [[10.0 + 40.0 + 50.0, 3.3]]}
    assert curves["minitron"] == {"0.5": [[30.0 + 18.0, 3.5], [30.0 + 20.0 + 12.0, 3.4],
                                          [30.0 + 35.0 + 30.0, 3.1]]}  # fmt: skip
