"""Importance ablation: every width axis of a trained checkpoint pruned to 50% by each of our
statistics, by weight magnitude and by ``--seeds`` random orders; validation loss zero-shot and
after ``--steps`` LM steps of recovery at equal tokens for every order (lower is better). Also
the calibration-size diagnostic: how many kept units each statistic's order at 1/4 of the
calibration samples shares with the order at all of them, and that order's zero-shot loss.

    python bench/bench_importance_ablation.py --ckpt demo_out/checkpoints/teacher --out DIR

Writes DIR/ablation.json, DIR/ablation.md (axis x order table) and DIR/ablation.png. Under
``run_all`` it runs on ``ELASTIC_PLUGIN_BENCH_CKPT`` (default ``demo_out/checkpoints/teacher``)
with fewer seeds and steps, and is skipped without a trained checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from elastic_plugin.importance.prune import PRUNABLE

CALIBRATION_SAMPLES = 256


def ablation(
    ckpt: Path,
    out: Path | None,
    axes: list[str],
    seeds: int,
    steps: int,
    calibration: int = CALIBRATION_SAMPLES,
    eval_batches: int = 8,
    verbose: bool = True,
    lr: float | None = None,
) -> dict:
    from bench_importance import _data, _eval, _setup

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.importance import collect_importance
    from elastic_plugin.importance.ablation import (
        AblationSettings,
        head_groups,
        kept_overlap,
        markdown_table,
        plot_results,
        run_axis,
    )
    from elastic_plugin.importance.methods import STATISTICS
    from elastic_plugin.importance.prune import importance_orders, mask_prune
    from elastic_plugin.parallel import Layout

    _setup()
    (model,), cfg, meta = build_from_checkpoint(ckpt, Layout())
    mbs, seq = cfg.training.micro_batch_size, cfg.training.seq_length
    calib = _data(meta, cfg, "train", calibration)
    valid = _data(meta, cfg, "valid", eval_batches * mbs)
    # recovery reads training batches the calibration did not (same ones for every order)
    train = _data(meta, cfg, "train", calibration + steps * mbs)[len(calib) :]
    m = cfg.model

    def collect(batches):
        return collect_importance(
            [model], iter(batches), len(batches) * mbs, seq, mbs, progress=False
        )

    started = time.perf_counter()
    scores = collect(calib)
    scores_small = collect(calib[: max(1, len(calib) // 4)])
    unpruned = _eval(model, valid, cfg)
    settings = AblationSettings(seeds=seeds, recovery_steps=steps)
    if lr is not None:
        settings.recovery_lr = lr
    log = (lambda text: print(text, file=sys.stderr, flush=True)) if verbose else None
    results, calibration_rows = [], []
    for axis in axes:
        res = run_axis(
            model,
            scores,
            axis,
            m.query_groups,
            m.mamba_num_groups,
            lambda model_: _eval(model_, valid, cfg),
            train,
            settings,
            progress=log,
        )
        if res is None:
            continue
        results.append(res.summary())
        base = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        for statistic in STATISTICS[axis]:
            args = (axis, m.query_groups, m.mamba_num_groups)
            full = importance_orders(scores, *args, statistic=statistic)
            small = importance_orders(scores_small, *args, statistic=statistic)
            model.load_state_dict(base, strict=False)
            mask_prune(model, axis, small, settings.keep)
            calibration_rows.append(
                {
                    "axis": axis,
                    "statistic": statistic,
                    "kept_overlap": round(
                        kept_overlap(small, full, settings.keep, head_groups(axis, *args[1:])), 4
                    ),
                    "zero_shot_small": round(_eval(model, valid, cfg), 4),
                    "zero_shot_full": round(res.zero_shot[statistic], 4),
                }
            )
        model.load_state_dict(base, strict=False)
    report = {
        "ckpt": str(ckpt),
        "unpruned": unpruned,
        "keep": settings.keep,
        "seeds": seeds,
        "recovery_steps": steps,
        "recovery_lr": settings.recovery_lr,
        "recovery_tokens": steps * mbs * seq,
        "calibration_samples": calibration,
        "calibration_small": len(calib[: max(1, len(calib) // 4)]) * mbs,
        "results": results,
        "calibration": calibration_rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ablation.json").write_text(json.dumps(report, indent=1))
        title = (
            f"{ckpt.name}: prune to {settings.keep:.0%} (unpruned {unpruned:.4f}); recovery "
            f"{steps} steps = {report['recovery_tokens']} tokens; random: {seeds} seeds"
        )
        table = markdown_table(results, title)
        calib_lines = [
            "",
            f"Calibration size: order from {report['calibration_small']} vs {calibration} samples",
            "",
            "| axis | statistic | kept units shared | zero-shot (small) | zero-shot (full) |",
            "|---|---|---|---|---|",
        ] + [
            f"| {r['axis']} | {r['statistic']} | {r['kept_overlap']:.2f} | "
            f"{r['zero_shot_small']:.4f} | {r['zero_shot_full']:.4f} |"
            for r in calibration_rows
        ]
        (out / "ablation.md").write_text(table + "\n".join(calib_lines) + "\n")
        plot_results(results, out / "ablation.png", title)
    return report


def run(device: str | None = None) -> list[dict]:
    """Under run_all: the demo teacher, 3 seeds, 8 recovery steps; one row per axis."""
    if device not in (None, "cpu"):
        return []
    from bench_importance import _checkpoint

    ckpt = _checkpoint()
    if ckpt is None:
        return [{"name": "importance ablation: no trained checkpoint (run `make demo`); skipped"}]
    report = ablation(ckpt, None, list(PRUNABLE), seeds=3, steps=8, verbose=False)
    rows = []
    for res in report["results"]:
        row: dict = {"name": f"ablation {res['axis']} [valid loss, 50%, zero-shot/recovered]"}
        for name, entry in res["methods"].items():
            row[f"{name}_zs"] = round(entry["zero_shot"]["mean"], 4)
            if "recovered" in entry:
                row[f"{name}_rec"] = round(entry["recovered"]["mean"], 4)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--axes", nargs="+", default=list(PRUNABLE), choices=list(PRUNABLE))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="recovery LM steps (0: none)")
    parser.add_argument("--calibration", type=int, default=CALIBRATION_SAMPLES)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None, help="recovery AdamW learning rate")
    args = parser.parse_args()
    if args.seeds < 2 or args.steps < 0:
        parser.error("--seeds must be >= 2 (a spread needs two) and --steps >= 0")
    report = ablation(
        args.ckpt,
        args.out,
        args.axes,
        args.seeds,
        args.steps,
        args.calibration,
        args.eval_batches,
        lr=args.lr,
    )
    print((args.out / "ablation.md").read_text())
    print(f"{report['seconds']} s -> {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
