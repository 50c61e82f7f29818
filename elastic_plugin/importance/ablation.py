"""Ablation of importance orders: prune one axis by each order, judge by validation loss, zero-shot
and after a short recovery at equal tokens for every order (single rank, TP=1).

Orders compared per axis: every statistic ``methods.STATISTICS`` has for it (one pass of
collected scores), weight magnitude, and ``seeds`` random orders (mean and spread). Recovery
trains the masked model for the same batches with the same optimizer for every order, keeping
the pruned units pruned (their zeros, and the excluded experts' router bias, are restored after
every step), so the orders differ only in which units they removed.
"""

from __future__ import annotations

import statistics as stats_
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.importance.methods import DEFAULTS, PUBLISHED, STATISTICS
from elastic_plugin.importance.prune import (
    importance_orders,
    magnitude_orders,
    mask_prune,
    random_orders,
)
from elastic_plugin.importance.scores import ImportanceScores

Orders = dict[int, torch.Tensor]


@dataclass
class AblationSettings:
    keep: float = 0.5
    seeds: int = 5
    recovery_steps: int = 16
    recovery_lr: float = 2e-4  # 1e-3 (fresh AdamW) raised the loss of the best orders


@dataclass
class AxisResult:
    axis: str
    zero_shot: dict[str, float] = field(default_factory=dict)  # order name -> valid loss
    recovered: dict[str, float] = field(default_factory=dict)
    # kept units each order shares with the published statistic's order (1 = same pruned model)
    overlap: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Per method: zero-shot / recovered loss; random orders as mean and std over seeds."""
        out: dict[str, Any] = {"axis": self.axis, "methods": {}, "overlap": dict(self.overlap)}
        for phase, losses in (("zero_shot", self.zero_shot), ("recovered", self.recovered)):
            rand = [v for k, v in losses.items() if k.startswith("random")]
            for name, value in losses.items():
                if not name.startswith("random"):
                    out["methods"].setdefault(name, {})[phase] = {"mean": value, "std": 0.0}
            if rand:
                out["methods"].setdefault("random", {})[phase] = {
                    "mean": stats_.mean(rand),
                    "std": stats_.stdev(rand) if len(rand) > 1 else 0.0,
                    "n": len(rand),
                }
        return out


def statistic_label(axis: str, statistic: str) -> str:
    tags = [
        t
        for t, table in (("published", PUBLISHED), ("default", DEFAULTS))
        if table[axis] == statistic
    ]
    return f"{statistic} ({', '.join(tags)})" if tags else statistic


def axis_orders(
    model, scores: ImportanceScores, axis: str, query_groups: int, mamba_groups: int, seeds: int
) -> dict[str, Orders]:
    """Every order to compare on ``axis`` (empty when the model lacks it)."""
    orders: dict[str, Orders] = {}
    for statistic in STATISTICS[axis]:
        ours = importance_orders(scores, axis, query_groups, mamba_groups, statistic=statistic)
        if ours:
            orders[statistic] = ours
    if not orders:
        return {}
    reference = next(iter(orders.values()))
    if "magnitude" not in orders:  # a scores file from before weights were recorded
        orders["magnitude"] = magnitude_orders(model, axis)
    groups = {k: head_groups(axis, query_groups, mamba_groups) for k in reference}
    for seed in range(seeds):
        orders[f"random{seed}"] = random_orders(reference, seed, groups)
    return orders


def _frozen_entries(model, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Entries pruning set to zero (or to the router's "never route" bias): kept so in recovery."""
    frozen = {}
    for name, tensor in model.state_dict().items():
        if name not in base or not torch.is_floating_point(tensor):
            continue
        changed = (tensor != base[name]) & ((tensor == 0) | (tensor < -1e8))
        if changed.any():
            frozen[name] = changed
    return frozen


def recover(
    model,
    batches: list[dict],
    base: dict[str, torch.Tensor],
    lr: float,
) -> None:
    """LM training of the pruned model on ``batches`` (one step each), pruned entries held."""
    from elastic_plugin.training.step import forward_step

    pruned = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    frozen = _frozen_entries(model, base)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    state = model.state_dict()
    model.train()
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        output, loss_fn = forward_step(iter([batch]), model)
        loss_sum, num_tokens, _ = loss_fn(output)
        (loss_sum / num_tokens.clamp(min=1)).backward()
        optimizer.step()
        with torch.no_grad():
            for name, mask in frozen.items():
                state[name][mask] = pruned[name][mask]


