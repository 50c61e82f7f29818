"""Zero-shot screening: each budget's architecture chosen by measured loss before training.

Why: a router that starts from a size prior explores architectures that wreck the small models
until its choice settles (the real-model run spent half its tokens at 11-21x the parent's
validation perplexity, and its 0.5 pick, a hidden size of 432 of 576, started at perplexity
44K). Cutting the reordered parent is free, so every homogeneous candidate of the grid (one size
per axis) is measured first: its language-model loss on ``router.screen_tokens`` validation
tokens, one forward each, through ``evaluate`` (``elastic.train.evaluate_budgets``: the sliced
model, under TP/PP as training evaluates it). Per budget the lowest-loss candidate within the
freeze's budget rule (``freeze.feasible_choices``: cost within 5% of the budget, the closest one
when none is) becomes the router's starting choice, at a strength that makes the Gumbel-max draw
pick it with probability ``START_PROBABILITY`` at the starting logit scale (the draw picks
candidate c with probability ``softmax(scale x logits)_c`` whatever the temperature).

The same pass measures an ablation per budget below 1.0: the parent cut along one axis only to
the budget (hidden, FFN, heads, ...: the size whose cost is closest to it) and cut in depth
(dropping the least important layers by ``importance.depth`` scores). ``screening.json`` holds
every row; ``python -m elastic_plugin.elastic.screening OUT/screening.json --budget 0.5`` prints
the ablation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.checkpoint.meta import budget_label, is_full_budget
from elastic_plugin.elastic.config import ResolvedElastic
from elastic_plugin.elastic.freeze import FREEZE_TOLERANCE, feasible_choices
from elastic_plugin.models.axes import model_axes
from elastic_plugin.models.config import ConfigError

__all__ = [
    "SCREENING_JSON",
    "START_PROBABILITY",
    "ablation_cuts",
    "depth_cut",
    "depth_importance",
    "format_ablation",
    "grid_choices",
    "init_router_from",
    "pick",
    "screen_router",
    "screen_table",
    "start_probability",
    "start_strength",
]

SCREENING_JSON = "screening.json"
START_PROBABILITY = 0.95  # the screened choice's probability of being drawn at iteration 1
MAX_PERPLEXITY_LOSS = 700.0  # exp() of more overflows a float: perplexity reported as exp(700)
AXIS_WORDS = {"embedding": "hidden", "ffn": "FFN", "attention_heads": "heads"}

Choice = dict[str, int]
Measure = Callable[..., Mapping[str, float | None]]


# ----------------------------------------------------------------------------- the grid
def grid_choices(resolved: ResolvedElastic) -> list[Choice]:
    """Every homogeneous choice (one candidate size per axis), in grid order."""
    names = list(resolved.axes)
    return [
        dict(zip(names, sizes))
        for sizes in itertools.product(*(resolved.axes[n].candidates for n in names))
    ]


def _perplexity(loss: float | None) -> float | None:
    return None if loss is None else math.exp(min(loss, MAX_PERPLEXITY_LOSS))


def _row(sizes: Mapping[str, Any], fraction: float, loss: float | None) -> dict[str, Any]:
    return {
        "sizes": dict(sizes),
        "cost_fraction": fraction,
        "loss": loss,
        "perplexity": _perplexity(loss),
    }


def screen_table(resolved: ResolvedElastic, cost, measure: Measure) -> list[dict[str, Any]]:
    """Every grid candidate's row (sizes, cost fraction, zero-shot loss, perplexity, rank by
    loss: 1 = lowest), measured by one ``measure({key: choice})`` call."""
    choices = grid_choices(resolved)
    losses = measure({f"c{i}": choice for i, choice in enumerate(choices)})
    rows = [
        _row(choice, cost.of_choice(choice) / cost.full, losses.get(f"c{i}"))
        for i, choice in enumerate(choices)
    ]
    order = sorted(range(len(rows)), key=lambda i: _loss_key(rows[i]["loss"]))
    for rank, i in enumerate(order, start=1):
        rows[i]["rank"] = rank
    return rows


def _loss_key(loss: float | None) -> float:
    return math.inf if loss is None or not math.isfinite(loss) else loss


def pick(
    rows: Sequence[Mapping[str, Any]],
    resolved: ResolvedElastic,
    cost,
    budget: float,
    tolerance: float = FREEZE_TOLERANCE,
) -> dict[str, Any]:
    """The lowest-loss row among the budget's feasible choices (the freeze's rule); equal
    losses go to the one under the budget, then the closest to it. Budget 1.0: the parent."""
    allowed = {
        tuple(sorted(c.items())) for c in feasible_choices(resolved, cost, budget, tolerance)
    }
    feasible = [r for r in rows if tuple(sorted(r["sizes"].items())) in allowed]
    if not feasible:  # the grid rows always include every feasible choice
        raise ValueError(f"screening: no grid row is feasible for budget {budget:g}")
    best = min(
        feasible,
        key=lambda r: (
            _loss_key(r["loss"]),
            r["cost_fraction"] > budget * (1 + 1e-9),
            abs(r["cost_fraction"] - budget),
        ),
    )
    return {**best, "feasible": len(feasible)}


# ----------------------------------------------------------------------------- router start
def start_strength(num_candidates: int, rows: int, probability: float, logit_scale: float) -> float:
    """The logit on the target (0 on the others) that makes one draw over ``num_candidates``
    pick the target with probability ``probability ** (1 / rows)``, so ``rows`` independent
    draws (axes x layers) all pick theirs with ``probability``: the Gumbel-max draw picks c
    with probability softmax(logit_scale x logits)_c."""
    if num_candidates < 2:
        return 0.0
    if not 0 < probability < 1 or rows < 1 or not logit_scale > 0:
        raise ValueError(
            f"start_strength: need 0 < probability < 1, rows >= 1, logit_scale > 0; got "
            f"{probability}, {rows}, {logit_scale}"
        )
    p = probability ** (1.0 / rows)
    return (math.log(p / (1.0 - p)) + math.log(num_candidates - 1)) / logit_scale


@torch.no_grad()
def start_probability(
    router, resolved: ResolvedElastic, budget: float, choice: Mapping[str, int], logit_scale: float
) -> float:
    """Probability that the first noisy draw for ``budget`` is ``choice`` on every axis and
    layer: the product of softmax(logit_scale x logits) at the chosen candidates."""
    logits = router.logits(router.encode(budget))
    total = 0.0
    for name, spec in resolved.axes.items():
        logp = torch.log_softmax(logits[name].double() * logit_scale, dim=-1)
        total += float(logp[:, spec.candidates.index(choice[name])].sum())
    return math.exp(total)


def init_router_from(
    router,
    resolved: ResolvedElastic,
    choices: Mapping[str, Mapping[str, int]],
    logit_scale: float,
    probability: float = START_PROBABILITY,
) -> tuple[dict[str, float], dict[str, float]]:
    """Solve each axis router's output layer (``_AxisRouter.init_output``) so that every budget
    starts on ``choices[label]`` with at least ``probability`` (every axis and layer at once)
    at ``logit_scale``. The strengths are raised by 5% steps when the weights' dtype (BF16)
    rounds the logits below it. Returns (strength per axis, start probability per budget)."""
    rows = sum(module.num_layers for module in router.routers.values() if module.num_candidates > 1)
    strengths = {
        name: start_strength(module.num_candidates, max(rows, 1), probability, logit_scale)
        for name, module in router.routers.items()
    }
    reached: dict[str, float] = {}
    for _ in range(20):
        for name, module in router.routers.items():
            spec = resolved.axes[name]
            targets = [
                spec.candidates.index(choices[budget_label(b)][name]) for b in router.budgets
            ]
            module.init_output(targets, strengths[name])
        reached = {
            budget_label(b): start_probability(
                router, resolved, b, choices[budget_label(b)], logit_scale
            )
            for b in router.budgets
            if not is_full_budget(b)
        }
        if all(p >= probability for p in reached.values()):
            break
        strengths = {name: s * 1.05 for name, s in strengths.items()}
    return strengths, reached


# ----------------------------------------------------------------------------- ablation
def ablation_cuts(
    resolved: ResolvedElastic, cost, budget: float, tolerance: float = FREEZE_TOLERANCE
) -> dict[str, dict[str, Any]]:
    """Per axis, the parent cut along that axis alone to the size whose cost is closest to
    ``budget`` (any size the elastic layers run: a multiple of the axis' unit in [minimum,
    full], not only the configured candidates). ``reaches``: within ``tolerance`` of it."""
    out: dict[str, dict[str, Any]] = {}
    axes = model_axes(resolved.model, resolved.tp, resolved.ep)
    for name in resolved.axes:
        full, multiple, minimum, _layers, _unit = axes[name]
        best: tuple[float, int, float] | None = None
        for size in range(multiple, full + 1, multiple):
            if size < minimum:
                continue
            fraction = cost.of_choice({name: size}) / cost.full
            miss = abs(fraction / budget - 1.0)
            if best is None or miss < best[0]:
                best = (miss, size, fraction)
        assert best is not None  # full itself is a multiple of the axis' unit
        out[name] = {
            "sizes": {**resolved.full_choice(), name: best[1]},
            "cost_fraction": best[2],
            "reaches": best[0] <= tolerance,
        }
    return out


def layer_params(model, metric: str) -> dict[int, int] | None:
    """Parameters of each decoder layer by global layer number (1-based, the model's pattern
    order); None for the memory metric (dropping a layer also drops its cache: not counted)."""
    from elastic_plugin.models.counting import count_parameters_per_layer

    if metric not in ("total_params", "active_params"):
        return None
    key = "params" if metric == "total_params" else "active"
    return {
        int(entry["layer"]) + 1: int(entry[key])  # type: ignore[call-overload]  # counted ints
        for entry in count_parameters_per_layer(model)
    }


def depth_cut(
    per_layer: Mapping[int, int],
    full_cost: float,
    budget: float,
    scores: Mapping[int, float] | None,
) -> dict[str, Any]:
    """The layers to drop for ``budget``: the least important first (lowest ``scores``; without
    scores the last layers first), as many as bring the cost closest to the budget (at least
    one layer is kept)."""
    numbers = sorted(per_layer)
    if scores:
        order = sorted(numbers, key=lambda n: (scores.get(n, math.inf), n))
    else:
        order = sorted(numbers, reverse=True)
    best: tuple[float, int, float] = (abs(1.0 / budget - 1.0), 0, 1.0)
    dropped = 0.0
    for k, number in enumerate(order[:-1], start=1):
        dropped += per_layer[number]
        fraction = (full_cost - dropped) / full_cost
        miss = abs(fraction / budget - 1.0)
        if miss < best[0]:
            best = (miss, k, fraction)
    return {
        "dropped_layers": sorted(order[: best[1]]),
        "layers_kept": len(numbers) - best[1],
        "cost_fraction": best[2],
        "reaches": best[0] <= FREEZE_TOLERANCE,
    }


def depth_importance(
    chunks,
    meta: Mapping[str, Any],
    valid_factory: Callable[[], Any],
    sched,
    model,
    data_parallel: int = 1,
) -> tuple[dict[int, float], str, int]:
    """Layer number -> depth importance, where it came from, and the FLOPs spent on it: the
    reordered checkpoint's scores file when it holds depth scores (``importance --depth``; 0),
    else measured here by ``importance.depth.depth_scores`` on one validation micro-batch per
    data-parallel rank (the full forward, then one per skipped layer)."""
    from elastic_plugin.importance.depth import depth_scores
    from elastic_plugin.importance.scores import ImportanceScores
    from elastic_plugin.models.flops import forward_flops

    path = meta.get("scores")
    if path and Path(path).is_file():
        scores = ImportanceScores.load(path, "the reordered checkpoint's scores")
        if scores.depth:
            return dict(scores.depth), f"scores file {path}", 0
    batches = valid_factory()
    first = [] if batches is None else [next(batches)]
    measured = depth_scores(chunks, first, sched.seq_length, sched.micro_batch_size)
    full = forward_flops(model, sched.seq_length, sched.micro_batch_size, full_router=True)
    flops = ((len(measured) + 1) * full.total - sum(full.per_layer)) * max(data_parallel, 1)
    tokens = sched.seq_length * sched.micro_batch_size
    source = f"measured (importance.depth: {len(measured) + 1} forwards of {tokens} tokens)"
    return measured, source, flops


def _skip_layer(_module, _args, kwargs, output):
    """A skipped layer passes its input through (as ``importance.depth`` skips one)."""
    hidden = kwargs["hidden_states"]
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


@contextmanager
def skipped_layers(chunks, numbers: Sequence[int]) -> Iterator[None]:
    """Skip the decoder layers with these global layer numbers (those this rank holds)."""
    handles = []
    wanted = set(numbers)
    for chunk in chunks:
        model = chunk
        while hasattr(model, "module") and not hasattr(model, "decoder"):
            model = model.module
        for layer in model.decoder.layers:
            if int(layer.layer_number) in wanted:
                handles.append(layer.register_forward_hook(_skip_layer, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------- the run
def screen_router(
    chunks,
    state,
    router,
    resolved: ResolvedElastic,
    cost,
    evaluate: Callable[..., Mapping[str, float | None]],
    valid_factory: Callable[[], Any],
    sched,
    *,
    data_parallel: int = 1,
    depth_scores: Mapping[int, float] | None = None,
    depth_source: str = "",
    depth_flops: int = 0,
    logit_scale: float = 1.0,
    out_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Screen every grid candidate and the ablation cuts, start ``router`` on each budget's
    pick, write ``OUT/screening.json`` (``out_dir``; rank 0 writes) and return its record.

    ``evaluate(chunks, state, table, valid_factory, sched)`` is ``elastic.train.
    evaluate_budgets``: ``sched.eval_iters`` micro-batches per candidate, here as many as
    ``router.screen_tokens`` needs. ``depth_scores``: layer number -> importance (None: the
    last layers go first in the depth cut); ``depth_flops``: what measuring them cost. The
    record counts the model FLOPs of every forward (``models.flops``, as training counts its
    steps), for a route's total cost."""
    from elastic_plugin.models.flops import forward_flops

    screen_tokens = resolved.config.router.screen_tokens
    per_microbatch = sched.seq_length * sched.micro_batch_size * max(data_parallel, 1)
    microbatches = max(1, math.ceil(screen_tokens / per_microbatch))
    screen_sched = replace(sched, eval_iters=microbatches)
    passes = {"candidates": 0, "ablation": 0}
    flops = {"candidates": 0, "ablation": 0, "depth_importance": depth_flops}

    def measure(
        table: Mapping[str, Choice], skip: Sequence[int] = (), phase: str = "candidates"
    ) -> Mapping[str, float | None]:
        for choice in table.values():
            count = forward_flops(
                resolved.model, sched.seq_length, sched.micro_batch_size, choice, full_router=True
            )
            skipped = sum(count.per_layer[n - 1] for n in skip)
            flops[phase] += (count.total - skipped) * microbatches * max(data_parallel, 1)
        passes[phase] += len(table)
        with skipped_layers(chunks, skip):
            return evaluate(chunks, state, dict(table), valid_factory, screen_sched)

    rows = screen_table(resolved, cost, measure)
    choices = {budget_label(b): pick(rows, resolved, cost, b) for b in resolved.budgets}
    ablation = _ablation(resolved, cost, measure, choices, depth_scores)
    strengths, reached = init_router_from(
        router, resolved, {label: row["sizes"] for label, row in choices.items()}, logit_scale
    )
    for label, p in reached.items():
        choices[label]["start_probability"] = p
    record = {
        "tokens_per_candidate": microbatches * per_microbatch,
        "microbatches": microbatches,
        "seq_length": sched.seq_length,
        "micro_batch_size": sched.micro_batch_size,
        "data_parallel": data_parallel,
        "passes": passes,  # candidates measured, each over tokens_per_candidate
        "flops": {**flops, "total": sum(flops.values())},
        "budget_metric": resolved.config.budget_metric,
        "tolerance": FREEZE_TOLERANCE,
        "candidates": rows,
        "choices": choices,
        "router_init": {
            "logit_scale": logit_scale,
            "target_probability": START_PROBABILITY,
            "strength": strengths,
        },
        "ablation": ablation,
        "depth_scores_from": depth_source if depth_scores else "none: the last layers first",
    }
    if log is not None:
        for line in summary_lines(record):
            log(line)
    if out_dir is not None and _is_rank0():
        path = Path(out_dir) / SCREENING_JSON
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def _ablation(
    resolved: ResolvedElastic,
    cost,
    measure: Measure,
    choices: Mapping[str, Mapping[str, Any]],
    depth_scores: Mapping[int, float] | None,
) -> dict[str, list[dict[str, Any]]]:
    """Per budget below 1.0: the screened pick, each single-axis cut and the depth cut, with
    their zero-shot losses (single-axis cuts in one ``measure`` call, the depth cut in one
    more with its layers skipped)."""
    out: dict[str, list[dict[str, Any]]] = {}
    per_layer = layer_params(resolved.model, resolved.config.budget_metric)
    for budget in resolved.budgets:
        if is_full_budget(budget):
            continue
        label = budget_label(budget)
        cuts = ablation_cuts(resolved, cost, budget)
        losses = measure({name: cut["sizes"] for name, cut in cuts.items()}, phase="ablation")
        screened = choices[label]
        rows = [
            {
                "cut": "screened",
                "reaches": True,
                **_row(screened["sizes"], screened["cost_fraction"], screened["loss"]),
            }
        ]
        for name, cut in cuts.items():
            row = _row(cut["sizes"], cut["cost_fraction"], losses.get(name))
            rows.append({"cut": AXIS_WORDS.get(name, name), "reaches": cut["reaches"], **row})
        if per_layer is not None:
            depth = depth_cut(per_layer, cost.full, budget, depth_scores)
            loss = measure(
                {"depth": resolved.full_choice()}, skip=depth["dropped_layers"], phase="ablation"
            )
            rows.append(
                {
                    "cut": "depth",
                    "reaches": depth["reaches"],
                    **_row(resolved.full_choice(), depth["cost_fraction"], loss.get("depth")),
                    "dropped_layers": depth["dropped_layers"],
                    "layers_kept": depth["layers_kept"],
                }
            )
        out[label] = rows
    return out


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


