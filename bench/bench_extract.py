"""Extraction throughput vs a plain copy of the same number of bytes.

Cutting a nested model out of an elastic checkpoint should cost little more than writing its
bytes: the slicing is index selection and the rest is I/O. For each budget of a freshly trained
elastic checkpoint (``tiny``: examples/configs/tiny.yaml; ``wide``: the same pattern at 4x the
width) and each output format, these run interleaved (``interleaved_medians``):

* ``extract``: ``run_extraction(plan, source)`` with the full model already loaded (slicing,
  building the plain model, atomic save; the loading is shared by ``elastic-plugin export``);
* ``copy``: ``shutil.copyfile`` of a file of the same size as that extraction's output, the
  floor any writer of those bytes pays on this disk.

Columns: ``MB`` written, medians, ``extract/copy`` (lower is better) and MB/s of each. Formats:
``megatron`` (plain Megatron dist checkpoint, fp32), ``hf_bf16`` and ``hf_nvfp4`` (safetensors;
NVFP4 also quantizes the parent once and cuts it), ``hf_fp8_calib`` (FP8 with activation scales
calibrated by ModelOpt on 16 sequences: the cost of ``--calib-samples``). ``load_s`` is the one-off load of the full model, reported per model.

Run: ``python bench/bench_extract.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only extract``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from _timing import copy_floor, interleaved_medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "examples" / "configs" / "tiny.yaml"
BUDGETS = ("1", "0.4")  # the stored table is set to full / smallest (see _checkpoint)
CALIB_SAMPLES = 16  # --calib-samples of the calibrated format
FORMATS = {  # (format, dtype, quantize, calibration sequences)
    "megatron": ("megatron", None, None, 0),
    "hf_bf16": ("hf", "bf16", None, 0),
    "hf_nvfp4": ("hf", "bf16", "nvfp4", 0),
    "hf_fp8_calib": ("hf", "bf16", "fp8", CALIB_SAMPLES),
}


def _experiment(name: str):
    from elastic_plugin.models.config import load_config

    cfg = load_config(TINY_CONFIG)
    if name == "wide":
        cfg.model = dataclasses.replace(
            cfg.model,
            hidden_size=512,
            ffn_hidden_size=1024,
            moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=512,
            kv_channels=128,
            mamba_head_dim=64,
        )
    return cfg


def _calibration_data(work: Path, name: str) -> str:
    """An indexed dataset of random tokens: the calibration text of ``hf_fp8_calib``."""
    import numpy as np

    from elastic_plugin.data.indexed import write_indexed_dataset

    vocab = _experiment(name).model.vocab_size
    rng = np.random.default_rng(0)
    prefix = str(work / "calib")
    docs = [rng.integers(0, vocab, 1000) for _ in range(CALIB_SAMPLES)]
    write_indexed_dataset(prefix, docs, vocab_size=vocab)
    return prefix


def _checkpoint(name: str, work: Path) -> Path:
    """One elastic iteration (synthetic tokens), then budget 0.4 -> every axis at its smallest."""
    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout
    from tests.support import elastic_cases as ec

    init_distributed()
    initialize_layout(Layout())
    cfg = _experiment(name)
    ckpt = ec.train_tiny_elastic(cfg, work, iters=1, batch=2, lr=1e-3)
    meta = json.loads((ckpt / "elastic_meta.json").read_text())
    meta["elastic"]["choices"]["0.4"] = {
        axis: min(spec["candidates"]) for axis, spec in meta["elastic"]["axes"].items()
    }
    (ckpt / "elastic_meta.json").write_text(json.dumps(meta))
    return ckpt


def run(
    quick: bool = False, reps: int | None = None, models: tuple[str, ...] | None = None
) -> list[dict]:
    from elastic_plugin.export.extract import (
        QuantOptions,
        load_source,
        plan_extraction,
        run_extraction,
    )

    reps = reps or (1 if quick else 3)
    models = models or (("tiny",) if quick else ("tiny", "wide"))
    rows = []
    for name in models:
        work = Path(tempfile.mkdtemp(prefix=f"bench_extract_{name}_"))
        try:
            ckpt = _checkpoint(name, work)
            counter = itertools.count()
            began = time.perf_counter()
            source = None
            calib = _calibration_data(work, name)
            for budget, (fmt_name, (fmt, dtype, quantize, samples)) in itertools.product(
                BUDGETS, FORMATS.items()
            ):

                def plan():
                    return plan_extraction(
                        ckpt,
                        float(budget),
                        work / f"out_{next(counter)}",
                        fmt=fmt,
                        dtype=dtype,
                        quantize=quantize,
                        # the smallest Mamba head dim (0.5 x) is not whole NVFP4 blocks
                        quant=QuantOptions("high-precision", samples, calib if samples else None)
                        if quantize
                        else None,
                    )

                if source is None:
                    source = load_source(plan())
                    load_s = time.perf_counter() - began
                sample = run_extraction(plan(), source)
                size = sample["bytes"]

                def extract():
                    out = run_extraction(plan(), source)["out"]
                    shutil.rmtree(out)

                times = interleaved_medians(
                    {"extract": extract, "copy": copy_floor(work, size)}, reps=reps, warmup=1
                )
                mb = round(size / 1e6, 6)  # the rates below are of the MB reported
                rows.append(
                    {
                        "name": f"{name}/b{budget}/{fmt_name}",
                        "MB": mb,
                        "extract_ms": 1e3 * times["extract"],
                        "copy_ms": 1e3 * times["copy"],
                        "extract/copy": times["extract"] / times["copy"],
                        "extract_MB/s": mb / times["extract"],
                        "copy_MB/s": mb / times["copy"],
                        "load_s": round(load_s, 2),
                    }
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
