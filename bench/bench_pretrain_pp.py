"""The teacher inside Megatron-LM's loop vs ``elastic-train``'s: step time side by side.

``examples/pretrain_elastic.py`` computes the frozen teacher's logits inline in the forward step
when the model is on one pipeline stage, and as a separate forward-only pass through Megatron's
pipeline schedule (a wrapped ``train_step``) under PP; ``elastic-plugin elastic-train`` always
runs the separate pass. For PP = 1 and PP = 2 (one CPU rank per stage), with the same random
tiny checkpoint, micro-batch, global batch and sequence length, each entry point trains
``ITERS`` iterations; the median step time after ``SKIP`` warm-up iterations is taken from
Megatron-LM's ``elapsed time per iteration`` and from ``elastic-train --profile``'s per-rank
records (slowest rank). Launches alternate between the two, ``reps`` times, and the medians of
those medians are compared (``ratio`` = Megatron-LM loop / elastic-train; 1.0: same cost).

Launch costs (process start, Megatron's initialisation) are outside both figures. On 2
oversubscribed CPU cores absolute times mean little; the ratio is the figure.
Run: ``python bench/bench_pretrain_pp.py [--quick] [--reps N]``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ITERS, SKIP = 8, 2
SHAPE = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
_TORCHRUN = Path(sys.executable).with_name("torchrun")
_ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def _elastic_flags() -> list[str]:
    from elastic_plugin.elastic.args import axis_flag
    from tests.support.elastic_cases import ELASTIC

    flags = ["--elastic-budgets", *map(str, ELASTIC["budgets"])]
    flags += ["--elastic-router-hidden-size", str(ELASTIC["router"]["hidden_size"])]
    for axis, sizes in ELASTIC["sizes"].items():
        flags += [axis_flag(axis), *map(str, sizes)]
    return flags


def _setup(work: Path) -> tuple[Path, object]:
    """A random tiny reordered checkpoint and a small prepared dataset (elastic-train's data)."""
    ckpt = work / "reordered"
    code = (
        "from elastic_plugin.compat import enable_cpu_megatron; enable_cpu_megatron()\n"
        "from elastic_plugin.parallel import Layout, init_distributed, initialize_layout\n"
        "init_distributed(); initialize_layout(Layout())\n"
        "from tests.support.elastic_cases import write_init_checkpoint_at\n"
        f"write_init_checkpoint_at({str(ROOT / 'examples/configs/tiny.yaml')!r}, {str(ckpt)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, capture_output=True)
    from elastic_plugin.data.prepare import prepare_dataset

    data = prepare_dataset(work / "data", num_train=400, num_valid=40, seed=3, progress=False)
    return ckpt, data


def _torchrun(nproc: int, *args: str) -> str:
    cmd = [str(_TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-4000:]}")
    return proc.stdout


def _megatron_ms(ckpt: Path, pp: int, iters: int) -> float:
    arch = subprocess.run(
        [sys.executable, str(ROOT / "examples/pretrain_elastic.py"), "--print-arch-flags"]
        + ["--elastic-ckpt", str(ckpt)],
        capture_output=True, text=True, check=True, env=ENV,
    ).stdout  # fmt: skip
    out = _torchrun(
        pp, str(ROOT / "examples/pretrain_elastic.py"), *shlex.split(arch),
        "--elastic-ckpt", str(ckpt), *_elastic_flags(), *SHAPE,
        "--pipeline-model-parallel-size", str(pp), "--train-iters", str(iters),
        "--lr", "1e-3", "--log-interval", "1", "--eval-interval", str(10 * iters),
        "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--distributed-backend", "gloo",
    )  # fmt: skip
    times = {int(it): float(ms) for it, ms in _ELAPSED.findall(out)}
    return statistics.median(ms for it, ms in times.items() if it > SKIP)


def _elastic_train_ms(ckpt: Path, data, pp: int, iters: int, out: Path) -> float:
    _torchrun(
        pp, "-m", "elastic_plugin.cli", "elastic-train", "--ckpt", str(ckpt), "--out", str(out),
        "--no-progress", "--data-path", data.train_prefix, "--tokenizer", str(data.tokenizer_path),
        "--valid-data-path", data.valid_prefix, "--pipeline-model-parallel-size", str(pp),
        "--profile", str(iters), "--lr", "1e-3", *SHAPE, *_elastic_flags(),
    )  # fmt: skip
    per_iteration: dict[int, float] = {}
    for path in (out / "profile").glob("rank_*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            it = entry["iteration"]
            per_iteration[it] = max(per_iteration.get(it, 0.0), entry["step_seconds"])
    return 1000 * statistics.median(s for it, s in per_iteration.items() if it > SKIP)


def run(quick: bool = False, reps: int | None = None) -> list[dict]:
    reps = reps or (1 if quick else 3)
    iters = SKIP + (3 if quick else ITERS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pretrain_pp_") as tmp:
        work = Path(tmp)
        ckpt, data = _setup(work)
        for pp in (1, 2):
            megatron, ours = [], []
            for rep in range(reps):
                out = work / f"elastic-train-pp{pp}-{rep}"
                first, second = (
                    (lambda: megatron.append(_megatron_ms(ckpt, pp, iters))),
                    (lambda: ours.append(_elastic_train_ms(ckpt, data, pp, iters, out))),
                )
                for fn in (first, second) if rep % 2 == 0 else (second, first):
                    fn()
            m, e = statistics.median(megatron), statistics.median(ours)
            teacher = "inline in forward_step" if pp == 1 else "separate pass (train_step)"
            rows.append(
                {
                    "name": f"PP{pp} teacher: Megatron-LM loop {teacher} vs elastic-train",
                    "megatron_lm_ms": round(m, 1),
                    "elastic_train_ms": round(e, 1),
                    "ratio": round(m / e, 3),
                }
            )
    return rows


if __name__ == "__main__":
    from run_all import bench_main

    bench_main(run, __doc__ or "")
