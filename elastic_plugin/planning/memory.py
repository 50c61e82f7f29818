"""Bytes per rank: weights, gradients and optimizer state as Megatron's DDP and optimizer allocate
them, the frozen teacher's copy, activations times the pipeline schedule's in-flight
micro-batches, and the teacher logits an elastic step holds.

State per parameter (our DDP: ``grad_reduce_in_fp32``; Megatron's Adam):

============== ========== ============ ===================================================
precision      weight     gradient     optimizer
BF16           2          4 (FP32)     12: FP32 main copy + Adam's two FP32 moments
FP32           4          4            8: the two moments (the weight is its own main copy)
============== ========== ============ ===================================================

With the distributed optimizer the optimizer state is split over the data-parallel group (the
experts' over the expert-data-parallel group, DP / EP), and DDP's weight and gradient buffers
are padded: every tensor starts on a 64-element boundary and each buffer ends on a multiple of
lcm(DP, 128) elements (Megatron's ``param_layout``); a rank's optimizer shard is its
1/DP of the padded buffer (an upper bound: padding elements get no optimizer state). Without it
nothing is padded or split. These are the buffers of one bucket per buffer (``bucket_size=None``,
as ``parallel.wrap_ddp_chunk`` builds them); Megatron-LM's bucketed default pads a little more.

The frozen teacher (``--teacher frozen``) is a second copy of the model's weights in the model
dtype, sharded like the student, with no gradients or optimizer state. The teacher runs inside
the student's schedule, micro-batch by micro-batch (``elastic.step``), so the last stage holds
the vocab-parallel logits (``[tokens, V / t]``, model dtype) of the micro-batches in flight
there (one under 1F1B, and without PP), whatever the number of micro-batches; under PP every
stage but the first also keeps, per in-flight micro-batch, the teacher's half of the received
p2p tensor (``T / sp x H``, model dtype) with the student's (``elastic-train`` and
Megatron-LM's own loop, ``elastic.megatron_lm_pretrain``, alike).

Under the non-interleaved 1F1B schedule stage ``i`` of ``p`` holds ``min(p - i, m)`` micro-batches'
activations at once (``m`` micro-batches per step and DP rank).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from elastic_plugin.elastic.config import DEFAULT_KD_CHUNK_TOKENS
from elastic_plugin.models.config import ModelConfig
from elastic_plugin.models.runtime import Runtime
from elastic_plugin.planning.activations import stage_activation_bytes
from elastic_plugin.planning.params import StageParams, stage_layer_types

__all__ = [
    "RankMemory",
    "in_flight",
    "padded_elements",
    "rank_memory",
    "state_bytes",
    "teacher_logit_bytes",
]

GRAD_BYTES = 4  # grad_reduce_in_fp32: FP32 main gradients whatever the model dtype


def padded_elements(numels: list[int], dp: int) -> int:
    """Elements of a distributed-optimizer DDP buffer holding tensors of ``numels``: each start
    padded to 64, the end to lcm(dp, 128) (one bucket). Order does not matter: the end padding
    is a multiple of 64, so only the sum of 64-rounded sizes counts."""
    if not numels:
        return 0
    divisor = math.lcm(dp, 128)
    total = sum(-(-n // 64) * 64 for n in numels)
    return -(-total // divisor) * divisor


def state_bytes(
    stage: StageParams, dp: int, ep: int, bf16: bool, distributed_optimizer: bool
) -> dict[str, float]:
    """Weights, gradients and optimizer state of one rank of ``stage``, in bytes."""
    weight = 2 if bf16 else 4
    opt = 12 if bf16 else 8
    edp = max(dp // ep, 1)
    if not distributed_optimizer:
        n = stage.total
        return {"weights": n * weight, "grads": n * GRAD_BYTES, "optimizer": n * opt}
    dense, expert = padded_elements(stage.dense, dp), padded_elements(stage.expert, edp)
    return {
        "weights": (dense + expert) * weight,
        "grads": (dense + expert) * GRAD_BYTES,
        "optimizer": (dense / dp + expert / edp) * opt,
    }


def teacher_logit_bytes(
    model: ModelConfig, tokens: int, tp: int, num_microbatches: int, bf16: bool
) -> float:
    """Teacher logits the last stage holds at once: ``num_microbatches`` micro-batches'
    vocab-parallel logits, ``[tokens, V / t]`` in the model dtype (``rank_memory`` passes the
    micro-batches in flight there: the teacher runs inside the student's schedule)."""
    return num_microbatches * tokens * model.vocab_size / tp * (2 if bf16 else 4)


def in_flight(stage: int, pp: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return max(1, min(pp - stage, num_microbatches))


@dataclass(frozen=True)
class RankMemory:
    """The bytes of the busiest rank (the stage with the largest total)."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    teacher_weights: float
    activations: float  # in-flight micro-batches' stored activations + the largest transient
    activations_per_microbatch: float
    in_flight: int
    teacher_logits: float

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.teacher_weights
            + self.activations
            + self.teacher_logits
        )

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def rank_memory(
    model: ModelConfig,
    nested: ModelConfig,
    stages: list[StageParams],
    tp: int,
    pp: int,
    ep: int,
    dp: int,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    runtime: Runtime,
    micro_batch_size: int,
    seq_length: int,
    num_microbatches: int,
    frozen_teacher: bool,
    mamba_scan: str = "fused",
    kd_chunk_tokens: int | None = DEFAULT_KD_CHUNK_TOKENS,
    cp: int = 1,
) -> RankMemory:
    """Memory of the busiest rank. ``model``: the full model (weights); ``nested``: the plain
    config of the widths a micro-batch runs (activations; the full model in masked mode).
    ``cp``: context parallelism; a rank holds ``seq_length / cp`` tokens of each sequence and
    its weights' copies (gradient reduction, optimizer shards) number ``dp x cp``."""
    tokens = micro_batch_size * seq_length // cp
    dtype_bytes = 2 if runtime.bf16 else 4
    kinds = stage_layer_types(nested, pp)
    best: RankMemory | None = None
    for index, stage in enumerate(stages):
        state = state_bytes(stage, dp * cp, ep, runtime.bf16, distributed_optimizer)
        last = index == pp - 1
        act = stage_activation_bytes(
            nested,
            kinds[index],
            index == 0,
            last,
            tokens,
            tp,
            sequence_parallel,
            runtime,
            mamba_scan,
            kd_chunk_tokens,
            cp,
        )
        count = in_flight(index, pp, num_microbatches)
        logits = teacher_logit_bytes(model, tokens, tp, count, runtime.bf16) if last else 0.0
        if index > 0:  # the teacher's half of each kept p2p input
            sp = tp if sequence_parallel and tp > 1 else 1
            act["stored"] += tokens / sp * model.hidden_size * dtype_bytes
        memory = RankMemory(
            stage=index,
            teacher_weights=stage.model * dtype_bytes if frozen_teacher else 0.0,
            activations=count * act["stored"] + act["transient"],
            activations_per_microbatch=act["stored"],
            in_flight=count,
            teacher_logits=logits,
            **state,
        )
        if best is None or memory.total > best.total:
            best = memory
    assert best is not None  # pp >= 1 stages
    return best
