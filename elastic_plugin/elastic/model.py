"""An elastic model chunk: a Megatron ``HybridModel`` + elastic layers + the budget router.

The router is a submodule of every model chunk (replicated on all ranks), so Megatron's DDP
reduces its gradients over data parallelism, Megatron's optimizer updates it (in its own
parameter group with a larger learning rate) and dist checkpointing saves it with the model.
Two things Megatron cannot know are added here:

* the router's gradient is split over pipeline stages (each stage's layers contribute through
  their masks): ``finalize_router_grads`` sums it over the pipeline group before Megatron's
  ``finalize_model_grads``;
* a sliced model's residual stream is narrower than ``hidden_size``, but pipeline P2P buffers
  have the full width: a stage pads its output with zeros and the next stage reads the prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.layout import STRIDED_ATTR
from elastic_plugin.elastic.layers import ElasticState, RankInfo, elastify
from elastic_plugin.elastic.router import (
    ROUTER_ATTR,
    BudgetRouter,
    RouterModule,
    load_router,
    make_router,
)
from elastic_plugin.models.runtime import Runtime

if TYPE_CHECKING:  # Megatron ships no types: this annotates what attach_elastic takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel


def _pad_stage_output(module, args, output):
    """Non-last stages send [s, b, hidden_size]: zero-pad a narrow residual stream."""
    full = module.config.hidden_size
    if torch.is_tensor(output) and output.shape[-1] < full:
        return torch.nn.functional.pad(output, (0, full - output.shape[-1]))
    return output


def _narrow_stage_input(state: ElasticState):
    def hook(module, args, kwargs):
        size, _ = state.hidden()
        tensor = getattr(module, "input_tensor", None)
        if size is not None and tensor is not None and tensor.shape[-1] > size:
            module.input_tensor = tensor[..., :size]
        return None

    return hook


def _gate_stage_input(state: ElasticState):
    """Under full recomputation, the stack's input is where the mask gate goes
    (``ElasticState.gate_masks``): the first stage's embedding output, a later stage's
    received activation."""

    def hook(module, args, kwargs):
        if not state.recompute:
            return None
        tensor = getattr(module, "input_tensor", None)
        if not module.pre_process and tensor is not None:
            module.input_tensor = state.gate_masks(tensor)
            return None
        if "hidden_states" in kwargs and torch.is_tensor(kwargs["hidden_states"]):
            kwargs = {**kwargs, "hidden_states": state.gate_masks(kwargs["hidden_states"])}
            return args, kwargs
        return None

    return hook


def _restore_at_output(state: ElasticState):
    def hook(module, args, output):
        return state.restore_on_backward(output) if state.recompute else output

    return hook


def attach_elastic(
    model: HybridModel, resolved, sequence_parallel: bool, router_seed: int = 0
) -> ElasticState:
    """Elastify an (unwrapped) model chunk and give it the router; returns the shared state."""
    from megatron.core import parallel_state as ps

    mcfg = resolved.model
    state = ElasticState(
        resolved,
        RankInfo.current(bool(getattr(model, STRIDED_ATTR, False)), sequence_parallel),
        groups={"attention_heads": mcfg.query_groups, "mamba_heads": mcfg.mamba_num_groups},
    )
    elastify(model, state)
    router = RouterModule(make_router(resolved, router_seed))  # initialised in FP32 on the CPU
    # beside the model's weights (on a GPU, Megatron's DDP buffers and the step expect it there)
    device = next(model.parameters()).device
    model.add_module(ROUTER_ATTR, router.to(device=device, dtype=model.config.params_dtype))
    first_stage = ps.is_pipeline_first_stage()
    for param in model.get_submodule(ROUTER_ATTR).parameters():
        param.elastic_router = True  # noqa: B010  (Megatron ParamKey(attr=...) matches on it)
        # every pipeline stage holds the router, its gradients summed over stages
        # (finalize_router_grads): Megatron's gradient norm counts a copy marked shared once
        param.shared = not first_stage  # noqa: B010
    if not ps.is_pipeline_last_stage():
        model.decoder.register_forward_hook(_pad_stage_output)
    if not ps.is_pipeline_first_stage():
        model.decoder.register_forward_pre_hook(_narrow_stage_input(state), with_kwargs=True)
    state.recompute = model.config.recompute_granularity == "full"
    if state.recompute:
        model.decoder.register_forward_pre_hook(_gate_stage_input(state), with_kwargs=True)
        model.register_forward_hook(_restore_at_output(state))
    return state


def router_of(chunk: torch.nn.Module) -> BudgetRouter:
    inner = getattr(chunk, "module", chunk)
    return cast(RouterModule, inner.get_submodule(ROUTER_ATTR)).router  # attach_elastic added it


def finalize_router_grads(chunks, *args, **kwargs):
    """Sum router gradients over pipeline stages, then Megatron's ``finalize_model_grads``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    if ps.get_pipeline_model_parallel_world_size() > 1:
        grads = [p.main_grad for p in router_of(chunks[0]).parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ps.get_pipeline_model_parallel_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return finalize_model_grads(chunks, *args, **kwargs)


def router_param_groups(lr: float, min_lr: float, lr_mult: float) -> dict:
    """Megatron optimizer overrides: the router trains at ``lr_mult`` x the model's LR.

    At ``lr_mult == 1`` no override is made: an override equal to the defaults gives Megatron
    parameter groups that a resumed run does not rebuild identically (its optimizer state then
    fails to load)."""
    from megatron.core.optimizer import ParamKey

    if lr_mult == 1.0:
        return {}
    return {ParamKey(attr="elastic_router"): {"max_lr": lr * lr_mult, "min_lr": min_lr * lr_mult}}


def build_elastic_chunks(
    ckpt_dir: str | Path,
    layout,
    resolved,
    wrap_ddp: bool = True,
    router_seed: int = 0,
    runtime: Runtime | None = None,
) -> tuple[list[torch.nn.Module], ElasticState, Any]:
    """Load a (reordered) checkpoint for ``layout``, make it elastic, wrap it in Megatron DDP.

    ``runtime``: precision and recomputation (default FP32, none); in a BF16 model the router's
    weights are BF16 too (FP32 main copies in the optimizer) and its math runs in FP32. ``initialize_layout(layout)`` must have been called. Returns (chunks, state,
    meta)."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import wrap_ddp_chunk

    runtime = runtime or Runtime()
    chunks, _, meta = build_from_checkpoint(
        ckpt_dir,
        layout,
        wrap_ddp=False,
        params_dtype=runtime.params_dtype,
        role="student",
        **runtime.transformer_overrides(),
    )
    model = chunks[0]
    state = attach_elastic(model, resolved, layout.sequence_parallel and layout.tp > 1, router_seed)
    if meta.get("kind") == "elastic":
        load_router(model, ckpt_dir)
    if wrap_ddp:
        return [wrap_ddp_chunk(model, layout)], state, meta
    return [model], state, meta
