"""``make demo-real``'s report: every figure from the per-window numbers in ``report.json``.

``build_report`` derives the tables from ``windows`` (model key -> per-window ``nll`` /
``correct`` / ``count``); ``recompute`` derives them again from a written report, so a test can
check that every printed figure follows from the file. Model keys: ``parent``,
``elastic/{fp32,bf16,fp8,nvfp4}/{budget}``, ``zero_shot/{ours,magnitude,random}/{budget}``,
``distil_alone/{budget}``, ``minitron/{budget}``. Beside them the raw ``curve`` (the elastic run's validation loss per
budget against its training tokens) and ``budget_control`` (replies to checkable questions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_plugin.demo_real import method_report
from elastic_plugin.demo_real.measure import paired, summarize

PAPER_ANCHOR = (
    "Star Elastic: width-only nesting recovers 98.1% of the parent's accuracy (160B tokens)"
)
PRECISIONS = ("fp32", "bf16", "fp8", "nvfp4")
ORDERS = ("ours", "magnitude", "random")  # importance orders, zero-shot; "ours" first
# the other routes to the same architectures, beside the elastic model
ROUTES = tuple(f"zero_shot/{o}" for o in ORDERS) + ("distil_alone",)
# the goal per budget: test perplexity within this many times the parent's
GOALS = method_report.GOALS
CURVE_FIT_POINTS = 3  # the curve's prediction fits loss = a + b ln(tokens) to its last points


def _ratio(value: float, base: float) -> float | None:
    return value / base if base else None


def _relative(value: float, base: float) -> float | None:
    return value / base - 1.0 if base else None


def derive(report: dict[str, Any]) -> dict[str, Any]:
    """The tables: per model its summary, per budget x precision its retention vs the parent,
    paired gaps (elastic fp32 vs zero-shot; ours vs magnitude order), quantization loss vs BF16."""
    windows = report["windows"]
    summary = {key: summarize(stats) for key, stats in windows.items()}
    parent = summary["parent"]
    rows = []
    for label in report["budgets"]:
        for precision in PRECISIONS:
            key = f"elastic/{precision}/{label}"
            if key not in summary:
                continue
            s = summary[key]
            rows.append(
                {
                    "budget": label,
                    "precision": precision,
                    "params": report["params"].get(label),
                    "perplexity": s["perplexity"],
                    "accuracy": s["accuracy"],
                    "perplexity_ratio": s["perplexity"] / parent["perplexity"],
                    "accuracy_retention": _ratio(s["accuracy"], parent["accuracy"]),
                }
            )
    routes = []
    for label in report["budgets"]:
        elastic = windows.get(f"elastic/fp32/{label}")
        for route in ROUTES:
            key = f"{route}/{label}"
            if elastic is None or key not in windows:
                continue
            routes.append(
                {
                    "budget": label,
                    "route": route,
                    "perplexity": summary[key]["perplexity"],
                    "accuracy": summary[key]["accuracy"],
                    "minus_elastic": paired(windows[key], elastic),
                }
            )
    orders = []
    for label in report["budgets"]:
        ours = windows.get(f"zero_shot/ours/{label}")
        for other in ORDERS[1:]:
            theirs = windows.get(f"zero_shot/{other}/{label}")
            if ours is not None and theirs is not None:
                orders.append(
                    {"budget": label, "versus": other, "ours_minus": paired(ours, theirs)}
                )
    quant = []
    for label in report["budgets"]:
        base = summary.get(f"elastic/bf16/{label}")
        for precision in ("fp8", "nvfp4"):
            q = summary.get(f"elastic/{precision}/{label}")
            if base and q:
                quant.append(
                    {
                        "budget": label,
                        "precision": precision,
                        "perplexity_vs_bf16": q["perplexity"] / base["perplexity"] - 1.0,
                        "accuracy_vs_bf16": _relative(q["accuracy"], base["accuracy"]),
                    }
                )
    decode = report.get("decode") or {}
    speed = []
    for label, by_batch in decode.items():
        for batch, tps in by_batch.items():
            base = decode.get("parent", {}).get(batch)
            params = report["params"].get(label)
            speed.append(
                {
                    "model": label,
                    "batch": int(batch),
                    "tokens_per_s": tps,
                    "speedup": tps / base if base else None,
                    "param_ratio": params / report["params"]["parent"] if params else None,
                }
            )
    return {
        "summary": summary,
        "budgets_table": rows,
        "routes": routes,
        "importance_orders": orders,
        "quantization": quant,
        "decode_table": speed,
        "curve_table": curve_table(report.get("curve")),
        "control_table": control_table(report.get("budget_control"), report["params"]),
        "method_table": method_report.method_table(report),
    }


def curve_table(curve: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per budget: validation perplexity against training tokens, as a multiple of the parent's
    (``curve["parent_loss"]``), and what a fit of loss = a + b ln(tokens) to the last
    ``CURVE_FIT_POINTS`` points predicts: the tokens at which the budget reaches its goal
    (``GOALS``; None: the fit is not falling, or no goal). An extrapolation, labelled as one."""
    if not curve:
        return []
    import math

    parent = float(curve["parent_loss"])
    rows = []
    for label, points in curve["points"].items():
        pts = sorted((float(t), float(loss)) for t, loss in points if t > 0)
        row: dict[str, Any] = {
            "budget": label,
            "tokens": [t for t, _ in pts],
            "perplexity": [math.exp(loss) for _, loss in pts],
            "x_parent": [math.exp(loss - parent) for _, loss in pts],
            "goal_x_parent": GOALS.get(label),
            "slope_per_e": None,
            "tokens_to_goal": None,
        }
        fit = pts[-CURVE_FIT_POINTS:]
        if len(fit) >= 2:
            xs = [math.log(t) for t, _ in fit]
            ys = [loss for _, loss in fit]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
            row["slope_per_e"] = b
            goal = GOALS.get(label)
            if goal is not None and b < 0:
                target = parent + math.log(goal)
                predicted = math.exp(mx + (target - my) / b)
                # a fit that puts the goal before the last point contradicts the data (a jump,
                # e.g. the router's freeze, steepens it): no prediction then
                row["tokens_to_goal"] = predicted if predicted > pts[-1][0] else None
        rows.append(row)
    return rows


