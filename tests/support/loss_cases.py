"""Rank-pool cases for the elastic losses: vocab-parallel KL under TP vs the single-rank reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Full-vocab ``T² · KL(p_t ‖ p_s)`` per token with PyTorch's own ``kl_div``."""
    log_s = F.log_softmax(student / temperature, dim=-1)
    log_t = F.log_softmax(teacher / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1) * temperature**2


def random_logits(
    shape: tuple[int, ...], seed: int, scale: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (student, teacher, upstream gradient) on every rank that uses the same seed."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(shape, generator=gen, dtype=torch.float64).float() * scale
    teacher = student + torch.randn(shape, generator=gen, dtype=torch.float64).float() * scale
    return student, teacher


def tp_kl_matches_reference(
    tp: int = 2,
    shape: tuple[int, ...] = (3, 5, 16),
    temperature: float = 2.0,
    seed: int = 7,
    use_default_group: bool = True,
    chunk_tokens: int | None = None,
) -> dict:
    """Each TP rank holds a contiguous vocab slice of the same full logits; compare its per-token KL
    and its gradient shard with the full-vocab reference computed locally."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from elastic_plugin.elastic.losses import vocab_parallel_kl
    from elastic_plugin.parallel import Layout, initialize_layout

    initialize_layout(Layout(tp=tp))
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    student, teacher = random_logits(tuple(shape), seed)
    weights = torch.rand(tuple(shape[:-1]), generator=torch.Generator().manual_seed(seed + 1))

    ref_student = student.clone().requires_grad_(True)
    ref_teacher = teacher.clone().requires_grad_(True)
    ref = reference_kl(ref_student, ref_teacher, temperature)
    (ref * weights).sum().backward()

    local = shape[-1] // world
    sl = slice(rank * local, (rank + 1) * local)
    my_student = student[..., sl].clone().requires_grad_(True)
    my_teacher = teacher[..., sl].clone().requires_grad_(True)
    group = None if use_default_group else parallel_state.get_tensor_model_parallel_group()
    kl = vocab_parallel_kl(my_student, my_teacher, temperature, group, chunk_tokens)
    (kl * weights).sum().backward()
    student_grad, ref_grad = my_student.grad, ref_student.grad
    assert student_grad is not None and ref_grad is not None  # both took part in backward()

    shards = [torch.empty_like(student_grad) for _ in range(world)]
    dist.all_gather(
        shards, student_grad.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    gathered = torch.cat(shards, dim=-1)
    return {
        "tp_rank": rank,
        "tp_world": world,
        "kl_shape": list(kl.shape),
        "kl_max_rel_diff": float(((kl - ref).abs() / ref.abs().clamp_min(1e-12)).max()),
        "kl_min": float(kl.min()),
        "grad_max_rel_diff": float((gathered - ref_grad).abs().max() / ref_grad.abs().max()),
        "local_grad_max_abs_diff": float((student_grad - ref_grad[..., sl]).abs().max()),
        "grad_max_abs": float(ref_grad.abs().max()),
        "teacher_grad_is_none": my_teacher.grad is None,
        "self_kl_max_abs": float(
            vocab_parallel_kl(
                my_student.detach(), my_student.detach(), temperature, group, chunk_tokens
            )
            .abs()
            .max()
        ),
    }
