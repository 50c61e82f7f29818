"""Run Megatron-Core 0.19.2 on CPU with the gloo backend.

Megatron-Core assumes CUDA in a few narrow places: its RNG tracker, default devices of buffers,
CUDA streams/events in the MoE dispatcher, type-string checks in the optimizer, collectives
gloo does not implement (uneven all-gather, list reduce-scatter), and, where Transformer Engine is
installed on a machine without a GPU, TE's CUDA kernels it calls whatever the layer spec. Each patch below targets one
such place, is applied once, and is recorded in ``applied_patches()`` so ``elastic-plugin info``
can say what was changed. Nothing is patched when CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

_APPLIED: list[str] = []
ENV_FLAG = "ELASTIC_PLUGIN_CPU"


def applied_patches() -> list[str]:
    """Names of the patches applied in this process, in order."""
    return list(_APPLIED)


def _patch(obj: Any, name: str, value: Any, label: str | None = None) -> None:
    setattr(obj, name, value)
    _APPLIED.append(label or f"{getattr(obj, '__name__', type(obj).__name__)}.{name}")


# --------------------------------------------------------------------------- RNG
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which would recurse.
    torch.default_generator.manual_seed(int(seed))


def _patch_rng() -> None:
    """Megatron's RNG tracker forks the *CUDA* generator; fork the CPU one instead."""
    from megatron.core.tensor_parallel import random as mrandom

    _patch(torch.cuda, "get_rng_state", _cpu_get_rng_state, "torch.cuda.get_rng_state")
    _patch(torch.cuda, "set_rng_state", _cpu_set_rng_state, "torch.cuda.set_rng_state")
    _patch(torch.cuda, "manual_seed", _cpu_manual_seed, "torch.cuda.manual_seed")
    _patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    # The tracker warns when the CPU generator changes inside a fork; here the "CUDA" generator
    # *is* the CPU one, so that warning would fire on every forked region and mean nothing.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


# ------------------------------------------------------------------------- devices
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "linspace",
    "eye",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_device(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda(device) else device


def _remap_device_kwarg(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # page-locking needs a CUDA driver (RoPE's CP slicing asks)
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


def _tensor_to(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        if args and _is_cuda(args[0]) and not isinstance(args[0], bool):
            args = (torch.device("cpu"),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return orig(self, *args, **kwargs)

    return to


def _tensor_cuda(self, device: Any = None, non_blocking: bool = False, **kwargs):
    return self


def _patch_devices() -> None:
    """Megatron allocates on ``torch.cuda.current_device()`` or ``"cuda"``: send those to the CPU."""
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"), "torch.cuda.current_device")
    # ``with torch.device(...)`` recognises the factories by identity, from a set it builds on
    # first use: built after the patch, it would hold the wrappers, and a meta-device context
    # (transformers' from_pretrained) would allocate real, uninitialised buffers instead
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _remap_device_kwarg(getattr(torch, name)), f"torch.{name}(device=cuda)")
    _patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to), "Tensor.to(cuda)")
    _patch(torch.Tensor, "cuda", _tensor_cuda, "Tensor.cuda")
    _patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type), "Tensor.type()")
    _patch(torch.nn.Module, "cuda", lambda self, device=None: self, "Module.cuda")


# ------------------------------------------------------------------------ type strings
def _tensor_type(orig: Callable) -> Callable:
    """Megatron's optimizer asserts ``param.type() == 'torch.cuda.FloatTensor'``; a CPU tensor
    answers with the CUDA spelling of its type (casts, ``type(dtype)``, are untouched)."""

    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        name = orig(self, *args, **kwargs)
        if (
            not args
            and not kwargs
            and isinstance(name, str)
            and name.startswith("torch.")
            and not name.startswith("torch.cuda.")
        ):
            return "torch.cuda." + name[len("torch.") :]
        return name

    return type_


