"""``elastic_plugin::ordered_gather``: keep the first ``k`` entries of a permutation along a dim.

Nested models store every smaller width as a prefix of an importance ranking, so reordering
or slicing a weight is one gather of a permutation prefix:

    ordered_gather(src, perm, k, dim) == src.index_select(dim, perm[:k]).contiguous()

The kernels are C++/CUDA (``csrc/``) when the extension is loaded, else the pure-PyTorch
definition below.  Either way this module registers the fake (meta) rule and autograd,
so the op passes ``torch.library.opcheck`` and traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import operator
from typing import SupportsIndex, cast, overload

import torch

from elastic_plugin.ops._loader import INFO

OP_NAME = "elastic_plugin::ordered_gather"
SCHEMA = "(Tensor src, Tensor perm, SymInt k, int dim) -> Tensor"


@overload
def as_int(name: str, value: int) -> int: ...


@overload
def as_int(name: str, value: torch.SymInt) -> torch.SymInt: ...


@overload
def as_int(name: str, value: object) -> int | torch.SymInt: ...


def as_int(name: str, value: object) -> int | torch.SymInt:
    """``value`` as an int (SymInts pass through); TypeError naming ``name`` otherwise."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"ordered_gather: {name} must be an int, got {type(value).__name__}")
    return operator.index(cast(SupportsIndex, value))  # its type has __index__ (checked above)


def check_args(src: torch.Tensor, perm: torch.Tensor, k: int, dim: int) -> int:
    """Validate metadata (not values) like the C++ op does; return ``dim`` in ``[0, src.dim())``.

    Runs before any work and under tracing (shapes only, no device sync).
    """
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"ordered_gather: src must be a torch.Tensor, got {type(src).__name__}")
    if not isinstance(perm, torch.Tensor):
        raise TypeError(f"ordered_gather: perm must be a torch.Tensor, got {type(perm).__name__}")
    k = as_int("k", k)
    dim = as_int("dim", dim)
    if src.layout != torch.strided:
        raise TypeError(
            f"ordered_gather: src must be a strided (dense) tensor, got layout {src.layout}"
        )
    if perm.dtype != torch.int64:
        raise TypeError(
            f"ordered_gather: perm must be an int64 (torch.long) tensor, got dtype {perm.dtype}"
        )
    if perm.dim() != 1:
        raise ValueError(
            f"ordered_gather: perm must be 1-D, got a {perm.dim()}-D tensor of shape {list(perm.shape)}"
        )
    if perm.device != src.device:
        raise ValueError(
            f"ordered_gather: perm is on {perm.device} but src is on {src.device}; perm must be on src's device"
        )
    ndim = src.dim()
    if ndim == 0:
        raise ValueError("ordered_gather: src must have at least 1 dimension, got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"ordered_gather: dim must be in [{-ndim}, {ndim - 1}] for a {ndim}-D src, got {dim}"
        )
    if k < 0 or k > perm.shape[0]:
        raise ValueError(f"ordered_gather: k must be in [0, len(perm)={perm.shape[0]}], got {k}")
    return dim % ndim


def reference_ordered_gather(
    src: torch.Tensor, perm: torch.Tensor, k: int, dim: int
) -> torch.Tensor:
    """Pure-PyTorch implementation (the fallback, and the CUDA path of a CPU-only build)."""
    d = check_args(src, perm, k, dim)
    kept = perm[:k]
    if k > 0:
        # One small reduction (and, on a GPU, one sync) so bad indices give a clear error.
        lo, hi = (int(v) for v in torch.aminmax(kept))
        if lo < 0 or hi >= src.shape[d]:
            raise ValueError(
                f"ordered_gather: perm[:k] values must be in [0, src.size(dim)={src.shape[d]}), "
                f"got min {lo} and max {hi}"
            )
    return src.index_select(d, kept).contiguous()


def _fake(src: torch.Tensor, perm: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Shape rule: src's shape with size k at dim; always a fresh contiguous tensor."""
    d = check_args(src, perm, k, dim)
    shape = list(src.shape)
    shape[d] = k
    return src.new_empty(shape)


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    src, perm, k, dim = inputs
    ctx.save_for_backward(perm)
    ctx.k = k
    ctx.dim = dim % src.dim()
    ctx.src_shape = src.shape


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
    """Scatter grad back to the kept rows: zeros shaped like src, index_add at perm[:k]."""
    (perm,) = ctx.saved_tensors
    grad_src = None
    if ctx.needs_input_grad[0]:
        grad_src = grad.new_zeros(ctx.src_shape).index_add(ctx.dim, perm[: ctx.k], grad)
    return grad_src, None, None, None


def _register() -> None:
    if not INFO.uses_extension:
        torch.library.custom_op(OP_NAME, reference_ordered_gather, mutates_args=(), schema=SCHEMA)
    elif not INFO.cuda_kernels:
        torch.library.impl(OP_NAME, "cuda", reference_ordered_gather, lib=_LIB)
    torch.library.register_fake(OP_NAME, _fake, lib=_LIB)
    torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_LIB)


# Keeps the Python registrations alive for the life of the process.
_LIB = torch.library.Library("elastic_plugin", "FRAGMENT")
_register()


def ordered_gather(src: torch.Tensor, perm: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Return ``src.index_select(dim, perm[:k])`` as a new contiguous tensor.

    Args:
        src: any strided tensor (any dtype, any strides).
        perm: 1-D int64 tensor on src's device; usually an importance ranking of ``dim``.
        k: how many leading entries of ``perm`` to keep, ``0 <= k <= len(perm)``.
        dim: the dimension to gather (negative counts from the end).

    Raises:
        TypeError / ValueError naming the bad argument (perm values out of
        ``[0, src.size(dim))`` included) before any data is copied.
    """
    check_args(src, perm, k, dim)
    return torch.ops.elastic_plugin.ordered_gather.default(src, perm, k, dim)
