"""Megatron dist checkpoints with our metadata: atomic saves, any-layout loads, reorder-aware.

A checkpoint directory holds Megatron's dist-checkpoint files plus ``elastic_meta.json``
(``checkpoint.meta``: the experiment config, the layout it was written with, and whether the
weights are importance-reordered). Reordered models keep their globally ranked axes strided in
memory; checkpoints always hold the canonical order (``checkpoint.layout``), so any layout can
load them. Every directory is published atomically (written as ``<dir>.tmp``, then renamed),
with the size and content digest of each of its files in its metadata (``checkpoint.integrity``);
every load checks them first, so a damaged file is a ConfigError naming it, not silently wrong
weights or a traceback from deep inside ``torch.load``. Then every pickle torch would unpickle
from it is checked against an allowlist (``checkpoint.safe_pickle``): a digest only says the
file is the one its writer recorded, not that its writer meant no harm.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_plugin.checkpoint.history import (
    iteration_dir,
    iteration_dirs,
    newest_verified,
    prune_history,
    resolve_checkpoint,
    write_latest,
)
from elastic_plugin.checkpoint.integrity import (
    FILES_KEY,
    already_verified,
    balanced_share,
    check_hashes,
    check_sizes,
    digest_names,
    file_digests,
    files_signature,
    recorded_digests,
    remember_verified,
)
from elastic_plugin.checkpoint.layout import STRIDED_ATTR, canonical_weights, mark_loaded_reordered
from elastic_plugin.checkpoint.meta import (
    CHECKPOINT_META,
    read_checkpoint_meta,
    write_checkpoint_meta,
)
from elastic_plugin.checkpoint.safe_pickle import check_checkpoint_pickles
from elastic_plugin.compat.faults import fault_point
from elastic_plugin.compat.sync_save import in_process_write_results
from elastic_plugin.models.config import ConfigError
from elastic_plugin.parallel import barrier, is_rank0

__all__ = [
    "build_from_checkpoint",
    "fresh_temporary",
    "load_checkpoint",
    "load_optimizer",
    "publish_directory",
    "record_digests",
    "resume_source",
    "save_checkpoint",
    "save_new_stage",
    "verify_checkpoint",
]


def save_checkpoint(
    chunks,
    out_dir: str | Path,
    meta: dict[str, Any],
    optimizer=None,
    iteration: int | None = None,
    keep_last: int = 0,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a Megatron dist checkpoint atomically: into ``<dir>.tmp``, then rename.

    With ``optimizer`` its state is saved too (key ``optimizer``), for resuming in the same
    layout: its moments of strided axes stay in memory order, which only that layout reads.
    ``extra_files(directory)`` (rank 0) adds files that belong to the checkpoint (a tokenizer,
    permutations) before the digests are taken, so they are published and verified with it.
    With ``iteration``, ``out_dir`` is a stage directory with history (``checkpoint.history``):
    the save goes to ``out_dir/iter_NNNNNNN``, is verified, then the stage's
    ``latest_checkpointed_iteration.txt`` points at it, and only then are saves beyond the
    newest ``keep_last`` (0: keep all) removed. Returns the checkpoint directory written."""
    from megatron.core import dist_checkpointing

    final = Path(out_dir) if iteration is None else iteration_dir(out_dir, iteration)
    tmp = final.with_name(final.name + ".tmp")
    model = getattr(chunks[0], "module", chunks[0])
    meta = {**meta, "reordered": bool(getattr(model, STRIDED_ATTR, False))}
    if is_rank0():
        fresh_temporary(final)
    barrier()
    with canonical_weights(model), in_process_write_results():
        state = model.sharded_state_dict()
        if optimizer is not None:
            state = {**state, "optimizer": optimizer.sharded_state_dict(state)}
        dist_checkpointing.save(state, str(tmp))
    if extra_files is not None and is_rank0():
        extra_files(tmp)
    fault_point("save.written")
    barrier()
    digests = record_digests(tmp)
    if is_rank0():
        write_checkpoint_meta(tmp, {**meta, FILES_KEY: digests})
        publish_directory(tmp, final)
    barrier()
    fault_point("save.published")
    if iteration is not None:
        verify_checkpoint(final)  # the pointer moves, and old saves go, only after this
        if is_rank0():
            write_latest(out_dir, iteration)
            fault_point("save.pointer")
            prune_history(out_dir, keep_last)
        barrier()
    return final