def run_axis(
    model,
    scores: ImportanceScores,
    axis: str,
    query_groups: int,
    mamba_groups: int,
    evaluate: Callable[[Any], float],
    recovery_batches: list[dict],
    settings: AblationSettings,
    progress: Callable[[str], None] | None = None,
) -> AxisResult | None:
    """All orders of one axis, each from the same starting weights (restored afterwards)."""
    orders = axis_orders(model, scores, axis, query_groups, mamba_groups, settings.seeds)
    if not orders:
        return None
    base = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    result = AxisResult(axis)
    published = orders.get(PUBLISHED[axis], next(iter(orders.values())))
    groups = head_groups(axis, query_groups, mamba_groups)
    result.overlap = {
        n: round(kept_overlap(o, published, settings.keep, groups), 3) for n, o in orders.items()
    }
    try:
        for name, order in orders.items():
            model.load_state_dict(base, strict=False)
            mask_prune(model, axis, order, settings.keep)
            result.zero_shot[name] = evaluate(model)
            if settings.recovery_steps > 0:
                steps = recovery_batches[: settings.recovery_steps]
                recover(model, steps, base, settings.recovery_lr)
                result.recovered[name] = evaluate(model)
            if progress is not None:
                rec = result.recovered.get(name)
                progress(
                    f"{axis:16s} {name:16s} zero-shot {result.zero_shot[name]:.4f}"
                    + (f"  recovered {rec:.4f}" if rec is not None else "")
                )
    finally:
        model.load_state_dict(base, strict=False)
    return result


def kept_overlap(a: Orders, b: Orders, keep: float, groups: int = 1) -> float:
    """Mean fraction of kept units two orders share (1 = the same pruned model); heads are kept
    per group, as ``mask_prune`` keeps them."""
    shares = []
    for key in a:
        per = a[key].numel() // groups
        k = max(1, int(per * keep))
        kept_a = set(a[key].view(groups, per)[:, :k].reshape(-1).tolist())
        kept_b = set(b[key].view(groups, per)[:, :k].reshape(-1).tolist())
        shares.append(len(kept_a & kept_b) / len(kept_a))
    return sum(shares) / max(1, len(shares))


def head_groups(axis: str, query_groups: int, mamba_groups: int) -> int:
    """Groups heads are ordered within (1 for the other axes)."""
    return {"attention_heads": query_groups, "mamba_heads": mamba_groups}.get(axis, 1)


# ------------------------------------------------------------------------------ reporting
def markdown_table(results: list[dict[str, Any]], title: str) -> str:
    """axis x method, zero-shot and recovered valid loss (random: mean +- std over seeds)."""

    def cell(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "-"
        if entry.get("n"):
            return f"{entry['mean']:.4f} ± {entry['std']:.4f}"
        return f"{entry['mean']:.4f}"

    lines = [
        f"### {title}",
        "",
        "| axis | order | zero-shot | after recovery | kept units shared with published |",
        "|---|---|---|---|---|",
    ]
    for res in results:
        best = {
            phase: min(m[phase]["mean"] for m in res["methods"].values() if phase in m)
            for phase in ("zero_shot", "recovered")
            if any(phase in m for m in res["methods"].values())
        }
        for name, entry in res["methods"].items():
            row = []
            for phase in ("zero_shot", "recovered"):
                text = cell(entry.get(phase))
                if phase in entry and entry[phase]["mean"] == best.get(phase):
                    text = f"**{text}**"
                row.append(text)
            label = name if name in ("magnitude", "random") else statistic_label(res["axis"], name)
            shared = res.get("overlap", {}).get(name)
            if name == "random":
                rand = [v for k, v in res.get("overlap", {}).items() if k.startswith("random")]
                shared = sum(rand) / len(rand) if rand else None
            share = "-" if shared is None else f"{shared:.2f}"
            lines.append(f"| {res['axis']} | {label} | {row[0]} | {row[1]} | {share} |")
    return "\n".join(lines) + "\n"


def plot_results(results: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """One panel per axis: each order's loss zero-shot and after recovery (random: mean +- std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(results))
    rows = (len(results) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.4 * rows), dpi=100, squeeze=False)
    for ax, res in zip(axes.flat, results):
        names = list(res["methods"])
        xs = range(len(names))
        for offset, phase, color in (
            (-0.1, "zero_shot", "tab:blue"),
            (0.1, "recovered", "tab:orange"),
        ):
            means = [res["methods"][n].get(phase, {}).get("mean", float("nan")) for n in names]
            stds = [res["methods"][n].get(phase, {}).get("std", 0.0) for n in names]
            ax.errorbar(  # markers, not bars: the differences are small next to the losses
                [x + offset for x in xs],
                means,
                yerr=stds,
                fmt="o",
                color=color,
                capsize=3,
                label="zero-shot" if phase == "zero_shot" else "after recovery",
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_title(res["axis"])
        ax.set_ylabel("valid loss (lower is better)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(results) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
