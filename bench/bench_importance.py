"""Importance: (1) collection cost vs a plain forward pass over the same data; (2) quality:
zero-shot pruning of the trained demo teacher to 50% on each axis with our order vs random
orders (mean of 3) vs weight magnitude, judged by validation loss (lower is better).

(2) needs a trained checkpoint: ``demo_out/checkpoints/teacher`` (``make demo``) or
``ELASTIC_PLUGIN_BENCH_CKPT=DIR``; without one only (1) runs, on a randomly initialized model.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

KEEP = 0.5
EVAL_BATCHES = 8
CALIBRATION_SAMPLES = 256
# (axis, Mamba statistic): the published x-projection definition, and out_proj's input
AXES = (
    ("embedding", None),
    ("ffn", None),
    ("shared_ffn", None),
    ("attention_heads", None),
    ("mamba_heads", "x_proj"),
    ("mamba_heads", "out_proj_input"),
    ("mamba_channels", "x_proj"),
    ("mamba_channels", "out_proj_input"),
    ("experts", None),
)


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
    from elastic_plugin.importance.prune import (
        importance_orders,
        magnitude_orders,
        mask_prune,
        random_orders,
    )
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
    base = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    unpruned = _eval(model, valid, cfg)
    m = cfg.model
    for axis, source in AXES:
        ours = importance_orders(
            scores,
            axis,
            m.query_groups,
            m.mamba_num_groups,
            mamba_source=source or "out_proj_input",
        )
        if not ours:
            continue
        groups = (
            {k: (m.query_groups if axis == "attention_heads" else m.mamba_num_groups) for k in ours}
            if axis in ("attention_heads", "mamba_heads")
            else None
        )
        variants = {"ours": ours, "magnitude": magnitude_orders(model, axis)}
        variants.update({f"random{s}": random_orders(ours, s, groups) for s in range(3)})
        losses = {}
        for name, orders in variants.items():
            model.load_state_dict(base, strict=False)
            mask_prune(model, axis, orders, KEEP)
            losses[name] = _eval(model, valid, cfg)
        model.load_state_dict(base, strict=False)
        random_mean = statistics.mean(losses[f"random{s}"] for s in range(3))
        label = f"{axis} ({source})" if source else axis
        rows.append(
            {
                "name": f"prune {label} to {KEEP:.0%} [valid loss]",
                "unpruned": round(unpruned, 4),
                "ours": round(losses["ours"], 4),
                "random_mean": round(random_mean, 4),
                "magnitude": round(losses["magnitude"], 4),
                "ours_best": losses["ours"] <= min(random_mean, losses["magnitude"]),
            }
        )
    return rows
