"""``elastic-plugin scaling-report DIR``: join the runs of a layout sweep into one table and plots,
measured next to planned.

A sweep (``examples/slurm/sweep.sh``) gives every layout its own run directory under ``DIR``
with ``sweep.json`` (the layout, the number of GPUs, and the plan's entry for the layout) and the
``elastic_metrics.jsonl`` elastic-train writes (with ``--log-interval 1``: per iteration the
step's tokens/s, model TFLOP/s per rank, the largest rank's peak memory and the step seconds).
The first ``warmup`` logged iterations are dropped (allocation, compilation); the rest give
medians (time) and the maximum (memory). An iteration that trained a single budget (the sweep's
curriculum gives each budget its own stage: ``ITERS:1/0/0,ITERS:0/1/0,...``) also counts
toward that budget's own medians (``budgets``). A run profiled with ``elastic-train --profile``
also has each rank's own records (``OUT/profile``): per-rank medians and peak memory
(``ranks``). Planned figures are the plan's estimates: the
ratios measured / planned say how far the stated model is from this machine.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError
from elastic_plugin.training.profile import read_profiles

__all__ = ["RunResult", "collect_runs", "render_report", "scaling_plots"]

SWEEP_FILE = "sweep.json"
METRICS_FILE = "elastic_metrics.jsonl"
GIB = 2**30


@dataclass(frozen=True)
class RunResult:
    """One sweep run: what it measured and, when the sweep recorded it, what the plan said."""

    name: str
    gpus: int
    layout: str
    iterations: int
    tokens_per_s: float
    tflops_per_rank: float
    step_seconds: float
    peak_memory_gib: float
    planned_tokens_per_s: float | None = None
    planned_memory_gib: float | None = None
    # budget label -> {"iterations", "tokens_per_s", "step_seconds", "planned_tokens_per_s"}
    budgets: dict[str, dict[str, Any]] = field(default_factory=dict)
    # rank -> its own medians and peak memory, from elastic-train --profile (training.profile)
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def throughput_ratio(self) -> float | None:
        if not self.planned_tokens_per_s:
            return None
        return self.tokens_per_s / self.planned_tokens_per_s

    @property
    def memory_ratio(self) -> float | None:
        if not self.planned_memory_gib:
            return None
        return self.peak_memory_gib / self.planned_memory_gib

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "throughput_ratio": self.throughput_ratio,
            "memory_ratio": self.memory_ratio,
        }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def _throughput(path: Path) -> list[tuple[dict[str, float], list[str]]]:
    """Each logged iteration's throughput and the budgets it trained (``train_loss`` keys)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc})") from None
        rate = record.get("throughput") if isinstance(record, dict) else None
        if isinstance(rate, dict) and rate.get("seconds"):
            out.append((rate, sorted(record.get("train_loss") or {})))
    return out


def _per_budget(
    records: list[tuple[dict[str, float], list[str]]], planned: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Medians over the iterations that trained one budget only, with the plan's figure."""
    plan = {float(b["budget"]): b for b in planned.get("budgets") or [] if "budget" in b}
    groups: dict[str, list[dict[str, float]]] = {}
    for rate, budgets in records:
        if len(budgets) == 1:
            groups.setdefault(budgets[0], []).append(rate)
    out = {}
    for label, rates in groups.items():
        entry = plan.get(float(label)) if _is_number(label) else None
        out[label] = {
            "iterations": len(rates),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rates),
            "step_seconds": statistics.median(r["seconds"] for r in rates),
            "planned_tokens_per_s": None if not entry else entry.get("tokens_per_s"),
        }
    return out


