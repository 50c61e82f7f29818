"""One training (or evaluation) step through Megatron-Core's pipeline schedules.

``forward_step`` is the Megatron forward-step contract (data iterator + model → output and a loss
closure); ``train_step`` runs ``get_forward_backward_func`` + ``finalize_model_grads`` + the
optimizer, the same calls ``megatron.training`` makes, so what we test here is what users run.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # Megatron ships no types: this annotates what train_step takes
    from megatron.core.transformer.module import MegatronModule


def masked_lm_loss(loss_mask: torch.Tensor | None, output_tensor: torch.Tensor):
    """Token-averaged LM loss; returns (sum, num_tokens, report) so Megatron averages over DP/microbatches.

    ``loss_mask`` is None only on a pipeline stage without data, which computes no loss."""
    if loss_mask is None:
        raise ValueError(
            "masked_lm_loss: no loss_mask (the batch has neither loss_mask nor tokens)"
        )
    from elastic_plugin.models.context_parallel import loss_scale

    losses = output_tensor.float()
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses.reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    # under CP: this rank's share of the whole sequence's token mean
    return loss_sum * loss_scale(mask.sum()), num_tokens, {"lm loss": report}


def get_batch(data_iterator: Iterator[dict] | None) -> dict[str, Any]:
    """Next batch, moved to the model's device and, under context parallelism, cut to this CP
    rank's two mirrored chunks; stages without data get ``None`` fields."""
    from elastic_plugin.models.context_parallel import split_batch

    if data_iterator is None:
        return {}
    batch = next(data_iterator)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return split_batch({k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()})


def forward_step(data_iterator: Iterator[dict] | None, model: torch.nn.Module):
    """Megatron forward-step function for a HybridModel on (tokens, labels, loss_mask) batches."""
    batch = get_batch(data_iterator)
    tokens = batch.get("tokens")
    position_ids = batch.get("position_ids")
    if tokens is not None and position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output = model(tokens, position_ids, batch.get("attention_mask"), labels=batch.get("labels"))
    loss_mask = batch.get("loss_mask")
    if loss_mask is None and tokens is not None:
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
    return output, partial(masked_lm_loss, loss_mask)


def reduce_loss_reports(reports: list[dict]) -> float | None:
    """Token-mean loss over micro-batches and data-parallel ranks (``None`` off the last stage)."""
    if not reports:
        return None
    from megatron.core import parallel_state

    total = torch.stack([r["lm loss"] for r in reports]).sum(0)
    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        torch.distributed.all_reduce(
            total, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    return float(total[0] / total[1].clamp(min=1))


def _batch_iterator_for_stage(data_iterator):
    """Only the first and last pipeline stages read data (tokens / labels)."""
    from megatron.core import parallel_state

    if parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage():
        return data_iterator
    return None


def run_schedule(
    chunks,
    data_iterator,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    forward_step_func=forward_step,
    adjust_tensor_shapes_fn=None,
) -> list[dict]:
    """Megatron's schedule for this layout (1F1B under PP) over ``num_microbatches``;
    ``adjust_tensor_shapes_fn``: Megatron's hook for other p2p shapes (1F1B only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra = (
        {}
        if adjust_tensor_shapes_fn is None
        else {"adjust_tensor_shapes_fn": adjust_tensor_shapes_fn}
    )
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=_batch_iterator_for_stage(data_iterator),
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **extra,
    )


def train_step(
    chunks: list[MegatronModule],
    optimizer,
    data_iterator: Iterator[dict] | None,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    step_optimizer: bool = True,
    forward_step_func=forward_step,
    finalize_grads_func=None,
    reduce_reports=None,
    adjust_tensor_shapes_fn=None,
) -> dict[str, Any]:
    """Forward+backward over ``num_microbatches`` micro-batches, then one optimizer step.

    ``forward_step_func``/``finalize_grads_func`` default to the plain LM step and Megatron's
    ``finalize_model_grads``; elastic training passes its own (distillation loss, router grads).
    """
    from megatron.core.distributed import finalize_model_grads

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_grads_func or finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    reports = run_schedule(
        chunks,
        data_iterator,
        num_microbatches,
        seq_length,
        micro_batch_size,
        forward_only=False,
        forward_step_func=forward_step_func,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
    )
    result: dict[str, Any] = {
        "loss": (reduce_reports or reduce_loss_reports)(reports),
        "reports": reports,
    }
    if step_optimizer:
        ok, grad_norm, _ = optimizer.step()
        result.update(update_successful=ok, grad_norm=grad_norm)
    return result


@torch.no_grad()
def eval_step(
    chunks, data_iterator, num_microbatches: int, seq_length: int, micro_batch_size: int
) -> float | None:
    """Mean validation loss (last pipeline stage; ``None`` elsewhere)."""
    for chunk in chunks:
        chunk.eval()
    try:
        reports = run_schedule(
            chunks, data_iterator, num_microbatches, seq_length, micro_batch_size, forward_only=True
        )
    finally:
        for chunk in chunks:
            chunk.train()
    return reduce_loss_reports(reports)


def share_from_last_stage(value: float | None) -> float | None:
    """Losses exist on the last pipeline stage only; give every rank the same number."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    packed = torch.tensor(
        [value if value is not None else 0.0, 1.0 if value is not None else 0.0],
        dtype=torch.float64,
    )
    dist.all_reduce(packed, group=parallel_state.get_pipeline_model_parallel_group())
    # every TP/DP replica of the last stage reported the same value: average them
    dist.all_reduce(packed)
    return float(packed[0] / packed[1]) if packed[1] > 0 else None


def cosine_lr_scheduler(
    optimizer, lr: float, min_lr: float, warmup_iters: int, train_iters: int, weight_decay: float
):
    """Megatron's ``OptimizerParamScheduler``: linear warm-up to ``lr`` (at most
    ``train_iters - 1`` steps), cosine decay to ``min_lr`` over ``train_iters``, constant weight
    decay. The teacher and the elastic stage build theirs here, so their schedules agree."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=min(warmup_iters, max(train_iters - 1, 0)),
        lr_decay_steps=train_iters,
        lr_decay_style="cosine",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=train_iters,
        wd_incr_style="constant",
    )
