"""Bytes each rank passes to ``torch.distributed`` per training step, per process group and kind:
what an elastic step (teacher forward, student forward + backward, gradient reduction) under
Megatron-Core 0.19.2 issues, as counted at the calls on a real run (``tests/test_planning.py``).

Sizes are message sizes (nccl-tests' convention): an all-reduce or p2p send its tensor, an
all-gather its gathered output, a reduce-scatter or all-to-all its input. Per micro-batch, with
``T = micro_batch x seq`` tokens, ``h`` the hidden size of the pass (the teacher's full one, the
student's nested one), ``a`` the model dtype's bytes, ``k`` top-k, ``t`` TP, ``sp = t`` with
sequence parallelism else 1:

* **TP**, without SP: one all-reduce of ``T h a`` per layer and the embedding in every forward,
  one per layer and the output layer in the backward. With SP, per layer in the forward an
  all-gather and a reduce-scatter of ``T h a`` (the embedding: a reduce-scatter, at the full
  width even for a nested student; the output layer: an all-gather); in the backward two
  all-gathers (the output gradient, and the saved sequence shard re-gathered for the weight
  gradient) and a reduce-scatter per layer, an all-gather for the embedding, and for the output
  layer (whose output gradient is not sequence-parallel) one all-gather and a reduce-scatter.
  MoE layers under TP: the routed tokens are all-gathered (``k T h a``) with their FP32
  probabilities (``4 k T``), and the experts' probability-weighted output reduce-scattered in
  FP32 (``4 k T h``), all reversed in the backward (with EP the gathered token count per rank
  follows the routing; the sum over the ranks is exact); the shared expert as a dense layer. The distillation loss
  all-reduces ``5 x 4 T`` bytes (max, then three sums, FP32). Once per step with SP: the
  gradients of the sequence-parallel parameters (norms, MoE routers; FP32) are all-reduced.
* **EP** all-to-all per MoE layer and pass: the dispatch ``k (T / sp) h a`` plus the
  probabilities ``4 k T / sp``, and the combine ``k (T / sp) h a`` (per rank it varies with the
  routing; the sum over the EP group is exact); three passes (teacher, student, backward). The
  token counts per expert are all-gathered over TP x EP in each forward (``8 E t e``).
* **PP**: the teacher runs inside the student's schedule (``elastic.step``): every stage but
  the last sends ``2 x T / sp x H x a`` forward per micro-batch (the student's and the teacher's
  hidden states stacked in one p2p tensor; buffers keep the full hidden size ``H``), every stage
  but the first the gradient of that tensor back (same size; the teacher's half is zeros).
  Without a teacher each direction sends ``T / sp x H x a``. Once per step the budget router's FP32 gradients are summed
  over the stages.
* **CP** (context parallelism, ``c`` ranks; ``T`` is then the ``1 / c`` of the tokens a rank
  holds): per attention layer and pass, K and V are all-gathered over the CP group
  (``2 c T g d / t x a``, ``g`` query groups of ``d`` channels), their gradients
  reduce-scattered in the backward (the same size); per Mamba layer and pass, Megatron's
  ``MambaContextParallel`` trades the sequence shard for a head shard (all-to-all of z, x, B,
  C and dt: ``T (2 D + 2 G N + H) / t x a``) and back (``T D / t x a``), mirrored in the
  backward. Gradients are reduced, and the distributed optimizer sharded, over DP x CP.
* **DP** once per step: an all-reduce of the FP32 gradient buffer, or with the distributed
  optimizer a reduce-scatter of it and an all-gather of the updated weights (padded buffers,
  ``memory.padded_elements``); expert gradients over the expert-data-parallel group (DP / EP).
  With EP > 1 Megatron chains two distributed optimizers (dense, experts) and each one's step
  all-gathers all of the chunk's buffers: the weights are all-gathered twice per step.
  The MoE routers' token counts (expert bias, FP32) are all-reduced over TP x DP.

Left out: scalar reductions (loss reports, the gradient norm: a few bytes) and the budget
router's mask gradients under TP at budgets below 1.0 (one all-reduce of a mask per layer and
axis: < 0.5% of the TP bytes on the tiny model).
"""

from __future__ import annotations

from elastic_plugin.models.config import ModelConfig
from elastic_plugin.planning.memory import padded_elements
from elastic_plugin.planning.params import StageParams, stage_layer_types

__all__ = ["step_comm_bytes"]

Comm = dict[str, dict[str, float]]


def _add(out: Comm, group: str, kind: str, nbytes: float) -> None:
    if nbytes:
        out.setdefault(group, {}).setdefault(kind, 0.0)
        out[group][kind] += nbytes


def _tp_pass(
    out: Comm, model: ModelConfig, kinds: list[str], h: int, tokens: int, a: int, tp: int,
    sp: bool, first: bool, last: bool, backward: bool,
) -> None:  # fmt: skip
    """TP bytes of one pass (forward, or the backward of a training pass) of one stage."""
    dense = tokens * h * a
    k = model.moe_router_topk
    for kind in kinds:
        blocks = 1
        if kind == "moe":
            blocks = 1 if model.moe_shared_expert_intermediate_size else 0
            # routed tokens gathered in the model dtype; the experts' output, weighted by the
            # FP32 probabilities, reduce-scattered in FP32 (the backward reverses both)
            routed, weighted = k * dense, k * tokens * h * 4
            _add(out, "tp", "all_gather", weighted if backward else routed)
            _add(out, "tp", "reduce_scatter", routed if backward else weighted)
            _add(out, "tp", "reduce_scatter" if backward else "all_gather", 4 * k * tokens)
        if sp:
            _add(out, "tp", "all_gather", (2 if backward else 1) * blocks * dense)
            _add(out, "tp", "reduce_scatter", blocks * dense)
        else:
            _add(out, "tp", "all_reduce", blocks * dense)
    if first:  # the vocab-parallel embedding: full width (a nested width is cut after it)
        full = tokens * model.hidden_size * a
        if sp:
            _add(out, "tp", "all_gather" if backward else "reduce_scatter", full)
        elif not backward:
            _add(out, "tp", "all_reduce", full)
    if last:  # the output layer (its output gradient is not sequence-parallel)
        if sp:
            _add(out, "tp", "all_gather", dense)
            if backward:
                _add(out, "tp", "reduce_scatter", dense)
        elif backward:
            _add(out, "tp", "all_reduce", dense)


