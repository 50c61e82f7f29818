"""The last stage of ``make demo-real``: measure every model (``measure``) into ``report.json``,
then write ``report.md`` and the plots (``report``).

    python -m elastic_plugin.demo_real.evaluate --out OUT --hf-dir DIR --test-data PREFIX

``report.json`` keeps the per-window numbers each figure is computed from (``windows``), so the
printed figures can be recomputed from it (``report.recompute``; tested).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from elastic_plugin.demo_real import measure, method_report
from elastic_plugin.demo_real.alone import ALONE_FILE
from elastic_plugin.demo_real.report import build_report, plot, write_markdown
from elastic_plugin.demo_real.route_stage import ROUTES_DIR

PARENT = "parent"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    from elastic_plugin.checkpoint.meta import budget_label, read_elastic_meta, trained_budgets
    from elastic_plugin.export.tokens import token_windows

    hf_logging.disable_progress_bar()  # a bar per model load; our log lines say what loads
    out = Path(args.out)
    started = time.time()

    def log(message: str) -> None:
        print(f"[demo-real evaluate {time.time() - started:6.1f}s] {message}", flush=True)

    elastic = out / "checkpoints" / "elastic"
    meta = read_elastic_meta(elastic)
    budgets = sorted(trained_budgets(meta), reverse=True)
    tokens = token_windows(args.test_data, args.windows, args.seq_length, "--test-data")
    windows: dict[str, Any] = {}
    windows[PARENT] = measure.measure_hf_dir(Path(args.hf_dir), tokens, args.batch_size)
    log(f"parent (HF, fp32): {measure.summarize(windows[PARENT])}")
    orders = {
        name: out / "checkpoints" / ckpt
        for name, ckpt in (
            ("ours", "reordered"),
            ("magnitude", "reordered_magnitude"),
            ("random", "reordered_random"),
        )
        if (out / "checkpoints" / ckpt / "latest_checkpointed_iteration.txt").is_file()
    }
    mega = measure.measure_megatron(elastic, orders, budgets, tokens, args.batch_size, log)
    for label, stats in mega["elastic"].items():
        windows[f"elastic/fp32/{label}"] = stats
    for order, per_budget in mega["zero_shot"].items():
        for label, stats in per_budget.items():
            windows[f"zero_shot/{order}/{label}"] = stats
    alone_file = out / "alone" / ALONE_FILE
    alone = json.loads(alone_file.read_text()) if alone_file.is_file() else {"sizes": {}}
    for label, run in alone["sizes"].items():
        key = f"distil_alone/{label}"
        windows[key] = measure.measure_checkpoint(Path(run["checkpoint"]), run["budget"], tokens,
                                                  args.batch_size)  # fmt: skip
        log(f"{key} ({run['tokens']:,} tokens): {measure.summarize(windows[key])}")
    routes_dir = out / ROUTES_DIR
    costs = method_report.route_costs(routes_dir)
    minitron = json.loads((routes_dir / "minitron" / "route.json").read_text()) if (
        "minitron" in costs) else {"sizes": {}}  # fmt: skip
    for label, size in minitron["sizes"].items():
        if label == "1":  # the parent itself
            continue
        key = f"minitron/{label}"
        windows[key] = measure.measure_checkpoint(
            Path(size["checkpoint"]), size["architecture"]["source_fraction"], tokens,
            args.batch_size,
        )  # fmt: skip
        log(f"{key} ({size['architecture']['winner']}): {measure.summarize(windows[key])}")
    exports = json.loads((out / "exports" / "exports.json").read_text())["exports"]
    bf16_dirs: dict[str, Path] = {}
    for row in exports:
        if row["precision"] not in ("bf16", "fp8", "nvfp4"):
            continue
        label, key = budget_label(row["budget"]), f"elastic/{row['precision']}/"
        key += budget_label(row["budget"])
        windows[key] = measure.measure_hf_dir(Path(row["path"]), tokens, args.batch_size)
        log(f"export {key}: {measure.summarize(windows[key])}")
        if row["precision"] == "bf16":
            bf16_dirs[label] = Path(row["path"])
    prompts = list(measure.PROMPTS[: args.prompts])
    answers = {PARENT: measure.answer_prompts(Path(args.hf_dir), Path(args.hf_dir), prompts,
                                              args.answer_tokens)}  # fmt: skip
    for label, path in bf16_dirs.items():
        answers[label] = measure.answer_prompts(
            path, Path(args.hf_dir), prompts, args.answer_tokens
        )
    log("prompts answered")
    speed = {PARENT: measure.decode_speed(Path(args.hf_dir), (1, 4), args.decode_tokens)}
    for label, path in bf16_dirs.items():
        speed[label] = measure.decode_speed(path, (1, 4), args.decode_tokens)
    log(f"decode tokens/s: {speed}")
    control = measure.budget_control(
        Path(args.hf_dir),
        {label: path for label, path in bf16_dirs.items() if label != "1"},
        Path(args.hf_dir),
        measure.CHECKABLE[: args.control_questions],
        args.draft_tokens,
        args.answer_tokens,
    )
    log("budget control: " + ", ".join(
        f"{r['route']} {sum(r['correct'])}/{len(r['correct'])}" for r in control["routes"]))  # fmt: skip
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.models.counting import count_parameters

    parent_params = count_parameters(config_from_dict(meta["config"]).model).total
    report = build_report(
        windows=windows,
        params={PARENT: parent_params, **mega["params"]},
        choices=mega["choices"],
        budgets=[budget_label(b) for b in budgets],
        prompts=prompts,
        answers=answers,
        decode=speed,
        data={
            "test_data": args.test_data,
            "windows": int(tokens.shape[0]),
            "seq_length": args.seq_length,
            "tokens": int(tokens[:, 1:].numel()),
        },
        training=_training_summary(out, args),
        alone={k: v for k, v in alone.items() if k != "sizes"}
        | {
            "sizes": {
                label: {k: r[k] for k in ("iters", "tokens", "seconds")}
                for label, r in alone["sizes"].items()
            }
        },  # fmt: skip
        curve=_curve(out, meta, args.train_global_batch, args.train_seq_length),
        budget_control=control,
        route_costs=costs,
        screening=_screening(out),
        route_curves=method_report.route_curves(routes_dir, out / "elastic_metrics.jsonl"),
    )
    report["seconds"] = round(time.time() - started, 1)
    report["plots"] = [str(p) for p in plot(report, out)]
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "report.md")
    return report


def _screening(out: Path) -> dict[str, Any] | None:
    """The elastic run's zero-shot screening (``OUT/screening.json``): each budget's starting
    pick and the ablation rows (the full candidate table stays in the file)."""
    from elastic_plugin.elastic.screening import SCREENING_JSON

    path = out / SCREENING_JSON
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return {k: record[k] for k in ("choices", "ablation", "budget_metric", "tokens_per_candidate")}


def _curve(
    out: Path, meta: dict[str, Any], global_batch: int, seq_length: int
) -> dict[str, Any] | None:
    """The elastic run's validation LM loss per budget at every evaluation (its metrics file),
    against the training tokens seen by then (``comparison.plan.elastic_tokens`` of the batch
    the run trained with), and the parent's on the same validation batches
    (``teacher_valid_loss``)."""
    from elastic_plugin.checkpoint.meta import budget_label
    from elastic_plugin.comparison.plan import elastic_tokens

    metrics = out / "elastic_metrics.jsonl"
    parent = meta.get("teacher_valid_loss")
    if parent is None or not metrics.is_file():
        return None
    training = {"seq_length": seq_length, "global_batch_size": global_batch}
    config = {**meta["config"], "training": {**meta["config"]["training"], **training}}
    points: dict[str, list[list[float]]] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        valid = row.get("valid_loss")
        if not isinstance(valid, dict) or not isinstance(row.get("iteration"), int):
            continue
        tokens = elastic_tokens(config, row["iteration"])
        for label, loss in valid.items():
            if loss is not None:
                points.setdefault(budget_label(float(label)), []).append([tokens, float(loss)])
    return {"parent_loss": float(parent), "points": points} if points else None


def _training_summary(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Iterations the elastic run trained (its metrics file) and the tokens that makes
    (iterations x global batch x sequence length; the student sees each once, the teacher too)."""
    iters = 0
    metrics = out / "elastic_metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if isinstance(row.get("iteration"), int):
                iters = max(iters, row["iteration"])
    tokens_per_iter = args.train_global_batch * args.train_seq_length
    return {
        "iterations": iters,
        "global_batch": args.train_global_batch,
        "seq_length": args.train_seq_length,
        "tokens": iters * tokens_per_iter,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_plugin.demo_real.evaluate")
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-dir", required=True, help="the converted parent (HF directory)")
    parser.add_argument("--test-data", required=True, help="indexed prefix of the test split")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=len(measure.PROMPTS))
    parser.add_argument("--control-questions", type=int, default=len(measure.CHECKABLE))
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--train-global-batch", type=int, default=4)
    parser.add_argument("--train-seq-length", type=int, default=128)
    evaluate(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
