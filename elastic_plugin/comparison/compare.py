"""``run_compare``: plan the routes from the elastic checkpoint, train the separate ones
(``runner``), measure every model alike (``measure``) and write the report (``report``)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import run_dir
from elastic_plugin.checkpoint.meta import (
    budget_label,
    read_checkpoint_meta,
    read_elastic_meta,
    stored_choice,
    trained_budgets,
)
from elastic_plugin.comparison.plan import ROUTES, TOKEN_BUDGETS, RunSpec, elastic_tokens, plan_runs
from elastic_plugin.models.config import ConfigError

__all__ = ["CompareInputs", "check_inputs", "run_compare"]


@dataclass(frozen=True)
class CompareInputs:
    ckpt: Path
    reordered: Path
    out: Path
    meta: dict[str, Any]
    labels: tuple[str, ...]  # compared budgets
    budgets: dict[str, float]  # label -> trained budget
    num_sizes: int  # sizes a separate route must make (trained budgets below 1.0)
    routes: tuple[str, ...]
    token_budgets: tuple[str, ...]
    seeds: tuple[int, ...]
    scale: float
    num_problems: int
    batch_size: int
    eval_sequences: int


def _names(flag: str, text: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in items if t not in allowed]
    if not items or bad:
        raise ConfigError(
            f"{flag} {text!r}: {'nothing given' if not items else repr(bad[0]) + ' unknown'}; "
            f"allowed: a comma-separated list of {', '.join(allowed)}"
        )
    return items


def check_inputs(
    ckpt: str | Path,
    out: str | Path,
    reordered: str | Path | None = None,
    budgets: str | None = None,
    routes: str = ",".join(ROUTES),
    token_budgets: str = ",".join(TOKEN_BUDGETS),
    seeds: int = 3,
    scale: float = 1.0,
    num_problems: int = 200,
    batch_size: int = 50,
    eval_sequences: int = 64,
) -> CompareInputs:
    """Everything that can be wrong, found from metadata alone (no torch, no training)."""
    for flag, value in (
        ("--seeds", seeds),
        ("--num-problems", num_problems),
        ("--batch-size", batch_size),
        ("--eval-sequences", eval_sequences),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag}={value!r}: must be an int >= 1")
    if not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise ConfigError(f"--scale={scale!r}: must be a fraction in (0, 1]")
    route_names = _names("--routes", routes, ROUTES)
    token_names = _names("--token-budgets", token_budgets, TOKEN_BUDGETS)
    ckpt = Path(ckpt)
    meta = read_elastic_meta(ckpt)
    trained = {budget_label(b): float(b) for b in trained_budgets(meta)}
    below = [label for label, b in trained.items() if b < 1.0]
    if not below:
        raise ConfigError(f"--ckpt {ckpt}: no trained budget below 1.0 to compare")
    if budgets == "smallest":
        labels: tuple[str, ...] = (min(below, key=lambda label: trained[label]),)
    else:
        labels = tuple(below) if budgets is None else _names("--budgets", budgets, below)
    for label in labels:  # a per-layer (heterogeneous) choice is not one plain model
        from elastic_plugin.nested.choice import homogeneous_choice

        homogeneous_choice(stored_choice(meta, trained[label], ckpt), trained[label])
    reordered = Path(reordered) if reordered else run_dir(ckpt) / "checkpoints" / "reordered"
    needs_teacher = {"prune_distil", "zero_shot"} & set(route_names)
    if needs_teacher:
        rmeta = read_checkpoint_meta(reordered, "--reordered")
        if rmeta.get("kind") == "elastic":
            raise ConfigError(
                f"--reordered {reordered}: an elastic checkpoint; give the importance-ordered "
                "teacher (elastic-plugin reorder --out)"
            )
    data = meta.get("data") or {}
    if not (data.get("valid_data_path") or data.get("data_path")):
        raise ConfigError(
            f"--ckpt {ckpt}: records no data prefixes (meta 'data': {data}); the comparison "
            "trains and measures on the elastic run's data"
        )
    for key in ("data_path", "valid_data_path"):
        prefix = data.get(key)
        if prefix and not Path(prefix + ".idx").is_file():
            raise ConfigError(f"--ckpt {ckpt}: its {key} {prefix} is not readable here")
    heldout = Path(data.get("valid_data_path") or data["data_path"]).parent / "heldout.jsonl"
    if not heldout.is_file():
        raise ConfigError(
            f"--ckpt {ckpt}: no held-out problems next to its data ({heldout}); the "
            "comparison scores accuracy on the task's held-out problems"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    return CompareInputs(
        ckpt,
        reordered,
        out,
        meta,
        labels,
        trained,
        len(below),
        route_names,
        token_names,
        tuple(range(1, seeds + 1)),
        float(scale),
        num_problems,
        batch_size,
        eval_sequences,
    )


def run_compare(inputs: CompareInputs, progress: bool = True) -> dict[str, Any]:
    """Train, measure and report (see the module docstring); returns the report dict."""
    from elastic_plugin.comparison.measure import Measure, load_route_model, measure_all
    from elastic_plugin.comparison.report import (
        COMPARE_JSON,
        COMPARE_MD,
        COMPARE_PLOT,
        assemble,
        markdown,
        plot,
    )
    from elastic_plugin.comparison.runner import SizeSource, copy_data, run_totals, train_run

    started = time.time()

    def log(message: str) -> None:
        if progress:
            print(f"[compare {time.time() - started:7.1f}s] {message}", flush=True)

    meta, out = inputs.meta, inputs.out
    config = meta["config"]
    training = config["training"]
    seq, gbs = int(training["seq_length"]), int(training["global_batch_size"])
    total = elastic_tokens(config, int(meta["iteration"]))
    runs = plan_runs(
        inputs.labels,
        inputs.routes,
        inputs.token_budgets,
        inputs.seeds,
        total,
        inputs.num_sizes,
        gbs,
        seq,
        inputs.scale,
    )
    out.mkdir(parents=True, exist_ok=True)
    data_meta = meta["data"]
    data = copy_data(
        data_meta.get("data_path") or data_meta["valid_data_path"],
        data_meta.get("valid_data_path") or data_meta["data_path"],
        meta["tokenizer"],
        out / "data",
    )
    choices = {
        label: {
            k: int(v[0] if isinstance(v, list) else v)
            for k, v in stored_choice(meta, inputs.budgets[label], inputs.ckpt).items()
        }
        for label in inputs.labels
    }
    fractions = meta["elastic"]["cost_fraction"]
    trained = [r for r in runs if r.token_budget is not None]
    log(
        f"elastic run: {meta['iteration']} iterations, {total:,} tokens; {len(trained)} "
        f"separate models to train, then {len(runs)} to measure"
    )
    records: list[dict[str, Any]] = []
    loaders = []
    done = 0
    for spec in runs:
        record: dict[str, Any] = {"name": spec.name, "route": spec.route, "label": spec.label}
        checkpoint = inputs.ckpt
        if spec.token_budget is not None:
            done += 1
            log(f"training {done}/{len(trained)} {spec.name}: {spec.iters} iterations")
            source = SizeSource(
                config,
                choices[spec.label],
                float(fractions[spec.label]),
                inputs.reordered,
                data,
            )
            result = train_run(spec, out / "runs", source, log=log)
            record |= result
            checkpoint = Path(result["checkpoint"])
        elif spec.route == "zero_shot":
            checkpoint = inputs.reordered
        budget = (
            float(fractions[spec.label])
            if spec.route == "prune_distil"
            else inputs.budgets[spec.label]
        )
        records.append(record)
        loaders.append(_loader(spec, checkpoint, budget, choices[spec.label], load_route_model))
    measure = Measure(
        data.prepared_dir,
        data.valid_prefix,
        inputs.num_problems,
        inputs.batch_size,
        inputs.eval_sequences,
        seq,
    )
    measure_all(list(zip(records, loaders)), measure, log)
    settings = {
        "task": measure.problems.examples[0].task,
        "problems": len(measure.problems),
        "eval_sequences": int(measure.tokens.shape[0]),
        "seq_length": seq,
        "seeds": list(inputs.seeds),
        "scale": inputs.scale,
        "num_sizes": inputs.num_sizes,
        "token_budgets": {
            b: next((r.tokens for r in runs if r.token_budget == b), 0)
            for b in inputs.token_budgets
        },
        "elastic_checkpoint": str(inputs.ckpt),
        "reordered_checkpoint": str(inputs.reordered),
    }
    totals = run_totals(run_dir(inputs.ckpt) / "elastic_metrics.jsonl") or {}
    elastic_run: dict[str, Any] = {
        "iterations": int(meta["iteration"]),
        "tokens": total,
        "seconds": totals.get("seconds"),
        "tflop": totals.get("tflop"),
        "budgets": sorted(inputs.budgets.values(), reverse=True),
    }
    sizes = {
        label: {"choice": choices[label], "cost_fraction": fractions[label]}
        for label in inputs.labels
    }
    report = assemble(records, sizes, elastic_run, settings)
    report["models"] = records
    report["plots"] = [str(plot(report, out / COMPARE_PLOT))]
    report["seconds"] = round(time.time() - started, 1)
    (out / COMPARE_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / COMPARE_MD).write_text(markdown(report))
    return report


def _loader(spec: RunSpec, checkpoint: Path, budget: float, choice, load):
    return lambda: load(spec.route, checkpoint, budget, choice)
