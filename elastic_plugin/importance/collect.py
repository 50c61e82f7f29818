"""Collect importance scores: forward passes over calibration data with hooks installed.

Forward-only through Megatron's own schedule (so PP stages pass activations as in training),
progress on rank 0, hooks removed afterwards (also on error), partial statistics saved every
``save_every`` batches (safetensors + JSON, ``checkpoint.tensor_file``) so an interrupted
collection resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.tensor_file import (
    layer_key,
    layers_from,
    read_tensor_file,
    write_tensor_file,
)
from elastic_plugin.importance.hooks import AXES, ImportanceHooks, LocalStats
from elastic_plugin.importance.magnitude import weight_magnitudes
from elastic_plugin.importance.scores import ImportanceScores, reduce_local_stats
from elastic_plugin.models.logits import without_logits

if TYPE_CHECKING:  # Megatron ships no types: this annotates the model inside a wrapper
    from megatron.core.models.hybrid.hybrid_model import HybridModel


class CalibrationError(ValueError):
    """The calibration data cannot provide what was asked for."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _partial_path(resume_dir: Path) -> Path:
    return resume_dir / f"partial_rank{_rank():05d}.safetensors"


PARTIAL_FORMAT = "importance_partial"


def _load_partial(path: Path) -> tuple[LocalStats, dict[str, int]]:
    """A partial state :func:`_save_partial` wrote: the statistics and the counters."""
    found = read_tensor_file(path, PARTIAL_FORMAT, 1, f"--resume-dir partial state {path}")
    counters = found.info.get("counters")
    axes = found.info.get("axes")
    if not (
        isinstance(counters, dict)
        and all(isinstance(counters.get(k), int) for k in _COUNTERS)
        and isinstance(axes, list)
        and all(isinstance(a, str) for a in axes)
    ):
        raise CalibrationError(
            f"{path}: not a partial importance state; delete the resume directory"
        )
    stats = LocalStats.from_state_dict(
        {
            "sums": {axis: layers_from(found.tensors, f"sums/{axis}", str(path)) for axis in axes},
            "expert_tokens": layers_from(found.tensors, "expert_tokens", str(path)),
            "tokens_seen": counters["tokens_seen"],
        }
    )
    return stats, {k: int(counters[k]) for k in _COUNTERS}


_COUNTERS = ("batches_done", "num_batches", "micro_batch_size", "tokens_seen")


def check_calibration(num_available: int | None, num_samples: int, micro_batch_size: int) -> int:
    """Number of micro-batches to run; errors for an empty or too-short calibration set."""
    if num_samples <= 0:
        raise CalibrationError(f"num_samples={num_samples} must be > 0")
    if micro_batch_size <= 0:
        raise CalibrationError(f"micro_batch_size={micro_batch_size} must be > 0")
    if num_available is not None:
        if num_available == 0:
            raise CalibrationError("the calibration set is empty")
        if num_available < num_samples:
            raise CalibrationError(
                f"the calibration set has {num_available} samples, fewer than num_samples={num_samples}"
            )
    if num_samples % micro_batch_size:
        raise CalibrationError(
            f"num_samples={num_samples} must be a multiple of micro_batch_size={micro_batch_size}"
        )
    return num_samples // micro_batch_size


def _counted(iterator: Iterator[dict], limit: int, samples_per_batch: int) -> Iterator[dict]:
    """Yield ``limit`` batches, failing clearly if the iterator runs out first."""
    for index in range(limit):
        try:
            yield next(iterator)
        except StopIteration:
            raise CalibrationError(
                f"calibration data ran out after {index * samples_per_batch} samples; "
                f"asked for {limit * samples_per_batch}"
            ) from None


