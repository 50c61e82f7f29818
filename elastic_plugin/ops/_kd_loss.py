"""``elastic_plugin::kd_row_stats`` / ``kd_grad``: the distillation loss's two passes over logits.

With ``s = student / T`` and ``t = teacher / T`` row by row (one rank's vocab shard):
``kd_row_stats`` gives ``[5, rows]`` = ``max s``, ``sum e^(s - max s)``, ``max t``,
``sum e^(t - max t)`` and ``a = sum e^(t - max t) (t - s)`` (a teacher value of ``-inf`` adds
nothing), in FP64 (the KL is a difference of log-sums: sums rounded to FP32 first lose digits); ``kd_grad`` gives ``scale_r (e^(s - lse_s) - e^(t - lse_t))`` in the student's dtype
from the log-normalisers ``lse [2, rows]``. The C++ kernels (``csrc/kd_loss_cpu.cpp``, CPU)
read each row once per pass; the PyTorch compositions below are the references and the
fallbacks (CUDA, or no extension), computed ``chunk`` rows at a time so that no FP32 temporary
the size of the logits exists.
"""

from __future__ import annotations

import torch

from elastic_plugin.ops._loader import cpu_kernel_serves, register_cpu_ops

STATS_OP = "elastic_plugin::kd_row_stats"
STATS_SCHEMA = "(Tensor student, Tensor teacher, float temperature) -> Tensor"
GRAD_OP = "elastic_plugin::kd_grad"
GRAD_SCHEMA = (
    "(Tensor student, Tensor teacher, Tensor lse, Tensor scale, float temperature) -> Tensor"
)
REFERENCE_CHUNK_ROWS = 1024  # rows per step of the PyTorch compositions (memory, not math)


def check_logits(who: str, student: torch.Tensor, teacher: torch.Tensor) -> None:
    """Metadata checks shared by every implementation."""
    if student.dim() != 2 or student.shape != teacher.shape:
        raise ValueError(
            f"{who}: student and teacher must be 2-D [rows, vocab] of one shape, got "
            f"{tuple(student.shape)} and {tuple(teacher.shape)}"
        )
    if student.dtype != teacher.dtype or student.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f"{who}: student and teacher must both be float32 or both bfloat16, got "
            f"{student.dtype} and {teacher.dtype}"
        )


def reference_kd_row_stats(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Pure-PyTorch ``kd_row_stats``: ``[5, rows]`` FP64."""
    check_logits("kd_row_stats", student, teacher)
    rows = student.shape[0]
    out = torch.empty(5, rows, dtype=torch.float64, device=student.device)
    for a in range(0, rows, REFERENCE_CHUNK_ROWS):
        sl = slice(a, min(a + REFERENCE_CHUNK_ROWS, rows))
        s = student[sl].float() / temperature  # new tensors: modified in place below
        t = teacher[sl].float() / temperature
        m_s, m_t = s.amax(-1), t.amax(-1)
        cross = torch.sub(t, s)
        e_s = s.sub_(m_s.unsqueeze(-1)).exp_()
        e_t = t.sub_(m_t.unsqueeze(-1)).exp_()
        cross.mul_(e_t).masked_fill_(e_t == 0, 0.0)  # e^t = 0 adds nothing, not 0 * inf
        out[0, sl], out[1, sl] = m_s, e_s.sum(-1, dtype=torch.float64)
        out[2, sl], out[3, sl] = m_t, e_t.sum(-1, dtype=torch.float64)
        out[4, sl] = cross.sum(-1, dtype=torch.float64)
    return out


def reference_kd_grad(
    student: torch.Tensor,
    teacher: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Pure-PyTorch ``kd_grad``: ``[rows, vocab]`` in the student's dtype."""
    check_logits("kd_grad", student, teacher)
    grad = torch.empty_like(student)
    for a in range(0, student.shape[0], REFERENCE_CHUNK_ROWS):
        sl = slice(a, a + REFERENCE_CHUNK_ROWS)
        p_s = (student[sl].float() / temperature).sub_(lse[0, sl].unsqueeze(-1)).exp_()
        p_t = (teacher[sl].float() / temperature).sub_(lse[1, sl].unsqueeze(-1)).exp_()
        grad[sl] = p_s.sub_(p_t).mul_(scale[sl].unsqueeze(-1))
    return grad


def _fake_stats(student, teacher, temperature):
    check_logits("kd_row_stats", student, teacher)
    return student.new_empty((5, student.shape[0]), dtype=torch.float64)


def _fake_grad(student, teacher, lse, scale, temperature):
    check_logits("kd_grad", student, teacher)
    return torch.empty_like(student)


_LIB = register_cpu_ops(  # kept alive for the life of the process
    [
        (STATS_OP, STATS_SCHEMA, reference_kd_row_stats, _fake_stats),
        (GRAD_OP, GRAD_SCHEMA, reference_kd_grad, _fake_grad),
    ]
)


def kd_row_stats(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[5, rows]`` FP64 row statistics of ``student`` / ``teacher`` logits ``[rows, vocab]``
    divided by ``temperature`` (see the module docstring)."""
    check_logits("kd_row_stats", student, teacher)
    if cpu_kernel_serves(student):
        return torch.ops.elastic_plugin.kd_row_stats.default(student, teacher, temperature)
    return reference_kd_row_stats(student, teacher, temperature)


def kd_grad(
    student: torch.Tensor,
    teacher: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """``scale_r (softmax(s) - softmax(t))`` row by row, in the student's dtype, from the
    log-normalisers ``lse [2, rows]`` (student, teacher) of the scaled logits."""
    check_logits("kd_grad", student, teacher)
    if cpu_kernel_serves(student):
        return torch.ops.elastic_plugin.kd_grad.default(student, teacher, lse, scale, temperature)
    return reference_kd_grad(student, teacher, lse, scale, temperature)