def save_new_stage(
    chunks,
    out_dir: str | Path,
    meta: dict[str, Any],
    iteration: int,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """A stage directory that did not exist (or was empty), published whole: its first save
    (``iter_NNNNNNN`` and the latest pointer) is written into ``<out_dir>.tmp`` and that is
    renamed to ``out_dir``, so an interrupted run leaves only the ``.tmp``. For the one-shot
    stages (import, reorder into a new directory, extract). Returns the save's directory."""
    final = Path(out_dir)
    staging = final.with_name(final.name + ".tmp")
    if is_rank0():
        shutil.rmtree(staging, ignore_errors=True)
    barrier()
    save_checkpoint(chunks, staging, meta, iteration=iteration, extra_files=extra_files)
    if is_rank0():
        publish_directory(staging, final)
    barrier()
    return iteration_dir(final, iteration)


def resume_source(stage: str | Path) -> Path | None:
    """The save a ``--resume`` continues: the stage's newest save that verifies (damaged newer
    ones are skipped and named on rank 0), a checkpoint written before history existed, or
    None (nothing saved yet). Collective: every rank hashes a share of each save it tries."""
    stage = Path(stage)
    if iteration_dirs(stage):
        chosen, skipped = newest_verified(stage, verify_checkpoint)
        for path, why in skipped:
            if is_rank0():
                print(f"resume: skipped {path.name}: {why}", flush=True)
        if chosen is None:
            raise ConfigError(
                f"resume: no save of {stage} verifies ({len(skipped)} tried); the last "
                f"problem: {skipped[-1][1] if skipped else 'none'}"
            )
        if skipped and is_rank0():
            print(f"resume: continuing from {chosen.name}", flush=True)
        return chosen
    return stage if (stage / CHECKPOINT_META).is_file() else None


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

    ckpt_dir = resolve_checkpoint(ckpt_dir)
    meta = read_checkpoint_meta(ckpt_dir)
    verify_checkpoint(ckpt_dir, meta)
    model = getattr(chunks[0], "module", chunks[0])
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
    model.load_state_dict(state, strict=False)
    if meta.get("reordered"):
        mark_loaded_reordered(model)
    return meta


def load_optimizer(chunks, optimizer, ckpt_dir: str | Path) -> None:
    """Restore optimizer state written by ``save_checkpoint(..., optimizer=...)``."""
    from megatron.core import dist_checkpointing

    ckpt_dir = resolve_checkpoint(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    model = getattr(chunks[0], "module", chunks[0])
    sharded = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
    state = dist_checkpointing.load({"optimizer": sharded}, str(ckpt_dir))
    fused = _fused_groups(optimizer)
    optimizer.load_state_dict(state["optimizer"])
    if fused and not _fused_groups(optimizer):  # a save from before the fused CPU Adam
        from elastic_plugin.parallel import fuse_cpu_adam

        fuse_cpu_adam(optimizer)


def _fused_groups(optimizer) -> bool:
    """Whether Megatron's optimizer runs torch's fused Adam (``parallel.fuse_cpu_adam``)."""
    inner = [
        getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])
    ]
    return any(g.get("fused") for o in inner if o is not None for g in o.param_groups)


