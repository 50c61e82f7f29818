"""What each route of ``make demo-real`` cost, in model FLOPs, and its models as BF16 HF directories.

Routes (issue 41, item 3): ``elastic`` (one run for every budget), ``minitron`` (per size a
search over candidate architectures, then the winner distilled further: ``demo_real.minitron``)
and ``alone`` (each size distilled alone on the elastic run's architecture: ``demo_real.alone``).

**Cost** = every training and search step of a route, recomputed from what its runs logged and
the architecture (``models.flops``), never from wall time:

* a distillation iteration over ``B`` sequences of ``S`` tokens costs
  ``training_flops(student at its choice, S, B) + forward_flops(teacher, S, B)`` (the frozen
  parent's forward is part of every step); the iterations are read from the run's metrics file
  (the logged iteration numbers; the window's logged tokens are checked against them);
* the elastic run's micro-batches each train the budget the run's sampler drew
  (``elastic.sampling``: a pure function of seed, iteration and micro-batch) at the choice the
  router had for it: the frozen table after the freeze; before it, the choice the router logged
  at the end of that log window (the router's noisy per-micro-batch draw is not logged: the
  one approximation, reported beside the FLOPs the run itself counted, ``logged_flops``);
  full budget micro-batches train the full model;
* search steps: the validation forwards that pick an architecture (the elastic run's
  loss-selected freeze; each Minitron candidate's validation loss), and anything the caller adds
  (e.g. a zero-shot screening) as a :class:`Cost`;
* importance: the statistics pass (a forward to the last norm) once per route that uses it, and
  for the depth scores ``(L + 1)`` forwards per batch, each skipping one layer (Minitron only).

Evaluations that decide nothing (the teacher's loss at the start of a run, the curves) are
measurement, not cost. ``route.json`` per route: ``total_flops``, ``total_tokens``, per budget
tokens / FLOPs / architecture / export directory, and every cost item.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "ROUTES",
    "ROUTE_FILE",
    "Cost",
    "RouteSize",
    "depth_importance_flops",
    "alone_route",
    "distil_iteration_flops",
    "elastic_route",
    "elastic_run_cost",
    "export_hf",
    "importance_cost",
    "link_dir",
    "logged_windows",
    "run_cost",
    "statistics_flops",
    "validation_flops",
    "write_route",
]

ROUTES = ("elastic", "minitron", "alone")
ROUTE_FILE = "route.json"
_TOKEN_RTOL = 1e-3  # logged window tokens are tokens/s x seconds (seconds rounded to 0.1 ms)


@dataclass(frozen=True)
class Cost:
    """One item of a route's cost: ``kind`` is ``importance``, ``train`` or ``search``."""

    name: str
    kind: str
    tokens: int
    flops: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteSize:
    """One budget's final model of a route: its architecture and where it was exported."""

    label: str
    architecture: dict[str, Any]
    checkpoint: str | None
    hf_dir: str | None
    tokens: int = 0
    flops: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------ FLOPs per step
def distil_iteration_flops(
    student: ModelConfig,
    choice: Mapping[str, Any] | None,
    teacher: ModelConfig,
    seq_length: int,
    global_batch: int,
) -> int:
    """One distillation iteration: the student's forward + backward at ``choice`` and the frozen
    teacher's forward, over ``global_batch`` sequences (FLOPs are linear in the batch)."""
    from elastic_plugin.models.flops import forward_flops, training_flops

    student_flops = training_flops(student, seq_length, global_batch, dict(choice or {})).total
    return student_flops + forward_flops(teacher, seq_length, global_batch).total


def validation_flops(
    model: ModelConfig, choice: Mapping[str, Any] | None, seq_length: int, sequences: int
) -> int:
    """A validation pass (the student's forward only: its LM loss) over ``sequences``."""
    from elastic_plugin.models.flops import forward_flops

    return forward_flops(model, seq_length, sequences, dict(choice or {})).total


def statistics_flops(model: ModelConfig, seq_length: int, samples: int) -> int:
    """Importance's statistics pass: the forward up to the output layer (which it skips)."""
    from elastic_plugin.models.flops import forward_flops

    count = forward_flops(model, seq_length, samples)
    return count.total - count.breakdown["output_layer"]


def depth_importance_flops(
    model: ModelConfig, seq_length: int, batches: int, micro_batch: int
) -> int:
    """``importance --depth``: per batch one full forward and one per layer with that layer
    skipped (``importance.depth``)."""
    from elastic_plugin.models.flops import forward_flops

    count = forward_flops(model, seq_length, micro_batch)
    per_batch = (model.num_layers + 1) * count.total - sum(count.per_layer)
    return batches * per_batch