def _per_rank(run: Path, warmup: int) -> dict[str, dict[str, Any]]:
    """Each rank's medians over its profiled iterations (the first ``warmup`` dropped) and its
    largest peak memory: the slow or memory-bound rank of a layout."""
    out = {}
    for rank, rows in sorted(read_profiles(run).items()):
        kept = rows[warmup:] or rows
        out[str(rank)] = {
            "host": kept[0].get("host"),
            "iterations": len(kept),
            "step_seconds": statistics.median(r["step_seconds"] for r in kept),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in kept),
            "tflops_per_rank": statistics.median(r["tflops_per_rank"] for r in kept),
            "peak_memory_gib": max(r["peak_memory_gib"] for r in kept),
        }
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def collect_runs(root: Path, warmup: int = 1) -> list[RunResult]:
    """Every run directory under ``root`` (itself included) with an ``elastic_metrics.jsonl``;
    ``ConfigError`` naming the directory when there is none, or too few iterations."""
    if not root.is_dir():
        raise ConfigError(f"scaling-report {root}: no such directory")
    dirs = sorted({p.parent for p in root.rglob(METRICS_FILE)})
    if not dirs:
        raise ConfigError(
            f"scaling-report {root}: no {METRICS_FILE} below it (run examples/slurm/sweep.sh, "
            f"or elastic-train --log-interval 1, into its subdirectories)"
        )
    runs = []
    for run in dirs:
        records = _throughput(run / METRICS_FILE)[warmup:]
        rates = [rate for rate, _ in records]
        if not rates:
            raise ConfigError(
                f"{run / METRICS_FILE}: no throughput record after the first {warmup} "
                f"(--warmup); train more iterations with --log-interval 1"
            )
        sweep = _read_json(run / SWEEP_FILE) if (run / SWEEP_FILE).is_file() else {}
        planned = sweep.get("planned") or {}
        memory = (planned.get("memory") or {}).get("total")
        runs.append(
            RunResult(
                name=str(run.relative_to(root)) if run != root else run.name,
                gpus=int(sweep.get("gpus", 0)),
                layout=str((sweep.get("layout") or {}).get("name", run.name)),
                iterations=len(rates),
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in rates),
                tflops_per_rank=statistics.median(r["tflops_per_rank"] for r in rates),
                step_seconds=statistics.median(r["seconds"] for r in rates),
                peak_memory_gib=max(r["peak_memory_gib"] for r in rates),
                planned_tokens_per_s=planned.get("tokens_per_s"),
                planned_memory_gib=None if memory is None else memory / GIB,
                budgets=_per_budget(records, planned),
                ranks=_per_rank(run, warmup),
            )
        )
    return runs


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def render_report(runs: list[RunResult]) -> str:
    """A Markdown table, one row per run, largest throughput first."""
    lines = [
        "| run | GPUs | layout | iters | tokens/s | TFLOP/s/rank | step s | peak GiB/rank "
        "| tokens/s measured/planned | memory measured/planned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: -r.tokens_per_s):
        lines.append(
            f"| {r.name} | {r.gpus or '?'} | {r.layout} | {r.iterations} | {r.tokens_per_s:.0f} "
            f"| {r.tflops_per_rank:.3g} | {r.step_seconds:.3f} | {r.peak_memory_gib:.3f} "
            f"| {_ratio(r.throughput_ratio)} | {_ratio(r.memory_ratio)} |"
        )
        for label, b in sorted(r.budgets.items(), key=lambda item: item[0], reverse=True):
            planned = b["planned_tokens_per_s"]
            ratio = None if not planned else b["tokens_per_s"] / planned
            lines.append(
                f"| {r.name} budget {label} | {r.gpus or '?'} | {r.layout} | {b['iterations']} "
                f"| {b['tokens_per_s']:.0f} | | {b['step_seconds']:.3f} | | {_ratio(ratio)} | |"
            )
        if r.ranks:  # elastic-train --profile: the slowest rank and the fullest one
            slow = max(r.ranks, key=lambda k: r.ranks[k]["step_seconds"])
            full = max(r.ranks, key=lambda k: r.ranks[k]["peak_memory_gib"])
            lines.append(
                f"| {r.name} per rank ({len(r.ranks)}) | {r.gpus or '?'} | {r.layout} | "
                f"| slowest rank {slow} | | {r.ranks[slow]['step_seconds']:.3f} "
                f"| rank {full}: {r.ranks[full]['peak_memory_gib']:.3f} | | |"
            )
    return "\n".join(lines)


def scaling_plots(runs: list[RunResult], out_dir: Path) -> list[Path]:
    """``scaling_throughput.png`` (tokens/s vs GPUs, measured and planned) and
    ``scaling_memory.png`` (peak memory per rank by layout, measured and planned)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ax.plot(r.gpus, r.tokens_per_s, "o")
        ax.annotate(r.layout, (r.gpus, r.tokens_per_s), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")  # fmt: skip
        if r.planned_tokens_per_s:
            ax.plot(r.gpus, r.planned_tokens_per_s, "kx")
    ax.plot([], [], "o", label="measured")
    ax.plot([], [], "kx", label="planned (estimate)")
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput by layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "scaling_throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(runs) + 2), 4))
    x = list(range(len(runs)))
    ax.bar([i - 0.2 for i in x], [r.peak_memory_gib for r in runs], 0.4, label="measured peak")
    ax.bar([i + 0.2 for i in x], [r.planned_memory_gib or 0 for r in runs], 0.4,
           label="planned (estimate)")  # fmt: skip
    ax.set_xticks(x, [r.layout for r in runs], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("GiB per rank (largest rank)")
    ax.set_title("memory per rank by layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "scaling_memory.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
