"""``elastic_plugin::prefix_linear``: a linear layer on a prefix of its weight, without copying it.

Sliced mode runs a nested width as a prefix of the full (importance-ordered) weight:

    prefix_linear(x, weight, bias, n, k) == x[..., :k] @ weight[:n, :k].T + bias[:n]

Column-parallel layers keep the first ``n`` outputs (``k = K``), row-parallel layers the first
``k`` inputs (``n = N``).  The kernel (``csrc/prefix_linear.cpp``) hands BLAS the strided
views, so the weight is read in place: the cost is that of a genuinely smaller GEMM, not of
the full one followed by a mask, and no memory goes to a sliced copy.

Gradients have the full shapes autograd expects: ``x`` gets zeros past column ``k``, the
weight is non-zero only in its ``[:n, :k]`` block, the bias only in ``[:n]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_plugin.ops._gather import as_int
from elastic_plugin.ops._loader import INFO

OP_NAME = "elastic_plugin::prefix_linear"
SCHEMA = "(Tensor x, Tensor weight, Tensor? bias, SymInt n, SymInt k) -> Tensor"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WHO = "prefix_linear"


def check_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, k: int
) -> None:
    """Validate metadata like the C++ op does (shapes only, so it also runs under tracing)."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHO}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{_WHO}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    n = as_int("n", n)
    k = as_int("k", k)
    if x.layout != torch.strided or weight.layout != torch.strided:
        raise TypeError(
            f"{_WHO}: x and weight must be strided (dense) tensors, got layouts {x.layout} and {weight.layout}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{_WHO}: x must be float16, bfloat16, float32 or float64, got dtype {x.dtype}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(
            f"{_WHO}: weight dtype {weight.dtype} differs from x dtype {x.dtype}; they must match"
        )
    if weight.device != x.device:
        raise ValueError(
            f"{_WHO}: weight is on {weight.device} but x is on {x.device}; they must be on the same device"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"{_WHO}: weight must be 2-D [N, K], got a {weight.dim()}-D tensor of shape {list(weight.shape)}"
        )
    if x.dim() == 0:
        raise ValueError(f"{_WHO}: x must have at least 1 dimension, got a 0-d tensor")
    if bias is not None:
        if bias.layout != torch.strided:
            raise TypeError(f"{_WHO}: bias must be a strided (dense) tensor")
        if bias.dtype != x.dtype:
            raise TypeError(
                f"{_WHO}: bias dtype {bias.dtype} differs from x dtype {x.dtype}; they must match"
            )
        if bias.device != x.device:
            raise ValueError(
                f"{_WHO}: bias is on {bias.device} but x is on {x.device}; they must be on the same device"
            )
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{_WHO}: bias must be 1-D of size weight.size(0)={weight.shape[0]}, got shape {list(bias.shape)}"
            )
    if n < 0 or n > weight.shape[0]:
        raise ValueError(f"{_WHO}: n must be in [0, weight.size(0)={weight.shape[0]}], got {n}")
    if k < 0 or k > weight.shape[1]:
        raise ValueError(f"{_WHO}: k must be in [0, weight.size(1)={weight.shape[1]}], got {k}")
    if k > x.shape[-1]:
        raise ValueError(f"{_WHO}: k must be <= x.size(-1)={x.shape[-1]}, got {k}")


def reference_prefix_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, k: int
) -> torch.Tensor:
    """Pure-PyTorch implementation (the fallback); F.linear also takes the views without copying."""
    check_args(x, weight, bias, n, k)
    return F.linear(x[..., :k], weight[:n, :k], None if bias is None else bias[:n])


def _fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, k: int
) -> torch.Tensor:
    """Shape rule: x's shape with its last dim replaced by n."""
    check_args(x, weight, bias, n, k)
    return x.new_empty((*x.shape[:-1], n))


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias, n, k = inputs
    saved_x = x if ctx.needs_input_grad[1] else None
    saved_w = weight if ctx.needs_input_grad[0] else None
    ctx.save_for_backward(saved_x, saved_w)
    ctx.n, ctx.k = n, k
    ctx.x_width = x.shape[-1]
    ctx.w_shape = weight.shape
    ctx.has_bias = bias is not None


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Prefix-sized GEMMs, zero-padded to the full shapes (differentiable, so double backward works)."""
    x, weight = ctx.saved_tensors
    n, k = ctx.n, ctx.k
    big_n, big_k = ctx.w_shape
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = F.pad(grad.matmul(weight[:n, :k]), (0, ctx.x_width - k))
    if ctx.needs_input_grad[1]:
        block = grad.reshape(-1, n).t().matmul(x[..., :k].reshape(-1, k))
        grad_w = F.pad(block, (0, big_k - k, 0, big_n - n))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = F.pad(grad.reshape(-1, n).sum(0), (0, big_n - n))
    return grad_x, grad_w, grad_b, None, None


def _register() -> None:
    if not INFO.uses_extension:
        torch.library.custom_op(OP_NAME, reference_prefix_linear, mutates_args=(), schema=SCHEMA)
    torch.library.register_fake(OP_NAME, _fake, lib=_LIB)
    torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_LIB)


# Keeps the Python registrations alive for the life of the process.
_LIB = torch.library.Library("elastic_plugin", "FRAGMENT")
_register()


def prefix_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, k: int
) -> torch.Tensor:
    """``x[..., :k] @ weight[:n, :k].T (+ bias[:n])``, reading ``weight`` in place.

    Args:
        x: ``[..., >= k]`` floating-point tensor (float16, bfloat16, float32, float64).
        weight: ``[N, K]``, same dtype and device as x; row-major is the copy-free case.
        bias: ``[N]`` or None.
        n: output features kept, ``0 <= n <= N``.
        k: input features used, ``0 <= k <= min(K, x.shape[-1])``.

    Returns:
        ``[..., n]`` tensor of x's dtype.

    Raises:
        TypeError / ValueError naming the argument for unsupported dtypes, shapes or devices.
    """
    check_args(x, weight, bias, n, k)
    return torch.ops.elastic_plugin.prefix_linear.default(x, weight, bias, n, k)
