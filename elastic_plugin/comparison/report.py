"""``compare.json`` / ``compare.md`` / ``compare_accuracy_vs_params.png``: every route per size
(mean and spread over seeds), the cost of obtaining all sizes by each route, and, stated
plainly, where the elastic run loses.

Route keys: ``elastic``, ``zero_shot``, and ``<route>/<token budget>`` for the separately
trained ones (``prune_distil/equal_cost``, ``scratch/equal_tokens``, ...)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["COMPARE_JSON", "COMPARE_MD", "COMPARE_PLOT", "assemble", "headline", "markdown"]

COMPARE_JSON = "compare.json"
COMPARE_MD = "compare.md"
COMPARE_PLOT = "compare_accuracy_vs_params.png"
TOKEN_BUDGET_WORDS = {
    "equal_cost": "the elastic run's tokens split over its {n} sizes below 1.0",
    "equal_tokens": "the elastic run's tokens for each size",
}


def route_key(record: dict[str, Any]) -> str:
    budget = record.get("token_budget")
    return record["route"] if budget is None else f"{record['route']}/{budget}"


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def _aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One route at one size over its seeds."""
    first = records[0]
    return {
        "route": first["route"],
        "token_budget": first.get("token_budget"),
        "seeds": [r.get("seed") for r in records],
        "tokens": first.get("tokens", 0),
        "iters": first.get("iters", 0),
        "seconds": statistics.fmean(r.get("seconds") or 0.0 for r in records),
        "tflop": statistics.fmean(r.get("tflop") or 0.0 for r in records),
        "valid_loss": _spread([r["valid_loss"] for r in records]),
        "accuracy": _spread([r["accuracy"] for r in records]),
    }


NOISE_SE = 2.0  # a gap within this many paired standard errors is called sampling noise


