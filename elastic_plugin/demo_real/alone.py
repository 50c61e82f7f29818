"""Minitron's route beside the elastic run: each smaller size pruned, then distilled alone.

The same architecture the elastic run chose for a budget, cut from the same importance-ordered
parent and distilled from the same frozen parent on the same data, at *equal cost*: the elastic
route's FLOPs less the importance pass split equally over the sizes below 1.0, each share whole
iterations of that size's own cost (``demo_real.routes``; all of them together cost one elastic
route), or, without those FLOPs, the elastic run's training tokens split
(``comparison.plan.route_tokens``). Each run is ``comparison.runner.train_run``, the
``elastic-train`` command on a one-candidate config (``comparison.configs.distil_config``), so the
route is the one ``compare`` measures on the synthetic task.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ALONE_FILE = "alone.json"


def elastic_run_config(
    elastic_ckpt: Path, batch: Mapping[str, int]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(meta, config, training)`` of the elastic run as it ran: its checkpoint's experiment
    config with ``batch`` (the run's ``seq_length`` / ``micro_batch_size`` /
    ``global_batch_size`` flags; the checkpoint's config holds the YAML's) over ``training``."""
    from elastic_plugin.checkpoint.meta import read_elastic_meta

    meta = read_elastic_meta(elastic_ckpt)
    training = {**meta["config"]["training"], **batch}
    return meta, {**meta["config"], "training": training}, training


def distil_run(
    spec: Any,
    runs_dir: Path,
    config: Mapping[str, Any],
    choice: Mapping[str, int],
    fraction: float,
    source_ckpt: Path,
    data: Any,
    flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One fixed architecture (``choice``, cost fraction ``fraction`` of ``source_ckpt``'s
    model) distilled for ``spec.iters`` iterations by ``comparison.runner.train_run`` (an
    ``elastic-train`` process on a one-candidate config): the record every route keeps of a run
    (checkpoint, budget, iters, tokens, seconds, tflop, wall_s, valid_loss). ``flags``: extra
    ``elastic-train`` flags (the schedule; ``--teacher-ckpt`` where the student's source is not
    the parent)."""
    from elastic_plugin.comparison.runner import SizeSource, train_run

    training = config["training"]
    source = SizeSource(config, dict(choice), float(fraction), source_ckpt, data, tuple(flags))
    result = train_run(spec, runs_dir, source)
    valid = result.get("train_valid_loss")
    if isinstance(valid, Mapping):
        valid = next(iter(valid.values()), None)
    return {
        "checkpoint": result["checkpoint"],
        "budget": float(fraction),
        "iters": spec.iters,
        "tokens": spec.iters * int(training["global_batch_size"]) * int(training["seq_length"]),
        "seconds": result["seconds"],
        "tflop": result.get("tflop"),
        "wall_s": result["wall_s"],
        "valid_loss": valid,
    }


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
    size_flops: float | None = None,
) -> dict[str, Any]:
    """Train every budget below 1.0 alone at equal cost; write and return ``out/alone.json``:
    label -> {checkpoint, budget (its cost fraction: the one budget it was trained for),
    iters, tokens, seconds (the steps' own), wall_s}. ``batch``: the elastic run's
    ``seq_length`` / ``micro_batch_size`` / ``global_batch_size`` as it ran (flags included;
    its checkpoint's config holds the YAML's); ``schedule_flags``: the elastic run's schedule
    flags (its learning rate), so that both routes train alike. ``size_flops``: each size's
    share of the elastic route's FLOPs (``demo_real.routes``), turned into whole iterations of
    that size's own cost (student training + the parent's forward): equal FLOPs, not tokens;
    None splits the elastic run's tokens instead."""
    from elastic_plugin.checkpoint.meta import budget_label, stored_choice, trained_budgets
    from elastic_plugin.comparison.plan import (
        RunSpec,
        elastic_tokens,
        iters_for_tokens,
        route_tokens,
    )
    from elastic_plugin.comparison.runner import CompareData

    meta, config, training = elastic_run_config(elastic_ckpt, batch)
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
        if size_flops is not None:
            iters = _iters_for_flops(config, choice, size_flops)
            tokens = iters * int(training["global_batch_size"]) * int(training["seq_length"])
        spec = RunSpec("prune_distil", label, "equal_cost", seed, iters, tokens)
        print(
            f"[demo-real alone {time.time() - started:6.1f}s] distilling the {label} architecture "
            f"alone: {iters} iterations ({tokens:,} tokens; the elastic run: {total:,})",
            flush=True,
        )
        results[label] = distil_run(
            spec, out / "runs", config, choice, float(fractions[label]), reordered, data,
            schedule_flags,
        )  # fmt: skip
        results[label]["choice"] = choice
    summary = {"elastic_tokens": total, "token_budget": "equal_cost", "sizes": results,
               "split": "flops" if size_flops is not None else "tokens"}  # fmt: skip
    (out / ALONE_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _iters_for_flops(config: Mapping[str, Any], choice: Mapping[str, int], flops: float) -> int:
    """Whole iterations (at least one) of ``choice`` distilled from the parent that cost
    ``flops``."""
    from elastic_plugin.demo_real.routes import distil_iteration_flops
    from elastic_plugin.models.config import config_from_dict

    parent = config_from_dict(config).model
    training = config["training"]
    per_iter = distil_iteration_flops(
        parent, choice, parent, int(training["seq_length"]), int(training["global_batch_size"])
    )
    return max(1, round(flops / per_iter))
