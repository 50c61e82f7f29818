"""Slicing a budget out of one nested Hugging Face directory vs copying that budget's bytes.

``export --nested`` writes the full model once; ``elastic-plugin slice`` builds any budget's own
export from it. It should cost little more than writing the budget's bytes: reading the nested
shards, index selection, writing. For each budget of a freshly trained elastic checkpoint
(``tiny``: examples/configs/tiny.yaml; ``wide``: the same pattern at 4x the width), these run
interleaved (``interleaved_medians``):

* ``slice``: ``slice_nested(nested_dir, budget, out)`` (read every shard, cut, write, publish);
* ``copy``: ``shutil.copyfile`` of a file the size of that budget's output, the floor any writer
  of those bytes pays on this disk.

Columns: ``MB`` written, medians, ``slice/copy`` (lower is better), and per model the nested
directory's bytes against the budgets' separate exports (``nested/separate``).

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


def run(
    quick: bool = False, reps: int | None = None, models: tuple[str, ...] | None = None
) -> list[dict]:
    from elastic_plugin.export.nested_hf import slice_nested, write_nested_export

    reps = reps or (1 if quick else 3)
    models = models or (("tiny",) if quick else ("tiny", "wide"))
    rows = []
    for name in models:
        work = Path(tempfile.mkdtemp(prefix=f"bench_slice_{name}_"))
        try:
            ckpt = _checkpoint(name, work)
            nested = write_nested_export(ckpt, work / "nested")
            counter = itertools.count()
            sizes = {
                b: slice_nested(work / "nested", float(b), work / f"own_{b}")["bytes"]
                for b in BUDGETS
            }
            for budget in BUDGETS:

                def cut():
                    out = work / f"slice_{next(counter)}"
                    slice_nested(work / "nested", float(budget), out)
                    shutil.rmtree(out)

                times = interleaved_medians(
                    {"slice": cut, "copy": copy_floor(work, sizes[budget])}, reps=reps, warmup=1
                )
                mb = sizes[budget] / 1e6
                rows.append(
                    {
                        "name": f"{name}/b{budget}",
                        "MB": round(mb, 3),
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
