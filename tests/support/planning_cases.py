"""Rank-pool cases that measure what ``elastic-plugin plan`` predicts (tests/test_planning.py):
the bytes Megatron allocates for weights, gradients and optimizer state on each rank, the bytes
each elastic training step passes through ``torch.distributed`` per process group, and the
activation bytes one micro-batch keeps.

Communication is counted at the calls: every collective and point-to-point function of
``torch.distributed`` (and the aliases Megatron binds at import, e.g. ``dist_all_gather_func``)
is wrapped, the outermost call only (our CPU adaptations implement some collectives with
others). Sizes: all-reduce, broadcast, send: the tensor; all-gather: the gathered output;
reduce-scatter, all-to-all: the input (the message size of nccl-tests). Groups of one rank
are not counted (nothing moves), nor scalars of at most ``SCALAR_BYTES`` (loss reports, the
gradient norm), which the plan leaves out.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.elastic_cases import _experiment, _setup, write_init_checkpoint

__all__ = ["SCALAR_BYTES", "activation_peak", "count_comm", "measure_step"]

SCALAR_BYTES = 8

_STATE = threading.local()


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# function name -> (argument index of the counted tensor, keyword name)
_SIZED: dict[str, tuple[str, int, str]] = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "_all_gather_base": ("all_gather", 0, "output_tensor"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "_reduce_scatter_base": ("reduce_scatter", 1, "input"),
    "all_to_all_single": ("all_to_all", 1, "input"),
    "all_to_all": ("all_to_all", 1, "input_tensor_list"),
    "send": ("p2p", 0, "tensor"),
    "isend": ("p2p", 0, "tensor"),
}


def _group_names() -> tuple[dict[int, str], dict[tuple[int, ...], str]]:
    """Megatron's groups by identity -> a name, and by ranks (the first name wins) for groups
    made elsewhere with the same ranks."""
    from megatron.core import parallel_state as ps

    named = (
        ("tp", ps.get_tensor_model_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
        ("dp", ps.get_data_parallel_group),
        # under CP the gradients are reduced over data x context parallel: the plan's "dp"
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ("cp", ps.get_context_parallel_group),
        ("ep", ps.get_expert_model_parallel_group),
        ("edp", ps.get_expert_data_parallel_group),
        ("tp_ep", ps.get_expert_tensor_and_model_parallel_group),
        ("tp_dp", lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        ("tp_dp", ps.get_tensor_and_data_parallel_group),
        ("mp", ps.get_model_parallel_group),
    )
    by_id: dict[int, str] = {}
    by_ranks: dict[tuple[int, ...], str] = {}
    for name, get in named:
        group = get()
        by_id.setdefault(id(group), name)
        by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), name)
    by_ranks.setdefault(tuple(range(dist.get_world_size())), "world")
    return by_id, by_ranks


def _wrap(fn: Callable, name: str, log: list) -> Callable:
    kind, index, key = _SIZED[name]

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        depth = getattr(_STATE, "depth", 0)
        if depth == 0:
            tensor = args[index] if len(args) > index else kwargs.get(key)
            group = kwargs.get("group")
            if group is None:
                positions = {"send": 2, "isend": 2, "broadcast": 2, "all_to_all_single": 4}
                pos = positions.get(name, 2 if kind != "all_reduce" else 2)
                group = args[pos] if len(args) > pos and not isinstance(args[pos], int) else None
            if name == "all_reduce" and len(args) > 2:
                group = args[2]
            log.append((kind, group, _nbytes(tensor)))
        _STATE.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.depth = depth

    return counted


def _wrap_batch(fn: Callable, log: list) -> Callable:
    @functools.wraps(fn)
    def counted(p2p_op_list):
        depth = getattr(_STATE, "depth", 0)
        if depth == 0:
            for op in p2p_op_list:
                if "send" in op.op.__name__:
                    log.append(("p2p", op.group, _nbytes(op.tensor)))
        _STATE.depth = depth + 1
        try:
            return fn(p2p_op_list)
        finally:
            _STATE.depth = depth

    return counted


@contextmanager
def count_comm(calls: list | None = None) -> Iterator[dict[str, dict[str, int]]]:
    """Count bytes per group name and kind while the block runs; yields the totals, filled on
    exit: ``{"tp": {"all_reduce": bytes, ...}, ...}``; ``calls`` gets every call's
    ``(group, kind, bytes)`` in order."""
    log: list[tuple[str, Any, int]] = []
    originals = {name: getattr(dist, name) for name in _SIZED if hasattr(dist, name)}
    originals.pop("isend", None)  # P2POp checks isend / irecv by identity: counted in batches
    patched: list[tuple[Any, str, Any]] = []
    replacement = {id(fn): _wrap(fn, name, log) for name, fn in originals.items()}
    batch = dist.batch_isend_irecv
    replacement[id(batch)] = _wrap_batch(batch, log)
    by_id = {**{id(fn): fn for fn in originals.values()}, id(batch): batch}
    modules = [dist] + [m for n, m in list(sys.modules.items()) if n.startswith("megatron.")
                        and m is not None]  # fmt: skip
    for module in modules:
        for attr, value in list(vars(module).items()):
            if id(value) in by_id and value is by_id[id(value)]:
                patched.append((module, attr, value))
                setattr(module, attr, replacement[id(value)])
    totals: dict[str, dict[str, int]] = {}
    try:
        yield totals
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
        by_id, by_ranks = _group_names()
        world = tuple(range(dist.get_world_size()))
        for kind, group, nbytes in log:
            ranks = world if group is None else tuple(dist.get_process_group_ranks(group))
            if len(ranks) < 2 or nbytes <= SCALAR_BYTES:
                continue
            name = by_id.get(id(group)) or by_ranks.get(ranks, f"ranks{list(ranks)}")
            totals.setdefault(name, {}).setdefault(kind, 0)
            totals[name][kind] += nbytes
            if calls is not None:
                calls.append((name, kind, nbytes))


def _state_bytes(chunks: list[Any], optimizer: Any) -> dict[str, int]:
    """Weights (parameters), DDP gradient buffers and Adam state (+ FP32 main copies) of this
    rank as allocated."""
    ddp = chunks[0]
    model = ddp.module
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    param_buffers = sum(
        b.param_data.numel() * b.param_data.element_size()
        for b in buffers
        if getattr(b, "param_data", None) is not None
    )
    state = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        mains = []
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                mains += list(group)
        state += sum(m.numel() * m.element_size() for m in mains)
        for values in opt.optimizer.state.values():
            state += sum(
                t.numel() * t.element_size()
                for k, t in values.items()
                if k in ("exp_avg", "exp_avg_sq")
            )
    return {
        "weights": param_buffers if param_buffers else weights,
        "param_numel": sum(p.numel() for p in model.parameters()),
        "grads": grads,
        "optimizer": state,
    }


def measure_step(
    config_path: str,
    workdir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    bf16: bool = False,
    budget: float = 1.0,
    num_microbatches: int = 2,
    pattern: str | None = None,
    calls: bool = False,
    cp: int = 1,
) -> dict[str, Any]:
    """One elastic training step under a layout, every micro-batch at ``budget``: the state
    bytes of this rank after the optimizer has run, and the bytes counted per group during the
    step (teacher pass, student forward/backward, gradient reduction, optimizer)."""
    from megatron.core import parallel_state as ps

    from elastic_plugin.elastic.config import CurriculumStage
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.parallel import Layout
    from tests.support.elastic_cases import MICRO_BATCH, SEQ_LEN, _iteration_batches

    work = Path(workdir)
    if not (work / "init" / "elastic_meta.json").is_file():  # collective: every rank
        write_init_checkpoint(_experiment(config_path, pattern), work / "init")
    layout = Layout(tp, pp, ep, sequence_parallel, distributed_optimizer, cp)
    cfg, chunks, optimizer, step = _setup(
        config_path, work, layout, pattern, "sliced", False, 1234,
        runtime={"bf16": True} if bf16 else None,
    )  # fmt: skip
    budgets = step.sampler.budgets
    probs = tuple(1.0 if b == budget else 0.0 for b in budgets)
    step.sampler = BudgetSampler(budgets, [CurriculumStage(iters=1, budget_probs=probs)], 5, 1)
    step.num_microbatches = num_microbatches
    step.iteration = 1
    batches = _iteration_batches(cfg.model.vocab_size, 1)[:num_microbatches]
    optimizer.zero_grad()
    log: list | None = [] if calls else None
    with count_comm(log) as comm:
        step.train_step(chunks, optimizer, iter(batches), SEQ_LEN, batches[0]["tokens"].shape[0])
    teacher = sum(
        p.numel() * p.element_size() for chunk in step.teacher_chunks for p in chunk.parameters()
    )
    resolved = step.state.resolved
    choices = [
        {n: resolved.axes[n].candidates[picks[n][0]] for n in resolved.axes}
        for _, _, _, picks in step.trace or []
    ]  # one per routed micro-batch (budget 1.0 is never routed)
    return {
        "rank": dist.get_rank(),
        "stage": ps.get_pipeline_model_parallel_rank(),
        "state": {
            **_state_bytes(chunks, optimizer),
            "teacher_weights": teacher,
            "teacher_logits": step.teacher_logit_peak,  # held at once on this rank
        },
        "comm": comm,
        "calls": log,
        "choice": choices[-1] if choices else None,
        "choices": choices,
        "micro_batch": batches[0]["tokens"].shape[0],
        "seq_length": SEQ_LEN,
        "full_micro_batch": MICRO_BATCH,
    }


def activation_peak(
    config_path: str,
    workdir: str,
    pattern: str | None,
    seq_len: int,
    micro_batch: int,
    budget: float = 1.0,
    cp: int = 1,
) -> dict[str, Any]:
    """Peak bytes one student forward + backward allocates (one micro-batch at ``budget``,
    sliced, FP32, the teacher's logits computed before and not counted), what autograd saved
    per layer, and the router's choice; one rank, or ``cp`` context-parallel ranks
    (``tests.support.memory``)."""
    from tests.support.memory import (
        clear_megatron_buffer,
        elastic_iteration,
        peak_bytes,
        saved_activations,
    )

    it = elastic_iteration(
        config_path, workdir, None, pattern, seq_len, micro_batch, 1, budget, cp=cp
    )
    it.teacher_pass()
    clear_megatron_buffer()
    with saved_activations(it.chunks[0].module) as layers:
        peak, _ = peak_bytes(
            lambda: it.run(step_optimizer=False, teacher=False), torch.device("cpu")
        )
    resolved = it.step.state.resolved
    choice = None
    for _, _, _, picks in it.step.trace or []:
        choice = {n: resolved.axes[n].candidates[picks[n][0]] for n in resolved.axes}
    return {"peak": peak, "saved": layers["saved"], "input": layers["input"], "choice": choice}


def pipeline_activation_peak(
    config_path: str,
    workdir: str,
    pattern: str,
    seq_len: int,
    micro_batch: int,
    num_microbatches: int,
) -> dict[str, Any]:
    """PP = 2 (2 ranks): the peak bytes each stage allocates in the student pass of one elastic
    step of ``num_microbatches`` micro-batches at budget 1.0 (FP32; the teacher pass runs before
    and is not counted), to compare with the 1F1B schedule's in-flight micro-batches."""
    from megatron.core import parallel_state as ps

    from elastic_plugin.elastic.config import CurriculumStage
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.parallel import Layout
    from tests.support.memory import clear_megatron_buffer, peak_bytes, synthetic_batches

    work = Path(workdir)
    if not (work / "init" / "elastic_meta.json").is_file():
        write_init_checkpoint(_experiment(config_path, pattern), work / "init")
    cfg, chunks, optimizer, step = _setup(
        config_path, work, Layout(pp=2), pattern, "sliced", False, 1234
    )
    budgets = step.sampler.budgets
    step.sampler = BudgetSampler(
        budgets, [CurriculumStage(iters=1, budget_probs=(1.0, 0.0, 0.0))], 5, 1
    )
    step.num_microbatches = num_microbatches
    step.iteration = 1
    batches = synthetic_batches(cfg.model.vocab_size, micro_batch, seq_len, num_microbatches)
    step.teacher_pass(chunks, batches, seq_len, micro_batch)
    logits = step._teacher_logits
    step.teacher_pass = lambda *a, **k: setattr(step, "_teacher_logits", logits)
    step.teacher_in_schedule = False  # the student's pass alone (the teacher's replayed)
    clear_megatron_buffer()
    peak, _ = peak_bytes(
        lambda: step.train_step(
            chunks, optimizer, iter(batches), seq_len, micro_batch, step_optimizer=False
        ),
        torch.device("cpu"),
    )
    return {"stage": ps.get_pipeline_model_parallel_rank(), "peak": peak}


def profile_layout(
    config_path: str,
    workdir: str,
    out: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    distributed_optimizer: bool = False,
    iters: int = 3,
    micro_batch: int = 2,
    global_batch: int = 8,
    per_budget: bool = False,
    cp: int = 1,
) -> None:
    """``train_elastic --profile`` of the tiny model under a layout for ``iters`` iterations on
    synthetic tokens (``SEQ_LEN`` long), logging every iteration to ``out/elastic_metrics.jsonl``
    and each rank's records to ``out/profile`` (what a sweep run writes, with no checkpoint); ``per_budget``: ``iters`` per budget, one curriculum stage each (as
    ``sweep.sh`` runs them). ``workdir`` holds (or gets) the shared ``init`` checkpoint."""
    import dataclasses

    from elastic_plugin.elastic.config import parse_curriculum
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.parallel import Layout
    from tests.support.elastic_cases import (
        _elastic_config,
        _synthetic_iterator,
        tiny_schedule,
    )

    work = Path(workdir)
    cfg = _experiment(config_path, None)
    if not (work / "init" / "elastic_meta.json").is_file():
        write_init_checkpoint(cfg, work / "init")
    layout = Layout(tp, pp, ep, sequence_parallel, distributed_optimizer, cp)
    ecfg = _elastic_config(cfg.model, "sliced", False)
    if per_budget:
        n = len(ecfg.budgets)
        stages = ",".join(
            f"{iters}:" + "/".join("1" if i == j else "0" for j in range(n)) for i in range(n)
        )
        ecfg = dataclasses.replace(ecfg, curriculum=parse_curriculum(stages))
        iters *= n
    sched = tiny_schedule(iters, 1e-3, global_batch=global_batch, micro_batch=micro_batch)
    train_elastic(
        cfg, ecfg, layout, work / "init", Path(out),
        lambda c: _synthetic_iterator(cfg.model.vocab_size, micro_batch, c), None, sched,
        progress=False, profile=iters,
    )  # fmt: skip


def allreduce_bus_bandwidth(nbytes: int = 8 << 20, reps: int = 5) -> float:
    """Bytes/s on the wire per rank of an all-reduce of ``nbytes`` over the world (the median of
    ``reps``; ring bus factor ``2 (n - 1) / n``, as the plan's ``timing.bus_factor``)."""
    import statistics
    import time

    n = dist.get_world_size()
    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor)  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return nbytes * 2 * (n - 1) / n / statistics.median(times)


