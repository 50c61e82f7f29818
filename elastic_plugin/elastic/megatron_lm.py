"""Megatron-LM's own checkpoints (``--save`` / ``--load``) of an elastic run, in our layout.

A reordered model keeps its globally ranked axes (FFN neurons over TP, experts over EP) strided
in memory (``checkpoint.layout``). Megatron-LM's ``save_checkpoint`` writes
``model.sharded_state_dict()`` as memory holds it, so a ``--save`` directory would only load
back in the layout that wrote it, and our tools could not read it. ``install_checkpoint_hooks``
wraps the two functions ``megatron.training.training`` calls:

* **save**: the weights are laid out canonically around Megatron's synchronous write (as our
  ``save_checkpoint`` does), then ``elastic_meta.json`` (the experiment and elastic config, the
  router's choice table, the layout, each file's digest) goes into the ``iter_NNNNNNN``
  directory. A ``--save`` directory is then a stage directory like ``elastic-train``'s:
  ``inspect``, ``extract``, ``export``, ``generate`` and ``verify`` read it, in any layout.
* **load**: the files are verified first (digests, and every pickle against an allowlist:
  ``checkpoint.safe_pickle``; a plain Megatron-LM save's pickles too); after Megatron loads, the weights are laid out strided
  again and, when the optimizer state was not loaded (``--no-load-optim``, ``--finetune``), the
  optimizer's main weights are reloaded from them. Optimizer state written in another TP/EP
  layout is refused before anything is read: its moments follow that layout's memory order
  (``--no-load-optim`` loads the weights alone).

Only ``--ckpt-format torch_dist`` without ``--async-save`` is layout-independent this way
(``check_checkpoint_args``): an asynchronous write happens after the weights are strided again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import LATEST_FILE, iteration_dir, resolve_checkpoint
from elastic_plugin.checkpoint.meta import CHECKPOINT_META, read_checkpoint_meta
from elastic_plugin.models.config import ConfigError

__all__ = [
    "check_checkpoint_args",
    "install_checkpoint_hooks",
    "loaded_checkpoint_dir",
    "unwrap_chunk",
]

_INSTALLED = "_elastic_checkpoint_hooks"


def unwrap_chunk(module: Any) -> Any:
    """The HybridModel inside Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def check_checkpoint_args(args: Any) -> None:
    """Refuse the checkpoint settings under which a save is not layout-independent, naming
    the flag (before Megatron builds anything)."""
    if not getattr(args, "save", None):
        return
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if fmt != "torch_dist":
        raise ConfigError(
            f"--ckpt-format {fmt}: elastic checkpoints need --ckpt-format torch_dist (Megatron's "
            f"distributed checkpoint, which loads in any layout and which our tools read)"
        )
    if getattr(args, "async_save", False):
        raise ConfigError(
            "--async-save: a reordered model is laid out canonically only while the save "
            "runs; drop --async-save (the write must finish inside save_checkpoint)"
        )


def loaded_checkpoint_dir(args: Any, load_arg: str = "load") -> Path | None:
    """The ``iter_`` (or ``release``) directory Megatron-LM's ``load_checkpoint`` will read
    for ``--<load_arg>`` (falling back to ``--pretrained-checkpoint`` as it does), or None when
    there is nothing to load."""
    candidates = [getattr(args, load_arg, None)]
    if load_arg == "load":
        candidates.append(getattr(args, "pretrained_checkpoint", None))
    for candidate in candidates:
        if not candidate or not (Path(candidate) / LATEST_FILE).is_file():
            continue
        root = Path(candidate)
        step = getattr(args, "ckpt_step", None)
        if step is not None:
            return iteration_dir(root, step)
        if (root / LATEST_FILE).read_text().strip() == "release":
            return root / "release"
        return resolve_checkpoint(root)
    return None


def _loads_optimizer(args: Any, optimizer: Any, source: Path) -> bool:
    """Whether Megatron-LM's ``load_checkpoint`` will restore optimizer state (its own rule)."""
    return (
        optimizer is not None
        and source.name != "release"
        and not getattr(args, "finetune", False)
        and not getattr(args, "no_load_optim", False)
    )


def _current_layout(args: Any) -> dict[str, int]:
    return {
        "tp": int(args.tensor_model_parallel_size),
        "ep": int(getattr(args, "expert_model_parallel_size", 1) or 1),
    }


