"""``bench/bench_training_runtime.py``: its quickest measurement (a 2 x 32-token micro-batch, one
repetition) in a worker rank: the two rows, positive finite timings and peaks, ratios consistent
with them, and the memory effects that do not depend on the machine's speed (full
recomputation and BF16 lower the peak, selective recomputation leaves it). Behaviour, not speed;
the losses of the four runtimes are checked by the benchmark itself before it times them."""

from __future__ import annotations

import math

import pytest

from bench import bench_training_runtime as bench
from elastic_plugin.models.config import ConfigError


@pytest.mark.parametrize(
    "kwargs,field",
    [({"reps": 0}, "reps"), ({"warmup": -1}, "warmup"), ({"seq_len": 0}, "seq_len")],
)
def test_bad_arguments_raise_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        bench.measure(**kwargs)


def _finite_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_quickest_measurement_gives_consistent_rows(rank_pools):
    (rows,) = rank_pools.get(1).run(
        "bench.bench_training_runtime:measure", seq_len=32, micro_batch=2, reps=1, warmup=0
    )
    assert [r["name"] for r in rows] == [
        "training iteration tiny b2xs32 budget 0.77: bf16 vs fp32 [cpu]",
        "training iteration tiny b2xs32 budget 0.77: recompute [cpu]",
    ]
    precision, recompute = rows
    for row, names in ((precision, ("fp32", "bf16")), (recompute, ("none", "full", "selective"))):
        for name in names:
            assert _finite_positive(row[f"{name}_ms"]), (name, row)
            assert _finite_positive(row[f"{name}_MB"]), (name, row)
    assert precision["bf16/fp32"] == pytest.approx(precision["bf16_ms"] / precision["fp32_ms"])
    assert precision["mem bf16/fp32"] == pytest.approx(precision["bf16_MB"] / precision["fp32_MB"])
    assert recompute["none_ms"] == precision["fp32_ms"]  # one baseline for both rows
    assert recompute["none_MB"] == precision["fp32_MB"]
    for mode in ("full", "selective"):
        assert recompute[f"{mode}/none"] == pytest.approx(
            recompute[f"{mode}_ms"] / recompute["none_ms"]
        )
        assert recompute[f"mem {mode}/none"] == pytest.approx(
            recompute[f"{mode}_MB"] / recompute["none_MB"]
        )
    # memory is deterministic: full recomputation keeps only the layers' inputs, BF16 halves
    # the activations, selective recomputation of the SDPA core attention saves ~nothing
    assert recompute["mem full/none"] < 0.6
    assert precision["mem bf16/fp32"] < 0.9
    assert recompute["mem selective/none"] == pytest.approx(1.0, abs=0.05)