def pipeline_teacher_peak(
    config_path: str,
    workdir: str,
    pattern: str,
    seq_len: int,
    micro_batch: int,
    num_microbatches: int,
    teacher_in_schedule: bool,
) -> dict[str, Any]:
    """PP = 2 (2 ranks): the peak bytes each stage allocates in one whole elastic step at budget
    1.0 (FP32), the frozen teacher's forward included: inside the student's schedule or, with
    ``teacher_in_schedule=False``, over every micro-batch first; and the most teacher-logit bytes
    the stage held at once, the losses and the gradient norm."""
    from megatron.core import parallel_state as ps

    from elastic_plugin.elastic.config import CurriculumStage
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.parallel import Layout
    from tests.support.memory import clear_megatron_buffer, peak_bytes, synthetic_batches

    work = Path(workdir)
    if not (work / "init" / "elastic_meta.json").is_file():
        write_init_checkpoint(_experiment(config_path, pattern), work / "init")
    cfg, chunks, optimizer, step = _setup(
        config_path, work, Layout(pp=2), pattern, "sliced", False, 1234
    )
    budgets = step.sampler.budgets
    step.sampler = BudgetSampler(
        budgets, [CurriculumStage(iters=1, budget_probs=(1.0, 0.0, 0.0))], 5, 1
    )
    step.num_microbatches = num_microbatches
    step.iteration = 1
    step.teacher_in_schedule = teacher_in_schedule
    batches = synthetic_batches(cfg.model.vocab_size, micro_batch, seq_len, num_microbatches)
    clear_megatron_buffer()
    peak, got = peak_bytes(
        lambda: step.train_step(chunks, optimizer, iter(batches), seq_len, micro_batch),
        torch.device("cpu"),
    )
    result: dict[str, Any] = got  # type: ignore[assignment]  # ElasticStep.train_step's dict
    table = result["loss"] or {}
    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "peak": peak,
        "teacher_logits": step.teacher_logit_peak,
        "kd": {i: a["kd_sum"] / a["tokens"] for i, a in table.items()},
        "grad_norm": float(result["grad_norm"]),
    }
