"""Depth importance (optional axis): how much the logits move when one layer is skipped.

``score_j = sum (logits_without_j - logits)^2 / sum logits^2`` over the calibration batches
(normalized logit MSE). A skipped layer passes its input through unchanged. Runs through
Megatron's schedule, so it works under PP (the owning stage skips) and TP (vocab-parallel
logits: partial sums are all-reduced over TP).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from elastic_plugin.parallel import is_rank0


def _skip_hook(_module, _args, kwargs, output):
    hidden = kwargs["hidden_states"]
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


def _logits_step(data_iterator, model):
    from elastic_plugin.training.step import get_batch

    batch = get_batch(data_iterator)
    tokens = batch.get("tokens")
    positions = None if tokens is None else torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, batch.get("attention_mask"))

    def keep(output):
        return output.sum() * 0.0, torch.tensor(1), {"logits": output.detach().float()}

    return logits, keep


def _forward_logits(chunks, batch: dict | None, seq_length: int, micro_batch_size: int):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    stage_reads = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    out = get_forward_backward_func()(
        forward_step_func=_logits_step,
        data_iterator=iter([batch]) if stage_reads else None,
        model=chunks,
        num_microbatches=1,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    return out[0]["logits"] if out else None


def _global_layer_numbers(model) -> list[int]:
    from megatron.core import parallel_state as ps

    local = [int(layer.layer_number) for layer in model.decoder.layers]
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return local
    parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    return sorted(n for part in parts for n in part)


@torch.no_grad()
def depth_scores(
    chunks, batches: Iterable[dict], seq_length: int, micro_batch_size: int, progress: bool = False
) -> dict[int, float]:
    """Normalized logit MSE per global layer number (identical on every rank)."""
    from megatron.core import parallel_state as ps

    model = getattr(chunks[0], "module", chunks[0])
    batches = list(batches)
    if not batches and (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()):
        raise ValueError("depth importance needs at least one calibration batch")
    numbers = _global_layer_numbers(model)
    local_layers = {int(layer.layer_number): layer for layer in model.decoder.layers}
    num_batches = torch.tensor([len(batches)])
    if dist.is_initialized():
        dist.all_reduce(num_batches, op=dist.ReduceOp.MAX)
    sums = torch.zeros(len(numbers), 2, dtype=torch.float64)  # [diff^2, ref^2]
    for chunk in chunks:
        chunk.eval()
    bar = None
    if progress and is_rank0():
        from elastic_plugin.data.progress import make_progress

        bar = make_progress(int(num_batches) * len(numbers), "depth", unit="fwd")
    try:
        for b in range(int(num_batches)):
            batch = batches[b] if b < len(batches) else None
            reference = _forward_logits(chunks, batch, seq_length, micro_batch_size)
            for i, number in enumerate(numbers):
                handle = None
                if number in local_layers:
                    handle = local_layers[number].register_forward_hook(
                        _skip_hook, with_kwargs=True
                    )
                try:
                    skipped = _forward_logits(chunks, batch, seq_length, micro_batch_size)
                finally:
                    if handle is not None:
                        handle.remove()
                if reference is not None:
                    sums[i, 0] += (skipped.double() - reference.double()).pow(2).sum()
                    sums[i, 1] += reference.double().pow(2).sum()
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for chunk in chunks:
            chunk.train()
    if dist.is_initialized() and ps.model_parallel_is_initialized():
        dist.all_reduce(sums, group=ps.get_tensor_model_parallel_group())  # vocab shards
        dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())  # last stage has them
        dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
    return {n: float(sums[i, 0] / sums[i, 1].clamp(min=1e-30)) for i, n in enumerate(numbers)}