# ------------------------------------------------------------------------------ logged steps
def _records(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.is_file():
        raise ConfigError(f"{metrics}: no metrics file (the run did not log)")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def logged_windows(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, int, dict]]:
    """``(first, last, record)`` per logged training window (records that carry ``throughput``),
    in order: the window covers iterations ``first..last``. A resumed run's file restarts at
    the resume point, so windows never overlap."""
    out: list[tuple[int, int, dict]] = []
    previous = 0
    for record in records:
        if not record.get("throughput"):
            continue
        last = int(record["iteration"])
        if last <= previous:
            raise ConfigError(f"metrics: iteration {last} logged after {previous}")
        out.append((previous + 1, last, dict(record)))
        previous = last
    return out


def _check_window_tokens(first: int, last: int, record: Mapping[str, Any], tokens: int) -> None:
    rate = record["throughput"]
    logged = float(rate.get("tokens_per_s") or 0.0) * float(rate.get("seconds") or 0.0)
    if logged and abs(logged - tokens) > _TOKEN_RTOL * tokens + 1:
        raise ConfigError(
            f"metrics: iterations {first}..{last} logged {logged:.0f} tokens, the schedule "
            f"gives {tokens}; the batch or sequence length passed here is not the run's"
        )


def _logged_flops(windows: Sequence[tuple[int, int, dict]]) -> float:
    return sum(float(w[2]["throughput"].get("model_tflops") or 0.0) * 1e12 for w in windows)


def run_cost(
    name: str,
    metrics: Path,
    student: ModelConfig,
    choice: Mapping[str, Any] | None,
    teacher: ModelConfig,
    seq_length: int,
    global_batch: int,
    kind: str = "train",
) -> Cost:
    """A fixed-architecture distillation run (one candidate: ``alone``, a Minitron candidate or
    final run) from its metrics file: every logged iteration x :func:`distil_iteration_flops`."""
    windows = logged_windows(_records(Path(metrics)))
    per_iter = distil_iteration_flops(student, choice, teacher, seq_length, global_batch)
    iters = 0
    for first, last, record in windows:
        n = last - first + 1
        _check_window_tokens(first, last, record, n * global_batch * seq_length)
        iters += n
    return Cost(
        name,
        kind,
        iters * global_batch * seq_length,
        float(iters * per_iter),
        {"iters": iters, "flops_per_iter": per_iter, "logged_flops": _logged_flops(windows)},
    )


def _homogeneous(choice: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v[0] if isinstance(v, list) and len(set(v)) == 1 else v) for k, v in choice.items()}


