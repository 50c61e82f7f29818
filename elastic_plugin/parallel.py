"""Parallel layout set-up on top of Megatron-Core: process groups, sharded model chunks, optimizer.

Everything here is Megatron-Core's own machinery (``parallel_state``, ``DistributedDataParallel``,
``get_megatron_optimizer``); this module only wires it up the same way for our tests, the demo
and the CLI, on CPU (gloo) and GPU (NCCL) alike.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elastic_plugin.models.config import Layout, ModelConfig
from elastic_plugin.models.spec_choice import SpecChoice

if TYPE_CHECKING:  # Megatron ships no types: this annotates Megatron model chunks
    from megatron.core.transformer.module import MegatronModule


DEFAULT_TIMEOUT_S = 600.0
_LOGGED_SPECS: set[str] = set()  # the layer-spec lines this process printed (once each)
_timeout_s = DEFAULT_TIMEOUT_S  # what every collective of this process waits before it fails


def collective_timeout_s() -> float:
    """How long a collective waits for a peer (``--distributed-timeout-minutes``)."""
    return _timeout_s


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the default process group from torchrun-style env vars (or a 1-rank world).

    A 1-rank world rendezvouses through an in-process store: no port to pick (a port picked
    "free" can be taken by another run before it is bound) and no rendezvous env left behind
    for the subprocesses this process starts (a torchrun or CLI child would inherit it).
    ``timeout_s``: how long a collective waits for a peer (default 600 s), also for the
    model-parallel groups ``initialize_layout`` creates."""
    global _timeout_s
    if dist.is_initialized():
        return
    _timeout_s = float(timeout_s or DEFAULT_TIMEOUT_S)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=_timeout_s))
        return
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=_timeout_s),
    )


def is_rank0() -> bool:
    """True on global rank 0, and in a process that never joined a process group: the rank
    that prints, plots and writes shared files."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (nothing to wait for outside a process group)."""
    if dist.is_initialized():
        dist.barrier()


def destroy_subgroups() -> int:
    """Destroy every process group but the default (world) one; returns how many.

    Megatron's ``destroy_model_parallel`` only drops its references to the groups; a gloo group
    lives on with a TCP loop and two run-loop threads. A process that re-lays-out its ranks (a
    layout sweep, a test run) would otherwise pile up thousands of threads: measured 1,700 in one
    pytest process, which made every later step (and every process sharing the machine) slower."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0
    world = c10d._get_default_group()
    destroyed = 0
    for group in list(c10d._world.pg_map):
        if group is world:
            continue
        try:
            dist.destroy_process_group(group)
            destroyed += 1
        except Exception:  # already gone, or torn down by its backend: nothing left to free
            pass
    return destroyed


def initialize_layout(layout: Layout, seed: int = 1234) -> None:
    """(Re)create Megatron's model-parallel groups for ``layout`` and seed its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout.check_world(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        destroy_subgroups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        context_parallel_size=layout.cp,
        distributed_timeout_minutes=_timeout_s / 60,  # a float works (a timedelta of it)
    )
    model_parallel_cuda_manual_seed(seed)


def layer_spec_of(role: str = "sliced", use_te: bool | None = None) -> SpecChoice:
    """The layer spec of a model built for ``role`` (``spec_choice.MODEL_ROLES``), logged on
    rank 0 once per process and role: ``use_te`` True / False forces TE's / the local spec."""
    from elastic_plugin.models.spec_choice import choose_layer_spec

    if use_te is None:
        choice = choose_layer_spec(role)
    else:
        choice = SpecChoice("te" if use_te else "local", f"use_te={use_te} given", role)
    line = choice.describe()
    if line not in _LOGGED_SPECS and is_rank0():
        print(line, file=sys.stderr, flush=True)
    _LOGGED_SPECS.add(line)
    return choice


