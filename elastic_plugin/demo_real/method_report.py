"""Does the method pay? The three routes of ``make demo-real`` at equal total cost, in the report.

Inputs (``report.json``): the per-window test numbers of each route's models (``windows``:
``elastic/fp32/<b>``, ``distil_alone/<b>``, ``minitron/<b>``; the same windows for every model,
so differences are paired), ``route_costs`` (each route's ``route.json`` totals) and
``route_curves`` (validation loss against the route's cumulative FLOPs, from its runs' metrics
files: :func:`route_curves`). Outputs: the method table (per route and size: test perplexity,
times the parent's, the goal, the paired loss difference against the elastic model with its
standard error, the route's total FLOPs) and the plot of perplexity against cumulative FLOPs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from elastic_plugin.demo_real.measure import paired, summarize

# route -> the window key prefix of its models (elastic: fp32, as the others are measured)
ROUTE_MODELS = {"elastic": "elastic/fp32", "minitron": "minitron", "alone": "distil_alone"}
# issue 41's goals on the test split: perplexity within this many times the parent's
GOALS = {"1": 1.02, "0.7": 1.25, "0.5": 2.0}


def route_costs(routes_dir: Path) -> dict[str, dict[str, Any]]:
    """Each route's ``route.json`` totals (``total_flops``, ``total_tokens``,
    ``flops_by_kind``) and its models' directories."""
    out: dict[str, dict[str, Any]] = {}
    for route in ROUTE_MODELS:
        path = routes_dir / route / "route.json"
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        out[route] = {
            "total_flops": record["total_flops"],
            "total_tokens": record["total_tokens"],
            "flops_by_kind": record["flops_by_kind"],
            "sizes": {
                label: {
                    "hf_dir": s["hf_dir"],
                    "checkpoint": s["checkpoint"],
                    "tokens": s["tokens"],
                    "flops": s["flops"],
                    "architecture": s["architecture"],
                }
                for label, s in record["sizes"].items()
            },
        }
    return out


def _valid_points(metrics: Path) -> list[tuple[int, dict[str, float]]]:
    """``(iteration, {budget: validation loss})`` of every evaluation a run logged."""
    points = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            valid = row.get("valid_loss")
            if isinstance(valid, dict) and isinstance(row.get("iteration"), int):
                losses = {k: float(v) for k, v in valid.items() if v is not None}
                points.append((row["iteration"], losses))
    return points


def route_curves(routes_dir: Path, elastic_metrics: Path) -> dict[str, dict[str, list]]:
    """Per route and size below 1.0: ``[cumulative FLOPs, validation loss]`` at each of its
    evaluations, the route's FLOPs counted as it ran them (sizes one after another for
    ``alone`` and ``minitron``, each Minitron candidate's search run before the winner's
    final run; the elastic run's training spread evenly over its iterations, after its
    importance and search)."""
    from elastic_plugin.checkpoint.meta import budget_label

    routes = {r: json.loads((routes_dir / r / "route.json").read_text())
              for r in ROUTE_MODELS if (routes_dir / r / "route.json").is_file()}  # fmt: skip
    curves: dict[str, dict[str, list]] = {}
    if "elastic" in routes:
        kinds = routes["elastic"]["flops_by_kind"]
        points = _valid_points(elastic_metrics)
        last = max((it for it, _ in points), default=0)
        per_iter = kinds["train"] / last if last else 0.0
        base = kinds["importance"] + kinds["search"]
        curves["elastic"] = {}
        for it, losses in points:
            for budget, loss in losses.items():
                label = budget_label(float(budget))
                if label != "1":
                    curves["elastic"].setdefault(label, []).append([base + per_iter * it, loss])
    for route in ("alone", "minitron"):
        if route not in routes:
            continue
        record = routes[route]
        spent = record["flops_by_kind"]["importance"]
        curves[route] = {}
        for label, size in record["sizes"].items():
            if label == "1":
                continue
            runs = _runs(route, record, label, size)
            for name, metrics, flops in runs:
                cost = next(c for c in record["costs"] if c["name"] == name)
                per_iter = cost["detail"]["flops_per_iter"]
                start = spent
                for it, losses in _valid_points(metrics):
                    for loss in losses.values():
                        curves[route].setdefault(label, []).append([start + per_iter * it, loss])
                spent += flops
    return curves


def _runs(route: str, record: dict[str, Any], label: str, size: dict[str, Any]) -> list:
    """``(cost name, metrics file, FLOPs it spent)`` of a size's runs in the order they ran."""

    def metrics(checkpoint: str) -> Path:
        return Path(checkpoint).parents[1] / "elastic_metrics.jsonl"

    if route == "alone":
        return [(f"{label} alone", metrics(size["checkpoint"]), size["flops"])]
    detail = size["detail"]
    runs = []
    for mix, cand in detail["candidates"].items():
        runs.append((f"{label} {mix} search", metrics(cand["checkpoint"]), cand["flops"]))
    winner = size["architecture"]["winner"]
    final = next(c for c in record["costs"] if c["name"] == f"{label} {winner} final")
    runs.append((final["name"], metrics(size["checkpoint"]), final["flops"]))
    return runs