# ----------------------------------------------------------------------------- reading it
def summary_lines(record: Mapping[str, Any]) -> list[str]:
    """One line per budget: how many candidates fit, the pick, its loss and start probability;
    then what the screening cost."""
    lines = []
    for label, row in record["choices"].items():
        p = row.get("start_probability")
        lines.append(
            f"screening {label}: {row['feasible']} of {len(record['candidates'])} candidates "
            f"within {record['tolerance']:.0%}; best {row['sizes']} cost "
            f"{row['cost_fraction']:.3f} loss {_fmt(row['loss'])} (ppl {_fmt(row['perplexity'], 1)})"
            + (f"; the router starts on it with p={p:.3f}" if p is not None else "")
        )
    passes, flops = record["passes"], record["flops"]
    lines.append(
        f"screening cost: {passes['candidates']} candidates + {passes['ablation']} ablation cuts "
        f"x {record['tokens_per_candidate']} tokens, {flops['total'] / 1e12:.3f} TFLOP (model "
        f"FLOPs, depth importance {flops['depth_importance'] / 1e12:.3f})"
    )
    return lines


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ablation_rows(record: Mapping[str, Any], budget: float) -> list[dict[str, Any]]:
    """The ablation rows of ``budget`` from a screening record (``screening.json``)."""
    label = budget_label(budget)
    table = record.get("ablation") or {}
    if label not in table:
        raise ConfigError(
            f"--budget {budget:g}: the screening has no ablation for it; budgets with one: "
            f"{', '.join(table) or 'none'}"
        )
    return list(table[label])


