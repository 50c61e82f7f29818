"""The demo's last stage: accuracy per nested model and precision, and budget control, measured.

``evaluate_demo`` loads every trained budget of the elastic checkpoint (and, with an export
directory, every HF export in BF16 / FP8 / NVFP4), answers the held-out problems with each, and
runs the budget-control settings: the full model thinking freely (the reference), elastic budget
control (think small, answer with a larger nested model) and standard budget control (the full
model with its thinking capped). It writes ``report.json`` (schema: docs/demo.md, "report.json"),
``report.md`` and three plots, and checks the issue's targets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import run_dir
from elastic_plugin.checkpoint.meta import (
    budget_label,
    read_checkpoint_meta,
    read_elastic_meta,
    stored_choices,
    trained_budgets,
)
from elastic_plugin.models.config import ConfigError

__all__ = ["evaluate_demo", "REPORT_JSON", "REPORT_MD", "TARGETS"]

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
HELDOUT_FILE = "heldout.jsonl"  # = data.prepare.HELDOUT_FILE (that module imports Megatron)
PRECISIONS = ("bf16", "fp8", "nvfp4")
CAP_FRACTIONS = (0.25, 0.5, 0.75)  # standard budget control: caps as fractions of the full
#                                     model's mean thinking length
TARGETS = {"speedup": 1.5, "accuracy_drop_points": 2.0, "retention": 0.9}
COMPARE_JSON = Path("compare") / "compare.json"  # `elastic-plugin compare --out OUT/compare`


def _valid_losses(ckpt: Path) -> dict[str, float]:
    """The elastic run's last validation loss per budget (its metrics file next to the run)."""
    metrics = run_dir(ckpt) / "elastic_metrics.jsonl"
    last: dict[str, float] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            last.update(record.get("valid_loss") or {})
    return last


