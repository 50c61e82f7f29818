"""Greedy generation on the tiny hybrid model: cached decode vs full recompute, side by side.

For batch 1 and batch 8 (equal-length prompts, so full recompute also runs batched), both
generators produce ``NEW`` tokens after a ``PROMPT``-token prompt; repetitions alternate between
them (medians). Columns: decode tokens/s of each (tokens after the first / decode time; the
first token comes from the prompt's forward in both), ``decode_speedup`` = cached / recompute,
and the same for the whole generation (prompt included). Both must produce the same tokens
(checked on every run). One intra-op thread by default: on a 2-core machine shared with other
jobs, two threads stall in spin-waits and the medians stop meaning anything.

Run: ``python bench/bench_generate.py [--quick] [--reps N] [--threads T] [--json PATH]`` or
``python bench/run_all.py --only generate``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = 64
NEW = 48
BATCHES = (1, 8)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run(quick: bool = False, reps: int | None = None, threads: int = 1) -> list[dict]:
    from elastic_plugin.inference import generate, recompute_generate
    from tests.support.inference_cases import random_prompts, tiny_inference_model

    reps = reps or (1 if quick else 3)
    new = 8 if quick else NEW
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, cfg = tiny_inference_model(seed=1)
        rows = []
        for batch in BATCHES:
            prompts = random_prompts([PROMPT] * batch, cfg.vocab_size, seed=batch)
            runners = {
                "cached": lambda: generate(model, prompts, new),
                "recompute": lambda: recompute_generate(model, prompts, new),
            }
            for fn in runners.values():  # warm-up (first calls allocate and dispatch lazily)
                fn()
            decode: dict[str, list[float]] = {k: [] for k in runners}
            total: dict[str, list[float]] = {k: [] for k in runners}
            for rep in range(reps):
                order = list(runners.items())
                order = order[rep % 2 :] + order[: rep % 2]
                outputs = {}
                for name, fn in order:
                    result = fn()
                    outputs[name] = result.tokens
                    decode[name].append(result.decode_tokens_per_s)
                    total[name].append(result.tokens_per_s)
                if outputs["cached"] != outputs["recompute"]:
                    raise AssertionError(f"batch {batch}: cached and recomputed tokens differ")
            cached, recompute = _median(decode["cached"]), _median(decode["recompute"])
            rows.append(
                {
                    "name": f"generate/b{batch}/p{PROMPT}+{new}",
                    "cached_tok/s": cached,
                    "recompute_tok/s": recompute,
                    "decode_speedup": cached / recompute,
                    "total_speedup": _median(total["cached"]) / _median(total["recompute"]),
                }
            )
        return rows
    finally:
        torch.set_num_threads(saved_threads)


def main() -> None:
    from run_all import bench_main

    bench_main(run, __doc__.splitlines()[0], threads=True)


if __name__ == "__main__":
    main()