def _paired(route: list[dict[str, Any]], elastic: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The route minus the elastic model on the *same* problems and windows: the mean paired
    difference and its standard error (spread of the per-item differences / sqrt(items); the
    route's seeds averaged per item first). Why paired: both models see the same items, so the
    items' own difficulty cancels; what remains says whether a gap is more than the sampling
    noise of this many problems or windows."""
    if not elastic or any("correct" not in r or "window_losses" not in r for r in route + elastic):
        return None
    out: dict[str, Any] = {}
    for metric, key in (("accuracy", "correct"), ("valid_loss", "window_losses")):
        mine = [
            statistics.fmean(float(v) for v in items) for items in zip(*(r[key] for r in route))
        ]
        base = [float(v) for v in elastic[0][key]]
        diffs = [a - b for a, b in zip(mine, base)]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        out[metric] = {"diff": statistics.fmean(diffs), "se": se, "items": len(diffs)}
    return out


def _beyond_noise(paired: dict[str, Any] | None, metric: str) -> bool | None:
    """Whether the paired gap on ``metric`` exceeds ``NOISE_SE`` standard errors (None: unknown)."""
    if paired is None or paired[metric]["se"] != paired[metric]["se"]:  # absent or NaN
        return None
    gap = paired[metric]
    return abs(gap["diff"]) > NOISE_SE * gap["se"]


def _noise_words(paired: dict[str, Any] | None, metric: str, scale: float, unit: str) -> str:
    if paired is None:
        return ""
    gap = paired[metric]
    beyond = _beyond_noise(paired, metric)
    verdict = "unknown" if beyond is None else "beyond" if beyond else "within"
    items = "problems" if metric == "accuracy" else "validation windows"
    return (
        f", paired standard error ±{scale * gap['se']:.{2 if scale == 100 else 4}f}{unit} over "
        f"{gap['items']} {items}: {verdict} sampling noise"
    )


def _losses(size: dict[str, Any]) -> list[str]:
    """Plain sentences: every route that beats the elastic model of this size, and by how much
    (on the mean over seeds; the seed spread and the paired standard error over the evaluated
    items say whether it is more than noise)."""
    routes = size["routes"]
    elastic = routes.get("elastic")
    if elastic is None:
        return []
    out = []
    e_acc, e_loss = elastic["accuracy"]["mean"], elastic["valid_loss"]["mean"]
    for key, r in routes.items():
        if key == "elastic":
            continue
        acc, loss, paired = r["accuracy"], r["valid_loss"], r.get("vs_elastic")
        beats = []
        if acc["mean"] > e_acc:
            beats.append(
                f"accuracy {100 * acc['mean']:.1f}% vs {100 * e_acc:.1f}% "
                f"(+{100 * (acc['mean'] - e_acc):.1f} points, seed spread ±{100 * acc['std']:.1f}"
                + _noise_words(paired, "accuracy", 100, " points")
                + ")"
            )
        if loss["mean"] < e_loss:
            beats.append(
                f"validation loss {loss['mean']:.4f} vs {e_loss:.4f} "
                f"(seed spread ±{loss['std']:.4f}" + _noise_words(paired, "valid_loss", 1, "") + ")"
            )
        if beats:
            out.append(
                f"budget {size['budget']}: {key} beats the elastic model on " + "; ".join(beats)
            )
    return out


def assemble(
    records: list[dict[str, Any]],
    sizes: dict[str, dict[str, Any]],
    elastic_run: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The report dict. ``records``: one per model made (route, label, seed, tokens, seconds,
    valid_loss, accuracy, params); ``sizes``: label -> {choice, cost_fraction}."""
    rows = []
    for label, info in sizes.items():
        mine = [r for r in records if r["label"] == label]
        keys = list(dict.fromkeys(route_key(r) for r in mine))
        routes = {k: _aggregate([r for r in mine if route_key(r) == k]) for k in keys}
        base = [r for r in mine if route_key(r) == "elastic"]
        for key, route in routes.items():
            if key != "elastic":
                route["vs_elastic"] = _paired([r for r in mine if route_key(r) == key], base)
        if "elastic" in routes:
            routes["elastic"] |= {
                "tokens": elastic_run["tokens"],
                "seconds": elastic_run.get("seconds"),
                "tflop": elastic_run.get("tflop"),
                "note": "the one elastic run made every size; its tokens and time are shared",
            }
        rows.append(
            {
                "budget": label,
                "params": mine[0]["params"] if mine else None,
                "choice": info["choice"],
                "routes": routes,
            }
        )
    for row in rows:
        row["elastic_loses"] = _losses(row)
    report = {
        "settings": settings,
        "elastic_run": elastic_run,
        "sizes": rows,
        "cost": _costs(records, elastic_run, settings["num_sizes"]),
        "elastic_loses": [s for row in rows for s in row["elastic_loses"]],
    }
    report["headline"] = headline(report)
    return report


def headline(report: dict[str, Any]) -> dict[str, Any] | None:
    """The short form the demo's report.md carries: the smallest compared size, its elastic
    model against the same architecture distilled alone (equal tokens per model when measured,
    else equal total cost) and the zero-shot floor, as a few markdown lines."""
    if not report["sizes"]:
        return None
    row = min(report["sizes"], key=lambda r: float(r["budget"]))
    routes = row["routes"]
    alone_key = next(
        (k for k in ("prune_distil/equal_tokens", "prune_distil/equal_cost") if k in routes), None
    )
    if "elastic" not in routes or alone_key is None:
        return None
    e, a = routes["elastic"], routes[alone_key]
    d_acc = 100 * (e["accuracy"]["mean"] - a["accuracy"]["mean"])
    d_loss = e["valid_loss"]["mean"] - a["valid_loss"]["mean"]
    paid = d_acc >= 0 and d_loss <= 0
    paired = a.get("vs_elastic")
    # a loss counts unless every gap is known to be within the paired sampling noise
    noisy = [_beyond_noise(paired, m) for m in ("accuracy", "valid_loss")]
    within_noise = not paid and all(n is False for n in noisy)
    lines = [
        f"Budget {row['budget']}: the elastic model (one run of {e['tokens']:,} tokens for every "
        f"size) vs the same architecture pruned from the teacher and distilled alone "
        f"({alone_key.split('/')[1].replace('_', ' ')}: {a['tokens']:,} tokens, seeds "
        f"{a['seeds']}):",
        "",
        "| model | valid loss | accuracy |",
        "|---|---|---|",
        f"| elastic | {_pm(e['valid_loss'], 1, 4)} | {_pm(e['accuracy'], 100, 1)}% |",
        f"| distilled alone | {_pm(a['valid_loss'], 1, 4)} | {_pm(a['accuracy'], 100, 1)}% |",
    ]
    if "zero_shot" in routes:
        z = routes["zero_shot"]
        lines.append(
            f"| zero-shot prune (floor) | {_pm(z['valid_loss'], 1, 4)} | "
            f"{_pm(z['accuracy'], 100, 1)}% |"
        )
    if paid:
        verdict = "the method paid: the elastic model is at least as good"
    elif within_noise:
        verdict = (
            "the elastic model is behind, but within the sampling noise of this evaluation "
            f"(each gap under {NOISE_SE:g} paired standard errors)"
        )
    else:
        verdict = "the elastic model loses here"
    errors = ""
    if paired is not None:
        errors = (
            f" (paired standard errors ±{100 * paired['accuracy']['se']:.1f} points over "
            f"{paired['accuracy']['items']} problems, ±{paired['valid_loss']['se']:.4f} over "
            f"{paired['valid_loss']['items']} validation windows)"
        )
    lines += [
        "",
        f"Elastic minus alone: {d_acc:+.1f} accuracy points, {d_loss:+.4f} validation loss"
        f"{errors}: **{verdict}**.",
    ]
    if report["settings"]["scale"] != 1.0:
        lines.append(f"(Distilled alone at {report['settings']['scale']:g}x its token budget.)")
    return {
        "budget": row["budget"],
        "route": alone_key,
        "elastic": {"valid_loss": e["valid_loss"]["mean"], "accuracy": e["accuracy"]["mean"]},
        "alone": {
            "valid_loss": a["valid_loss"]["mean"],
            "accuracy": a["accuracy"]["mean"],
            "tokens": a["tokens"],
        },
        "paid": paid,
        "within_noise": within_noise,
        "paired_standard_error": None
        if paired is None
        else {m: paired[m]["se"] for m in ("accuracy", "valid_loss")},
        "checkpoint": report["settings"].get("elastic_checkpoint"),
        "markdown": lines,
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _costs(records: list[dict[str, Any]], elastic_run: dict[str, Any], num_sizes: int):
    """Tokens, training FLOPs and step time to obtain the compared sizes by each route (one
    seed each), and their ratio to the one elastic run that made all ``num_sizes`` sizes
    (> 1: the route costs more). FLOPs are the load-independent measure (the paper's cost
    ratios are in GPU hours, i.e. FLOPs at a fixed utilisation); step time is as measured."""
    e_tokens, e_tflop, e_s = (
        elastic_run["tokens"],
        elastic_run.get("tflop"),
        elastic_run.get("seconds"),
    )
    out: dict[str, dict[str, Any]] = {
        "elastic": {
            "sizes": num_sizes,
            "tokens": e_tokens,
            "tflop": e_tflop,
            "seconds": e_s,
            "token_ratio": 1.0,
            "flop_ratio": 1.0 if e_tflop else None,
            "time_ratio": 1.0 if e_s else None,
        }
    }
    trained = [r for r in records if r.get("token_budget") is not None]
    for key in dict.fromkeys(route_key(r) for r in trained):
        per_size: dict[str, list[dict[str, Any]]] = {}
        for r in trained:
            if route_key(r) == key:
                per_size.setdefault(r["label"], []).append(r)
        tokens = sum(rs[0]["tokens"] for rs in per_size.values())
        tflop = sum(statistics.fmean(r.get("tflop") or 0.0 for r in rs) for rs in per_size.values())
        seconds = sum(
            statistics.fmean(r.get("seconds") or 0.0 for r in rs) for rs in per_size.values()
        )
        out[key] = {
            "sizes": len(per_size),
            "tokens": tokens,
            "tflop": tflop,
            "seconds": seconds,
            "token_ratio": tokens / e_tokens,
            "flop_ratio": _ratio(tflop, e_tflop),
            "time_ratio": _ratio(seconds, e_s),
        }
    if any(r["route"] == "zero_shot" for r in records):
        out["zero_shot"] = {
            "sizes": len({r["label"] for r in records}),
            "tokens": 0,
            "tflop": 0.0,
            "seconds": 0.0,
            "token_ratio": 0.0,
            "flop_ratio": 0.0,
            "time_ratio": 0.0,
        }
    return out


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _pm(spread: dict[str, Any], scale: float, digits: int) -> str:
    mean = f"{scale * spread['mean']:.{digits}f}"
    if len(spread["values"]) < 2:
        return mean
    return f"{mean} ± {scale * spread['std']:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    s, e = report["settings"], report["elastic_run"]
    lines = [
        "# Does the method pay? One elastic run vs. making each size separately",
        "",
        f"Task `{s['task']}`: {s['problems']} held-out problems (accuracy) and "
        f"{s['eval_sequences']} validation sequences of {s['seq_length']} tokens (loss), the "
        f"same for every model. Elastic run: {e['iterations']} iterations, {e['tokens']:,} "
        f"tokens, {_num(e.get('tflop'), 3)} TFLOP, {_num(e.get('seconds'), 0)} s of training "
        f"steps. Separate routes: the importance-ordered teacher "
        f"cut to each budget's architecture, then distilled from the teacher alone "
        f"(`elastic-train` with that one architecture), or the same architecture trained "
        f"from scratch (`train`), for "
        + " or ".join(
            f"`{b}` = {t:,} tokens per size ({TOKEN_BUDGET_WORDS[b].format(n=s['num_sizes'])})"
            for b, t in s["token_budgets"].items()
        )
        + f"; seeds {s['seeds']} (mean ± standard deviation).",
    ]
    if s["scale"] != 1.0:
        lines += [
            "",
            f"**Reduced run: separate routes trained at {s['scale']:g}x the token budgets "
            "above** (the elastic run is the full one); the separate routes would do better "
            "at full scale.",
        ]
    lines += [
        "",
        "## Per size",
        "",
        "| budget | params (total / active) | route | valid loss | accuracy | tokens | "
        "train TFLOP | train time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["sizes"]:
        p = row["params"] or {"total": 0, "active": 0}
        for key, r in row["routes"].items():
            lines.append(
                f"| {row['budget']} | {p['total']:,} / {p['active']:,} | {key} | "
                f"{_pm(r['valid_loss'], 1, 4)} | {_pm(r['accuracy'], 100, 1)}% | "
                f"{r['tokens']:,} | {_num(r.get('tflop'), 3)} | {_num(r.get('seconds'), 0)} |"
            )
    lines += [
        "",
        "## Cost of obtaining the sizes",
        "",
        "The elastic run made every size at once; a separate route pays for each compared size "
        "(one seed each). Time is the training steps' own time as measured (machine load "
        "differs between runs); FLOPs (the plugin's model FLOP count, teacher forward passes "
        "included) do not depend on it.",
        "",
        "| route | sizes | tokens | train TFLOP | train time (s) | tokens / elastic | "
        "FLOPs / elastic | time / elastic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, c in report["cost"].items():
        lines.append(
            f"| {key} | {c['sizes']} | {c['tokens']:,} | {_num(c.get('tflop'), 3)} | "
            f"{_num(c.get('seconds'), 0)} | {_x(c['token_ratio'])} | {_x(c.get('flop_ratio'))} | "
            f"{_x(c.get('time_ratio'))} |"
        )
    lines += ["", "## Where the elastic run loses", ""]
    lines += [f"- {line}" for line in report["elastic_loses"]] or [
        "- nowhere: no separate route beats the elastic model of any size on mean accuracy "
        "or validation loss"
    ]
    lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in report.get("plots", [])], ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Accuracy and validation loss vs active parameters, one line per route (error bars: seed
    spread; routes nudged apart along x so equal points stay visible). The loss panel still
    separates the routes where every model's accuracy is 0."""
    from elastic_plugin.evaluation.plots import finish_figure, pyplot

    plt = pyplot()
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    keys = list(dict.fromkeys(k for row in report["sizes"] for k in row["routes"]))
    for i, key in enumerate(keys):
        rows = sorted(
            (row for row in report["sizes"] if key in row["routes"] and row["params"]),
            key=lambda row: row["params"]["active"],
        )
        x = [row["params"]["active"] * (1 + 0.006 * (i - len(keys) / 2)) for row in rows]
        style = {
            "marker": "o" if key == "elastic" else ".",
            "linewidth": 2.5 if key == "elastic" else 1.2,
            "capsize": 3,
            "label": key,
        }
        for ax, metric, scale in ((acc_ax, "accuracy", 100), (loss_ax, "valid_loss", 1)):
            values = [row["routes"][key][metric] for row in rows]
            ax.errorbar(
                x,
                [scale * v["mean"] for v in values],
                yerr=[scale * v["std"] for v in values],
                **style,
            )
    acc_ax.set_xlabel("active parameters")
    acc_ax.set_ylabel("accuracy (%)")
    acc_ax.set_title("held-out accuracy")
    return finish_figure(
        fig,
        loss_ax,
        path,
        "active parameters",
        "validation loss",
        f"Elastic vs separate routes on {report['settings']['task']}",
        legend_size=8,
    )
