"""The pickle allowlist check: what it adds to a checkpoint load, measured side by side.

Every load checks the pickles torch would unpickle from a checkpoint (``.metadata`` and the
``.distcp`` byte items; ``checkpoint.safe_pickle``) before Megatron reads them. For a plain
model of the tiny config (``tiny``) and of the same pattern at 4x the width (``wide``, as in
``bench_extract``), saved at TP=PP=EP=1, these run interleaved (``interleaved_medians``):

* ``load``: ``load_checkpoint`` as shipped (digests and pickle check, both caches emptied each
  time, as in a fresh process) vs the same with the pickle check stubbed out (``nocheck``);
  ``check``: ``check_checkpoint_pickles`` alone. Ratios ``load/nocheck`` (what a load costs
  with the check on) and ``check/load`` (the check's share);
* ``metadata``: checking ``.metadata`` vs ``pickle.loads`` of it (what torch does with it):
  ``check/unpickle``.

Run: ``python bench/bench_safe_load.py [--quick] [--reps N] [--json PATH]`` or ``python
bench/run_all.py --only safe_load``. ``--quick``: ``tiny`` only, one repetition.
"""

from __future__ import annotations

import pickle
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians  # noqa: E402
from bench_checkpoint_hash import _model, _stubbed  # noqa: E402

MODELS = ("tiny", "wide")


def run(
    quick: bool = False, reps: int | None = None, models: tuple[str, ...] | None = None
) -> list[dict]:
    from elastic_plugin.checkpoint import integrity, io, safe_pickle
    from elastic_plugin.parallel import Layout

    reps = reps or (1 if quick else 7)
    models = models or (("tiny",) if quick else MODELS)
    warmup = 0 if quick else 1
    rows = []
    for name in models:
        work = Path(tempfile.mkdtemp(prefix=f"bench_safe_load_{name}_"))
        try:
            chunks, cfg = _model(name)
            meta = {"kind": "teacher", "config": cfg.to_dict(), "layout": asdict(Layout())}
            ckpt = io.save_checkpoint(chunks, work / "ckpt", meta)
            metadata = (ckpt / ".metadata").read_bytes()
            pickle.loads(metadata)  # import torch's checkpoint classes before timing

            def fresh() -> None:  # hash and check every time, as a fresh process does
                integrity.forget_verified()
                safe_pickle.forget_checked()

            def load() -> None:
                fresh()
                io.load_checkpoint(chunks, ckpt)

            def load_nocheck() -> None:
                fresh()
                with _stubbed(io, "check_checkpoint_pickles", lambda *a, **k: None):
                    io.load_checkpoint(chunks, ckpt)

            times = interleaved_medians(
                {
                    "load": load,
                    "nocheck": load_nocheck,
                    "check": lambda: safe_pickle.check_checkpoint_pickles(ckpt, use_cache=False),
                    "check_metadata": lambda: safe_pickle.check_pickle_bytes(metadata, "m"),
                    "unpickle": lambda: pickle.loads(metadata),
                },
                reps=reps,
                warmup=warmup,
            )
            report = safe_pickle.check_checkpoint_pickles(ckpt, use_cache=False)
            rows.append(
                {
                    "name": f"{name}/load",
                    "pickles": report.files + report.byte_items,
                    "load_ms": 1e3 * times["load"],
                    "nocheck_ms": 1e3 * times["nocheck"],
                    "check_ms": 1e3 * times["check"],
                    "load/nocheck": times["load"] / times["nocheck"],
                    "check/load": times["check"] / times["nocheck"],
                }
            )
            rows.append(
                {
                    "name": f"{name}/metadata",
                    "KB": round(len(metadata) / 1e3, 1),
                    "check_ms": 1e3 * times["check_metadata"],
                    "unpickle_ms": 1e3 * times["unpickle"],
                    "check/unpickle": times["check_metadata"] / times["unpickle"],
                }
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0])


if __name__ == "__main__":  # dist-checkpointing starts helper processes: guard the entry point
    main()
