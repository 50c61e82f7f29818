"""Elastic-training losses: vocab-parallel distillation KL and the budget loss
(docs/design.md, "Losses").

The cross-entropy term (kept for budget 1.0 if asked) is Megatron's own
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``; nothing here re-implements it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from elastic_plugin.elastic.config import DEFAULT_KD_CHUNK_TOKENS
from elastic_plugin.models.config import ConfigError

__all__ = [
    "DEFAULT_KD_CHUNK_TOKENS",
    "budget_loss",
    "check_chunk_tokens",
    "distillation_loss_func",
    "vocab_parallel_kl",
]


def _default_tp_group():
    """Megatron's TP group when model parallel is initialised with TP > 1, else ``None``."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:  # never imported, so never initialised: skip the 7 s import
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() <= 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _active(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _kl_and_lse(student, teacher, temperature: float, group, chunk: int):
    """Per-token ``KL(p_t || p_s)`` of the scaled logits (before the T² factor) and the
    log-normalisers ``lse [2, tokens]`` (student, teacher), over every vocab shard of ``group``.

    With ``s, t`` the logits divided by T, ``Z`` the global exp-sums after subtracting the global
    max ``m``, and ``A = Σ_v e^{t_v - m_t} (t_v - s_v)`` (summed over all shards):
    ``KL = A / Z_t - (m_t + log Z_t) + (m_s + log Z_s)``. Each shard's row statistics come from
    ``ops.kd_row_stats`` (one read of the logits per pass; ``csrc/kd_loss_cpu.cpp`` on CPU),
    ``chunk`` rows at a time; then two collectives: one MAX of the maxima, one SUM of
    ``[Z_s, Z_t, A]`` rescaled to the global maxima. No rank ever holds more than its shard.
    """
    from elastic_plugin.ops import kd_row_stats

    vocab = student.shape[-1]
    s_all, t_all = student.reshape(-1, vocab), teacher.reshape(-1, vocab)
    n = s_all.shape[0]
    # rows: max s, sum e^(s - max s), max t, sum e^(t - max t), A (this shard's)
    parts = [
        kd_row_stats(s_all[a : a + chunk], t_all[a : a + chunk], temperature)
        for a in range(0, n, chunk)
    ]
    stats = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    maxima = stats[[0, 2]]
    if _active(group):
        local = maxima.clone()
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        shift = torch.exp(local - maxima)  # this shard's sums, to the global maxima
        sums = torch.stack([stats[1] * shift[0], stats[3] * shift[1], stats[4] * shift[1]])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    else:
        sums = stats[[1, 3, 4]]
    z_s, z_t, a = sums[0], sums[1], sums[2]
    lse = torch.stack([maxima[0] + torch.log(z_s), maxima[1] + torch.log(z_t)])  # FP64
    kl = a / z_t + (maxima[0] - maxima[1]) + (torch.log(z_s) - torch.log(z_t))
    return kl.float(), lse.float()


class _VocabParallelKL(torch.autograd.Function):
    """Per-token ``T² · KL(p_t ‖ p_s)`` over vocab shards (``_kl_and_lse``), with an exact, local
    backward that keeps ``p_s - p_t`` in FP32 from the forward.

    ``d(T² KL)/d student_logit_v = T (p_s,v - p_t,v)`` needs only the local shard and the global
    normalisers, so backward is communication-free and each rank gets exactly its shard's gradient
    (the loss is replicated across TP, so no reduction of grad_output is needed either).
    """

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float, group):
        from elastic_plugin.ops import kd_grad

        rows = student[..., 0].numel()
        kl, lse = _kl_and_lse(student, teacher, temperature, group, max(rows, 1))
        if ctx.needs_input_grad[0]:
            vocab = student.shape[-1]
            ones = torch.ones(rows, dtype=torch.float32, device=student.device)
            diff = kd_grad(
                student.reshape(-1, vocab).float(), teacher.reshape(-1, vocab).float(),
                lse, ones, temperature,
            )  # fmt: skip
            ctx.save_for_backward(diff.reshape(student.shape))
        ctx.temperature = temperature
        ctx.student_dtype = student.dtype
        return (kl * (temperature**2)).reshape(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (diff,) = ctx.saved_tensors
        grad = diff * (grad_out.float().unsqueeze(-1) * ctx.temperature)
        return grad.to(ctx.student_dtype), None, None, None


def check_chunk_tokens(chunk_tokens: object, name: str = "kd_chunk_tokens") -> int:
    """``chunk_tokens`` as a positive int, or a ConfigError naming ``name`` (flag or field)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ConfigError(
            f"{name}={chunk_tokens!r}: allowed: a positive integer (tokens per chunk of the "
            f"distillation loss; default {DEFAULT_KD_CHUNK_TOKENS})"
        )
    return chunk_tokens


class _ChunkedVocabParallelKL(torch.autograd.Function):
    """``_VocabParallelKL`` computed ``chunk`` tokens at a time, forward and backward.

    The same formula and the same two collectives (``_kl_and_lse``), but no FP32
    ``[tokens, V/tp]`` tensor is kept: the forward keeps the two log-normalisers per token and
    references to the logits; the backward writes ``T (p_s - p_t)`` straight into a gradient in
    the student's dtype (``ops.kd_grad``; the PyTorch fallback works a chunk at a time).
    """

    @staticmethod
    def forward(ctx, student, teacher, temperature: float, group, chunk: int):
        kl, lse = _kl_and_lse(student, teacher, temperature, group, chunk)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(student, teacher, lse)
        ctx.temperature = temperature
        ctx.chunk = chunk
        return (kl * (temperature**2)).reshape(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from elastic_plugin.ops import kd_grad

        student, teacher, lse = ctx.saved_tensors
        vocab = student.shape[-1]
        scale = grad_out.float().reshape(-1) * ctx.temperature
        grad = kd_grad(
            student.reshape(-1, vocab), teacher.reshape(-1, vocab), lse, scale, ctx.temperature
        )
        return grad.reshape(student.shape), None, None, None, None


def vocab_parallel_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token ``T² · KL(p_teacher ‖ p_student)`` for vocab-parallel logit shards.

    ``student_logits``/``teacher_logits``: ``[..., V/tp]`` (any leading dims, e.g. ``[b, s]`` or
    ``[s, b]``), the last dim being this rank's vocab shard. ``tp_group``: the group the vocab is
    split over; default Megatron's TP group when model parallel is initialised with TP > 1, else
    no communication. Math in fp32; the teacher is detached; returns shape ``student_logits.shape[:-1]``.
    The T² factor keeps gradient magnitudes independent of T (Hinton et al.).
    ``chunk_tokens``: compute ``chunk_tokens`` tokens at a time (``_ChunkedVocabParallelKL``: the
    same loss and gradient without the FP32 ``[tokens, V/tp]`` temporaries); None: all at once.
    """
    if not temperature > 0:
        raise ConfigError(
            f"temperature={temperature!r} must be > 0 (the distillation softmax temperature)"
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same shape (same vocab shard)"
        )
    if student_logits.dim() < 1 or student_logits.shape[-1] == 0:
        raise ValueError(
            f"logits need a non-empty last (vocab) dim, got {tuple(student_logits.shape)}"
        )
    group = tp_group if tp_group is not None else _default_tp_group()
    if chunk_tokens is not None:
        chunk = check_chunk_tokens(chunk_tokens)
        return _ChunkedVocabParallelKL.apply(
            student_logits, teacher_logits.detach(), float(temperature), group, chunk
        )
    return _VocabParallelKL.apply(
        student_logits, teacher_logits.detach(), float(temperature), group
    )


def budget_loss(cost: torch.Tensor, budget: float, full_cost: float) -> torch.Tensor:
    """``|cost / (budget · full_cost) − 1|`` (docs/design.md, "Losses"): how far the router's
    (expected) cost of
    the chosen sub-network is from the target fraction of the full model's cost, relative."""
    if not budget > 0:
        raise ConfigError(f"budget={budget!r} must be > 0 (a fraction of the full model's cost)")
    if not full_cost > 0:
        raise ConfigError(
            f"full_cost={full_cost!r} must be > 0 (the full model's parameter/memory count)"
        )
    return torch.abs(cost / (budget * full_cost) - 1.0)


def distillation_loss_func(
    loss_mask: torch.Tensor,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    report_key: str = "kd loss",
    chunk_tokens: int | None = DEFAULT_KD_CHUNK_TOKENS,
):
    """Megatron ``loss_func`` convention: ``(kl_sum over masked tokens, num_tokens, {key: [sum, n]})``.

    ``loss_mask`` has the logits' leading shape, or its transpose (``[b, s]`` mask with ``[s, b]``
    logits, as Megatron's output layer produces), so callers need not care which they hold.
    """
    kl = vocab_parallel_kl(student_logits, teacher_logits, temperature, tp_group, chunk_tokens)
    mask = loss_mask.float()
    if mask.shape != kl.shape:
        if mask.dim() == 2 and mask.t().shape == kl.shape:
            mask = mask.t()
        else:
            raise ValueError(
                f"loss_mask {tuple(loss_mask.shape)} does not match the logits' leading "
                f"shape {tuple(kl.shape)} (or its transpose)"
            )
    loss_sum = torch.sum(kl * mask)
    count = mask.sum()
    report = torch.stack([loss_sum.detach(), count.detach()])
    return loss_sum, count.to(torch.int), {report_key: report}