def _cp_pass(
    out: Comm,
    model: ModelConfig,
    kinds: list[str],
    tokens: int,
    a: int,
    tp: int,
    cp: int,
    backward: bool,
) -> None:
    """CP bytes of one pass of one stage at ``model``'s widths; ``tokens``: held here."""
    attention = kinds.count("attention")
    if attention:  # K and V gathered (forward) or their gradients reduce-scattered (backward)
        kv = 2 * model.query_groups * model.head_dim // tp * cp * tokens * a
        _add(out, "cp", "reduce_scatter" if backward else "all_gather", attention * kv)
    mamba = kinds.count("mamba")
    if mamba:
        d, heads = model.mamba_d_inner, model.mamba_num_heads
        bc = 2 * model.mamba_num_groups * model.mamba_state_dim
        _add(out, "cp", "all_to_all", mamba * tokens * (2 * d + bc + heads + d) // tp * a)


def _ep_pass(out: Comm, model: ModelConfig, moe: int, h: int, tokens: int, a: int) -> None:
    """EP bytes of one pass over ``moe`` MoE layers (``tokens``: this rank's sequence shard)."""
    k = model.moe_router_topk
    _add(out, "ep", "all_to_all", moe * (2 * k * tokens * h * a + 4 * k * tokens))


def step_comm_bytes(
    model: ModelConfig,
    nested: ModelConfig,
    stage: int,
    stages: list[StageParams],
    tp: int,
    pp: int,
    ep: int,
    dp: int,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    bf16: bool,
    micro_batch_size: int,
    seq_length: int,
    num_microbatches: int,
    teacher: bool = True,
    cp: int = 1,
) -> Comm:
    """Bytes per group and kind that one rank of pipeline stage ``stage`` passes in one step
    (``num_microbatches`` micro-batches, all of the budget whose widths ``nested`` has; the
    teacher runs ``model``; ``teacher=False``: no teacher pass, as when ``model`` trains alone).
    ``cp``: context parallelism (the rank holds ``seq_length / cp`` tokens; ``dp`` excludes it)."""
    out: Comm = {}
    a = 2 if bf16 else 4
    tokens = micro_batch_size * seq_length // cp
    sp = tp > 1 and sequence_parallel
    kinds = stage_layer_types(model, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    m = num_microbatches
    moe = kinds.count("moe")
    passes: list[tuple[ModelConfig, bool]] = [(model, False)] if teacher else []
    passes += [(nested, False), (nested, True)]
    for widths, backward in passes:
        h = widths.hidden_size
        for _ in range(m):
            if tp > 1:
                _tp_pass(out, model, kinds, h, tokens, a, tp, sp, first, last, backward)
            if ep > 1:
                _ep_pass(out, model, moe, h, tokens // (tp if sp else 1), a)
            if cp > 1:
                _cp_pass(out, widths, kinds, tokens, a, tp, cp, backward)
            if tp * ep > 1 and not backward:  # the tokens per expert, over TP x EP
                _add(out, "tp_ep", "all_gather", moe * 8 * model.num_moe_experts * tp * ep)
    if tp > 1 and last:
        _add(out, "tp", "all_reduce", m * 5 * 8 * tokens)  # the distillation loss (FP64 row stats)
    if pp > 1:
        p2p = tokens // (tp if sp else 1) * model.hidden_size * a
        # [student; teacher] stacked forward, and its gradient backward
        per_direction = 2 if teacher else 1
        sends = (0 if last else per_direction) + (0 if first else per_direction)
        _add(out, "pp", "p2p", m * sends * p2p)
        _add(out, "pp", "all_reduce", 4 * stages[stage].router)
    params = stages[stage]
    h = model.hidden_size
    if sp:  # gradients of the sequence-parallel parameters: norms and MoE routers
        norms = len(kinds) + (1 if last else 0)
        routers = moe * model.num_moe_experts * h
        _add(out, "tp", "all_reduce", 4 * (norms * h + routers))
    dp = dp * cp  # the gradients' group: data x context parallel
    edp = dp // ep
    if model.moe_router_enable_expert_bias and tp * dp > 1:
        _add(out, "tp_dp", "all_reduce", 4 * model.num_moe_experts * moe)
    # with expert buffers Megatron chains two distributed optimizers, and each one's step
    # all-gathers every buffer of the model chunk: the weights are gathered twice
    gathers = 2 if params.expert else 1
    for group, numels, size in (("dp", params.dense, dp), ("edp", params.expert, edp)):
        if size < 2 or not numels:
            continue
        if distributed_optimizer:
            padded = padded_elements(numels, size)
            _add(out, group, "reduce_scatter", 4 * padded)
            _add(out, group, "all_gather", gathers * a * padded)
        else:
            _add(out, group, "all_reduce", 4 * sum(numels))
    return out