# ------------------------------------------------------------------- streams/events
class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NullStream:
    """Stands in for ``torch.cuda.Stream``; one CPU "stream" that is always in sync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


_THE_STREAM = _NullStream()


def _move_splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron only moves *CUDA* split sizes to host lists; do it for CPU tensors too."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _patch_streams() -> None:
    _patch(torch.cuda, "Stream", _NullStream, "torch.cuda.Stream")
    _patch(torch.cuda, "Event", _NullEvent, "torch.cuda.Event")
    _patch(
        torch.cuda, "current_stream", lambda device=None: _THE_STREAM, "torch.cuda.current_stream"
    )
    _patch(
        torch.cuda, "default_stream", lambda device=None: _THE_STREAM, "torch.cuda.default_stream"
    )
    _patch(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext(), "torch.cuda.stream")
    _patch(torch.cuda, "synchronize", lambda device=None: None, "torch.cuda.synchronize")
    _patch(torch.Tensor, "record_stream", lambda self, stream: None, "Tensor.record_stream")
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    _patch(moe_utils, "maybe_move_tensor_to_cpu", _move_splits_to_host)
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _move_splits_to_host)


# ------------------------------------------------------------------- gloo collectives
def _is_gloo(group: Any) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "gloo"


def _uneven_all_gather(orig: Callable) -> Callable:
    """gloo's ``all_gather`` needs equal shapes; MoE with EP x TP gathers uneven token counts.
    Pad every piece to the largest first dim, gather, and copy the valid rows out."""

    @functools.wraps(orig)
    def all_gather(tensor_list, tensor, group=None, async_op=False):

        shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
        if len(shapes) == 1 or not _is_gloo(group) or async_op or tensor.dim() == 0:
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        orig(gathered, padded, group=group)
        for out, full in zip(tensor_list, gathered):
            out.copy_(full[: out.shape[0]])
        return None

    return all_gather


def _list_reduce_scatter(orig: Callable) -> Callable:
    """gloo has no list ``reduce_scatter``: all-reduce the concatenation, keep our slice."""

    @functools.wraps(orig)
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        import torch.distributed as dist

        if not _is_gloo(group) or async_op:
            kwargs = {} if op is None else {"op": op}
            return orig(output, input_list, group=group, async_op=async_op, **kwargs)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=op or dist.ReduceOp.SUM, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start : start + input_list[rank].numel()].view_as(output))
        return None

    return reduce_scatter


def _patch_collectives() -> None:
    import torch.distributed as dist

    _patch(dist, "all_gather", _uneven_all_gather(dist.all_gather), "dist.all_gather(uneven, gloo)")
    _patch(
        dist,
        "reduce_scatter",
        _list_reduce_scatter(dist.reduce_scatter),
        "dist.reduce_scatter(list, gloo)",
    )


def _run_fusions_eagerly() -> None:
    """Megatron's ``torch.compile``-fused element-wise functions run uncompiled on CPU
    (``deferred_compile.run_eagerly``); Megatron-LM's ``--disable-jit-fuser`` does the same."""
    from elastic_plugin.compat import deferred_compile

    deferred_compile.run_eagerly()
    _APPLIED.append("megatron fused functions: uncompiled")


# --------------------------------------------------------------------------- TE without a GPU
_MOE_TE_KERNELS = (  # megatron.core.transformer.moe.moe_utils: each None falls back to torch
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_and_pad_with_probs",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)


def _from_te(value: Any) -> bool:
    return (getattr(value, "__module__", "") or "").startswith("transformer_engine")


def _patch_te_kernels() -> None:
    """Transformer Engine importable but no GPU (TE installed on a CPU node): Megatron decides at
    import that TE is there and routes math through TE's CUDA kernels whatever the layer spec:
    the MoE router's gating GEMM and fused permute / top-k / aux loss, the optimizer's FusedAdam
    and multi-tensor helpers ("Found no NVIDIA driver" on the first call). Each is pointed at the
    implementation Megatron itself uses without TE; nothing changes where TE was not imported."""
    from megatron.core import utils as mutils
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_TE_KERNELS:
        if getattr(moe_utils, name, None) is not None:
            _patch(moe_utils, name, None, f"moe_utils.{name} -> torch (TE without a GPU)")
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mopt_base

    if _from_te(getattr(mopt, "Adam", None)):
        _patch(mopt, "Adam", torch.optim.AdamW, "optimizer.Adam -> torch AdamW (TE without a GPU)")
        _patch(mopt, "SGD", torch.optim.SGD)
        _patch(mopt, "USING_PYTORCH_OPTIMIZER", True)
    if _from_te(getattr(distrib_optimizer, "Adam", None)):
        _patch(distrib_optimizer, "Adam", torch.optim.Adam, "distrib_optimizer.Adam -> torch")
        _patch(distrib_optimizer, "HAVE_APEX_OR_TE", False)
        _patch(distrib_optimizer, "USING_TE_OPTIMIZER", False)
    if _from_te(getattr(mopt_base, "multi_tensor_applier", None)):
        _patch(mopt_base, "multi_tensor_applier", mutils.local_multi_tensor_applier)
        _patch(mopt_base, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)
    if _from_te(getattr(clip_grads, "multi_tensor_applier", None)):
        _patch(clip_grads, "multi_tensor_applier", mutils.local_multi_tensor_applier)
        _patch(clip_grads, "l2_norm_impl", mutils.local_multi_tensor_l2_norm)
        _patch(clip_grads, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)
        _patch(clip_grads, "multi_tensor_scale_tensor_impl", None)


def enable_cpu_megatron(force: bool = False) -> list[str]:
    """Make Megatron-Core run on CPU + gloo; a no-op when CUDA is available (unless ``force``).

    Idempotent. Returns the list of applied patches.
    """
    if _APPLIED:
        return applied_patches()
    if torch.cuda.is_available() and not force:
        return []
    _patch_rng()
    _patch_devices()
    _patch_streams()
    _patch_collectives()
    _patch_te_kernels()
    _run_fusions_eagerly()
    from elastic_plugin.compat.mamba_install import install_mamba_fallbacks

    patched = install_mamba_fallbacks()
    _APPLIED.extend(
        f"mamba:{name}"
        for name in (patched.get("patched", []) if isinstance(patched, dict) else [])
    )
    return applied_patches()


def maybe_enable_from_env() -> list[str]:
    """Enable when ``ELASTIC_PLUGIN_CPU=1`` is set (for Megatron scripts that don't call us)."""
    if os.environ.get(ENV_FLAG, "0") not in ("", "0", "false", "False"):
        return enable_cpu_megatron()
    return []