def build_from_checkpoint(
    ckpt_dir: str | Path,
    layout,
    wrap_ddp: bool = False,
    params_dtype=None,
    role: str = "sliced",
    **config_overrides,
):
    """Build this rank's model chunk for ``layout`` from a checkpoint's own config and load it.

    ``params_dtype`` (default float32) need not be the dtype the checkpoint was written in: a
    BF16 run's checkpoint loads into FP32 tools and the other way round (each tensor is
    converted on load). ``role``: what the model is built for, which picks its layer spec
    (``parallel.build_model_chunks``; ``"teacher"`` for a frozen teacher, which may run
    Transformer Engine's layers). ``config_overrides``: ``TransformerConfig`` fields
    (recomputation). Returns ``(chunks, experiment_config, meta)``; ``initialize_layout`` must
    have been called.
    """
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.parallel import build_model_chunks

    ckpt_dir = resolve_checkpoint(ckpt_dir)
    meta = read_checkpoint_meta(ckpt_dir)
    cfg = config_from_dict(meta["config"], source=f"{ckpt_dir}/{CHECKPOINT_META}")
    verify_checkpoint(ckpt_dir, meta)  # before building: a damaged checkpoint fails fast
    import torch

    chunks, _ = build_model_chunks(
        cfg.model,
        layout,
        params_dtype=params_dtype or torch.float32,
        wrap_ddp=wrap_ddp,
        role=role,
        **config_overrides,
    )
    load_checkpoint(chunks, ckpt_dir)
    return chunks, cfg, meta


# ------------------------------------------------------------------------------ integrity
def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (just ours outside a multi-rank process group)."""
    _, world = _rank_world()
    if world == 1:
        return [value]
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return values


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    _, world = _rank_world()
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def record_digests(directory: str | Path) -> dict[str, dict[str, Any]]:
    """The digests of every file of a just written checkpoint directory, on every rank: the ranks
    split the files by size (``balanced_share``), so hashing costs ~1/world of the bytes each.
    Collective; call it after every rank's files are complete (after a barrier)."""
    root = Path(directory)
    sizes = _from_rank0(
        {name: (root / name).stat().st_size for name in digest_names(root)} if is_rank0() else None
    )
    rank, world = _rank_world()
    mine: dict[str, dict[str, Any]] | str
    try:
        mine = file_digests(root, balanced_share(sizes, rank, world))
    except OSError as exc:  # every rank must still reach the gather, or the others hang
        mine = f"rank {rank}: {exc}"
    parts = _all_gather(mine)
    failed = [part for part in parts if isinstance(part, str)]
    if failed:
        raise OSError(f"checkpoint {root}: cannot hash the saved files ({failed[0]})")
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))


def _problem(root: Path, recorded: dict[str, dict[str, Any]], share: list[str]) -> str | None:
    """This rank's finding: every file's size (cheap, so every rank checks all), then the
    content of its share of the files, then the pickles (every rank: torch reads ``.metadata``
    on every rank); None when all is well."""
    try:
        check_sizes(root, recorded)
        check_hashes(root, recorded, share)
    except ConfigError as exc:
        return str(exc)
    return _pickle_problem(root)


def _pickle_problem(root: Path) -> str | None:
    """A pickle of the checkpoint that must not be loaded (``checkpoint.safe_pickle``)."""
    try:
        check_checkpoint_pickles(root)
    except ConfigError as exc:
        return str(exc)
    return None


def verify_checkpoint(ckpt_dir: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Check a checkpoint's files against the digests its metadata recorded, before anything
    reads them: a ConfigError (the same on every rank) names the first missing, truncated or
    altered file with the expected and found size or hash, or a pickle that names a global off
    the allowlist (``checkpoint.safe_pickle``). Checkpoints written before digests were
    recorded have their pickles checked only. Collective under a process group: each rank
    hashes a share."""
    root = resolve_checkpoint(ckpt_dir)
    meta = read_checkpoint_meta(root) if meta is None else meta
    recorded = recorded_digests(meta, root)
    if recorded is None:
        problems = [p for p in _all_gather(_pickle_problem(root)) if p]
        if problems:
            raise ConfigError(problems[0])
        return
    rank, world = _rank_world()
    signature = files_signature(root, recorded)  # None when a file is missing: _problem names it
    if already_verified(signature):
        problem = None
    else:
        sizes = {name: int(entry["bytes"]) for name, entry in recorded.items()}
        problem = _problem(root, recorded, balanced_share(sizes, rank, world))
    problems = [p for p in _all_gather(problem) if p]
    if problems:
        raise ConfigError(problems[0])
    remember_verified(signature)