def method_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per route and size: test perplexity, times the parent's, the goal and whether it is met,
    the paired loss difference against the elastic model of the same size (nats/token, with
    its standard error; negative: better than elastic) and the route's total FLOPs."""
    windows, costs = report["windows"], report.get("route_costs") or {}
    parent = summarize(windows["parent"])["perplexity"]
    rows = []
    for label in report["budgets"]:
        elastic = windows.get(f"elastic/fp32/{label}")
        for route, prefix in ROUTE_MODELS.items():
            key = f"{prefix}/{label}"
            if key not in windows:
                continue
            ppl = summarize(windows[key])["perplexity"]
            goal = GOALS.get(label)
            rows.append(
                {
                    "route": route,
                    "budget": label,
                    "perplexity": ppl,
                    "x_parent": ppl / parent,
                    "goal_x_parent": goal,
                    "goal_met": None if goal is None else ppl / parent <= goal,
                    "minus_elastic": None
                    if route == "elastic" or elastic is None
                    else paired(windows[key], elastic)["loss"],
                    "route_flops": costs.get(route, {}).get("total_flops"),
                }
            )
    return rows


def markdown_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("method_table") or []
    if not rows:
        return []
    costs = report.get("route_costs") or {}
    lines = [
        "",
        "## Does the method pay? Three routes at equal total cost (test split, paired windows)",
        "",
        "Each route's cost counts every training and search step and its importance pass "
        "(`OUT/routes/<route>/route.json`); elastic: one run for every budget; minitron: per "
        "size four candidate architectures distilled briefly, the best distilled further; "
        "alone: each size distilled alone on the elastic run's architecture.",
        "",
        "| route | total PFLOP | tokens |",
        "|---|---|---|",
    ]
    for route, c in costs.items():
        lines.append(f"| {route} | {c['total_flops'] / 1e15:.3f} | {c['total_tokens']:,} |")
    lines += [
        "",
        "| budget | route | perplexity | x parent | goal | loss - elastic (nats/token) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        goal = "-" if r["goal_x_parent"] is None else (
            f"<= {r['goal_x_parent']} {'met' if r['goal_met'] else 'missed'}"
        )  # fmt: skip
        gap = r["minus_elastic"]
        diff = "-" if gap is None else f"{gap['diff']:+.4f} ± {gap['se']:.4f}"
        lines.append(
            f"| {r['budget']} | {r['route']} | {r['perplexity']:.2f} | {r['x_parent']:.3f} | "
            f"{goal} | {diff} |"
        )
    return lines + architecture_lines(report)


def architecture_lines(report: dict[str, Any]) -> list[str]:
    """Where each budget's architecture started (the zero-shot screening's pick), where the
    elastic run ended, what Minitron's search picked, and the 0.5 ablation (one kind of cut
    alone: FFN, heads, hidden, depth)."""
    screening = report.get("screening") or {}
    starts = screening.get("choices") or {}
    lines = ["", "### The architecture of each budget", "",
             "| budget | screened start (zero-shot loss) | elastic run's end | minitron's pick |",
             "|---|---|---|---|"]  # fmt: skip
    minitron = (report.get("route_costs") or {}).get("minitron", {}).get("sizes", {})
    for label in report["budgets"]:
        start = starts.get(label)
        begun = "-" if not start else f"{_sizes(start['sizes'])} ({start['loss']:.3f})"
        end = _sizes((report.get("choices") or {}).get(label) or {})
        pick = (minitron.get(label) or {}).get("architecture") or {}
        picked = "-" if "winner" not in pick else (
            f"{pick['winner']}: {_sizes(pick['choice'])}, {len(pick['dropped_layers'])} layers "
            "dropped"
        )  # fmt: skip
        lines.append(f"| {label} | {begun} | {end or '-'} | {picked} |")
    if "0.5" in (screening.get("ablation") or {}):
        from elastic_plugin.elastic.screening import format_ablation

        lines += ["", "```", format_ablation(screening, 0.5), "```"]
    return lines


def _sizes(sizes: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sizes.items())


def plot_curves(report: dict[str, Any], out: Path) -> Path | None:
    """Validation perplexity against each route's cumulative FLOPs, one line per route and
    size; a route's last point sits at its total cost (equal for every route)."""
    curves = report.get("route_curves") or {}
    if not any(curves.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    styles = {"elastic": "o-", "minitron": "s--", "alone": "^:"}
    for route, sizes in curves.items():
        for label, points in sorted(sizes.items()):
            pts = sorted(points)
            ax.plot([x for x, _ in pts], [math.exp(y) for _, y in pts], styles.get(route, "o-"),
                    label=f"{route} {label}")  # fmt: skip
    parent = report.get("curve") or {}
    if parent.get("parent_loss") is not None:
        ax.axhline(math.exp(parent["parent_loss"]), color="k", lw=0.8, label="parent")
    ax.set(xlabel="cumulative training + search FLOPs of the route",
           ylabel="validation perplexity", xscale="log", yscale="log")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "perplexity_vs_flops.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