def _wrap_save(orig: Callable, meta_for_save: Callable[[int, list], dict[str, Any]]) -> Callable:
    @functools.wraps(orig)
    def save_checkpoint(iteration, model, *rest, **kwargs):
        from megatron.training import get_args
        from megatron.training.checkpointing import get_checkpoint_name

        from elastic_plugin.checkpoint.layout import STRIDED_ATTR, canonical_weights
        from elastic_plugin.compat.sync_save import in_process_write_results

        args = get_args()
        chunks = [unwrap_chunk(m) for m in model]
        with ExitStack() as stack:  # canonical on disk; strided again when the write is done
            for chunk in chunks:
                stack.enter_context(canonical_weights(chunk))
            if not getattr(args, "async_save", False):  # a writer process needs Megatron's queue
                stack.enter_context(in_process_write_results())
            result = orig(iteration, model, *rest, **kwargs)
        if args.save and not kwargs.get("non_persistent_ckpt", False):
            directory = Path(
                get_checkpoint_name(
                    args.save, iteration, release=kwargs.get("release", False), return_base_dir=True
                )
            )
            meta = {
                **meta_for_save(iteration, chunks),
                "reordered": bool(getattr(chunks[0], STRIDED_ATTR, False)),
            }
            _write_meta(directory, meta)
        return result

    return save_checkpoint


def _write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """``elastic_meta.json`` with the digests of every file Megatron wrote (collective)."""
    import torch.distributed as dist

    from elastic_plugin.checkpoint.integrity import FILES_KEY
    from elastic_plugin.checkpoint.io import record_digests
    from elastic_plugin.checkpoint.meta import write_checkpoint_meta
    from elastic_plugin.parallel import is_rank0

    dist.barrier()  # every rank's files are complete
    digests = record_digests(directory)
    if is_rank0():
        write_checkpoint_meta(directory, {**meta, FILES_KEY: digests})
    dist.barrier()


def _wrap_load(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *rest, **kw):
        from megatron.training import get_args

        from elastic_plugin.checkpoint.io import verify_checkpoint
        from elastic_plugin.checkpoint.layout import mark_loaded_reordered

        args = get_args()
        source = loaded_checkpoint_dir(args, load_arg)
        meta = None
        if source is not None and (source / CHECKPOINT_META).is_file():
            meta = read_checkpoint_meta(source, f"--{load_arg.replace('_', '-')}")
            verify_checkpoint(source, meta)  # before Megatron reads a byte
            loads_optimizer = _loads_optimizer(args, optimizer, source)
            saved = {k: int((meta.get("layout") or {}).get(k, 1)) for k in ("tp", "ep")}
            now = _current_layout(args)
            if loads_optimizer and saved != now:
                raise ConfigError(
                    f"--{load_arg} {source} was written at TP{saved['tp']} EP{saved['ep']}, this "
                    f"run is TP{now['tp']} EP{now['ep']}: its optimizer state follows that "
                    f"layout's memory order; add --no-load-optim (and --no-load-rng) to load "
                    f"the weights alone"
                )
        elif source is not None:  # a plain Megatron-LM save: its pickles are checked all the same
            from elastic_plugin.checkpoint.safe_pickle import check_checkpoint_pickles

            check_checkpoint_pickles(source)
        result = orig(ddp_model, optimizer, opt_param_scheduler, load_arg, *rest, **kw)
        if meta is not None and meta.get("reordered"):
            for chunk in ddp_model:
                mark_loaded_reordered(unwrap_chunk(chunk))
            if not loads_optimizer and optimizer is not None:
                reload = getattr(optimizer, "reload_model_params", None)
                if reload is not None:
                    reload()  # the main weights were copied before the weights were strided
        return result

    return load_checkpoint


def install_checkpoint_hooks(meta_for_save: Callable[[int, list], dict[str, Any]]) -> bool:
    """Wrap ``megatron.training.training``'s ``save_checkpoint`` and ``load_checkpoint`` (the
    names its loop calls). ``meta_for_save(iteration, model_chunks)``: the metadata of a save
    (``elastic.train.checkpoint_meta``). Idempotent; returns whether it installed now."""
    import megatron.training.training as training

    if getattr(training.save_checkpoint, _INSTALLED, False):
        return False
    save = _wrap_save(training.save_checkpoint, meta_for_save)
    load = _wrap_load(training.load_checkpoint)
    for fn in (save, load):
        setattr(fn, _INSTALLED, True)
    training.save_checkpoint = save
    training.load_checkpoint = load
    return True