def format_ablation(record: Mapping[str, Any], budget: float) -> str:
    """The ablation at ``budget`` as a text table, and which cut keeps the most (lowest loss
    among the cuts that reach the budget)."""
    rows = ablation_rows(record, budget)
    lines = [
        f"ablation at budget {budget:g} ({record['budget_metric']}; zero-shot, "
        f"{record['tokens_per_candidate']} validation tokens each)",
        f"{'cut':<10} {'cost':>6} {'reaches':>7} {'loss':>9} {'perplexity':>12}  architecture",
    ]
    for row in rows:
        arch = (
            f"{row['layers_kept']} layers kept, dropped {row['dropped_layers']}"
            if row["cut"] == "depth"
            else ", ".join(f"{k}={v}" for k, v in row["sizes"].items())
        )
        lines.append(
            f"{row['cut']:<10} {row['cost_fraction']:>6.3f} {'yes' if row['reaches'] else 'no':>7} "
            f"{_fmt(row['loss']):>9} {_fmt(row['perplexity'], 1):>12}  {arch}"
        )
    cuts = [r for r in rows if r["cut"] != "screened" and r["reaches"] and r["loss"] is not None]
    if cuts:
        best = min(cuts, key=lambda r: r["loss"])
        lines.append(f"keeps the most (one kind of cut alone): {best['cut']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m elastic_plugin.elastic.screening OUT/screening.json [--budget 0.5]``."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_plugin.elastic.screening",
        description="Print the zero-shot ablation of one budget from an elastic run's screening.",
    )
    parser.add_argument("screening", help=f"the run's {SCREENING_JSON}")
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args(argv)
    path = Path(args.screening)
    if not path.is_file():
        print(f"{parser.prog}: {path}: no such file", file=sys.stderr)
        return 2
    try:
        print(format_ablation(json.loads(path.read_text()), args.budget))
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
