"""Slicing a budget out of one nested Hugging Face directory vs copying that budget's bytes.

``export --nested`` writes the full model once; ``elastic-plugin slice`` builds any budget's own
export from it. It should cost little more than writing the budget's bytes: reading the nested
shards, index selection, writing. For each budget of a freshly trained elastic checkpoint
(``tiny``: examples/configs/tiny.yaml; ``wide``: the same pattern at 4x the width), these run
interleaved (``interleaved_medians``):

* ``slice``: ``slice_nested(nested_dir, budget, out)`` (read every shard, cut, write, publish);
* ``copy``: ``shutil.copyfile`` of a file the size of that budget's output, the floor any writer
  of those bytes pays on this disk.

Per precision (BF16, and FP8 / NVFP4 nested directories, whose slices cut the quantized parent:
packed NVFP4 bytes and block scales). Columns: ``MB`` written, medians, ``slice/copy`` (lower is
better), and per model and precision the nested directory's bytes against the budgets' separate
exports (``nested/separate``).

Run: ``python bench/bench_slice.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only slice``.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import copy_floor, interleaved_medians  # noqa: E402
from bench_extract import BUDGETS, _checkpoint  # noqa: E402

PRECISIONS = ("bf16", "fp8", "nvfp4")


def run(
    quick: bool = False,
    reps: int | None = None,
    models: tuple[str, ...] | None = None,
    precisions: tuple[str, ...] = PRECISIONS,
) -> list[dict]:
    from elastic_plugin.export.extract import QuantOptions
    from elastic_plugin.export.nested_hf import slice_nested, write_nested_export

    reps = reps or (1 if quick else 3)
    models = models or (("tiny",) if quick else ("tiny", "wide"))
    rows = []
    for name in models:
        work = Path(tempfile.mkdtemp(prefix=f"bench_slice_{name}_"))
        try:
            ckpt = _checkpoint(name, work)
            for precision in precisions:
                quantize = None if precision == "bf16" else precision
                nested_dir = work / f"nested_{precision}"
                # tiny's smallest Mamba head dim (8 of 16) is not whole NVFP4 blocks
                quant = QuantOptions("high-precision") if quantize else None
                nested = write_nested_export(ckpt, nested_dir, None, "bf16", None, quantize, quant)
                counter = itertools.count()
                sizes = {
                    b: slice_nested(nested_dir, float(b), work / f"own_{precision}_{b}")["bytes"]
                    for b in BUDGETS
                }
                for budget in BUDGETS:

                    def cut(source=nested_dir, budget=budget):
                        out = work / f"slice_{next(counter)}"
                        slice_nested(source, float(budget), out)
                        shutil.rmtree(out)

                    times = interleaved_medians(
                        {"slice": cut, "copy": copy_floor(work, sizes[budget])},
                        reps=reps,
                        warmup=1,
                    )
                    rows.append(
                        {
                            "name": f"{name}/{precision}/b{budget}",
                            "MB": round(sizes[budget] / 1e6, 3),
                            "slice_ms": 1e3 * times["slice"],
                            "copy_ms": 1e3 * times["copy"],
                            "slice/copy": times["slice"] / times["copy"],
                            "nested_MB": round(nested["bytes"] / 1e6, 3),
                            "nested/separate": nested["bytes"] / sum(sizes.values()),
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
