"""A process's fixed costs: start-up imports, its first checkpoint save, its first forward.

Every command and every rank is a fresh process, and a short job (a test, an evaluation, a
resumed run that saves soon) pays these before its steps matter. Each row runs both candidates
in fresh interpreters, interleaved (``interleaved_medians``), each reporting its own timing:

* ``imports``: importing the plugin, the CPU patches, ``elastic_plugin.elastic.train`` and
  ``models.builder`` (what ``elastic-train`` loads before its first step), with Megatron's
  ``torch.compile`` decorations deferred to the first call (``compat/deferred_compile.py``, as
  shipped) vs torch's own decoration (the hook removed first), which imports TorchDynamo and
  Inductor; ``compiler_loaded`` says whether they were imported;
* ``first save``: the first ``checkpoint.io.save_checkpoint`` of the tiny model (examples/configs/
  tiny.yaml) in a process, its write results passed in-process (``compat/sync_save.py``, as
  shipped) vs through Megatron's spawned ``multiprocessing`` manager;
* ``first step``: the tiny model's first forward and backward on CPU with Megatron's fused
  element-wise functions uncompiled (the CPU patches, as shipped) vs compiled by Inductor.

Columns: ``shipped_s`` and ``other_s`` (median seconds) and ``shipped/other`` (lower is better).
Run: ``python bench/bench_startup.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only startup``. ``--quick``: one repetition, no warm-up.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_IMPORTS = """
import sys, time
began = time.perf_counter()
import elastic_plugin
if {other}:  # torch's own decoration: the deferral hook removed before Megatron is imported
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "DeferCompileFinder"]
from elastic_plugin.compat import enable_cpu_megatron
enable_cpu_megatron()
import elastic_plugin.elastic.train, elastic_plugin.models.builder
RESULT = {{"seconds": time.perf_counter() - began,
          "compiler_loaded": "torch._inductor" in sys.modules}}
"""
_MODEL = """
import contextlib, time, torch
from tests.support.inference_cases import tiny_inference_model
model, cfg = tiny_inference_model(seed=1)
"""
_SAVE = (
    _MODEL
    + """
from dataclasses import asdict
from elastic_plugin.checkpoint import io
from elastic_plugin.models.config import load_config
from elastic_plugin.parallel import Layout
from tests.support.inference_cases import TINY_CONFIG
if {other}:  # Megatron's manager queue
    io.in_process_write_results = contextlib.nullcontext
meta = {{"kind": "extracted", "config": load_config(TINY_CONFIG).to_dict(),
        "layout": asdict(Layout())}}
began = time.perf_counter()
io.save_checkpoint([model], "{work}/ckpt", meta)
RESULT = {{"seconds": time.perf_counter() - began}}
"""
)
_STEP = (
    _MODEL
    + """
from elastic_plugin.compat import deferred_compile
deferred_compile.run_eagerly(not {other})  # compiled: as without the CPU patch
model.train()
tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
position = torch.arange(64).unsqueeze(0).expand_as(tokens)
began = time.perf_counter()
model(tokens, position, None).float().square().mean().backward()
RESULT = {{"seconds": time.perf_counter() - began}}
"""
)


def _child(code: str, other: bool, work: str) -> dict:
    work = tempfile.mkdtemp(dir=work)  # every save into a directory of its own
    script = code.format(other=other, work=work) + "\nimport json; print(json.dumps(RESULT))\n"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
             "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(name: str, code: str, reps: int, warmup: int, work: str) -> dict:
    reported: dict[str, list[dict]] = {"shipped": [], "other": []}

    def candidate(label: str):
        return lambda: reported[label].append(_child(code, label == "other", work))

    interleaved_medians(
        {label: candidate(label) for label in reported}, reps=reps, warmup=warmup
    )  # fresh processes, interleaved; each reports its own timing (warm-up ones dropped below)
    seconds = {k: statistics.median(r["seconds"] for r in v[warmup:]) for k, v in reported.items()}
    row = {
        "name": f"startup/{name}",
        "shipped_s": seconds["shipped"],
        "other_s": seconds["other"],
        "shipped/other": seconds["shipped"] / seconds["other"],
    }
    if "compiler_loaded" in reported["shipped"][-1]:
        row["compiler_loaded"] = (
            f"shipped {reported['shipped'][-1]['compiler_loaded']}, "
            f"other {reported['other'][-1]['compiler_loaded']}"
        )
    return row


def run(quick: bool = False, reps: int | None = None) -> list[dict]:
    reps = reps or (1 if quick else 5)
    warmup = 0 if quick else 1
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
        return [
            _row(name, code, reps, warmup, work)
            for name, code in (("imports", _IMPORTS), ("first save", _SAVE), ("first step", _STEP))
        ]


if __name__ == "__main__":
    from run_all import bench_main

    bench_main(run, __doc__)
