"""The plan's step-time model against measured elastic steps on this machine's CPU ranks.

``elastic-plugin plan`` estimates a step from a device's GEMM rate and link bandwidth (a stated
model). Here the device is this machine, described by what it measures: the FP32 matmul rate
of one process (1024 x 1024 GEMMs, the plan's FP32 peak; efficiency 1), the gloo all-reduce
bus bandwidth of two ranks (every link; comm efficiency 1) and a copy's memory bandwidth. Each
layout of the tiny model (``examples/configs/tiny.yaml``, budgets 1.0/0.77/0.4 drawn uniformly,
4 x 32-token micro-batches of 2 sequences per rank and step) trains a few iterations the way
a sweep run does (``tests.support.planning_cases.profile_layout``, every iteration logged), and
``scaling-report``'s reader (``planning.scaling.collect_runs``) gives the median step time after
the first. Rows: measured and planned step time and ``measured/planned``: how much slower than
its GEMMs and collectives this machine runs the step (non-GEMM work, dispatch, the Python
schedule), i.e. the efficiency factor the plan would need here. A machine with a GPU runs the
same sweep with ``examples/slurm/sweep.sh`` and ``elastic-plugin scaling-report``.

Run: ``python bench/bench_plan.py [--quick] [--json PATH]`` or
``python bench/run_all.py --only plan``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY = str(ROOT / "examples" / "configs" / "tiny.yaml")
CASES = "tests.support.planning_cases"
LAYOUTS: tuple[tuple[int, dict[str, Any]], ...] = (
    (1, {}),
    (2, {}),
    (2, {"tp": 2, "sequence_parallel": True}),
    (2, {"pp": 2}),
    (4, {"tp": 2, "ep": 2, "sequence_parallel": True}),
    (8, {"tp": 2, "ep": 2, "sequence_parallel": True}),
)
MICRO_BATCH, GLOBAL_BATCH, SEQ = 2, 8, 32  # per rank; SEQ is elastic_cases.SEQ_LEN


def _rates() -> tuple[float, float]:
    """FP32 matmul FLOP/s and copy bytes/s of this process (medians of 5)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src = torch.randn(16 << 20)
    dst = torch.empty_like(src)
    flops, copies = [], []
    for _ in range(6):
        start = time.perf_counter()
        a @ b
        flops.append(2 * 1024**3 / (time.perf_counter() - start))
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * src.numel() * 4 / (time.perf_counter() - start))
    return statistics.median(flops[1:]), statistics.median(copies[1:])


def _planned(world: int, kw: dict[str, Any], device) -> tuple[str, float]:
    from elastic_plugin.models.runtime import Runtime
    from elastic_plugin.planning.layouts import PlanLayout, check_layout
    from elastic_plugin.planning.plan import PlanInputs, _mix, evaluate_layout
    from tests.support.elastic_cases import _elastic_config, tiny_model

    model = tiny_model(TINY, None)
    elastic = _elastic_config(model, "sliced", False)
    tp, pp, ep = kw.get("tp", 1), kw.get("pp", 1), kw.get("ep", 1)
    layout = PlanLayout(tp=tp, pp=pp, ep=ep, dp=world // (tp * pp),
                        sequence_parallel=kw.get("sequence_parallel", False),
                        distributed_optimizer=kw.get("distributed_optimizer", False))  # fmt: skip
    inputs = PlanInputs(model, "tiny", world, device, SEQ, MICRO_BATCH, GLOBAL_BATCH, Runtime(),
                        elastic, efficiency=1.0, comm_efficiency=1.0, reserve_gb=0.0)  # fmt: skip
    resolved = check_layout(model, layout, world, elastic, inputs.runtime, MICRO_BATCH,
                            GLOBAL_BATCH)  # fmt: skip
    return layout.name, _mix(evaluate_layout(inputs, layout, resolved, SEQ), None)


def run(quick: bool = False, reps: int | None = None, device: str | None = None) -> list[dict]:
    """One row per layout (``quick``: 3 iterations each instead of 8). CPU only."""
    if device not in (None, "cpu"):
        return []
    from elastic_plugin.planning.devices import Device
    from elastic_plugin.planning.scaling import collect_runs
    from tests.support.multirank import RankPool

    iters = 3 if quick else (reps or 7) + 1
    flops, copy = _rates()
    work = Path(tempfile.mkdtemp(prefix="bench_plan_"))
    bandwidth = 0.0
    names: dict[str, tuple[int, dict[str, Any]]] = {}
    for world in sorted({w for w, _ in LAYOUTS}):
        with RankPool(world) as pool:
            if world > 1:
                bandwidth = pool.run(f"{CASES}:allreduce_bus_bandwidth")[0]
            for i, (w, kw) in enumerate(LAYOUTS):
                if w != world:
                    continue
                name = f"{i:02d}_{world}"
                names[name] = (world, kw)
                pool.run(f"{CASES}:profile_layout", config_path=TINY, workdir=str(work),
                         out=str(work / "runs" / name), iters=iters, micro_batch=MICRO_BATCH,
                         global_batch=GLOBAL_BATCH, **kw)  # fmt: skip
    cpu = Device("this cpu", 2 * flops / 1e12, 2 * flops / 1e12, 24.0, copy / 1e12,
                 bandwidth / 1e9, bandwidth / 1e9, 8)  # fmt: skip
    rows = []
    for r in collect_runs(work / "runs", warmup=1):
        world, kw = names[r.name]
        layout, planned = _planned(world, kw, cpu)
        rows.append({
            "name": f"plan {world} rank(s) {layout}",
            "measured_ms": 1e3 * r.step_seconds,
            "planned_ms": 1e3 * planned,
            "measured/planned": r.step_seconds / planned,
        })  # fmt: skip
    rows.append({"name": "plan this cpu", "gemm_gflops": flops / 1e9,
                 "gloo_busbw_MBps": bandwidth / 1e6, "copy_GBps": copy / 1e9})  # fmt: skip
    return rows


if __name__ == "__main__":
    import argparse
    import json

    from run_all import print_table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 iterations per layout")
    parser.add_argument("--reps", type=int, default=None, help="timed iterations per layout")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()
    result = run(quick=args.quick, reps=args.reps)
    print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
