"""What a model does at its output layer: logits computed batch-major, so that Megatron's
``[s, b, V] -> [b, s, V]`` copy costs nothing (``batch_major_logits``), or no logits at all for a
pass that only reads the hidden states (``without_logits``).

A ``HybridModel`` called without labels returns ``logits.transpose(0, 1).contiguous()``: with a
micro-batch above one that is a copy of the whole ``[tokens, V/tp]`` tensor, and its gradient
is copied back the same way. For distillation both the teacher's and the student's logits go
through it: measured on SmolLM2-135M (49,152-token vocabulary, 4 x 512 tokens, 2 CPU cores) the
three copies took 1.3-1.7 s of a 24 s elastic step. Inside ``batch_major_logits`` the output
layer is fed ``[b, s, h]`` (the hidden states transposed: a copy of ``h`` per token, not ``V``)
and hands back its ``[b, s, V]`` result as a ``[s, b, V]`` view; Megatron's transpose then
lands on contiguous memory and ``contiguous()`` returns it as it is. Same numbers, same
gradients (the test compares them); only the copies are gone.

Not used where the output layer's first dimension must be the sequence: sequence parallelism
(it gathers along it); and only for calls without labels (Megatron's cross-entropy views its
``[s, b, V]`` input as 2-D, which needs the usual layout).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["batch_major_logits", "output_layer_of", "without_logits"]


def _model(chunk: torch.nn.Module) -> Any:
    """The Megatron model inside DDP / Float16Module wrappers."""
    module: Any = chunk
    while not hasattr(module, "output_layer") and hasattr(module, "module"):
        module = module.module
    return module


def output_layer_of(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer of a model chunk (inside DDP / Float16Module wrappers), or None on a
    pipeline stage without one."""
    module = _model(chunk)
    if not getattr(module, "post_process", False):
        return None
    return getattr(module, "output_layer", None)


def _batch_major_input(module, args, kwargs):
    hidden, *rest = args
    return (hidden.transpose(0, 1).contiguous(), *rest), kwargs


def _sequence_major_view(module, args, kwargs, output):
    logits, bias = output
    return logits.transpose(0, 1), bias


@contextmanager
def batch_major_logits(*chunks: torch.nn.Module) -> Iterator[None]:
    """Within this block, forwards of ``chunks`` (without labels) compute their logits in
    ``[b, s, V]`` memory order (see the module docstring); nothing changes outside it."""
    handles = []
    try:
        for chunk in chunks:
            layer = output_layer_of(chunk)
            if layer is None or getattr(layer, "sequence_parallel", False):
                continue
            handles.append(layer.register_forward_pre_hook(_batch_major_input, with_kwargs=True))
            handles.append(layer.register_forward_hook(_sequence_major_view, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


class _HiddenStates(torch.nn.Module):
    """Stands in for the output layer: hands its input on, as ``(output, bias)``."""

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden, None


@contextmanager
def without_logits(*chunks: torch.nn.Module) -> Iterator[None]:
    """Within this block, forwards of ``chunks`` stop before the output layer: the model
    returns its final hidden states (``[b, s, h]``) instead of logits. For passes that only read
    activations (importance statistics): the logits GEMM is ``2 h V`` FLOPs a token, a fifth of
    SmolLM2-135M's forward, and its ``[tokens, V]`` result is never used there."""
    swapped = []
    try:
        for chunk in chunks:
            if output_layer_of(chunk) is None:
                continue
            module = _model(chunk)
            swapped.append((module, module.output_layer))
            module.output_layer = _HiddenStates()
        yield
    finally:
        for module, layer in swapped:
            module.output_layer = layer