def _check_inputs(
    ckpt: Path,
    exports: Path | None,
    out: Path,
    num_problems: int,
    batch_size: int,
    latency_problems: int,
) -> dict[str, Any]:
    meta = read_elastic_meta(ckpt)
    for flag, value, low in (
        ("--num-problems", num_problems, 1),
        ("--batch-size", batch_size, 1),
        ("--latency-problems", latency_problems, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{flag}={value!r}: must be an int >= {low}")
    if _prepared_dir(meta) is None:
        raise ConfigError(
            f"--ckpt {ckpt}: its data ({meta.get('data')}) is not a prepared task "
            f"directory here; evaluation needs the task's held-out problems (on your own data: "
            f"--data-path PREFIX --tokenizer FILE measures held-out loss per budget)"
        )
    if exports is not None and not (exports / "exports.json").is_file():
        raise ConfigError(
            f"--exports {exports}: no exports.json (run `elastic-plugin export` first)"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    return meta


def _prepared_dir(meta: dict[str, Any]) -> str | None:
    """The prepared task directory the checkpoint was trained on: recorded as such, or the
    folder of its data prefix (elastic-train records the teacher's prepared data by prefix)."""
    data = meta.get("data") or {}
    candidates = [data.get("prepared")] + [
        str(Path(p).parent) for p in (data.get("valid_data_path"), data.get("data_path")) if p
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / HELDOUT_FILE).is_file():
            return candidate
    return None


def _settings(budgets: Sequence[float], mean_think: float) -> list:
    from elastic_plugin.evaluation.settings import Setting

    full = max(budgets)
    out = []
    for answer in sorted(budgets, reverse=True):
        for think in sorted(budgets, reverse=True):
            if think < answer:
                out.append(
                    Setting(
                        f"think {budget_label(think)} -> answer {budget_label(answer)}",
                        think,
                        answer,
                    )
                )
    caps = sorted({max(1, round(f * mean_think)) for f in CAP_FRACTIONS})
    out += [Setting(f"full, thinking capped at {cap}", full, full, cap=cap) for cap in caps]
    return out


def evaluate_demo(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    exports_dir: str | Path | None = None,
    num_problems: int = 200,
    batch_size: int = 50,
    latency_problems: int = 32,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the evaluation (see the module docstring); returns the report dict."""
    import torch

    from elastic_plugin.evaluation.models import load_budget_models, load_export_model
    from elastic_plugin.evaluation.plots import draw_report_plots
    from elastic_plugin.evaluation.problems import load_problems
    from elastic_plugin.evaluation.settings import Setting, interleaved_latencies, run_setting

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    exports = Path(exports_dir) if exports_dir is not None else None
    meta = _check_inputs(ckpt, exports, out, num_problems, batch_size, latency_problems)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny decode steps are dispatch-bound; 1 thread avoids spin stalls
    try:
        budgets = sorted(trained_budgets(meta), reverse=True)
        prepared = _prepared_dir(meta)
        assert prepared is not None  # _check_inputs found it
        problems = load_problems(prepared, num_problems)
        models = load_budget_models(ckpt, budgets)
        export_rows = (
            json.loads((exports / "exports.json").read_text())["exports"] if exports else []
        )
        for row in export_rows:
            if row["precision"] in PRECISIONS:
                models[(row["budget"], row["precision"])], _ = load_export_model(row["path"])

        def log(message: str) -> None:
            if progress:
                print(f"[evaluate {time.time() - started:6.1f}s] {message}", flush=True)

        per_model, singles = {}, []
        for budget, precision in sorted(models, key=lambda k: (-k[0], k[1])):
            setting = Setting(
                f"budget {budget_label(budget)} ({precision})", budget, budget, precision=precision
            )
            result = run_setting(setting, models, problems, batch_size, 0)
            per_model[(budget, precision)] = result
            singles += [setting] if precision == "fp32" else []
            log(
                f"{setting.name}: accuracy {result['accuracy']:.3f}, thinking "
                f"{result['think_tokens_mean']:.1f} tokens"
            )
        full = max(budgets)
        reference = per_model[(full, "fp32")]
        control, settings = [reference], _settings(budgets, reference["think_tokens_mean"])
        for setting in settings:
            result = run_setting(setting, models, problems, batch_size, 0)
            control.append(result)
            log(f"{setting.name}: accuracy {result['accuracy']:.3f}")
        log(
            f"latency at batch 1: {len(singles + settings)} settings interleaved over "
            f"{min(latency_problems, len(problems))} problems"
        )
        latency = interleaved_latencies(singles + settings, models, problems, latency_problems)
        for result in [*per_model.values(), *control[1:]]:
            result.update(latency.get(result["name"], {}))
        control[0] = reference | {"name": f"full ({budget_label(full)}) thinking freely"}
        for result in control[1:]:
            log(
                f"{result['name']}: latency {result.get('latency_ms_batch1') or float('nan'):.1f} "
                f"ms at batch 1 (full model thinking: "
                f"{reference.get('latency_ms_batch1') or float('nan'):.1f} ms)"
            )
    finally:
        torch.set_num_threads(threads)

    report = _assemble(
        ckpt, meta, budgets, problems, per_model, control, export_rows, _valid_losses(ckpt)
    )
    report["plots"] = [str(p) for p in draw_report_plots(report, ckpt, out)]
    report["comparison"] = _comparison(out / COMPARE_JSON, ckpt)
    report["machine_use"] = training_machine_use(ckpt)
    report["seconds"] = round(time.time() - started, 1)
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_MD).write_text(markdown(report))
    return report


def _assemble(
    ckpt: Path,
    meta: dict[str, Any],
    budgets: list[float],
    problems,
    per_model: dict,
    control: list[dict],
    export_rows: list[dict],
    valid: dict[str, float],
) -> dict[str, Any]:
    from elastic_plugin.evaluation.models import budget_params

    params = budget_params(ckpt, meta, budgets)
    rows = []
    for budget in budgets:
        fp32 = per_model[(budget, "fp32")]
        row = {
            "budget": budget,
            "params": params[budget_label(budget)],
            "choice": stored_choices(meta).get(budget_label(budget)),
            "valid_loss": valid.get(budget_label(budget)),
            "accuracy": {
                p: per_model[(budget, p)]["accuracy"]
                for p in ("fp32", *PRECISIONS)
                if (budget, p) in per_model
            },
            "think_tokens_mean": fp32["think_tokens_mean"],
            "latency_ms_batch1": fp32["latency_ms_batch1"],
            "latency_ms_batched": fp32["latency_ms_batched"],
            "export": {
                r["precision"]: {"bytes": r["bytes"], "valid_loss": r.get("valid_loss")}
                for r in export_rows
                if r["budget"] == budget
            },
        }
        rows.append(row)
    return {
        "task": problems.examples[0].task,
        "problems": len(problems),
        "checkpoint": str(ckpt),
        "teacher_valid_loss": meta.get("teacher_valid_loss"),
        "budgets": rows,
        "budget_control": [_strip(c) for c in control],
        "targets": _targets(rows, control),
    }


TRAINING_METRICS = (
    ("train (teacher)", "teacher_metrics.jsonl"),
    ("elastic-train", "elastic_metrics.jsonl"),
)


def training_machine_use(ckpt: Path) -> dict[str, Any] | None:
    """How much of the machine the demo's training stages used: their tokens/s and model GFLOP/s
    (from the throughput their metrics log, ``OUT/*_metrics.jsonl`` beside ``OUT/checkpoints``)
    against the FP32 / BF16 GEMM peak measured here, in the dtype each checkpoint records."""
    from elastic_plugin.compat.host import (
        gemm_peak_gflops,
        machine_use,
        throughput_totals,
        tune_host,
    )

    root = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    stages, peaks = [], {}
    for stage, name in TRAINING_METRICS:
        path = root / name
        if not path.is_file():
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        totals = throughput_totals(records)
        if totals is None:
            continue
        dtype = _trained_dtype(root, name)
        if dtype not in peaks:
            peaks[dtype] = gemm_peak_gflops(dtype)
        use = machine_use(totals["tokens"], totals["model_flops_per_rank"], totals["seconds"],
                          peaks[dtype])  # fmt: skip
        stages.append({"stage": stage, "dtype": dtype, "tokens": int(totals["tokens"]),
                       "seconds": round(totals["seconds"], 1), **use})  # fmt: skip
    if not stages:
        return None
    host = tune_host()
    return {"cpu": host.cpu.describe(), "threads": host.threads,
            "peak_gflops": {k: round(v, 1) for k, v in peaks.items() if v}, "stages": stages}  # fmt: skip


def _trained_dtype(root: Path, metrics_name: str) -> str:
    """The parameters' dtype the stage's checkpoint records (FP32 if it says nothing)."""
    stage = "teacher" if metrics_name.startswith("teacher") else "elastic"
    try:
        meta = read_checkpoint_meta(root / "checkpoints" / stage)
    except ConfigError:  # no checkpoint there: the metrics alone
        return "float32"
    return str(meta.get("params_dtype", "float32"))


def _comparison(path: Path, ckpt: Path) -> dict[str, Any] | None:
    """The short form of `compare`'s report (its ``headline``) when it measured this checkpoint:
    the smallest nested model against the same architecture distilled alone."""
    if not path.is_file():
        return None
    head = json.loads(path.read_text()).get("headline")
    if not head or Path(head.get("checkpoint") or "").resolve() != ckpt.resolve():
        return None
    return head


def _strip(result: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "name",
        "kind",
        "think",
        "answer",
        "cap",
        "precision",
        "accuracy",
        "think_tokens_mean",
        "answer_tokens_mean",
        "prompt_tokens_mean",
        "latency_ms_batch1",
        "latency_ms_batch1_mean",
        "latency_ms_batched",
        "examples",
    )
    return {k: result.get(k) for k in keep}


def _targets(rows: list[dict], control: list[dict]) -> dict[str, Any]:
    """The issue's targets: think 0.4 -> answer 1.0 vs the full model thinking (batch-1
    latency >= 1.5x lower at <= 2 points lower accuracy); 0.77 keeps >= 90% of the full
    model's accuracy; the smallest budget's recovery, reported as it is."""
    full, smallest = rows[0], rows[-1]
    reference = control[0]
    out: dict[str, Any] = {}
    elastic = [
        c
        for c in control
        if c["kind"] == "elastic"
        and c["answer"] == full["budget"]
        and c["think"] == smallest["budget"]
    ]
    if elastic:
        e = elastic[0]
        measured = reference.get("latency_ms_batch1") and e.get("latency_ms_batch1")
        speedup = reference["latency_ms_batch1"] / e["latency_ms_batch1"] if measured else None
        drop = 100 * (reference["accuracy"] - e["accuracy"])
        ratio = smallest["params"]["active"] / full["params"]["active"]
        think, answer = e["think_tokens_mean"], e["answer_tokens_mean"]
        out["budget_control"] = {
            "setting": e["name"],
            "speedup_batch1": speedup,
            "speedup_batched": reference["latency_ms_batched"] / e["latency_ms_batched"],
            # not measured: what the same tokens would give if a decode step cost time in
            # proportion to active parameters and the re-prefill were free (a ceiling)
            "speedup_if_step_time_tracked_active_params": (think + answer)
            / (think * ratio + answer),
            "arithmetic_ratio": _arithmetic_ratio(reference, e, ratio),
            "accuracy_drop_points": drop,
            "target": f">= {TARGETS['speedup']}x lower latency at <= "
            f"{TARGETS['accuracy_drop_points']} points lower accuracy",
            "met": (
                speedup is not None
                and speedup >= TARGETS["speedup"]
                and drop <= TARGETS["accuracy_drop_points"]
            ),
        }
    for row in rows[1:]:
        retention = (
            row["accuracy"]["fp32"] / full["accuracy"]["fp32"] if full["accuracy"]["fp32"] else None
        )
        entry = {
            "retention": retention,
            "accuracy": row["accuracy"]["fp32"],
            "full_accuracy": full["accuracy"]["fp32"],
        }
        if abs(row["budget"] - 0.77) < 1e-9:
            entry |= {
                "target": f">= {TARGETS['retention']:.0%} of the full model's accuracy",
                "met": retention is not None and retention >= TARGETS["retention"],
            }
        out[f"retention_{budget_label(row['budget'])}"] = entry
    return out


def _arithmetic_ratio(reference: dict, elastic: dict, active_ratio: float) -> float | None:
    """``inference.arithmetic_ratio`` of the measured token counts (None: no prompt length)."""
    from elastic_plugin.inference.budget_control import arithmetic_ratio

    prompt = reference.get("prompt_tokens_mean")
    if prompt is None:
        return None
    return arithmetic_ratio(
        prompt,
        elastic["think_tokens_mean"],
        elastic["answer_tokens_mean"],
        active_ratio,
        reference["think_tokens_mean"],
        reference["answer_tokens_mean"],
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Elastic nested models on `{report['task']}`",
        "",
        f"{report['problems']} held-out problems, scored by reasoning-gym; teacher "
        f"validation loss {report['teacher_valid_loss']}.",
        "",
        "## Nested models",
        "",
        "| budget | params (total / active) | valid loss | accuracy fp32 | bf16 | fp8 | nvfp4 "
        "| thinking tokens | latency batch 1 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["budgets"]:
        acc = r["accuracy"]
        cell = lambda p: f"{100 * acc[p]:.1f}%" if p in acc else "-"  # noqa: E731
        loss = f"{r['valid_loss']:.4f}" if r["valid_loss"] is not None else "-"
        lines.append(
            f"| {budget_label(r['budget'])} | {r['params']['total']:,} / "
            f"{r['params']['active']:,} | {loss} | {cell('fp32')} | {cell('bf16')} | "
            f"{cell('fp8')} | {cell('nvfp4')} | {r['think_tokens_mean']:.1f} | "
            f"{_ms(r['latency_ms_batch1'])} |"
        )
    lines += [
        "",
        "## Budget control",
        "",
        "| setting | accuracy | thinking tokens | answer tokens | latency batch 1 (ms) | "
        "latency batched (ms/problem) |",
        "|---|---|---|---|---|---|",
    ]
    for c in report["budget_control"]:
        lines.append(
            f"| {c['name']} | {100 * c['accuracy']:.1f}% | {c['think_tokens_mean']:.1f} | "
            f"{c['answer_tokens_mean']:.1f} | {_ms(c['latency_ms_batch1'])} | "
            f"{c['latency_ms_batched']:.2f} |"
        )
    lines += ["", "## Targets", ""]
    for name, t in report["targets"].items():
        verdict = "" if "met" not in t else (" — **met**" if t["met"] else " — **missed**")
        body = ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in t.items()
            if k != "met"
        )
        lines.append(f"- {name}: {body}{verdict}")
    if report.get("comparison"):
        lines += ["", "## Does the method pay?", "", *report["comparison"]["markdown"]]
    use = report.get("machine_use")
    if use:
        peaks = ", ".join(f"{k} {v} GFLOP/s" for k, v in use["peak_gflops"].items())
        lines += [
            "", "## Machine use (training)", "",
            f"{use['cpu']}; {use['threads']} threads; GEMM peak measured here: {peaks}.", "",
            "| stage | dtype | tokens | steps' seconds | tokens/s | model GFLOP/s | % of peak |",
            "|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for st in use["stages"]:
            share = st["share_of_peak"]
            lines.append(
                f"| {st['stage']} | {st['dtype']} | {st['tokens']:,} | {st['seconds']} | "
                f"{st['tokens_per_s']} | {st['model_gflops']} | "
                f"{'-' if share is None else f'{100 * share:.1f}'} |"
            )
    lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in report.get("plots", [])], ""]
    return "\n".join(lines)