def control_table(control: dict[str, Any] | None, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Per route of the budget-control run: questions answered right, tokens written, seconds
    against the parent alone's, and for a small->parent route ``arithmetic_ratio`` (the
    switch's arithmetic over the parent alone's, counting every token each model reads)."""
    if not control:
        return []
    from elastic_plugin.inference.budget_control import arithmetic_ratio

    routes = {r["route"]: r for r in control["routes"]}
    parent = routes.get("parent")
    rows = []
    for name, r in routes.items():
        n = len(r["correct"])
        row: dict[str, Any] = {
            "route": name,
            "correct": sum(r["correct"]),
            "questions": n,
            "new_tokens": sum(r["new_tokens"]) / n,
            "seconds": sum(r["seconds"]),
            "time_vs_parent": sum(r["seconds"]) / sum(parent["seconds"]) if parent else None,
            "arithmetic_ratio": None,
        }
        small = name.removesuffix("->parent")
        if name.endswith("->parent") and parent and params.get(small):
            prompt = sum(r["prompt_tokens"]) / n
            draft = sum(min(t, control["draft_tokens"]) for t in r["new_tokens"]) / n
            row["arithmetic_ratio"] = arithmetic_ratio(
                prompt,
                draft,
                row["new_tokens"] - draft,
                params[small] / params["parent"],
                alone_think=0.0,
                alone_answer=sum(parent["new_tokens"]) / n,
            )
        rows.append(row)
    return rows


def build_report(**fields: Any) -> dict[str, Any]:
    report = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "anchor": PAPER_ANCHOR}
    report.update(fields)
    report.update(derive(report))
    return report


def recompute(report: dict[str, Any]) -> dict[str, Any]:
    """The derived tables again, from the report's own ``windows`` (for checking a file)."""
    return derive(report)


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(report: dict[str, Any]) -> str:
    p = report["summary"]["parent"]
    data = report["data"]
    train = report.get("training") or {}
    lines = [
        f"# Elastic nesting of {report['model']}",
        "",
        f"Held-out test: {data['windows']} windows x {data['seq_length']} tokens "
        f"({data['tokens']} predicted tokens) of documents no training step read. "
        f"Elastic run: {train.get('iterations', '?')} iterations, "
        f"{train.get('tokens', '?')} tokens. {report['anchor']}.",
        "",
        f"Parent: perplexity {_f(p['perplexity'], 2)}, next-token accuracy {_pct(p['accuracy'])}, "
        f"{report['params']['parent']:,} parameters.",
        "",
        "## Budgets x precision (retention against the parent)",
        "",
        "| budget | precision | params | perplexity | x parent | accuracy | retention |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["budgets_table"]:
        lines.append(
            f"| {r['budget']} | {r['precision']} | {r['params'] or 0:,} | "
            f"{_f(r['perplexity'], 2)} | {_f(r['perplexity_ratio'], 2)} | "
            f"{_pct(r['accuracy'])} | {_pct(r['accuracy_retention'])} |"
        )
    lines += [
        "",
        "## Other routes at the same architecture (paired over the same windows)",
        "",
        "| budget | route | perplexity | accuracy | loss - elastic (nats/token) | "
        "accuracy - elastic |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["routes"]:
        gap = r["minus_elastic"]
        lines.append(
            f"| {r['budget']} | {r['route']} | {_f(r['perplexity'], 2)} | {_pct(r['accuracy'])} "
            f"| {gap['loss']['diff']:+.4f} ± {gap['loss']['se']:.4f} | "
            f"{100 * gap['accuracy']['diff']:+.2f} ± {100 * gap['accuracy']['se']:.2f} pts |"
        )
    lines += method_report.markdown_lines(report)
    if report["importance_orders"]:
        lines += [
            "",
            "## Importance order, zero-shot (ours minus another order; negative loss = ours"
            " prunes better)",
            "",
            "| budget | versus | loss diff (nats/token) | accuracy diff |",
            "|---|---|---|---|",
        ]
        for r in report["importance_orders"]:
            gap = r["ours_minus"]
            lines.append(
                f"| {r['budget']} | {r['versus']} | {gap['loss']['diff']:+.4f} ± "
                f"{gap['loss']['se']:.4f} | {100 * gap['accuracy']['diff']:+.2f} ± "
                f"{100 * gap['accuracy']['se']:.2f} pts |"
            )
    if report.get("curve_table"):
        lines += [
            "",
            "## Validation perplexity against training tokens (x the parent's)",
            "",
            "| budget | tokens: x parent | goal | fit slope (nats per e-fold) | "
            "tokens to goal (extrapolated) |",
            "|---|---|---|---|---|",
        ]
        for r in report["curve_table"]:
            points = ", ".join(f"{int(t):,}: {x:.2f}" for t, x in zip(r["tokens"], r["x_parent"]))
            to_goal = r["tokens_to_goal"]
            lines.append(
                f"| {r['budget']} | {points} | {_f(r['goal_x_parent'], 2)} | "
                f"{_f(r['slope_per_e'], 3)} | {'-' if to_goal is None else f'{to_goal:,.0f}'} |"
            )
    lines += [
        "",
        "## Quantization against BF16",
        "",
        "| budget | precision | perplexity | accuracy |",
    ]
    lines.append("|---|---|---|---|")
    for r in report["quantization"]:
        lines.append(
            f"| {r['budget']} | {r['precision']} | {_pct(r['perplexity_vs_bf16'])} | "
            f"{_pct(r['accuracy_vs_bf16'])} |"
        )
    lines += ["", "## Greedy decoding (fp32, cache on)", "", "| model | batch | tokens/s | "
              "x parent | params / parent |", "|---|---|---|---|---|"]  # fmt: skip
    for r in report["decode_table"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {_f(r['tokens_per_s'], 1)} | {_f(r['speedup'], 2)} "
            f"| {_f(r['param_ratio'], 2)} |"
        )
    control = report.get("budget_control")
    if report.get("control_table") and control:
        lines += [
            "",
            f"## Elastic budget control: a small budget drafts {control['draft_tokens']} tokens, "
            "the parent re-reads and answers (batch 1, greedy, BF16 exports in fp32)",
            "",
            "| route | right | new tokens | seconds | x parent time | arithmetic ratio |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["control_table"]:
            lines.append(
                f"| {r['route']} | {r['correct']}/{r['questions']} | {_f(r['new_tokens'], 1)} | "
                f"{_f(r['seconds'], 1)} | {_f(r['time_vs_parent'], 2)} | "
                f"{_f(r['arithmetic_ratio'], 2)} |"
            )
    lines += ["", "## Instruction prompts, answered greedily (BF16 exports; parent fp32)", ""]
    for i, prompt in enumerate(report["prompts"]):
        lines.append(f"**{prompt}**")
        lines.append("")
        for model, answers in report["answers"].items():
            lines.append(f"- {model}: {answers[i]!r}")
        lines.append("")
    if report.get("benchmarks"):  # demo_real.benchmarks: lm-evaluation-harness per budget
        from elastic_plugin.demo_real.benchmarks import markdown_section

        lines.append(markdown_section(report["benchmarks"]))
    if report.get("stages"):
        lines += _stage_lines(report["stages"], report.get("machine"))
    return "\n".join(lines) + "\n"


def _stage_lines(stages: list[dict[str, Any]], machine: dict[str, Any] | None) -> list[str]:
    """Each stage's time and, where it runs the model, how much of the machine it used."""
    lines = ["## Stage times and machine use", ""]
    if machine:
        lines += [
            f"{machine['cpu']}; {machine['threads']} threads; {machine['precision']}; "
            f"{machine['dtype']} GEMM peak {machine['peak_gflops']} GFLOP/s (measured in the run).",
            "",
        ]
    lines += [
        "| stage | wall s | CPU s | tokens | tokens/s | model GFLOP/s | % of peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in stages:
        use = s.get("use") or {}
        share = use.get("share_of_peak")
        lines.append(
            f"| {s['stage']} | {s['wall_s']} | {s['cpu_s']} | {use.get('tokens', '')} | "
            f"{use.get('tokens_per_s', '')} | {use.get('model_gflops', '')} | "
            f"{'' if share is None else f'{100 * share:.1f}'} |"
        )
    return lines


def write_markdown(report: dict[str, Any], path: Path) -> Path:
    path.write_text(markdown(report))
    return path


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """Perplexity per budget and precision, next to zero-shot pruning and the parent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    params = report["params"]
    for precision in PRECISIONS:
        pts = [r for r in report["budgets_table"] if r["precision"] == precision]
        if pts:
            ax.plot([r["params"] for r in pts], [r["perplexity"] for r in pts], "o-",
                    label=f"elastic {precision}")  # fmt: skip
    for route in ROUTES:
        pts = [r for r in report["routes"] if r["route"] == route]
        if pts:
            ax.plot([params[r["budget"]] for r in pts], [r["perplexity"] for r in pts], "x--",
                    label=route.replace("_", " "))  # fmt: skip
    ax.axhline(report["summary"]["parent"]["perplexity"], color="k", lw=0.8, label="parent")
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "perplexity_vs_params.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths = [path]
    if report.get("curve_table"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in report["curve_table"]:
            ax.plot(r["tokens"], r["x_parent"], "o-", label=f"budget {r['budget']}")
            if r["goal_x_parent"]:
                ax.axhline(r["goal_x_parent"], ls=":", lw=0.8, color=ax.lines[-1].get_color())
        ax.axhline(1.0, color="k", lw=0.8, label="parent")
        ax.set(xlabel="training tokens", ylabel="validation perplexity / parent's", xscale="log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "perplexity_vs_tokens.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    flops_plot = method_report.plot_curves(report, out)
    return paths + ([flops_plot] if flops_plot else [])
