"""Multi-rank vs single-rank equivalence of the tiny HybridModel (rank-pool cases).

Protocol, so the parallel run starts from *exactly* the reference's weights:
1. ``make_reference`` (1 rank): build the model at TP=PP=EP=1, save it with Megatron's dist
   checkpointing, run one training step on fixed batches, and save the loss, the gradients
   (as a second dist checkpoint) and the parameters after one Adam step (a third one).
2. ``check_layout`` (N ranks): build the model under a layout, load the first checkpoint
   (Megatron reshards it), run the same step through ``get_forward_backward_func`` with the batch
   split over data-parallel ranks, and compare loss, gradients and updated parameters with the
   reference, loading the reference checkpoints into the same layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_plugin.models.config import ModelConfig, load_config
from elastic_plugin.parallel import Layout, build_model_chunks, build_optimizer, initialize_layout
from elastic_plugin.training.step import train_step

if TYPE_CHECKING:  # Megatron ships no types: these annotate what a function takes
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import MegatronModule

REF_MICRO_BATCH = 4
NUM_MICROBATCHES = 2
SEQ_LEN = 32
LR = 1e-2
# Adam divides by sqrt(v)+eps: with the default 1e-8, fp32 rounding noise (~1e-8) in a near-zero
# gradient becomes an O(lr) update difference. A larger eps keeps the comparison meaningful.
ADAM_EPS = 1e-4


def tiny_model(
    config_path: str, pattern: str | None = None, overrides: dict[str, Any] | None = None
) -> ModelConfig:
    """The config's model, optionally with another layer pattern or field values."""
    model = load_config(config_path).model
    changes = dict(overrides or {})
    if pattern:
        changes["hybrid_layer_pattern"] = pattern
    return replace(model, **changes).validate() if changes else model