def collect_importance(
    chunks: list[torch.nn.Module],
    data_iterator: Iterator[dict] | None,
    num_samples: int,
    seq_length: int,
    micro_batch_size: int,
    axes: Iterable[str] | None = None,
    resume_dir: str | Path | None = None,
    save_every: int = 50,
    progress: bool = True,
    num_available: int | None = None,
    meta: dict[str, Any] | None = None,
) -> ImportanceScores:
    """Run ``num_samples`` (per data-parallel rank) through the model and reduce the scores.

    ``axes``: which to require (default: every axis the model has); one the model lacks is an
    error before any forward pass. With ``resume_dir``, partial per-rank statistics are kept
    there and picked up by a later call with the same arguments.
    """
    from elastic_plugin.models.context_parallel import cp_size
    from elastic_plugin.training.step import run_schedule

    num_batches = check_calibration(num_available, num_samples, micro_batch_size)
    model: HybridModel = getattr(chunks[0], "module", chunks[0])
    stats, done = LocalStats(), 0
    partial = _partial_path(Path(resume_dir)) if resume_dir is not None else None
    if partial is not None and partial.is_file():
        stats, saved = _load_partial(partial)
        if saved["num_batches"] != num_batches or saved["micro_batch_size"] != micro_batch_size:
            raise CalibrationError(
                f"{partial} was collected with a different num_samples/micro_batch_size; "
                "delete the resume directory or use the same settings"
            )
        done = saved["batches_done"]
    hooks = ImportanceHooks(model, stats)
    try:
        _check_axes(axes, hooks.axes_present)
        if data_iterator is not None:
            for _ in range(done):  # skip what a previous run already saw
                next(data_iterator)
        bar = _progress(num_batches, done) if progress and _rank() == 0 else None
        batches = (
            _counted(data_iterator, num_batches - done, micro_batch_size)
            if data_iterator is not None
            else None
        )
        with torch.no_grad():
            for chunk in chunks:
                chunk.eval()
            for index in range(done, num_batches):
                with without_logits(*chunks):  # the statistics read hidden states only
                    run_schedule(
                        chunks, batches, 1, seq_length, micro_batch_size, forward_only=True,
                        forward_step_func=_statistics_forward_step,
                    )  # fmt: skip
                # this rank's tokens (under CP its share of each sequence), summed over DP x CP
                stats.tokens_seen += micro_batch_size * seq_length // cp_size()
                if bar is not None:
                    bar.update(1)
                if partial is not None and ((index + 1) % save_every == 0):
                    _save_partial(partial, stats, index + 1, num_batches, micro_batch_size)
        if bar is not None:
            bar.close()
    finally:
        hooks.remove()
        for chunk in chunks:
            chunk.train()
    for key, layers in weight_magnitudes(model).items():  # set, not added: resuming is exact
        if layers:
            stats.sums[key] = dict(layers)
    config = model.config
    scores = reduce_local_stats(
        stats,
        config.hidden_size,
        bool(config.sequence_parallel),
        meta={"num_samples_per_dp_rank": num_samples, "seq_length": seq_length, **(meta or {})},
    )
    if partial is not None and partial.exists():
        partial.unlink()
    return scores


def _statistics_forward_step(data_iterator, model):
    """Megatron's forward step for a pass whose hooks are the result: the model without
    labels (no loss, and under ``without_logits`` no logits), a zero loss for the schedule."""
    from elastic_plugin.training.step import get_batch

    batch = get_batch(data_iterator)
    tokens = batch.get("tokens")
    position_ids = batch.get("position_ids")
    if tokens is not None and position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output = model(tokens, position_ids, batch.get("attention_mask"))
    return output, lambda out: (out.sum() * 0.0, {})


def _check_axes(axes: Iterable[str] | None, present: set[str]) -> None:
    if axes is None:
        return
    for axis in axes:
        if axis not in AXES and axis != "shared_ffn":
            raise ValueError(f"axis {axis!r} is unknown; allowed: {', '.join(AXES)}, shared_ffn")
        if axis not in present:
            raise ValueError(
                f"axis {axis!r} is not in this model (it has: {', '.join(sorted(present))})"
            )


def _save_partial(
    path: Path, stats: LocalStats, done: int, num_batches: int, micro_batch_size: int
) -> None:
    """Atomic safetensors write (``checkpoint.tensor_file``): the sums as ``sums/axis/layer``,
    expert token counts, and the counters as JSON; resuming reads it without unpickling."""
    state = stats.state_dict()
    tensors = {
        layer_key(f"sums/{axis}", layer): value
        for axis, layers in state["sums"].items()
        for layer, value in layers.items()
    }
    tensors.update({layer_key("expert_tokens", k): v for k, v in state["expert_tokens"].items()})
    counters = {
        "batches_done": done,
        "num_batches": num_batches,
        "micro_batch_size": micro_batch_size,
        "tokens_seen": int(state["tokens_seen"]),
    }
    info = {"counters": counters, "axes": sorted(state["sums"])}
    write_tensor_file(path, tensors, info, PARTIAL_FORMAT, 1)


def _progress(total: int, initial: int):
    from elastic_plugin.data.progress import make_progress

    return make_progress(total, "importance", unit="batch", initial=initial)
