"""Small rank-pool cases used by the test-suite (each runs on every rank of a pool)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def built_parameter_counts(
    config_path: str, overrides: dict[str, Any] | None = None
) -> dict[str, int]:
    """Build the HybridModel on one rank and sum ``numel`` per counting component."""
    from dataclasses import replace

    from elastic_plugin.models.config import load_config
    from elastic_plugin.models.counting import component_of_parameter
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout

    model_cfg = load_config(config_path).model
    if overrides:
        model_cfg = replace(model_cfg, **overrides).validate()
    initialize_layout(Layout())
    (model,), _ = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        key = component_of_parameter(name)
        counts[key] = counts.get(key, 0) + param.numel()
    return counts


def uneven_all_gather() -> list[list[float]]:
    """Each rank contributes rank+1 rows; every rank must receive all of them, in order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.full((rank + 1, 3), float(rank))
    out = [torch.empty(r + 1, 3) for r in range(world)]
    dist.all_gather(out, mine)
    return [t[:, 0].tolist() for t in out]


def list_reduce_scatter() -> list[float]:
    """Uneven pieces: piece r has r+1 elements filled with (sender rank + 1) * (r + 1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces = [torch.full((r + 1,), float((rank + 1) * (r + 1))) for r in range(world)]
    out = torch.empty(rank + 1)
    dist.reduce_scatter(out, pieces)
    return out.tolist()


def eval_loss_from_checkpoint(
    ckpt_dir: str,
    data_dir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    eval_iters: int = 2,
) -> float | None:
    """Load a teacher checkpoint under a layout and compute the validation loss."""

    from elastic_plugin.checkpoint.io import load_checkpoint
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.data.indexed import batch_iterator, build_gpt_datasets
    from elastic_plugin.data.prepare import PreparedData
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout
    from elastic_plugin.training.step import eval_step, share_from_last_stage

    meta = read_checkpoint_meta(ckpt_dir)
    cfg = config_from_dict(meta["config"])
    layout = Layout(tp, pp, ep, sequence_parallel)
    initialize_layout(layout)
    chunks, _ = build_model_chunks(cfg.model, layout, wrap_ddp=False)
    load_checkpoint(chunks, ckpt_dir)
    prepared = PreparedData.load(data_dir)
    t = cfg.training
    datasets = build_gpt_datasets(
        prepared.load_tokenizer(),
        t.seq_length,
        train_data_path=prepared.train_prefix,
        valid_data_path=prepared.valid_prefix,
        num_samples=(t.micro_batch_size, eval_iters * t.micro_batch_size, None),
        seed=t.seed,
    )
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    it = batch_iterator(datasets.valid, t.micro_batch_size // dp, seed=t.seed, shuffle=False)
    loss = eval_step(chunks, it, eval_iters, t.seq_length, t.micro_batch_size // dp)
    return share_from_last_stage(loss)
