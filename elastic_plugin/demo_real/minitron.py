"""Route (b) of ``make demo-real``: Minitron's route as ModelOpt ships it, with its own search.

ModelOpt's ``mcore_minitron`` pruning under a ``params`` constraint ranks every axis by
activation importance and the layers by depth importance, lists the homogeneous architectures of
its search space that fit the parameter count, validates the top candidates with a score
function and prunes to the best; the Minitron paper distils each candidate briefly before
scoring it, and the winner is then distilled at length. Here, per size below 1.0:

1. candidates (:func:`candidates`): one per *axis mix* (:data:`MIXES`: FFN only; heads + FFN;
   hidden + FFN; depth + FFN, dropping the blocks with the lowest depth importance,
   ``nested.depth``), each the importance-ordered parent cut on its fixed axes, then the FFN
   solved to the size's parameter count: the widest FFN (a multiple of ``ffn_multiple``) whose
   model has at most that many parameters (ModelOpt's ``<= params``), within ``tolerance`` of
   the parent's parameters below it. ModelOpt limits depth pruning to 20 % of the layers and
   width to 40 % per axis by default (``max_depth_pruning`` / ``max_width_pruning``); the fixed
   cuts stay inside those;
2. each candidate distilled from the frozen parent for its share of the search FLOPs
   (``comparison.runner.train_run`` on a one-candidate config, as ``demo_real.alone``), scored
   by its validation loss at the end (the same held-out batches for every candidate);
3. the lowest validation loss wins and is distilled further, from its search checkpoint, for the
   rest of the size's FLOPs.

Equal cost: the route's total (importance with depth, every candidate's steps and validation,
every final run) is set to the elastic route's total FLOPs (``demo_real.routes``): the total less
this route's importance, split equally between the sizes; per size ``search_share`` of it for the
search (split equally between the candidates) and the rest for the final run; each run's share
becomes whole iterations of its own cost per iteration (student training + teacher forward), so
tokens differ where architectures do. ``search_share`` defaults to Nemotron Elastic's cost table
for Minitron-SSM (480B exploratory of 750B tokens). ``OUT/routes/minitron/route.json`` records
what the runs actually did, recomputed from their metrics files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "MIXES",
    "QUICK_MIXES",
    "SEARCH_SHARE",
    "Candidate",
    "candidates",
    "pick_best",
    "run_minitron",
    "split_budget",
]

# axis mix -> fixed cuts as fractions of the full size ("depth": of the blocks); the FFN is solved
MIXES: dict[str, dict[str, float]] = {
    "ffn": {},
    "heads+ffn": {"attention_heads": 2 / 3},
    "hidden+ffn": {"embedding": 0.875},
    "depth+ffn": {"depth": 0.2},
}
# --quick: one width mix and the depth mix, enough to take every step of the route once
QUICK_MIXES = {mix: MIXES[mix] for mix in ("ffn", "depth+ffn")}
SEARCH_SHARE = (
    480 / 750
)  # Nemotron Elastic's cost table: Minitron-SSM 480B exploratory + 270B final
TOLERANCE = 0.005  # of the parent's parameters, below the size's parameter count
FFN_MULTIPLE = 8
MIN_CANDIDATES = 4
ROUTE = "minitron"


@dataclass(frozen=True)
class Candidate:
    """One architecture at a size: ``choice`` over every width axis of its source model (the
    parent, or the parent with ``dropped_layers`` removed), its parameters and fractions."""

    mix: str
    choice: dict[str, int]
    dropped_layers: tuple[int, ...]
    pattern: str
    params: int
    fraction: float  # of the parent's parameters
    source_fraction: float  # of its source model's parameters: the budget its run trains


def _cut(full: int, fraction: float, multiple: int, minimum: int) -> int:
    size = max(minimum, math.floor(fraction * full / multiple + 0.5) * multiple)
    return min(full, size)


def _params(model: ModelConfig, choice: Mapping[str, int]) -> int:
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.counting import count_parameters

    return count_parameters(model_for_choice(model, choice)).total


def _solve(
    parent: ModelConfig,
    target: int,
    mix: str,
    cuts: Mapping[str, float],
    layer_scores: Mapping[int, float] | None,
    ffn_multiple: int,
    tolerance: float,
) -> Candidate | None:
    """The candidate of ``mix`` at ``target`` parameters, or None where the FFN cannot reach it."""
    from elastic_plugin.models.axes import model_axes
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.depth import (
        block_scores,
        blocks,
        depth_pruned_config,
        layers_of_blocks,
    )

    dropped: list[int] = []
    source = parent
    if "depth" in cuts:
        if layer_scores is None:
            raise ConfigError(
                f"mix {mix!r} prunes depth and needs depth scores: run `elastic-plugin "
                "importance --depth` (the scores file's depth section is empty)"
            )
        scores = block_scores(parent, layer_scores)
        count = min(len(scores) - 1, round(cuts["depth"] * len(blocks(parent))))
        lowest = sorted(range(len(scores)), key=lambda i: (scores[i], i))[:count]
        dropped = layers_of_blocks(parent, lowest)
        source = depth_pruned_config(parent, dropped)
    axes = model_axes(source)
    if "ffn" not in axes:
        raise ConfigError("Minitron's search here solves the FFN; this model has no dense MLP")
    unknown = sorted(set(cuts) - set(axes) - {"depth"})
    if unknown:
        raise ConfigError(f"mix {mix!r}: axis {unknown[0]!r}; allowed: {', '.join(axes)}, depth")
    choice = {
        name: _cut(full, cuts.get(name, 1.0), multiple, minimum)
        for name, (full, multiple, minimum, _layers, _unit) in axes.items()
    }
    full_ffn, multiple, minimum = axes["ffn"][:3]
    step = max(multiple, ffn_multiple)
    low = _params(source, {**choice, "ffn": max(minimum, step)})
    high = _params(source, {**choice, "ffn": full_ffn})
    if low > target:
        return None
    per_neuron = (high - low) / max(1, full_ffn - max(minimum, step))
    ffn = min(full_ffn, max(step, int((target - low) / per_neuron + max(minimum, step))))
    ffn -= ffn % step
    while ffn + step <= full_ffn and _params(source, {**choice, "ffn": ffn + step}) <= target:
        ffn += step
    while ffn > step and _params(source, {**choice, "ffn": ffn}) > target:
        ffn -= step
    choice["ffn"] = max(ffn, step)
    params = _params(source, choice)
    whole = count_parameters(parent).total
    if params > target or target - params > tolerance * whole:
        return None
    return Candidate(
        mix=mix,
        choice=choice,
        dropped_layers=tuple(dropped),
        pattern=source.hybrid_layer_pattern,
        params=params,
        fraction=params / whole,
        source_fraction=params / count_parameters(source).total,
    )


def candidates(
    parent: ModelConfig,
    budget: float,
    layer_scores: Mapping[int, float] | None,
    mixes: Mapping[str, Mapping[str, float]] = MIXES,
    ffn_multiple: int = FFN_MULTIPLE,
    tolerance: float = TOLERANCE,
    min_candidates: int = MIN_CANDIDATES,
) -> list[Candidate]:
    """Every mix's candidate at ``budget`` x the parent's total parameters (module docstring);
    a ConfigError when fewer than ``min_candidates`` can be solved, or none prunes depth."""
    from elastic_plugin.models.counting import count_parameters

    if not 0.0 < budget < 1.0:
        raise ConfigError(f"budget {budget!r}: allowed 0 < budget < 1 (1.0 is the parent)")
    target = math.floor(budget * count_parameters(parent).total)
    found = [
        c
        for mix, cuts in mixes.items()
        if (c := _solve(parent, target, mix, cuts, layer_scores, ffn_multiple, tolerance))
        is not None
    ]
    if len(found) < min_candidates or not any(c.dropped_layers for c in found):
        raise ConfigError(
            f"budget {budget:g}: {len(found)} candidates solved ({[c.mix for c in found]}); "
            f"Minitron's search here needs at least {min_candidates}, one of them pruning depth "
            "(mixes: MIXES; smaller fixed cuts, or a larger --tolerance)"
        )
    return found


def pick_best(losses: Mapping[str, float | None]) -> str:
    """The candidate with the lowest validation loss (ties: the first listed); candidates with
    no loss are out. ModelOpt picks the best score; a loss is lower-is-better."""
    measured = [(loss, i, mix) for i, (mix, loss) in enumerate(losses.items()) if loss is not None]
    if not measured or any(not math.isfinite(loss) for loss, _, _ in measured):
        raise RuntimeError(f"Minitron search: no usable validation loss among {dict(losses)}")
    return min(measured)[2]


def split_budget(
    total_flops: float,
    importance_flops: float,
    sizes: int,
    search_share: float = SEARCH_SHARE,
    over_budget: bool = False,
) -> tuple[float, float]:
    """``(per size, of it the search's)`` FLOPs under the equal-cost rule (module docstring).
    ``over_budget``: when the importance pass alone costs more than the total (a run of a few
    tokens: ``--quick``), ``(0, 0)``, so every run trains its minimum of one iteration and the
    route costs more than the elastic one (its ``route.json`` says by how much), instead of
    an error."""
    if not 0.0 < search_share < 1.0:
        raise ConfigError(f"search_share={search_share!r}; allowed: 0 < share < 1")
    if sizes < 1:
        raise ConfigError("no size below 1.0 to search for")
    per_size = (total_flops - importance_flops) / sizes
    if per_size <= 0 and over_budget:
        return 0.0, 0.0
    if per_size <= 0:
        raise ConfigError(
            f"the route's importance ({importance_flops:.3g} FLOPs) costs more than the "
            f"elastic route's total ({total_flops:.3g}): nothing is left to train"
        )
    return per_size, per_size * search_share


def _iters(flops: float, per_iter: float) -> int:
    return max(1, math.floor(flops / per_iter + 0.5))


def run_minitron(
    reordered: Path,
    elastic_ckpt: Path,
    scores_file: Path,
    train_prefix: str,
    valid_prefix: str,
    tokenizer: str,
    out: Path,
    batch: dict[str, int],
    elastic_total_flops: float,
    importance: Mapping[str, int],
    schedule_flags: tuple[str, ...] = (),
    search_share: float = SEARCH_SHARE,
    mixes: Mapping[str, Mapping[str, float]] = MIXES,
    parent_hf: Path | None = None,
    seed: int = 1,
    over_budget: bool = False,
    only_smallest: bool = False,
) -> dict[str, Any]:
    """The whole route into ``out`` (``OUT/routes/minitron``): depth-pruned sources under
    ``out/sources``, runs under ``out/runs``, each size's final model as a BF16 HF directory
    ``out/<label>``, and ``out/route.json`` (returned). ``elastic_total_flops``: the elastic
    route's ``total_flops``; ``importance``: the importance stage's ``samples``,
    ``seq_length``, ``depth_batches``, ``micro_batch_size``; ``batch``: the elastic run's
    ``seq_length`` / ``micro_batch_size`` / ``global_batch_size`` / ``eval_iters``.
    ``only_smallest`` and fewer ``mixes`` (at least one pruning depth): the ``--quick`` run,
    which only has to take every step once."""
    from elastic_plugin.checkpoint.meta import budget_label, trained_budgets
    from elastic_plugin.comparison.plan import RunSpec
    from elastic_plugin.comparison.runner import CompareData
    from elastic_plugin.demo_real.alone import distil_run, elastic_run_config
    from elastic_plugin.demo_real.routes import (
        Cost,
        RouteSize,
        depth_importance_flops,
        distil_iteration_flops,
        export_hf,
        run_cost,
        statistics_flops,
        validation_flops,
        write_route,
    )
    from elastic_plugin.importance.scores import ImportanceScores
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.nested.depth import depth_pruned_config, write_depth_pruned

    meta, config, training = elastic_run_config(elastic_ckpt, batch)
    parent = config_from_dict(meta["config"]).model
    depth = ImportanceScores.load(scores_file, "--scores").depth or None
    labels = sorted((b for b in trained_budgets(meta) if b < 1.0), reverse=True)
    labels = labels[-1:] if only_smallest else labels
    fewest = min(MIN_CANDIDATES, len(mixes))
    per_size = {budget_label(b): candidates(parent, b, depth, mixes, min_candidates=fewest)
                for b in labels}  # fmt: skip
    seq, gbs = int(training["seq_length"]), int(training["global_batch_size"])
    eval_sequences = int(training.get("eval_iters") or 0) * int(training["micro_batch_size"])
    imp_seq, mbs = int(importance["seq_length"]), int(importance["micro_batch_size"])
    costs = [
        Cost("importance statistics", "importance", int(importance["samples"]) * imp_seq,
             float(statistics_flops(parent, imp_seq, int(importance["samples"])))),
        Cost("importance depth", "importance",
             int(importance["depth_batches"]) * mbs * imp_seq * (parent.num_layers + 1),
             float(depth_importance_flops(parent, imp_seq, int(importance["depth_batches"]), mbs))),
    ]  # fmt: skip
    size_flops, search_flops = split_budget(
        elastic_total_flops, sum(c.flops for c in costs), len(labels), search_share, over_budget
    )
    data = CompareData(train_prefix, valid_prefix, tokenizer, str(Path(train_prefix).parent))
    teacher_flag = ("--teacher-ckpt", str(reordered))
    started = time.time()
    sizes: list[RouteSize] = []
    for label, found in per_size.items():
        runs: dict[str, dict[str, Any]] = {}
        for cand in found:
            source = reordered
            if cand.dropped_layers:
                source = write_depth_pruned(
                    reordered, out / "sources" / f"drop_{len(cand.dropped_layers)}_{label}",
                    cand.dropped_layers,
                )  # fmt: skip
            student = depth_pruned_config(parent, cand.dropped_layers)
            per_iter = distil_iteration_flops(student, cand.choice, parent, seq, gbs)
            check = validation_flops(student, cand.choice, seq, eval_sequences)
            iters = _iters(search_flops / len(found) - check, per_iter)
            spec = RunSpec("prune_distil", f"{label}_{cand.mix}", "search", seed, iters,
                           iters * gbs * seq)  # fmt: skip
            run_config = {**config, "model": asdict(student)}
            print(
                f"[demo-real minitron {time.time() - started:6.1f}s] {label} candidate "
                f"{cand.mix}: {cand.choice}, {len(cand.dropped_layers)} layers dropped, "
                f"{cand.params:,} params; {iters} iterations",
                flush=True,
            )
            result = distil_run(spec, out / "runs", run_config, cand.choice, cand.source_fraction,
                                Path(source), data, (*schedule_flags, *teacher_flag))  # fmt: skip
            metrics = Path(result["checkpoint"]).parents[1] / "elastic_metrics.jsonl"
            cost = run_cost(f"{label} {cand.mix} search", metrics, student, cand.choice, parent,
                            seq, gbs, kind="search")  # fmt: skip
            runs[cand.mix] = {"candidate": cand, "student": student, "run": result,
                              "cost": cost, "validation_flops": check}  # fmt: skip
            costs += [cost, Cost(f"{label} {cand.mix} validation", "search",
                                 eval_sequences * seq, float(check))]  # fmt: skip
        best = pick_best({mix: r["run"]["valid_loss"] for mix, r in runs.items()})
        win = runs[best]
        spent = sum(r["cost"].flops + r["validation_flops"] for r in runs.values())
        cand, student = win["candidate"], win["student"]
        per_iter = distil_iteration_flops(student, cand.choice, parent, seq, gbs)
        iters = _iters(size_flops - spent, per_iter)
        spec = RunSpec("prune_distil", f"{label}_{best}", "final", seed, iters, iters * gbs * seq)
        print(
            f"[demo-real minitron {time.time() - started:6.1f}s] {label}: {best} wins "
            f"(validation loss {win['run']['valid_loss']:.4f}); distilled further for {iters} "
            "iterations",
            flush=True,
        )
        final = distil_run(spec, out / "runs", {**config, "model": asdict(student)}, cand.choice,
                           cand.source_fraction, Path(win["run"]["checkpoint"]), data,
                           (*schedule_flags, *teacher_flag))  # fmt: skip
        metrics = Path(final["checkpoint"]).parents[1] / "elastic_metrics.jsonl"
        final_cost = run_cost(f"{label} {best} final", metrics, student, cand.choice, parent,
                              seq, gbs)  # fmt: skip
        costs.append(final_cost)
        hf_dir = export_hf(final["checkpoint"], cand.source_fraction, out / label)
        spent_size = spent + final_cost.flops
        tokens = final_cost.tokens + sum(
            r["cost"].tokens + eval_sequences * seq for r in runs.values()
        )
        sizes.append(
            RouteSize(
                label,
                {"winner": best, **asdict(cand)},
                final["checkpoint"],
                str(hf_dir),
                tokens,
                spent_size,
                {
                    "candidates": {
                        mix: {
                            **asdict(r["candidate"]),
                            "valid_loss": r["run"]["valid_loss"],
                            "checkpoint": r["run"]["checkpoint"],
                            "iters": r["cost"].detail["iters"],
                            "tokens": r["cost"].tokens,
                            "flops": r["cost"].flops + r["validation_flops"],
                        }
                        for mix, r in runs.items()
                    },  # fmt: skip
                    "final_valid_loss": final["valid_loss"],
                    "final_iters": final_cost.detail["iters"],
                },
            )
        )
    sizes.append(
        RouteSize("1", {"model": "parent"}, str(reordered), str(parent_hf) if parent_hf else None)
    )
    return write_route(
        out, ROUTE, sizes, costs, elastic_total_flops=float(elastic_total_flops),
        search_share=search_share, mixes={k: dict(v) for k, v in mixes.items()},
        tolerance=TOLERANCE, budget_1="the parent itself (no route trains it)",
        over_budget_allowed=over_budget,
    )  # fmt: skip
