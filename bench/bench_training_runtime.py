"""One elastic training iteration under each runtime setting: FP32 vs BF16, and activation
recomputation off vs full vs selective; step time and peak memory, side by side.

The tiny model (examples/configs/tiny.yaml, ``M*E-M*E-``), sliced, one micro-batch drawing
budget 0.77 (``tests.support.memory.elastic_iteration``): an iteration is the teacher pass, the
student's forward/backward (distillation + budget loss, router gradients) and Megatron's
optimizer step (``ElasticStep.train_step(step_optimizer=True)``). Four students load the same
checkpoint: ``fp32`` (no recomputation: the baseline of both rows), ``bf16`` (Megatron mixed
precision: BF16 weights and activations, FP32 main weights and gradients), ``full`` (full,
uniform, 1 layer) and ``selective`` (Megatron recomputes core attention only). Their learning
rate is 0 (the optimizer still does all its arithmetic), so every repetition computes the same
nested model (the MoE expert bias still moves a few tokens between experts). First their losses are checked (recomputation: equal to FP32's within 1e-6; BF16:
within 5%); then the four iterations run interleaved (``interleaved_medians``); then one more
iteration of each gives its peak memory above what was allocated before it (weights, gradient
buffers, optimizer state: equal in the recompute row; ``tests.support.memory.peak_bytes``, the
profiler's CPU allocation events).

Rows: ``bf16 vs fp32`` (``bf16/fp32``: time; ``mem bf16/fp32``) and ``recompute``
(``full/none``, ``selective/none``: time; ``mem full/none``, ``mem selective/none``), with the
medians (``*_ms``) and peaks (``*_MB``). Lower is better for every ratio. On a CPU, BF16 GEMMs
exist but the non-GEMM work (SSD scan, norms, casts) may not speed up: the ratio is reported
whatever it is. Full recomputation costs one more student forward per iteration and keeps only
each layer's input; selective recomputation changes little with the SDPA core attention, which
stores no ``s x s`` scores anyway. Measured on a quiet 2-core CPU (two runs, b8xs256):
``bf16/fp32`` 0.96-0.97 (memory 0.70), ``full/none`` 1.12-1.15 (memory 0.30),
``selective/none`` 1.05-1.07 (memory 1.00); at 2 x 64 tokens BF16 was 3.3x slower (casts and
dispatch dominate).

Run: ``python bench/bench_training_runtime.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only training_runtime``.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from _timing import interleaved_medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "examples" / "configs" / "tiny.yaml"
BUDGET = 0.77
VARIANTS: dict[str, dict[str, Any] | None] = {
    "fp32": None,
    "bf16": {"bf16": True},
    "full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "selective": {"recompute_granularity": "selective"},
}
SHAPE = {"seq_len": 256, "micro_batch": 8}
QUICK_SHAPE = {"seq_len": 64, "micro_batch": 2}
RECOMPUTE_LOSS_RTOL = 1e-6
BF16_LOSS_RTOL = 5e-2


def _losses(result: dict) -> dict[tuple[int, str], float]:
    return {
        (budget, key): value
        for budget, sums in (result["loss"] or {}).items()
        for key, value in sums.items()
        if key in ("kd_sum", "budget_loss_sum")
    }


def _check_losses(losses: dict[str, dict[tuple[int, str], float]]) -> None:
    """Recomputation must not change what is computed; BF16 only rounds it."""
    ref = losses["fp32"]
    for name, got in losses.items():
        rtol = BF16_LOSS_RTOL if name == "bf16" else RECOMPUTE_LOSS_RTOL
        if got.keys() != ref.keys() or any(
            abs(got[k] - v) > rtol * max(abs(v), 1e-12) for k, v in ref.items()
        ):
            raise AssertionError(f"{name} losses {got} != fp32 losses {ref} (rtol {rtol})")


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def measure(
    seq_len: int = SHAPE["seq_len"],
    micro_batch: int = SHAPE["micro_batch"],
    reps: int = 5,
    warmup: int = 1,
) -> list[dict]:
    """The two rows for one ``micro_batch x seq_len`` micro-batch per iteration; ``reps``
    interleaved timed rounds (median per variant) after ``warmup`` rounds."""
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.parallel import init_distributed
    from tests.support.memory import clear_megatron_buffer, elastic_iteration, peak_bytes

    if reps < 1 or warmup < 0 or seq_len < 1 or micro_batch < 1:
        raise ConfigError(
            f"reps={reps}, warmup={warmup}, seq_len={seq_len}, micro_batch={micro_batch}; "
            "allowed: reps >= 1, warmup >= 0, seq_len >= 1, micro_batch >= 1"
        )
    enable_cpu_megatron()
    init_distributed()
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="bench_training_runtime_") as work:
        iterations = {}
        for name, runtime in VARIANTS.items():
            iterations[name] = elastic_iteration(
                str(TINY_CONFIG), work, runtime, None, seq_len, micro_batch, 1, BUDGET
            )
            iterations[name].freeze_weights()
        _check_losses({name: _losses(it.run()) for name, it in iterations.items()})
        times = interleaved_medians(
            {name: it.run for name, it in iterations.items()}, reps=reps, warmup=warmup
        )
        peaks = {}
        for name, it in iterations.items():
            clear_megatron_buffer()
            peaks[name], _ = peak_bytes(it.run, cpu)
        del iterations
    ms = {name: 1e3 * t for name, t in times.items()}
    mb = {name: p / 2**20 for name, p in peaks.items()}
    shape = f"b{micro_batch}xs{seq_len} budget {BUDGET:g}"
    return [
        {
            "name": f"training iteration tiny {shape}: bf16 vs fp32 [cpu]",
            "fp32_ms": ms["fp32"],
            "bf16_ms": ms["bf16"],
            "bf16/fp32": _ratio(ms["bf16"], ms["fp32"]),
            "fp32_MB": mb["fp32"],
            "bf16_MB": mb["bf16"],
            "mem bf16/fp32": _ratio(mb["bf16"], mb["fp32"]),
        },
        {
            "name": f"training iteration tiny {shape}: recompute [cpu]",
            "none_ms": ms["fp32"],
            "full_ms": ms["full"],
            "selective_ms": ms["selective"],
            "full/none": _ratio(ms["full"], ms["fp32"]),
            "selective/none": _ratio(ms["selective"], ms["fp32"]),
            "none_MB": mb["fp32"],
            "full_MB": mb["full"],
            "selective_MB": mb["selective"],
            "mem full/none": _ratio(mb["full"], mb["fp32"]),
            "mem selective/none": _ratio(mb["selective"], mb["fp32"]),
        },
    ]


def run(quick: bool = False, reps: int | None = None, device: str | None = None) -> list[dict]:
    """Both rows (``quick``: a 2 x 64-token micro-batch, 1 repetition). CPU only: the models
    are built through the CPU compatibility layer of Megatron-Core."""
    if device not in (None, "cpu"):
        return []
    shape = QUICK_SHAPE if quick else SHAPE
    return measure(**shape, reps=reps or (1 if quick else 7), warmup=1)


if __name__ == "__main__":
    import argparse
    import json

    from _timing import keep_freed_memory
    from run_all import print_table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 x 64 tokens, 1 repetition")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    keep_freed_memory()
    result = run(quick=args.quick, reps=args.reps)
    print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
