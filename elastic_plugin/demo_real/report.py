"""``make demo-real``'s report: every figure from the per-window numbers in ``report.json``.

``build_report`` derives the tables from ``windows`` (model key -> per-window ``nll`` /
``correct`` / ``count``); ``recompute`` derives them again from a written report, so a test can
check that every printed figure follows from the file. Model keys: ``parent``,
``elastic/{fp32,bf16,fp8,nvfp4}/{budget}``, ``zero_shot/{ours,magnitude}/{budget}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_plugin.demo_real.measure import paired, summarize

PAPER_ANCHOR = (
    "Star Elastic: width-only nesting recovers 98.1% of the parent's accuracy (160B tokens)"
)
PRECISIONS = ("fp32", "bf16", "fp8", "nvfp4")


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
        for order in ("ours", "magnitude"):
            key = f"zero_shot/{order}/{label}"
            if elastic is None or key not in windows:
                continue
            routes.append(
                {
                    "budget": label,
                    "route": f"zero_shot/{order}",
                    "perplexity": summary[key]["perplexity"],
                    "accuracy": summary[key]["accuracy"],
                    "minus_elastic": paired(windows[key], elastic),
                }
            )
    orders = []
    for label in report["budgets"]:
        a, b = windows.get(f"zero_shot/ours/{label}"), windows.get(f"zero_shot/magnitude/{label}")
        if a is not None and b is not None:
            orders.append({"budget": label, "ours_minus_magnitude": paired(a, b)})
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
    }


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
    if report["importance_orders"]:
        lines += [
            "",
            "## Importance order, zero-shot (ours minus weight magnitude; negative loss = ours"
            " prunes better)",
            "",
            "| budget | loss diff (nats/token) | accuracy diff |",
            "|---|---|---|",
        ]
        for r in report["importance_orders"]:
            gap = r["ours_minus_magnitude"]
            lines.append(
                f"| {r['budget']} | {gap['loss']['diff']:+.4f} ± {gap['loss']['se']:.4f} | "
                f"{100 * gap['accuracy']['diff']:+.2f} ± {100 * gap['accuracy']['se']:.2f} pts |"
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
    lines += ["", "## Instruction prompts, answered greedily (BF16 exports; parent fp32)", ""]
    for i, prompt in enumerate(report["prompts"]):
        lines.append(f"**{prompt}**")
        lines.append("")
        for model, answers in report["answers"].items():
            lines.append(f"- {model}: {answers[i]!r}")
        lines.append("")
    if report.get("stages"):
        lines += ["## Stage times", "", "| stage | wall s | CPU s |", "|---|---|---|"]
        for s in report["stages"]:
            lines.append(f"| {s['stage']} | {s['wall_s']} | {s['cpu_s']} |")
    return "\n".join(lines) + "\n"


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
    for order in ("ours", "magnitude"):
        pts = [r for r in report["routes"] if r["route"] == f"zero_shot/{order}"]
        if pts:
            ax.plot([params[r["budget"]] for r in pts], [r["perplexity"] for r in pts], "x--",
                    label=f"zero-shot ({order} order)")  # fmt: skip
    ax.axhline(report["summary"]["parent"]["perplexity"], color="k", lw=0.8, label="parent")
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "perplexity_vs_params.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
