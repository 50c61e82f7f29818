"""Megatron dist checkpoints with our metadata: atomic saves, any-layout loads, reorder-aware.

A checkpoint directory holds Megatron's dist-checkpoint files plus ``elastic_meta.json``
(``checkpoint.meta``: the experiment config, the layout it was written with, and whether the
weights are importance-reordered). Reordered models keep their globally ranked axes strided in
memory; checkpoints always hold the canonical order (``checkpoint.layout``), so any layout can
load them. Every directory is published atomically (written as ``<dir>.tmp``, then renamed).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.layout import STRIDED_ATTR, canonical_weights, mark_loaded_reordered
from elastic_plugin.checkpoint.meta import (
    CHECKPOINT_META,
    read_checkpoint_meta,
    write_checkpoint_meta,
)
from elastic_plugin.parallel import barrier, is_rank0

__all__ = [
    "build_from_checkpoint",
    "fresh_temporary",
    "load_checkpoint",
    "load_optimizer",
    "publish_directory",
    "save_checkpoint",
]


def save_checkpoint(chunks, out_dir: str | Path, meta: dict[str, Any], optimizer=None) -> Path:
    """Write a Megatron dist checkpoint atomically: into ``<dir>.tmp``, then rename.

    With ``optimizer`` its state is saved too (key ``optimizer``), for resuming in the same
    layout: its moments of strided axes stay in memory order, which only that layout reads."""
    from megatron.core import dist_checkpointing

    final = Path(out_dir)
    tmp = final.with_name(final.name + ".tmp")
    model = getattr(chunks[0], "module", chunks[0])
    meta = {**meta, "reordered": bool(getattr(model, STRIDED_ATTR, False))}
    if is_rank0():
        fresh_temporary(final)
    barrier()
    with canonical_weights(model):
        state = model.sharded_state_dict()
        if optimizer is not None:
            state = {**state, "optimizer": optimizer.sharded_state_dict(state)}
        dist_checkpointing.save(state, str(tmp))
    barrier()
    if is_rank0():
        write_checkpoint_meta(tmp, meta)
        publish_directory(tmp, final)
    barrier()
    return final


def fresh_temporary(final: str | Path) -> Path:
    """``<final>.tmp``, emptied: where an atomic write of ``final`` goes first (a leftover of an
    interrupted write is discarded)."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_directory(tmp: Path, final: Path) -> None:
    """Rename a completely written ``tmp`` to ``final`` (replacing an old ``final``): readers
    see either the old directory or the whole new one, never a partial one."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(chunks, ckpt_dir: str | Path) -> dict[str, Any]:
    """Load into model chunks of any layout; reordered weights are laid out strided again."""
    from megatron.core import dist_checkpointing

    meta = read_checkpoint_meta(ckpt_dir)
    model = getattr(chunks[0], "module", chunks[0])
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
    model.load_state_dict(state, strict=False)
    if meta.get("reordered"):
        mark_loaded_reordered(model)
    return meta


def load_optimizer(chunks, optimizer, ckpt_dir: str | Path) -> None:
    """Restore optimizer state written by ``save_checkpoint(..., optimizer=...)``."""
    from megatron.core import dist_checkpointing

    model = getattr(chunks[0], "module", chunks[0])
    sharded = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
    state = dist_checkpointing.load({"optimizer": sharded}, str(ckpt_dir))
    optimizer.load_state_dict(state["optimizer"])


def build_from_checkpoint(ckpt_dir: str | Path, layout, wrap_ddp: bool = False):
    """Build this rank's model chunk for ``layout`` from a checkpoint's own config and load it.

    Returns ``(chunks, experiment_config, meta)``; ``initialize_layout`` must have been called.
    """
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.parallel import build_model_chunks

    meta = read_checkpoint_meta(ckpt_dir)
    cfg = config_from_dict(meta["config"], source=f"{ckpt_dir}/{CHECKPOINT_META}")
    chunks, _ = build_model_chunks(cfg.model, layout, wrap_ddp=wrap_ddp)
    load_checkpoint(chunks, ckpt_dir)
    return chunks, cfg, meta
