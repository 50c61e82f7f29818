"""``bench/bench_train.py --quick`` (a 2-layer Llama of SmolLM2's family, one repetition) in a
worker rank: every route of the benchmark has its row, with positive finite rates, model FLOP/s
set against the measured peak, and each of ours set against its plain twin. Behaviour, not
speed: the figures are the benchmark's (docs/benchmarks.md)."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "smollm2_elastic.yaml"


def test_quick_run_has_every_row(rank_pools, tmp_path):
    (result,) = rank_pools.get(1).run("bench.bench_train:measure", quick=True, cache=str(tmp_path))
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["threads"] >= 1
    assert machine["peak_gflops"]["fp32"] > 0 and machine["peak_gflops"]["fp8"] is None
    rows = {r["route"]: r for r in result["rows"]}
    budgets = ("1", "0.7", "0.5")
    expected = {"plain_train", "plain_kd", "ours_mix", "plain_fwd", "importance"}
    expected |= {f"ours_{b}" for b in budgets}
    expected |= {f"decode_{b}" for b in budgets} | {f"hf_decode_{b}" for b in budgets}
    assert set(rows) == expected
    for row in rows.values():
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
    for name in ("plain_train", "plain_kd", "ours_1", "ours_mix", "importance"):
        row = rows[name]
        assert row["model_gflops"] > 0 and 0 < row["share_of_peak"], row
    twins = {"ours_1": "plain_kd", "ours_mix": "plain_train", "importance": "plain_fwd"}
    for ours, twin in twins.items():
        assert rows[ours]["twin"] == twin
        assert math.isclose(
            rows[ours]["vs"], rows[ours]["tokens_per_s"] / rows[twin]["tokens_per_s"]
        )
    for b in budgets:
        assert rows[f"decode_{b}"]["twin"] == f"hf_decode_{b}" and rows[f"decode_{b}"]["vs"] > 0
    # the mix: the budgets' times weighted by the configured curriculum (smollm2_elastic.yaml:
    # stage 1 uniform, stage 2 at its budget_probs), each stage by its iterations
    elastic = yaml.safe_load(CONFIG.read_text())["elastic"]
    stages = elastic["curriculum"]
    total = sum(stage["iters"] for stage in stages)
    shares = {
        b: sum(
            stage["iters"] / total * stage.get("budget_probs", [1 / len(budgets)] * len(budgets))[i]
            for stage in stages
        )
        for i, b in enumerate(budgets)
    }
    assert [str(b).removesuffix(".0") for b in elastic["budgets"]] == list(budgets)
    mix = sum(shares[b] * rows[f"ours_{b}"]["seconds"] for b in budgets)
    assert math.isclose(rows["ours_mix"]["seconds"], mix)
