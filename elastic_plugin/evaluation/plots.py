"""The report's pictures: accuracy vs active parameters (per precision), loss per budget over
elastic training, and accuracy vs latency for the budget-control settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import run_dir
from elastic_plugin.checkpoint.meta import budget_label

__all__ = ["draw_report_plots", "finish_figure", "pyplot"]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_figure(
    fig, ax, path: Path, xlabel: str, ylabel: str, title: str, legend_size: int | None = None
) -> Path:
    """Labels, legend, save, close: the same ending for every figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def _accuracy_vs_params(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for precision, marker in (("fp32", "o-"), ("bf16", "s--"), ("fp8", "^--"), ("nvfp4", "v--")):
        points = sorted(
            (r["params"]["active"], 100 * r["accuracy"][precision], r["budget"])
            for r in report["budgets"]
            if precision in r["accuracy"]
        )
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=precision)
        if precision == "fp32":
            for active, acc, budget in points:
                ax.annotate(
                    budget_label(budget),
                    (active, acc),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                )
    return finish_figure(
        fig, ax, path, "active parameters", "accuracy (%)", f"Nested models on {report['task']}"
    )


def _loss_per_budget(metrics: Path, path: Path) -> Path | None:
    if not metrics.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    budgets = sorted(
        {b for r in records for b in (r.get("train_loss") or {})}, key=float, reverse=True
    )
    for index, budget in enumerate(budgets):
        color = f"C{index}"
        train = [
            (r["iteration"], r["train_loss"][budget])
            for r in records
            if budget in (r.get("train_loss") or {})
        ]
        valid = [
            (r["iteration"], r["valid_loss"][budget])
            for r in records
            if budget in (r.get("valid_loss") or {})
        ]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.5, label=f"{budget} train (KD)")
        if valid:
            ax.plot(*zip(*valid), "o-", color=color, label=f"{budget} valid")
    ax.set_yscale("log")
    return finish_figure(
        fig, ax, path, "iteration", "loss", "Loss per budget over elastic training", 7
    )


def _accuracy_vs_latency(report: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {
        "single": ("o", "one model"),
        "elastic": ("*", "elastic budget control"),
        "capped": ("s", "capped thinking (standard)"),
    }
    rows = report["budget_control"] + [
        {
            "name": f"budget {budget_label(r['budget'])}",
            "kind": "single",
            "accuracy": r["accuracy"]["fp32"],
            "latency_ms_batch1": r["latency_ms_batch1"],
        }
        for r in report["budgets"][1:]
    ]
    rows = [r for r in rows if r.get("latency_ms_batch1") is not None]
    if not rows:  # --latency-problems 0: nothing was timed
        plt.close(fig)
        return None
    seen = set()
    for row in rows:
        marker, label = styles[row["kind"]]
        ax.scatter(
            row["latency_ms_batch1"],
            100 * row["accuracy"],
            marker=marker,
            s=60,
            label=None if row["kind"] in seen else label,
        )
        seen.add(row["kind"])
        ax.annotate(
            row["name"],
            (row["latency_ms_batch1"], 100 * row["accuracy"]),
            fontsize=6,
            textcoords="offset points",
            xytext=(4, 2),
        )
    return finish_figure(
        fig,
        ax,
        path,
        "latency per problem, batch 1 (ms)",
        "accuracy (%)",
        "Budget control: accuracy vs latency",
        7,
    )


def draw_report_plots(report: dict[str, Any], ckpt: Path, out: Path) -> list[Path]:
    paths = [
        _accuracy_vs_params(report, out / "accuracy_vs_params.png"),
        _loss_per_budget(run_dir(ckpt) / "elastic_metrics.jsonl", out / "loss_per_budget.png"),
        _accuracy_vs_latency(report, out / "accuracy_vs_latency.png"),
    ]
    return [p for p in paths if p is not None]
