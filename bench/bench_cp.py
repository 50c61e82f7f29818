"""Context parallelism: an elastic training step at CP = 2 vs CP = 1 on the same tokens.

The same random tiny checkpoint, micro-batches, budget draws and optimizer; one CPU rank for
CP = 1, two for CP = 2 (each holds two mirrored quarter-sequence chunks). Per round, each layout
runs ``STEPS`` timed iterations (teacher pass, the student's forward + backward, optimizer; the
slowest rank's time); rounds alternate between the layouts and the medians are compared
(``ratio`` = CP 2 / CP 1: 0.5 would be perfect scaling, 1.0 no gain). ``peak_mib``: the
largest rank's peak allocated memory of one step (the profiler's allocation events); its ratio
is what CP buys per rank at this sequence length.

On 2 oversubscribed CPU cores the two CP ranks share the cores with everything else: absolute
times mean little, and the step-time ratio is an upper bound of what CP gives on separate
devices. Run: ``python bench/bench_cp.py [--quick] [--reps N]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG = str(ROOT / "examples" / "configs" / "tiny.yaml")
CASES = "tests.support.cp_cases"
STEPS = 3


def run(quick: bool = False, reps: int | None = None) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.support.multirank import RankPool

    rounds = reps or (1 if quick else 3)
    seq = 128 if quick else 512
    times: dict[int, list[float]] = {1: [], 2: []}
    peaks: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as work, RankPool(1) as one, RankPool(2) as two:
        one.run(f"{CASES}:write_checkpoint", config_path=CONFIG, workdir=work)
        for _ in range(rounds):
            for cp, pool in ((1, one), (2, two)):
                results = pool.run(
                    f"{CASES}:time_elastic_steps",
                    config_path=CONFIG,
                    workdir=work,
                    cp=cp,
                    seq_length=seq,
                    steps=1 if quick else STEPS,
                )
                times[cp].append(results[0]["step_s"])
                peaks[cp] = max(r["peak_bytes"] for r in results)
    step = {cp: statistics.median(t) for cp, t in times.items()}
    return [
        {
            "name": f"elastic step, tiny, seq {seq}, CP={cp} [cpu]",
            "step_s": step[cp],
            "peak_mib": peaks[cp] / 2**20,
            "ratio": step[cp] / step[1],
            "peak_ratio": peaks[cp] / peaks[1],
        }
        for cp in (1, 2)
    ]


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