def elastic_run_cost(
    elastic_ckpt: Path,
    metrics: Path,
    teacher: ModelConfig,
    batch: Mapping[str, int] | None = None,
) -> list[Cost]:
    """The elastic run's training (every micro-batch at its drawn budget's choice, the teacher's
    forward each) and its loss-selected freeze (the candidates' validation forwards), from its
    checkpoint metadata and metrics file (module docstring). ``batch``: ``seq_length`` /
    ``micro_batch_size`` / ``global_batch_size`` / ``eval_iters`` as the run had them from its
    flags (its metadata holds the YAML's)."""
    from elastic_plugin.checkpoint.meta import budget_label, is_full_budget, read_elastic_meta
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.models.flops import forward_flops, training_flops

    meta = read_elastic_meta(elastic_ckpt)
    cfg = config_from_dict(meta["config"])
    ecfg = ElasticConfig.from_dict(meta["config"]["elastic"])
    training = {**meta["config"]["training"], **dict(batch or {})}
    seq, gbs, mbs = (
        int(training[k]) for k in ("seq_length", "global_batch_size", "micro_batch_size")
    )
    stages = ecfg.curriculum_in_iterations(gbs, seq)
    budgets = list(meta["elastic"]["budgets"])
    windows = logged_windows(_records(Path(metrics)))
    total_iters = int(training.get("train_iters") or (windows[-1][1] if windows else 1))
    sampler = BudgetSampler(budgets, stages, int(training["seed"]), total_iters)
    frozen = meta["elastic"].get("frozen_choices")
    freeze_after = ecfg.router.freeze_after if frozen else None
    cache: dict[tuple[int, str], int] = {}

    def step(seq_len: int, choice: Mapping[str, Any] | None) -> int:
        key = (seq_len, json.dumps(choice, sort_keys=True))
        if key not in cache:
            student = training_flops(cfg.model, seq_len, mbs, dict(choice or {})).total
            cache[key] = student + forward_flops(teacher, seq_len, mbs).total
        return cache[key]

    flops, tokens, iters, approximated = 0, 0, 0, 0
    for first, last, record in windows:
        window_tokens = 0
        for iteration in range(first, last + 1):
            seq_len = sampler.seq_length(iteration) or seq
            after_freeze = freeze_after is not None and iteration > freeze_after
            table = frozen if after_freeze else record.get("choices") or {}
            for mb in range(gbs // mbs):
                budget = sampler.budget(iteration, mb)
                choice = None if is_full_budget(budget) else table.get(budget_label(budget))
                if choice is None and not is_full_budget(budget):
                    raise ConfigError(
                        f"metrics: no choice logged for budget {budget_label(budget)}"
                    )
                approximated += int(not after_freeze and not is_full_budget(budget))
                flops += step(seq_len, None if choice is None else _homogeneous(choice))
            window_tokens += gbs * seq_len
        _check_window_tokens(first, last, record, window_tokens)
        tokens += window_tokens
        iters += last - first + 1
    micro_batches = iters * (gbs // mbs)
    costs = [
        Cost(
            "elastic training",
            "train",
            tokens,
            float(flops),
            {
                "iters": iters,
                "logged_flops": _logged_flops(windows),
                "micro_batches": micro_batches,
                "micro_batches_before_freeze_approximated": approximated,
            },
        )
    ]
    search = meta["elastic"].get("freeze_search") or {}
    if search:
        eval_sequences = int(training.get("eval_iters") or 0) * mbs
        total, measured = 0, 0
        for label, record in search.items():
            choice = _homogeneous(meta["elastic"]["choices"][label])
            n = int(record.get("candidates") or 0)  # each candidate ~ the winner's cost
            total += n * validation_flops(cfg.model, choice, seq, eval_sequences)
            measured += n * eval_sequences * seq
        costs.append(
            Cost(
                "elastic freeze search",
                "search",
                measured,
                float(total),
                {"candidates": {k: int(v.get("candidates") or 0) for k, v in search.items()}},
            )
        )
    return costs


# ------------------------------------------------------------------------------ export + record
def export_hf(ckpt: str | Path, budget: float, out: Path) -> Path:
    """The model of ``budget`` in ``ckpt`` as a BF16 HF directory (``elastic-plugin extract
    --format hf``, the export every user runs); reused when ``out`` already holds one."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "elastic_plugin.cli", "extract", "--ckpt", str(ckpt),
        "--budget", repr(float(budget)), "--out", str(out), "--format", "hf", "--dtype", "bf16",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"export of {ckpt} at {budget!r} failed:\n{proc.stderr[-3000:]}")
    return out


def link_dir(target: Path, link: Path) -> Path:
    """``link`` -> ``target`` as a relative symlink (the output folder stays movable); an
    existing link is replaced."""
    import os

    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        raise ConfigError(f"{link} exists and is not a link; remove it to rebuild the route")
    link.symlink_to(os.path.relpath(target.resolve(), link.parent.resolve()))
    return link


def write_route(
    out_dir: Path, route: str, sizes: Sequence[RouteSize], costs: Sequence[Cost], **extra: Any
) -> dict[str, Any]:
    """Write ``out_dir/route.json`` (complete: totals, every cost item, every size) and print
    the route's total; returns what it wrote."""
    if route not in ROUTES:
        raise ConfigError(f"route {route!r}; allowed: {', '.join(ROUTES)}")
    kinds = {"importance", "train", "search"}
    bad = [c.name for c in costs if c.kind not in kinds]
    if bad:
        raise ConfigError(f"cost items {bad}: kind must be one of {', '.join(sorted(kinds))}")
    record = {
        "route": route,
        "total_flops": float(sum(c.flops for c in costs)),
        "total_tokens": int(sum(c.tokens for c in costs)),
        "flops_by_kind": {
            k: float(sum(c.flops for c in costs if c.kind == k)) for k in sorted(kinds)
        },
        "sizes": {s.label: asdict(s) for s in sizes},
        "costs": [asdict(c) for c in costs],
        **extra,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (ROUTE_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.rename(out_dir / ROUTE_FILE)
    print(
        f"[demo-real routes] {route}: {record['total_flops'] / 1e15:.3f} PFLOP, "
        f"{record['total_tokens']:,} tokens ("
        + ", ".join(f"{k} {v / 1e15:.3f}" for k, v in record["flops_by_kind"].items())
        + ")",
        flush=True,
    )
    return record


# ------------------------------------------------------------------------------ routes a and c
def importance_cost(parent: ModelConfig, samples: int, seq_length: int) -> Cost:
    """The width importance pass every route that prunes uses (the statistics forward)."""
    return Cost(
        "importance statistics",
        "importance",
        samples * seq_length,
        float(statistics_flops(parent, seq_length, samples)),
    )


def elastic_route(
    out: Path,
    elastic_ckpt: Path,
    metrics: Path,
    batch: Mapping[str, int],
    importance: Cost,
    extra: Sequence[Cost] = (),
    parent_hf: Path | None = None,
    exported: Mapping[str, Path] | None = None,
) -> dict[str, Any]:
    """Route (a): the elastic run's cost (``importance``, its training and freeze search, and
    ``extra``: e.g. a zero-shot screening of candidates) and every trained budget exported
    from the one checkpoint under ``out/<label>`` (1.0 included: the elastic run trains the
    full model too). ``exported``: label -> a BF16 HF directory ``export`` already wrote for
    that budget, linked (relative symlink) instead of written again. Writes and returns
    ``out/route.json``."""
    from elastic_plugin.checkpoint.meta import budget_label, read_elastic_meta, trained_budgets
    from elastic_plugin.models.config import config_from_dict

    meta = read_elastic_meta(elastic_ckpt)
    parent = config_from_dict(meta["config"]).model
    costs = [importance, *elastic_run_cost(elastic_ckpt, metrics, parent, batch), *extra]
    sizes = []
    for budget in sorted(trained_budgets(meta), reverse=True):
        label = budget_label(budget)
        if exported and label in exported:
            hf_dir = link_dir(Path(exported[label]), out / label)
        else:
            hf_dir = export_hf(elastic_ckpt, budget, out / label)
        sizes.append(
            RouteSize(
                label,
                {
                    "choice": meta["elastic"]["choices"][label],
                    "fraction": meta["elastic"]["cost_fraction"][label],
                },
                str(elastic_ckpt),
                str(hf_dir),
            )  # fmt: skip
        )
    extra_fields = {"parent_hf": str(parent_hf)} if parent_hf else {}
    return write_route(out, "elastic", sizes, costs, **extra_fields)


def alone_route(
    out: Path,
    alone: Mapping[str, Any],
    elastic_ckpt: Path,
    batch: Mapping[str, int],
    importance: Cost,
    parent_hf: Path | None = None,
) -> dict[str, Any]:
    """Route (c): ``alone`` is what ``demo_real.alone.distil_alone`` returned (its runs under
    ``OUT/alone/runs``); each run's cost is recomputed from its metrics file, its model exported
    under ``out/<label>``; budget 1.0 is the parent itself (no run trains it: recorded, not
    exported again). The importance pass is counted once. Writes and returns ``route.json``."""
    from elastic_plugin.checkpoint.meta import read_elastic_meta
    from elastic_plugin.models.config import config_from_dict

    meta = read_elastic_meta(elastic_ckpt)
    parent = config_from_dict(meta["config"]).model
    training = {**meta["config"]["training"], **dict(batch)}
    seq, gbs = int(training["seq_length"]), int(training["global_batch_size"])
    costs, sizes = [importance], []
    for label, run in alone["sizes"].items():
        choice = run.get("choice") or {
            k: int(v[0] if isinstance(v, list) else v)
            for k, v in meta["elastic"]["choices"][label].items()
        }
        metrics = Path(run["checkpoint"]).parents[1] / "elastic_metrics.jsonl"
        cost = run_cost(f"{label} alone", metrics, parent, choice, parent, seq, gbs)
        costs.append(cost)
        hf_dir = export_hf(run["checkpoint"], float(run["budget"]), out / label)
        sizes.append(
            RouteSize(
                label,
                {"choice": choice, "fraction": float(run["budget"])},
                run["checkpoint"],
                str(hf_dir),
                cost.tokens,
                cost.flops,
            )  # fmt: skip
        )
    sizes.append(RouteSize("1", {"model": "parent"}, None, str(parent_hf) if parent_hf else None))
    return write_route(
        out, "alone", sizes, costs, budget_1="the parent itself (no route trains it)"
    )
