"""Importance: (1) collection cost vs a plain forward pass over the same data; (2) quality:
zero-shot pruning of the trained demo teacher to 50% on each axis with our default and the
published statistic vs random orders (mean of 3) vs weight magnitude, judged by validation loss
(lower is better). ``bench_importance_ablation`` adds every statistic, 5 seeds and recovery.

(2) needs a trained checkpoint: ``demo_out/checkpoints/teacher`` (``make demo``) or
``ELASTIC_PLUGIN_BENCH_CKPT=DIR``; without one only (1) runs, on a randomly initialized model.
"""

from __future__ import annotations

import os
from pathlib import Path

EVAL_BATCHES = 8
CALIBRATION_SAMPLES = 256


def _setup():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout())


def _checkpoint() -> Path | None:
    path = Path(os.environ.get("ELASTIC_PLUGIN_BENCH_CKPT", "demo_out/checkpoints/teacher"))
    has_history = (path / "latest_checkpointed_iteration.txt").is_file()
    return path if has_history or (path / "elastic_meta.json").is_file() else None


def _data(meta, cfg, split: str, samples: int):
    from elastic_plugin.data.indexed import batch_iterator, build_gpt_datasets
    from elastic_plugin.data.prepare import PreparedData

    prepared = PreparedData.load(meta["data"]["prepared"])
    prefix = prepared.train_prefix if split == "train" else prepared.valid_prefix
    ds = build_gpt_datasets(
        prepared.load_tokenizer(),
        cfg.training.seq_length,
        train_data_path=prefix,
        num_samples=(samples, None, None),
        seed=cfg.training.seed,
    ).train
    mbs = cfg.training.micro_batch_size
    return [b for _, b in zip(range(samples // mbs), batch_iterator(ds, mbs, shuffle=False))]


def _eval(model, batches, cfg) -> float:
    from elastic_plugin.training.step import eval_step

    return eval_step(
        [model], iter(batches), len(batches), cfg.training.seq_length, cfg.training.micro_batch_size
    )


def _collection_cost(model, batches, cfg) -> dict:
    from _timing import interleaved_medians

    from elastic_plugin.importance import collect_importance
    from elastic_plugin.training.step import eval_step

    n = len(batches) * cfg.training.micro_batch_size
    t = interleaved_medians(
        {
            "forward": lambda: eval_step(
                [model],
                iter(batches),
                len(batches),
                cfg.training.seq_length,
                cfg.training.micro_batch_size,
            ),
            "importance": lambda: collect_importance(
                [model],
                iter(batches),
                n,
                cfg.training.seq_length,
                cfg.training.micro_batch_size,
                progress=False,
            ),
        },
        reps=3,
        warmup=1,
    )
    return {
        "name": f"importance collection vs forward ({n} samples)",
        "forward_ms": round(t["forward"] * 1e3, 1),
        "importance_ms": round(t["importance"] * 1e3, 1),
        "importance/forward": round(t["importance"] / t["forward"], 3),
    }


def run(device: str | None = None) -> list[dict]:
    if device not in (None, "cpu"):
        return []
    _setup()
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.importance import collect_importance
    from elastic_plugin.importance.ablation import AblationSettings, run_axis
    from elastic_plugin.importance.methods import DEFAULTS, PUBLISHED
    from elastic_plugin.importance.prune import PRUNABLE
    from elastic_plugin.parallel import Layout

    ckpt = _checkpoint()
    if ckpt is None:
        return [{"name": "importance quality: no trained checkpoint (run `make demo`); skipped"}]
    (model,), cfg, meta = build_from_checkpoint(ckpt, Layout())
    calib = _data(meta, cfg, "train", CALIBRATION_SAMPLES)
    valid = _data(meta, cfg, "valid", EVAL_BATCHES * cfg.training.micro_batch_size)
    rows = [_collection_cost(model, calib[:8], cfg)]
    scores = collect_importance(
        [model],
        iter(calib),
        CALIBRATION_SAMPLES,
        cfg.training.seq_length,
        cfg.training.micro_batch_size,
        progress=False,
    )
    unpruned = _eval(model, valid, cfg)
    m = cfg.model
    settings = AblationSettings(seeds=3, recovery_steps=0)
    for axis in PRUNABLE:
        res = run_axis(
            model,
            scores,
            axis,
            m.query_groups,
            m.mamba_num_groups,
            lambda model_: _eval(model_, valid, cfg),
            [],
            settings,
        )
        if res is None:
            continue
        losses = {k: v["zero_shot"]["mean"] for k, v in res.summary()["methods"].items()}
        ours = losses[DEFAULTS[axis]]
        rows.append(
            {
                "name": f"prune {axis} to {settings.keep:.0%} [valid loss]",
                "unpruned": round(unpruned, 4),
                "default": round(ours, 4),
                "published": round(losses[PUBLISHED[axis]], 4),
                "random_mean": round(losses["random"], 4),
                "magnitude": round(losses["magnitude"], 4),
                "default_best": ours <= min(losses["random"], losses["magnitude"]),
            }
        )
    return rows
