"""Checkpoint digests: what recording them costs a save, what verifying them costs a load.

Every checkpoint records the size and SHA-256 of each of its files at save and every load checks
them first (``checkpoint.integrity``). For a plain model of the tiny config (``tiny``:
examples/configs/tiny.yaml) and of the same pattern at 4x the width (``wide``, as in
``bench_extract``), saved and loaded at TP=PP=EP=1, these run interleaved
(``interleaved_medians``):

* ``save``: ``save_checkpoint`` as shipped vs the same save with ``record_digests`` stubbed out
  (``nodigest``); ``record``: ``record_digests`` alone on the written directory; ``history``:
  a save into a stage's history (``iteration=``: the new save is verified before the pointer
  moves, as elastic-train saves). Ratios ``save/nodigest`` (the whole save), ``record/save``
  (the hash's share of a plain save) and ``history/save`` (what the verification adds);
* ``load``: ``load_checkpoint`` as shipped (its verification cache emptied each time, so every
  load hashes) vs with ``verify_checkpoint`` stubbed out; ``verify``: ``verify_checkpoint`` alone.
  Ratios ``load/noverify`` and ``verify/load``;
* ``hash``: streaming each file of the checkpoint (8 MiB reads) through SHA-256 (the recorded
  digest), BLAKE2b, CRC-32 (``zlib``) and no hash at all (``read``): MB/s and ``x/read``.

The files are in the page cache (just written), so the hashes run at memory speed: the worst
case for their share of a load. Run: ``python bench/bench_checkpoint_hash.py [--quick] [--reps N]
[--json PATH]`` or ``python bench/run_all.py --only checkpoint_hash``. ``--quick``: ``tiny``
only, one repetition.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians  # noqa: E402
from bench_extract import _experiment  # noqa: E402

MODELS = ("tiny", "wide")
HASHES = ("sha256", "blake2b", "crc32", "read")


def _stream(path: Path, update: Callable[[memoryview], object]) -> int:
    """Feed a file to ``update`` in 8 MiB reads, as ``integrity.file_digest`` does."""
    from elastic_plugin.checkpoint.integrity import CHUNK_BYTES

    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            update(view[:n])
            size += n
    return size


def hasher(algorithm: str, files: list[Path]) -> Callable[[], int]:
    """A timed step that streams every one of ``files`` through ``algorithm`` (``read``: none)."""

    def run() -> int:
        total = 0
        for path in files:
            if algorithm == "crc32":
                crc = [0]
                total += _stream(path, lambda b: crc.__setitem__(0, zlib.crc32(b, crc[0])))
            elif algorithm == "read":
                total += _stream(path, lambda b: None)
            else:
                h = hashlib.new(algorithm)
                total += _stream(path, h.update)
        return total

    return run


@contextlib.contextmanager
def _stubbed(module, name: str, replacement) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def _model(name: str):
    """The plain model of ``name`` and its experiment config, this process at TP=PP=EP=1."""
    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    init_distributed()
    initialize_layout(Layout())
    cfg = _experiment(name)
    chunks, _ = build_model_chunks(cfg.model, Layout(), wrap_ddp=False)
    return chunks, cfg


def run(
    quick: bool = False, reps: int | None = None, models: tuple[str, ...] | None = None
) -> list[dict]:
    from elastic_plugin.checkpoint import integrity, io
    from elastic_plugin.parallel import Layout

    reps = reps or (1 if quick else 5)
    models = models or (("tiny",) if quick else MODELS)
    warmup = 0 if quick else 1
    rows = []
    for name in models:
        work = Path(tempfile.mkdtemp(prefix=f"bench_checkpoint_hash_{name}_"))
        try:
            chunks, cfg = _model(name)
            meta = {"kind": "teacher", "config": cfg.to_dict(), "layout": asdict(Layout())}
            ckpt = io.save_checkpoint(chunks, work / "ckpt", meta)
            files = [ckpt / n for n in sorted(io.read_checkpoint_meta(ckpt)["files"])]
            nbytes = sum(p.stat().st_size for p in files)
            counter = itertools.count()

            def save() -> None:
                out = io.save_checkpoint(chunks, work / f"save_{next(counter)}", meta)
                shutil.rmtree(out)

            def save_history() -> None:
                integrity.forget_verified()  # the verification hashes, as after a real save
                stage = work / f"stage_{next(counter)}"
                io.save_checkpoint(chunks, stage, meta, iteration=1)
                shutil.rmtree(stage)

            def save_nodigest() -> None:
                with _stubbed(io, "record_digests", lambda directory: {}):
                    save()

            def load() -> None:
                integrity.forget_verified()  # hash every time, as a fresh process does
                io.load_checkpoint(chunks, ckpt)

            def load_noverify() -> None:
                with _stubbed(io, "verify_checkpoint", lambda *args, **kwargs: None):
                    io.load_checkpoint(chunks, ckpt)

            def verify() -> None:
                integrity.forget_verified()
                io.verify_checkpoint(ckpt)

            times = interleaved_medians(
                {
                    "save": save,
                    "history": save_history,
                    "nodigest": save_nodigest,
                    "record": lambda: io.record_digests(ckpt),
                    "load": load,
                    "noverify": load_noverify,
                    "verify": verify,
                    **{h: hasher(h, files) for h in HASHES},
                },
                reps=reps,
                warmup=warmup,
            )
            mb = nbytes / 1e6
            rows.append(
                {
                    "name": f"{name}/save",
                    "MB": round(mb, 3),
                    "save_ms": 1e3 * times["save"],
                    "nodigest_ms": 1e3 * times["nodigest"],
                    "record_ms": 1e3 * times["record"],
                    "history_ms": 1e3 * times["history"],
                    "save/nodigest": times["save"] / times["nodigest"],
                    "record/save": times["record"] / times["nodigest"],
                    "history/save": times["history"] / times["save"],
                }
            )
            rows.append(
                {
                    "name": f"{name}/load",
                    "MB": round(mb, 3),
                    "load_ms": 1e3 * times["load"],
                    "noverify_ms": 1e3 * times["noverify"],
                    "verify_ms": 1e3 * times["verify"],
                    "load/noverify": times["load"] / times["noverify"],
                    "verify/load": times["verify"] / times["noverify"],
                }
            )
            for h in HASHES:
                rows.append(
                    {
                        "name": f"{name}/hash/{h}",
                        "MB": round(mb, 3),
                        "hash_ms": 1e3 * times[h],
                        "MB_s": mb / times[h],
                        "x/read": times[h] / times["read"],
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
