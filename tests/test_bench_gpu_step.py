"""``bench/bench_gpu_step.py``, the GPU acceptance benchmark, run at its CPU size (what
``BENCH_DEVICE=cpu`` runs): every row of the GPU run is there with finite, positive rates, the
ratios are the ones its columns name, and the JSON and the table it writes hold every row. The
numbers of a CPU run mean nothing; that the script runs end to end keeps it from rotting
between the GPU runs."""

from __future__ import annotations

import json
import math

import pytest

from bench import bench_gpu_step as bench


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    rows, about = bench.measure("cpu", reps=1, warmup=1)
    out = tmp_path_factory.mktemp("gpu_step")
    return rows, about, bench.write(rows, about, out)


def test_every_row_of_the_gpu_run_is_measured(dry_run) -> None:
    rows, about, _ = dry_run
    assert [row["name"] for row in rows] == list(bench.ROWS)
    for row in rows:
        for key in ("ms", "tflops"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        if row["name"] != "bf16_peak":
            assert row["tokens_per_s"] > 0 and row["mfu"] > 0
    assert about["size"] == "tiny" and about["dtype"] == "bfloat16" and about["params"] > 0


def test_the_ratios_are_what_their_columns_name(dry_run) -> None:
    rows, _, _ = dry_run
    by = {row["name"]: row for row in rows}
    plain, peak = by["megatron_step"], by["bf16_peak"]["tflops"]
    for name in ("elastic_b1.0", "elastic_mix"):
        row = by[name]
        assert row["vs_plain_tokens"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["vs_plain_mfu"] == pytest.approx(row["mfu"] / plain["mfu"])
        assert row["mfu"] == pytest.approx(row["tflops"] / peak)
    assert by["elastic_b1.0"]["goal_mfu>=0.95x"] in ("PASS", "MISS")
    assert by["elastic_mix"]["goal_tokens>=1x"] in ("PASS", "MISS")
    assert by["elastic_mix"]["mix"] == "1:0.2, 0.77:0.3, 0.4:0.5"  # tiny_elastic.yaml's stage 2
    sliced, full = by["sliced_half"], by["student_full"]
    assert 0 < sliced["flop_ratio"] < 0.5  # half width: about a quarter of the GEMM FLOPs
    assert sliced["vs_full_time"] == pytest.approx(sliced["ms"] / full["ms"])
    assert sliced["time/flops"] == pytest.approx(sliced["vs_full_time"] / sliced["flop_ratio"])
    assert by["masked_half"]["vs_sliced_time"] == pytest.approx(
        by["masked_half"]["ms"] / sliced["ms"]
    )
    assert by["fp8_full"]["vs_bf16_time"] == pytest.approx(by["fp8_full"]["ms"] / full["ms"])
    # masked computes the full width: its FLOPs are the full student's
    assert by["masked_half"]["tflops"] * by["masked_half"]["ms"] == pytest.approx(
        full["tflops"] * full["ms"]
    )


def test_the_json_and_the_table_hold_every_row(dry_run) -> None:
    rows, _, (json_path, md_path) = dry_run
    saved = json.loads(json_path.read_text())
    assert [row["name"] for row in saved["rows"]] == list(bench.ROWS)
    assert saved["about"]["seq"] == bench.SIZES["tiny"]["seq"]
    table = md_path.read_text()
    for name in bench.ROWS:
        assert f"| {name} |" in table


def test_the_gpu_size_is_a_1b_gpt_at_2048_tokens() -> None:
    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.counting import count_parameters

    spec = bench.SIZES["1b"]
    cfg = model_config_from_hf({**bench.LLAMA, **spec["config"]})
    assert 0.9e9 < count_parameters(cfg).total < 1.2e9
    assert spec["seq"] >= 2048 and cfg.hybrid_layer_pattern == "*-" * 16
    with pytest.raises(SystemExit, match="--size 'huge'"):
        bench.setup("cpu", "huge")
