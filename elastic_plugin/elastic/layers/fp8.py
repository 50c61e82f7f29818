"""FP8 GEMMs for elastic linears: the active block of every block linear, in E4M3.

Why: large runs train and serve in FP8, and the sliced linear's GEMM on an active prefix is
where FP8 tensor cores pay. Without Transformer Engine the GEMM is ``torch._scaled_mm`` on an
FP8-capable GPU (sm_89+, sizes multiple of 16), else the exact CPU emulation of
``ops.fp8_prefix_linear`` (same numerics, used to check the GPU path).

The recipe is "current scaling" (TE's ``Float8CurrentScaling``): each operand is scaled by its
amax at the time of the GEMM, per tensor or per row (per token of x, per output row of the
weight). Only the forward GEMM is FP8; the backward is straight-through in the input dtype (the
gradients of the unquantized GEMM on the same active block), i.e. FP8 forward, high-precision
backward. Under tensor parallelism the amax of an operand sharded along the contraction dim is
reduced (MAX) over the layer's TP group, so a TP run quantizes exactly as one rank does.

As in Megatron with Transformer Engine, only the transformer blocks' linears (attention, MLPs,
experts, Mamba in/out projections) run in FP8; the output layer and the MoE router keep the
model's dtype (their outputs are logits, which FP8 rounding would distort most).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from elastic_plugin import ops
from elastic_plugin.elastic.config import FP8_GEMMS as GEMM_CHOICES  # elastic.fp8_gemm's values
from elastic_plugin.ops import FP8_METHODS, FP8_SCALINGS, AmaxReduce

OFF = "off"
assert GEMM_CHOICES == (OFF, *FP8_SCALINGS)
METHODS = FP8_METHODS
EXEMPT_ATTR = "_elastic_fp8_exempt"  # set on linears that stay in the model dtype (output layer)

__all__ = ["GEMM_CHOICES", "Fp8Recipe", "active_recipe", "fp8_gemm", "fp8_linear", "runs_fp8"]


@dataclass(frozen=True)
class Fp8Recipe:
    """How elastic linears quantize: ``scaling`` per ``"tensor"`` or ``"row"``; ``method`` as
    ``ops.fp8_prefix_linear`` (``"auto"``: ``_scaled_mm`` where the GPU allows, else emulate)."""

    scaling: str = "tensor"
    method: str = "auto"

    def __post_init__(self) -> None:
        if self.scaling not in FP8_SCALINGS:
            raise ValueError(
                f"fp8_gemm: scaling must be one of {FP8_SCALINGS} (or {OFF!r} "
                f"for none), got {self.scaling!r}"
            )
        if self.method not in METHODS:
            raise ValueError(f"fp8_gemm: method must be one of {METHODS}, got {self.method!r}")


_ACTIVE: list[Fp8Recipe | None] = [None]


def active_recipe() -> Fp8Recipe | None:
    """The recipe of the innermost :func:`fp8_gemm` context, or None (no FP8)."""
    return _ACTIVE[-1]


@contextmanager
def fp8_gemm(scaling: str = "tensor", method: str = "auto") -> Iterator[Fp8Recipe | None]:
    """Run elastic linears' GEMMs in FP8 inside the block (like TE's ``fp8_autocast``).

    ``scaling="off"`` disables FP8 inside (e.g. for a teacher forward within a student's
    context). Contexts nest; the innermost wins. Validated on entry, before any GEMM runs."""
    recipe = None if scaling == OFF else Fp8Recipe(scaling, method)
    _ACTIVE.append(recipe)
    try:
        yield recipe
    finally:
        _ACTIVE.pop()


def runs_fp8(module: torch.nn.Module) -> bool:
    """Whether ``module`` (an elastic linear) computes in FP8 now."""
    return _ACTIVE[-1] is not None and not getattr(module, EXEMPT_ATTR, False)


def _amax_max(group) -> AmaxReduce:
    """A MAX all-reduce of an amax over ``group`` (None when the group is a single rank)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return reduce


class _Fp8Linear(torch.autograd.Function):
    """``x @ weight.T`` in FP8 forward; straight-through high-precision backward."""

    @staticmethod
    def forward(ctx, x, weight, recipe, x_reduce, w_reduce):
        ctx.save_for_backward(x, weight)
        n, k = weight.shape
        return ops.fp8_prefix_linear(
            x,
            weight,
            n,
            k,
            recipe.scaling,
            method=recipe.method,
            x_amax_reduce=x_reduce,
            w_amax_reduce=w_reduce,
        )

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.reshape(-1, weight.shape[0]).t() @ x.reshape(-1, weight.shape[1])
        return grad_x, grad_w, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    recipe: Fp8Recipe,
    tp_group=None,
    x_sharded: bool = False,
    w_sharded: bool = False,
) -> torch.Tensor:
    """``x @ weight.T`` (weight: the active ``[n, k]`` block, a view or a gathered copy) in FP8.

    ``x_sharded`` / ``w_sharded``: the operand is this rank's part, along k, of one split over
    ``tp_group`` (a row-parallel input and weight), so its amax is reduced over the group; a
    per-tensor weight scale of a column-parallel weight (sharded along n) is reduced as well,
    which makes the scales those of the unsharded layer.
    """
    row = recipe.scaling == "row"
    x_reduce = _amax_max(tp_group) if x_sharded else None
    w_reduce = _amax_max(tp_group) if (w_sharded or not row) else None
    return _Fp8Linear.apply(x, weight, recipe, x_reduce, w_reduce)
