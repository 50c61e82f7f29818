"""How much of the machine a stage used: totals from the training loop's throughput records,
tokens/s and model GFLOP/s against a measured GEMM peak, in ``make demo``'s report
(``evaluation.report.training_machine_use``) and ``make demo-real``'s stage table."""

from __future__ import annotations

import json

import pytest

from elastic_plugin.compat import host
from elastic_plugin.compat.host import gemm_peak_gflops, machine_use, throughput_totals

RECORDS = [
    {"iteration": 10, "train_loss": 1.0},  # no throughput: skipped
    {"throughput": {"tokens_per_s": 100.0, "tflops_per_rank": 0.05, "model_tflops": 0.2,
                    "seconds": 4.0}},
    {"throughput": {"tokens_per_s": 50.0, "tflops_per_rank": 0.02, "model_tflops": 0.08,
                    "seconds": 2.0}},
]  # fmt: skip


def test_totals_and_use_from_throughput_records():
    totals = throughput_totals(RECORDS)
    assert totals == pytest.approx(
        {"tokens": 500.0, "model_flops": 0.28e12, "model_flops_per_rank": 0.24e12, "seconds": 6.0}
    )
    use = machine_use(totals["tokens"], totals["model_flops_per_rank"], totals["seconds"], 80.0)
    assert use["tokens_per_s"] == pytest.approx(500 / 6, abs=0.01)
    assert use["model_gflops"] == pytest.approx(40.0)
    assert use["share_of_peak"] == pytest.approx(0.5)
    assert machine_use(1, 1e9, 1.0, None)["share_of_peak"] is None
    assert throughput_totals([{"iteration": 1}]) is None


def test_gemm_peak_is_a_plausible_rate():
    fp32 = gemm_peak_gflops("float32", n=128, seconds=0.05)
    assert fp32 is not None and 0.1 < fp32 < 1e5


def test_demo_report_says_how_much_of_the_machine_training_used(tmp_path, monkeypatch):
    from elastic_plugin.evaluation.report import markdown, training_machine_use

    (tmp_path / "checkpoints" / "elastic").mkdir(parents=True)
    (tmp_path / "elastic_metrics.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    monkeypatch.setattr(host, "gemm_peak_gflops", lambda dtype, *a, **k: 80.0)
    use = training_machine_use(tmp_path / "checkpoints" / "elastic")
    assert use is not None and [s["stage"] for s in use["stages"]] == ["elastic-train"]
    (row,) = use["stages"]
    assert row["dtype"] == "float32" and row["tokens"] == 500
    assert row["share_of_peak"] == pytest.approx(0.5)
    report = {"task": "t", "problems": 1, "teacher_valid_loss": 1.0, "budgets": [],
              "budget_control": [], "targets": {}, "machine_use": use}  # fmt: skip
    text = markdown(report)
    assert "## Machine use (training)" in text and "| elastic-train | float32 | 500 |" in text
    assert "| 50.0 |" in text  # % of peak


def test_demo_real_stage_table_shows_use():
    from elastic_plugin.demo_real.report import _stage_lines

    stages = [
        {"stage": "import", "wall_s": 3.0, "cpu_s": 2.0},
        {"stage": "elastic-train", "wall_s": 10.0, "cpu_s": 19.0,
         "use": {"tokens": 500, "seconds": 6.0, "tokens_per_s": 83.33, "model_gflops": 40.0,
                 "share_of_peak": 0.5}},
    ]  # fmt: skip
    machine = {"cpu": "AMD EPYC, 2 cores, avx2", "threads": 2, "precision": "precision: FP32",
               "dtype": "float32", "peak_gflops": 80.0}  # fmt: skip
    text = "\n".join(_stage_lines(stages, machine))
    assert "float32 GEMM peak 80.0 GFLOP/s" in text
    assert "| elastic-train | 10.0 | 19.0 | 500 | 83.33 | 40.0 | 50.0 |" in text
    assert "| import | 3.0 | 2.0 |  |  |  |  |" in text
