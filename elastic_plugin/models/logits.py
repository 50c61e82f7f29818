"""Logits computed batch-major, so that Megatron's ``[s, b, V] -> [b, s, V]`` copy costs nothing.

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

__all__ = ["batch_major_logits", "output_layer_of"]


def output_layer_of(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer of a model chunk (inside DDP / Float16Module wrappers), or None on a
    pipeline stage without one."""
    module: Any = chunk
    while not hasattr(module, "output_layer") and hasattr(module, "module"):
        module = module.module
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