def build_model_chunks(
    model_cfg: ModelConfig,
    layout: Layout,
    params_dtype: torch.dtype = torch.float32,
    wrap_ddp: bool = True,
    use_te: bool | None = None,
    role: str = "sliced",
    **config_overrides,
) -> tuple[list[MegatronModule], object]:
    """This rank's model chunk (one; no virtual pipeline yet), DDP-wrapped for training.

    ``role`` picks the layer spec (``layer_spec_of``): the default ``"sliced"`` is for a model
    whose layers our code slices, hooks or permutes; ``"teacher"`` / ``"trained"`` only run, so
    they get Transformer Engine's spec where it can run. The model records its choice
    (``layer_spec``)."""
    from megatron.core import parallel_state

    from elastic_plugin.models.builder import build_hybrid_model, transformer_config

    choice = layer_spec_of(role, use_te)
    tconf = transformer_config(model_cfg, layout, params_dtype, **config_overrides)
    model = build_hybrid_model(
        model_cfg,
        tconf,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        use_te=choice.use_te,
    )
    model.layer_spec = choice
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )

    for param in model.parameters():
        # Megatron's optimizer and DDP expect every param to carry a TP flag.
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if params_dtype != torch.float32 and param.dtype != params_dtype:
            # as Megatron-LM's Float16Module: every weight in the model dtype (Mamba's A_log and
            # D are made FP32; they are computed in FP32 anyway), FP32 main copies in the
            # optimizer. Megatron's non-distributed mixed-precision optimizer cannot checkpoint
            # FP32 weights beside BF16 ones.
            param.data = param.data.to(params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if not wrap_ddp:
        return [model], tconf
    return [wrap_ddp_chunk(model, layout)], tconf


def wrap_ddp_chunk(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """Megatron's DDP around one model chunk (grad buffers, DP reduction, distributed optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )

    for param in model.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=layout.distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()
    return ddp


def build_optimizer(
    chunks: list[MegatronModule],
    lr: float,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    distributed_optimizer: bool = False,
    adam_beta2: float = 0.95,
    adam_eps: float = 1e-8,
    min_lr: float | None = None,
    config_overrides: dict | None = None,
):
    """Megatron's (optionally distributed) Adam over the model chunks; ``config_overrides``
    (Megatron ``ParamKey`` -> ``ParamGroupOverride``) gives parameter groups their own LR."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tconf = chunks[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr if min_lr is None else min_lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        bf16=tconf.bf16,
        fp16=tconf.fp16,
        params_dtype=tconf.params_dtype,
        use_distributed_optimizer=distributed_optimizer,
    )
    if config_overrides is not None:  # keep Megatron's standard groups (no decay on norms/biases)
        from megatron.core.optimizer import get_standard_config_overrides

        config_overrides = {**get_standard_config_overrides(opt_config), **config_overrides}
    optimizer = get_megatron_optimizer(opt_config, chunks, config_overrides=config_overrides)
    if not distributed_optimizer:
        fuse_cpu_adam(optimizer)
    return optimizer


def fuse_cpu_adam(optimizer) -> int:
    """Switch the torch Adam(W) inside Megatron's optimizer to torch's fused CPU kernel where
    every parameter it updates is a floating CPU tensor; returns how many were switched.

    Without Transformer Engine or apex Megatron falls back to ``torch.optim.AdamW``, which on a
    CPU runs one tensor at a time, op by op: measured on SmolLM2-135M (2 cores) its step took
    0.89 s, half of it in ``sqrt``, against 0.07 s for the fused kernel (the same update to the
    last bits; 13% of an elastic step at 4 x 128 tokens). Not with the distributed optimizer:
    the fused kernel's results depend on where a shard starts (its vector and scalar tails), and
    a checkpoint must train the same in every layout; TP shards start at whole rows."""
    switched = 0
    for inner in (
        getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])
    ):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or not all(p.device.type == "cpu" and p.is_floating_point() for p in params):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched
