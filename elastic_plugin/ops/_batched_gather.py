"""``elastic_plugin::ordered_gather_many``: one permutation prefix applied to several tensors.

Reordering a layer by an importance ranking touches several tensors at once (an FFN's fc1
rows and bias, fc2 columns; a Mamba in-projection's blocks), each along its own dim:

    ordered_gather_many(tensors, perm, k, dims)[i] == ordered_gather(tensors[i], perm, k, dims[i])

One call checks ``perm`` once and, on CPU, copies every tensor in one parallel region
(``csrc/gather_many.cpp``); on CUDA it loops over the single-tensor kernel.  Without the
extension, the pure-PyTorch definition below is registered under the same schema.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastic_plugin.ops._gather import as_int, reference_ordered_gather
from elastic_plugin.ops._loader import INFO

OP_NAME = "elastic_plugin::ordered_gather_many"
SCHEMA = "(Tensor[] tensors, Tensor perm, SymInt k, int[] dims) -> Tensor[]"
_WHO = "ordered_gather_many"


def check_args(
    tensors: Sequence[torch.Tensor], perm: torch.Tensor, k: int, dims: Sequence[int]
) -> list[int]:
    """Validate metadata (not values) like the C++ op does; return dims normalized to ``[0, ndim)``."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"{_WHO}: tensors must be a list of torch.Tensor, got {type(tensors).__name__}"
        )
    if isinstance(dims, torch.Tensor) or not isinstance(dims, (list, tuple)):
        raise TypeError(f"{_WHO}: dims must be a list of int, got {type(dims).__name__}")
    if not isinstance(perm, torch.Tensor):
        raise TypeError(f"{_WHO}: perm must be a torch.Tensor, got {type(perm).__name__}")
    k = as_int("k", k)
    if perm.dtype != torch.int64:
        raise TypeError(
            f"{_WHO}: perm must be an int64 (torch.long) tensor, got dtype {perm.dtype}"
        )
    if perm.dim() != 1:
        raise ValueError(
            f"{_WHO}: perm must be 1-D, got a {perm.dim()}-D tensor of shape {list(perm.shape)}"
        )
    if len(dims) != len(tensors):
        raise ValueError(
            f"{_WHO}: dims must have one entry per tensor ({len(tensors)} tensors), got {len(dims)} dims"
        )
    if k < 0 or k > perm.shape[0]:
        raise ValueError(f"{_WHO}: k must be in [0, len(perm)={perm.shape[0]}], got {k}")
    normalized = []
    for i, (t, dim) in enumerate(zip(tensors, dims)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHO}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        dim = as_int(f"dims[{i}]", dim)
        if t.layout != torch.strided:
            raise TypeError(
                f"{_WHO}: tensors[{i}] must be a strided (dense) tensor, got layout {t.layout}"
            )
        if t.device != perm.device:
            raise ValueError(
                f"{_WHO}: tensors[{i}] is on {t.device} but perm is on {perm.device}; "
                "every tensor must be on perm's device"
            )
        ndim = t.dim()
        if ndim == 0:
            raise ValueError(
                f"{_WHO}: tensors[{i}] must have at least 1 dimension, got a 0-d tensor"
            )
        if not -ndim <= dim < ndim:
            raise ValueError(
                f"{_WHO}: dims[{i}] must be in [{-ndim}, {ndim - 1}] for the {ndim}-D tensors[{i}], got {dim}"
            )
        normalized.append(dim % ndim)
    return normalized


def reference_ordered_gather_many(
    tensors: Sequence[torch.Tensor], perm: torch.Tensor, k: int, dims: Sequence[int]
) -> list[torch.Tensor]:
    """Pure-PyTorch implementation (the fallback): one range check, then index_select per tensor."""
    dims = check_args(tensors, perm, k, dims)
    kept = perm[:k]
    if k > 0 and tensors:
        lo, hi = (int(v) for v in torch.aminmax(kept))
        for i, (t, d) in enumerate(zip(tensors, dims)):
            if lo < 0 or hi >= t.shape[d]:
                raise ValueError(
                    f"{_WHO}: perm[:k] values must be in [0, tensors[{i}].size(dims[{i}])={t.shape[d]}), "
                    f"got min {lo} and max {hi}"
                )
    return [reference_ordered_gather(t, perm, k, d) for t, d in zip(tensors, dims)]


def _fake(
    tensors: list[torch.Tensor], perm: torch.Tensor, k: int, dims: list[int]
) -> list[torch.Tensor]:
    """Shape rule: each tensor's shape with size k at its dim; always fresh contiguous tensors."""
    normalized = check_args(tensors, perm, k, dims)
    outputs = []
    for t, d in zip(tensors, normalized):
        shape = list(t.shape)
        shape[d] = k
        outputs.append(t.new_empty(shape))
    return outputs


def _setup_context(ctx, inputs: tuple, output: list[torch.Tensor]) -> None:
    tensors, perm, k, dims = inputs
    ctx.save_for_backward(perm)
    ctx.k = k
    ctx.dims = [d % t.dim() for t, d in zip(tensors, dims)]
    ctx.shapes = [t.shape for t in tensors]


def _backward(
    ctx, grads: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], None, None, None]:
    """Each grad scattered back to its tensor's kept rows (zeros elsewhere)."""
    (perm,) = ctx.saved_tensors
    kept = perm[: ctx.k]
    grad_tensors: list[torch.Tensor | None] = []
    for grad, shape, d in zip(grads, ctx.shapes, ctx.dims):
        if grad is None:  # this output did not reach the loss
            grad_tensors.append(None)
        else:
            grad_tensors.append(grad.new_zeros(shape).index_add(d, kept, grad))
    return grad_tensors, None, None, None


def _register() -> None:
    if not INFO.uses_extension:
        torch.library.custom_op(
            OP_NAME, reference_ordered_gather_many, mutates_args=(), schema=SCHEMA
        )
    torch.library.register_fake(OP_NAME, _fake, lib=_LIB)
    torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_LIB)


# Keeps the Python registrations alive for the life of the process.
_LIB = torch.library.Library("elastic_plugin", "FRAGMENT")
_register()


def ordered_gather_many(
    tensors: Sequence[torch.Tensor], perm: torch.Tensor, k: int, dims: Sequence[int]
) -> list[torch.Tensor]:
    """Return ``[t.index_select(d, perm[:k]) for t, d in zip(tensors, dims)]`` as new contiguous tensors.

    Args:
        tensors: strided tensors on perm's device (any dtypes, shapes and strides).
        perm: 1-D int64 ranking shared by all tensors.
        k: how many leading entries of ``perm`` to keep, ``0 <= k <= len(perm)``.
        dims: the dim gathered in each tensor (negative counts from the end), one per tensor.

    Raises:
        TypeError / ValueError naming the bad argument (``tensors[i]``, ``dims[i]``, ...),
        incl. perm values outside ``[0, tensors[i].size(dims[i]))``, before any data is copied.
    """
    check_args(tensors, perm, k, dims)
    return list(
        torch.ops.elastic_plugin.ordered_gather_many.default(list(tensors), perm, k, list(dims))
    )
