"""Full activation recomputation keeps only each layer's input: the peak memory of an elastic
student step falls as that predicts, and the gradients do not change.

One micro-batch (2 x 512 tokens) of the tiny model's widths with 12 layers (``M*-M*-M*-M*-``, no
MoE), sliced, every micro-batch at budget 0.77 (the router chose a 64-wide residual stream);
forward+backward of the student, peak CPU bytes from the profiler's allocation events
(``tests.support.memory.peak_bytes``). The teacher pass runs before the measured step and is not
counted (its logits are held in both runs). Recomputation: full, uniform, 1 layer per chunk.

Expected factor: without recomputation autograd keeps every layer's intermediates, measured
(saved-tensor hooks) at 14.5 MB per Mamba layer, 3.7 MB per attention and 4.3 MB per MLP layer
(22.5 MB per ``M*-``, 90 MB in all: the whole 92.5 MB peak), vs a 0.25 MB input per layer. With
recomputation the step keeps 12 inputs (3 MB) and re-creates one layer's intermediates at a time
(at most 14.5 MB): expected peak = 92.5 - 90 + 3 + 14.5 = 20.2 MB, factor 0.22. Measured:
92.5 MB -> 18.9 MB (factor 0.204, 0.94 x the expected peak); gradients bitwise equal.
Bounds: factor <= 0.30, peak within 0.8-1.2 x the expected one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
PATTERN = "M*-M*-M*-M*-"
SEQ_LEN, MICRO_BATCH = 512, 2
MAX_FACTOR = 0.30
EXPECTED_RANGE = (0.8, 1.2)
GRAD_ATOL = 1e-6


def test_full_recompute_keeps_only_layer_inputs(rank_pools, tmp_path):
    (r,) = rank_pools.get(1).run(
        "tests.support.memory:recompute_memory",
        config_path=CONFIG,
        workdir=str(tmp_path),
        pattern=PATTERN,
        seq_len=SEQ_LEN,
        micro_batch=MICRO_BATCH,
    )
    mb = {k: r[k] / 2**20 for k in ("peak_none", "peak_full", "expected_full")}
    saved, inputs = r["layer_saved_bytes"], r["layer_input_bytes"]
    assert len(saved) == len(inputs) == len(PATTERN)
    # the premise: activations dominate, and a layer's input is a small part of them
    assert sum(saved) >= 0.8 * r["peak_none"], (mb, saved)
    assert all(s >= 10 * i > 0 for s, i in zip(saved, inputs)), (saved, inputs)

    factor = r["peak_full"] / r["peak_none"]
    assert factor <= MAX_FACTOR, mb
    low, high = EXPECTED_RANGE
    assert low * r["expected_full"] <= r["peak_full"] <= high * r["expected_full"], mb

    # the same computation: losses and gradients (model and router) agree
    assert r["loss_full"].keys() == r["loss_none"].keys()
    for budget, sums in r["loss_none"].items():
        for key, value in sums.items():
            assert r["loss_full"][budget][key] == pytest.approx(value, rel=1e-6), (budget, key)
    assert r["num_grads"] > len(PATTERN)
    assert r["grad_max_abs"] > 1e-4
    assert r["grad_max_abs_diff"] <= GRAD_ATOL, r
