"""Minitron's route beside the elastic run: each smaller size pruned, then distilled alone.

The same architecture the elastic run chose for a budget, cut from the same importance-ordered
parent and distilled from the same frozen parent on the same data, at *equal cost*: the elastic
run's training tokens split over the sizes below 1.0 (all of them together cost one elastic run;
``comparison.plan.route_tokens``). Each run is ``comparison.runner.train_run``, the
``elastic-train`` command on a one-candidate config (``comparison.configs.distil_config``), so the
route is the one ``compare`` measures on the synthetic task.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

ALONE_FILE = "alone.json"


def distil_alone(
    elastic_ckpt: Path,
    reordered: Path,
    train_prefix: str,
    valid_prefix: str,
    tokenizer: str,
    out: Path,
    batch: dict[str, int],
    schedule_flags: tuple[str, ...] = (),
    seed: int = 1,
) -> dict[str, Any]:
    """Train every budget below 1.0 alone at equal cost; write and return ``out/alone.json``:
    label -> {checkpoint, budget (its cost fraction: the one budget it was trained for),
    iters, tokens, seconds (the steps' own), wall_s}. ``batch``: the elastic run's
    ``seq_length`` / ``micro_batch_size`` / ``global_batch_size`` as it ran (flags included;
    its checkpoint's config holds the YAML's); ``schedule_flags``: the elastic run's schedule
    flags (its learning rate), so that both routes train alike."""
    from elastic_plugin.checkpoint.meta import (
        budget_label,
        read_elastic_meta,
        stored_choice,
        trained_budgets,
    )
    from elastic_plugin.comparison.plan import (
        RunSpec,
        elastic_tokens,
        iters_for_tokens,
        route_tokens,
    )
    from elastic_plugin.comparison.runner import CompareData, SizeSource, train_run

    meta = read_elastic_meta(elastic_ckpt)
    training = {**meta["config"]["training"], **batch}
    config = {**meta["config"], "training": training}
    smaller = sorted((b for b in trained_budgets(meta) if b < 1.0), reverse=True)
    total = elastic_tokens(config, int(meta["iteration"]))
    tokens = route_tokens("equal_cost", total, len(smaller))
    iters = iters_for_tokens(
        tokens, int(training["global_batch_size"]), int(training["seq_length"])
    )
    data = CompareData(train_prefix, valid_prefix, tokenizer, str(Path(train_prefix).parent))
    fractions = meta["elastic"]["cost_fraction"]
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, Any] = {}
    for budget in smaller:
        label = budget_label(budget)
        choice = {
            k: int(v[0] if isinstance(v, list) else v)
            for k, v in stored_choice(meta, budget, elastic_ckpt).items()
        }
        spec = RunSpec("prune_distil", label, "equal_cost", seed, iters, tokens)
        source = SizeSource(
            config, choice, float(fractions[label]), reordered, data, schedule_flags
        )
        print(
            f"[demo-real alone {time.time() - started:6.1f}s] distilling the {label} architecture "
            f"alone: {iters} iterations ({tokens:,} tokens; the elastic run: {total:,})",
            flush=True,
        )
        result = train_run(spec, out / "runs", source)
        results[label] = {
            "checkpoint": result["checkpoint"],
            "budget": float(fractions[label]),
            "iters": iters,
            "tokens": iters * int(training["global_batch_size"]) * int(training["seq_length"]),
            "seconds": result["seconds"],
            "tflop": result.get("tflop"),
            "wall_s": result["wall_s"],
        }
    summary = {"elastic_tokens": total, "token_budget": "equal_cost", "sizes": results}
    (out / ALONE_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