def reference_batches(model: ModelConfig, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """Fixed random micro-batches (tokens, shifted labels), identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(NUM_MICROBATCHES):
        seq = torch.randint(0, model.vocab_size, (REF_MICRO_BATCH, SEQ_LEN + 1), generator=gen)
        batches.append(
            {
                "tokens": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": torch.ones(REF_MICRO_BATCH, SEQ_LEN),
            }
        )
    return batches


def dp_shard(batches: list[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's rows of every micro-batch."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if REF_MICRO_BATCH % dp:
        raise ValueError(f"micro-batch {REF_MICRO_BATCH} does not split over {dp} DP ranks")
    rows = REF_MICRO_BATCH // dp
    return iter([{k: v[rank * rows : (rank + 1) * rows] for k, v in b.items()} for b in batches])


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


@contextmanager
def params_replaced_by(model: torch.nn.Module, source: str):
    """Temporarily point every parameter's data at its grad (``main_grad``) so Megatron's
    ``sharded_state_dict`` — with all its TP/EP/PP sharding metadata — describes gradients."""
    saved = {}
    for name, param in model.named_parameters():
        saved[name] = param.data
        param.data = getattr(param, source).to(param.dtype)
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            param.data = saved[name]


def save_dist(model: MegatronModule, path: Path) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(path))


def load_dist(model: MegatronModule, path: Path) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    model.load_state_dict(state, strict=False)


def make_reference(
    config_path: str,
    workdir: str,
    pattern: str | None = None,
    overrides: dict[str, Any] | None = None,
    seed: int = 1234,
) -> dict[str, Any]:
    """Single-rank reference: init checkpoint, loss, grads and post-step params."""
    work = Path(workdir)
    model_cfg = tiny_model(config_path, pattern, overrides)
    initialize_layout(Layout(), seed=seed)
    chunks, _ = build_model_chunks(model_cfg, Layout())
    model = _unwrap(chunks[0])
    save_dist(model, work / "init")
    optimizer = build_optimizer(chunks, lr=LR, adam_eps=ADAM_EPS)
    out = train_step(
        chunks,
        optimizer,
        dp_shard(reference_batches(model_cfg)),
        NUM_MICROBATCHES,
        SEQ_LEN,
        REF_MICRO_BATCH,
        step_optimizer=False,
    )
    with params_replaced_by(model, "main_grad"):
        save_dist(model, work / "grads")
    optimizer.step()
    save_dist(model, work / "step1")
    (work / "reference.json").write_text(json.dumps({"loss": out["loss"]}))
    return {"loss": out["loss"], "params": sum(p.numel() for p in model.parameters())}


def _max_diff(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, value in actual.items():
        diff = (value.float() - expected[name].float()).abs().max().item() if value.numel() else 0.0
        if diff > worst:
            worst, where = diff, name
    return worst, where


def _reference_in_layout(
    model_cfg: ModelConfig, layout: Layout, path: Path
) -> dict[str, torch.Tensor]:
    """A checkpoint loaded into a fresh model of this layout: the reference, sharded like us."""
    chunks, _ = build_model_chunks(model_cfg, layout, wrap_ddp=False)
    load_dist(chunks[0], path)
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def check_layout(
    config_path: str,
    workdir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    pattern: str | None = None,
    overrides: dict[str, Any] | None = None,
    seed: int = 1234,
    cp: int = 1,
) -> dict[str, Any]:
    """Run the reference step under a layout; return loss and max grad/param differences."""
    work = Path(workdir)
    layout = Layout(tp, pp, ep, sequence_parallel, distributed_optimizer, cp)
    model_cfg = tiny_model(config_path, pattern, overrides)
    initialize_layout(layout, seed=seed + 17)  # a different seed: weights must come from disk
    chunks, _ = build_model_chunks(model_cfg, layout)
    model = _unwrap(chunks[0])
    load_dist(model, work / "init")
    for chunk in chunks:
        chunk.broadcast_params()
    optimizer = build_optimizer(
        chunks, lr=LR, adam_eps=ADAM_EPS, distributed_optimizer=distributed_optimizer
    )
    out = train_step(
        chunks,
        optimizer,
        dp_shard(reference_batches(model_cfg)),
        NUM_MICROBATCHES,
        SEQ_LEN,
        REF_MICRO_BATCH // _dp_size(),
        step_optimizer=False,
    )
    if distributed_optimizer:
        gather_sharded_grads(chunks[0])
    grads = {  # main_grad: the view of the grad buffer Megatron's DDP sets on every parameter
        n: p.main_grad.detach().clone()  # type: ignore[attr-defined]
        for n, p in model.named_parameters()
    }
    ref_grads = _reference_in_layout(model_cfg, layout, work / "grads")
    grad_diff, grad_where = _max_diff(grads, ref_grads)
    grad_scale = max(v.abs().max().item() for v in ref_grads.values())
    optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_params = _reference_in_layout(model_cfg, layout, work / "step1")
    param_diff, param_where = _max_diff(params, ref_params)
    reference = json.loads((work / "reference.json").read_text())
    return {
        "rank": dist.get_rank(),
        "loss": out["loss"],
        "ref_loss": reference["loss"],
        "grad_max_abs_diff": grad_diff,
        "grad_worst_param": grad_where,
        "grad_max_abs": grad_scale,
        "param_max_abs_diff": param_diff,
        "param_worst": param_where,
        "num_local_params": len(params),
    }


def gather_sharded_grads(chunk: DistributedDataParallel) -> None:
    """With the distributed optimizer each DP rank holds only its reduce-scattered shard of the
    grad buffer; all-gather the shards so every ``main_grad`` is the full reduced gradient."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for group in list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups):
        comm = group.intra_distributed_optimizer_instance_group
        size = group.intra_distributed_optimizer_instance_size
        rank = group.intra_distributed_optimizer_instance_rank
        for bucket in group.buckets:
            local = shard_buffer(bucket.grad_data, size)[rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, local, group=comm)


def _dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()
