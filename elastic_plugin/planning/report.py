"""The plan's outputs: a ranked table, the JSON document and a plot (memory per rank by layout
against the GPU's capacity, and estimated tokens/s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_plugin.planning.plan import LayoutPlan, PlanInputs

__all__ = ["plan_json", "plot_plan", "render_table"]

GB = 1e9


def render_table(inputs: PlanInputs, plans: list[LayoutPlan], top: int) -> str:
    """The ``top`` best layouts, one line each, then the first's per-budget detail."""
    dev = inputs.device
    lines = [
        f"plan for {inputs.source} on {inputs.gpus} x {dev.name} ({dev.memory_gb:g} GB, "
        f"{inputs.reserve_gb:g} GB reserved), seq {inputs.seq_length}, micro-batch "
        f"{inputs.micro_batch_size}, global batch {inputs.global_batch_size}, "
        f"{'BF16' if inputs.runtime.bf16 else 'FP32'}, teacher {inputs.elastic.teacher}",
        f"estimates from the stated model: efficiency {inputs.efficiency:g} of "
        f"{inputs.peak_tflops:g} TFLOPS, links at {inputs.comm_efficiency:g} of peak",
        f"{'#':>3} {'layout':<24} {'fits':<4} {'mem/rank GB':>11} {'headroom':>9} "
        f"{'step s':>8} {'tokens/s':>10} {'bubble':>6}",
    ]
    for i, plan in enumerate(plans[:top], 1):
        lines.append(
            f"{i:>3} {plan.layout.name:<24} {'yes' if plan.fits else 'no':<4} "
            f"{plan.memory.total / GB:>11.2f} {plan.headroom / GB:>9.2f} "
            f"{plan.step_seconds:>8.3f} {plan.tokens_per_s:>10.0f} "
            f"{plan.budgets[0].time.bubble_fraction:>6.2f}"
        )
    if plans:
        best = plans[0]
        m = best.memory
        lines += [
            "",
            f"layout {best.layout.name}, busiest rank (stage {m.stage}): weights "
            f"{m.weights / GB:.2f} GB, grads {m.grads / GB:.2f}, optimizer {m.optimizer / GB:.2f},"
            f" teacher {m.teacher_weights / GB:.2f}, activations {m.activations / GB:.2f} "
            f"({m.in_flight} in flight), teacher logits {m.teacher_logits / GB:.2f}",
            f"{'budget':>6} {'params':>8} {'active':>8} {'TFLOP/step':>11} {'step s':>8} "
            f"{'tokens/s':>10} {'act GB/mb':>9}",
        ]
        tokens = inputs.global_batch_size * inputs.seq_length
        for b in best.budgets:
            lines.append(
                f"{b.run.budget:>6g} {b.run.total_params / 1e9:>7.2f}B "
                f"{b.run.active_params / 1e9:>7.2f}B {b.step_flops / 1e12:>11.1f} "
                f"{b.time.seconds:>8.3f} {tokens / b.time.seconds:>10.0f} "
                f"{b.memory.activations_per_microbatch / GB:>9.2f}"
            )
        cur = best.curriculum
        if cur:
            lines.append("")
            for s in cur["stages"]:
                head = f"stage {s['tokens'] / 1e9:g}B tokens at {s['seq_length']}"
                if "layout" not in s:
                    lines.append(f"{head}: no valid layout")
                    continue
                lines.append(
                    f"{head} on {s['layout']}: {s['hours']:.1f} h, {s['gpu_hours']:.0f} GPU-hours"
                    + ("" if s["fits"] else " (NO layout fits at this length)")
                )
            lines.append(
                f"curriculum: {cur['hours']:.1f} h, {cur['gpu_hours']:.0f} GPU-hours; each budget "
                f"separately on {cur['separate_tokens_per_budget'] / 1e9:g}B tokens "
                f"({cur['separate_layout']}, no teacher): "
                + ", ".join(f"{k}: {v:.0f}" for k, v in cur["separate_gpu_hours"].items())
                + f" (total {cur['separate_gpu_hours_total']:.0f} GPU-hours)"
            )
    return "\n".join(lines)


def plan_json(
    inputs: PlanInputs, plans: list[LayoutPlan], top: int, rejected: dict[str, int]
) -> dict[str, Any]:
    tokens = inputs.global_batch_size * inputs.seq_length
    return {
        "source": inputs.source,
        "gpus": inputs.gpus,
        "device": inputs.device.to_dict(),
        "seq_length": inputs.seq_length,
        "micro_batch_size": inputs.micro_batch_size,
        "global_batch_size": inputs.global_batch_size,
        "runtime": inputs.runtime.to_dict(),
        "teacher": inputs.elastic.teacher,
        "efficiency": inputs.efficiency,
        "comm_efficiency": inputs.comm_efficiency,
        "reserve_gb": inputs.reserve_gb,
        "valid_layouts": len(plans),
        "fitting_layouts": sum(p.fits for p in plans),
        "rejected_layouts": rejected,
        "layouts": [p.to_dict(tokens) for p in plans[:top]],
    }


def plot_plan(inputs: PlanInputs, plans: list[LayoutPlan], top: int, path: Path) -> Path:
    """Memory per rank (stacked by kind) of the ``top`` layouts against the usable capacity,
    with estimated tokens/s on a second axis."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display (as evaluation/plots.py)
    import matplotlib.pyplot as plt

    shown = plans[:top]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(shown) + 2), 4.5))
    parts = ("weights", "grads", "optimizer", "teacher_weights", "activations", "teacher_logits")
    x = list(range(len(shown)))
    bottom = [0.0] * len(shown)
    for part in parts:
        values = [getattr(p.memory, part) / GB for p in shown]
        ax.bar(x, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    capacity = inputs.device.memory_bytes / GB - inputs.reserve_gb
    ax.axhline(capacity, color="k", linestyle="--", label=f"{inputs.device.name} usable")
    ax.set_xticks(x, [p.layout.name for p in shown], rotation=60, ha="right", fontsize=7)
    ax2 = ax.twinx()
    ax2.plot(x, [p.tokens_per_s for p in shown], "ko-", label="tokens/s (est.)")
    ax2.set_ylabel("estimated tokens/s")
    ax.set_xlabel("layout")
    ax.set_ylabel("GB per rank (busiest)")
    ax.set_title(f"plan: {inputs.gpus} x {inputs.device.name}, seq {inputs.seq_length} (estimates)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")  # written whole, then renamed
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
