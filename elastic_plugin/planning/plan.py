"""Assemble a plan: every valid layout, per budget its nested model, FLOPs, communication,
memory and estimated step time, ranked; and the configured curriculum's time and GPU-hours
against training each budget separately.

All figures are estimates from the stated model (``memory``, ``comm``, ``timing``): weights,
gradients, optimizer state and communication bytes equal what Megatron allocates and sends on
the runs the tests measure; activations and time are models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_plugin.elastic.config import CurriculumStage, ElasticConfig, ResolvedElastic
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import ModelConfig
from elastic_plugin.models.flops import training_flops
from elastic_plugin.models.runtime import Runtime
from elastic_plugin.planning.budgets import BudgetRun, budget_runs, stage_flops
from elastic_plugin.planning.comm import step_comm_bytes
from elastic_plugin.planning.devices import Device
from elastic_plugin.planning.layouts import PlanLayout, enumerate_layouts
from elastic_plugin.planning.memory import RankMemory, rank_memory, state_bytes
from elastic_plugin.planning.params import StageParams, elastic_router_tensors, stage_params
from elastic_plugin.planning.timing import StepTime, step_time

__all__ = ["LayoutPlan", "PlanInputs", "evaluate_layout", "make_plan"]


@dataclass(frozen=True)
class PlanInputs:
    model: ModelConfig
    source: str
    gpus: int
    device: Device
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    runtime: Runtime
    elastic: ElasticConfig
    distributed_optimizer: bool | None = None  # None: with and without
    efficiency: float = 0.4
    comm_efficiency: float = 0.7
    reserve_gb: float = 4.0
    curriculum: tuple[CurriculumStage, ...] = ()  # the training config's stage type
    separate_tokens: float | None = None
    mamba_scan: str = "fused"  # activations.MAMBA_SCANS: mamba_ssm's kernels, or our torch scan
    context_parallel: tuple[int, ...] | None = None  # CP sizes to consider; None: every valid one

    @property
    def frozen_teacher(self) -> bool:
        return self.elastic.teacher == "frozen"

    @property
    def peak_tflops(self) -> float:
        if self.elastic.fp8_gemm != "off":
            return self.device.fp8_tflops
        return self.device.bf16_tflops if self.runtime.bf16 else self.device.bf16_tflops / 2


@dataclass
class BudgetPlan:
    run: BudgetRun
    memory: RankMemory
    comm: dict[str, dict[str, float]]
    time: StepTime
    step_flops: float  # the whole step's FLOPs (all ranks): student + teacher

    def to_dict(self, tokens_per_step: int) -> dict[str, Any]:
        return {
            "budget": self.run.budget,
            "choice": self.run.choice,
            "params": {"total": self.run.total_params, "active": self.run.active_params},
            "step_flops": self.step_flops,
            "comm_bytes_per_rank": self.comm,
            "memory": self.memory.to_dict(),
            "step_time": self.time.to_dict(),
            "tokens_per_s": tokens_per_step / self.time.seconds,
        }


@dataclass
class LayoutPlan:
    layout: PlanLayout
    budgets: list[BudgetPlan]
    memory: RankMemory  # the largest over budgets
    capacity: float  # bytes usable on a GPU (capacity - reserve)
    step_seconds: float  # budgets mixed by the first curriculum stage's probabilities
    tokens_per_s: float
    curriculum: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def headroom(self) -> float:
        return self.capacity - self.memory.total

    def to_dict(self, tokens_per_step: int) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "fits": self.fits,
            "memory": self.memory.to_dict(),
            "headroom_bytes": self.headroom,
            "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_s,
            "budgets": [b.to_dict(tokens_per_step) for b in self.budgets],
            "curriculum": self.curriculum,
        }


def _router(resolved: ResolvedElastic) -> list[int]:
    axes = {
        name: (len(spec.candidates), len(spec.layers) if resolved.per_layer(name) else 1)
        for name, spec in resolved.axes.items()
    }
    return elastic_router_tensors(len(resolved.budgets), axes, resolved.config.router.hidden_size)


def _time(
    inputs: PlanInputs,
    layout: PlanLayout,
    stages: list[StageParams],
    model: ModelConfig,
    nested: ModelConfig,
    student: list[int],
    teacher: list[int],
    seq_length: int,
    num_microbatches: int,
    with_teacher: bool = True,
) -> tuple[StepTime, dict[str, dict[str, float]]]:
    """The slowest stage's step time and that stage's communication."""
    best: tuple[StepTime, dict[str, dict[str, float]]] | None = None
    for index, stage in enumerate(stages):
        comm = step_comm_bytes(
            model, nested, index, stages, layout.tp, layout.pp, layout.ep, layout.dp,
            layout.sequence_parallel, layout.distributed_optimizer, inputs.runtime.bf16,
            inputs.micro_batch_size, seq_length, num_microbatches, teacher=with_teacher,
            cp=layout.cp,
        )  # fmt: skip
        state = sum(
            state_bytes(
                stage, layout.dp_cp, layout.ep, inputs.runtime.bf16, layout.distributed_optimizer
            ).values()
        )
        time = step_time(
            inputs.device, layout.tp, layout.pp, layout.ep, layout.dp, student, teacher, comm,
            num_microbatches, state, inputs.peak_tflops, inputs.efficiency,
            inputs.comm_efficiency, cp=layout.cp,
        )  # fmt: skip
        if best is None or time.seconds > best[0].seconds:
            best = (time, comm)
    assert best is not None
    return best


_RUNS: dict[tuple[int, int, int, int], tuple[PlanInputs, list[BudgetRun]]] = {}


def evaluate_layout(
    inputs: PlanInputs, layout: PlanLayout, resolved: ResolvedElastic, seq_length: int
) -> list[BudgetPlan]:
    """Per budget of ``resolved``: its nested model, busiest-rank memory, communication and
    step time at ``seq_length`` (every micro-batch of the step at that budget)."""
    model = inputs.model
    tp, pp, ep, dp = layout.tp, layout.pp, layout.ep, layout.dp
    stages = stage_params(model, tp, pp, ep, _router(resolved))
    num_mb = inputs.global_batch_size // (inputs.micro_batch_size * dp)
    key = (id(inputs), tp, ep, seq_length)  # the runs depend on TP / EP only through resolve
    cached = _RUNS.get(key)
    if cached is None or cached[0] is not inputs:  # the entry keeps its inputs alive: no reused id
        runs = budget_runs(
            model, resolved, seq_length, inputs.micro_batch_size, inputs.runtime.full_recompute
        )
        _RUNS[key] = (inputs, runs)
    else:
        runs = cached[1]
    out = []
    for run in runs:
        memory = rank_memory(
            model, run.nested, stages, tp, pp, ep, dp, layout.sequence_parallel,
            layout.distributed_optimizer, inputs.runtime, inputs.micro_batch_size, seq_length,
            num_mb, inputs.frozen_teacher, inputs.mamba_scan, inputs.elastic.kd_chunk_tokens,
            layout.cp,
        )  # fmt: skip
        student = stage_flops(model, run.train_flops, pp)
        teacher = stage_flops(model, run.teacher_flops, pp)
        time, comm = _time(inputs, layout, stages, model, run.nested, student, teacher,
                           seq_length, num_mb)  # fmt: skip
        step_flops = (run.train_flops.total + run.teacher_flops.total) * (
            inputs.global_batch_size // inputs.micro_batch_size
        )
        out.append(BudgetPlan(run, memory, comm, time, step_flops))
    return out


def _mix(budgets: list[BudgetPlan], probs: tuple[float, ...] | None) -> float:
    """Expected step time when each micro-batch draws its budget with ``probs``."""
    weights = probs or tuple(1.0 / len(budgets) for _ in budgets)
    return sum(w * b.time.seconds for w, b in zip(weights, budgets))


def _separate(inputs: PlanInputs, layout: PlanLayout, run: BudgetRun, tokens: float) -> float:
    """Seconds to train ``run``'s nested model as a plain model of its own (whatever the
    elastic mode; its router over its own experts) on ``tokens``: no teacher, same layout."""
    plain = model_for_choice(inputs.model, run.choice)
    stages = stage_params(plain, layout.tp, layout.pp, layout.ep)
    num_mb = inputs.global_batch_size // (inputs.micro_batch_size * layout.dp)
    flops = training_flops(plain, inputs.seq_length, inputs.micro_batch_size,
                           recompute=inputs.runtime.full_recompute)  # fmt: skip
    student = stage_flops(plain, flops, layout.pp)
    time, _ = _time(inputs, layout, stages, plain, plain, student, [0] * layout.pp,
                    inputs.seq_length, num_mb, with_teacher=False)  # fmt: skip
    steps = tokens / (inputs.global_batch_size * inputs.seq_length)
    return steps * time.seconds


def _rank(inputs: PlanInputs, seq_length: int, probs: tuple[float, ...] | None) -> tuple[
    list[tuple[LayoutPlan, ResolvedElastic]], dict[str, int]
]:  # fmt: skip
    """Every valid layout evaluated at ``seq_length``, fitting ones first (fastest first), then
    the others (smallest shortfall first); and the rejected layouts per reason."""
    valid, rejected = enumerate_layouts(
        inputs.model, inputs.gpus, inputs.elastic, inputs.runtime, inputs.micro_batch_size,
        inputs.global_batch_size, inputs.distributed_optimizer, seq_length,
        inputs.context_parallel,
    )  # fmt: skip
    capacity = inputs.device.memory_bytes - inputs.reserve_gb * 1e9
    plans = []
    for layout, resolved in valid:
        budgets = evaluate_layout(inputs, layout, resolved, seq_length)
        memory = max((b.memory for b in budgets), key=lambda m: m.total)
        seconds = _mix(budgets, probs)
        tokens = inputs.global_batch_size * seq_length / seconds
        plans.append((LayoutPlan(layout, budgets, memory, capacity, seconds, tokens), resolved))
    plans.sort(key=lambda p: (not p[0].fits, -p[0].tokens_per_s if p[0].fits else -p[0].headroom))
    return plans, rejected


def curriculum_cost(inputs: PlanInputs, best: LayoutPlan) -> dict[str, Any]:
    """Each curriculum stage on its fastest fitting layout at the stage's sequence length
    (time, GPU-hours), and each budget trained separately on ``best``'s layout."""
    stages = []
    seconds = 0.0
    for stage in inputs.curriculum:
        seq_length = stage.seq_length or inputs.seq_length
        tokens = stage.token_count(inputs.global_batch_size, inputs.seq_length)
        ranked, _ = _rank(inputs, seq_length, stage.budget_probs)
        entry: dict[str, Any] = {
            "tokens": tokens,
            "seq_length": seq_length,
            "budget_probs": list(stage.budget_probs) if stage.budget_probs else None,
            "fits": bool(ranked) and ranked[0][0].fits,
        }
        if ranked:
            plan = ranked[0][0]
            steps = tokens / (inputs.global_batch_size * seq_length)
            t = steps * plan.step_seconds
            seconds += t
            entry.update(
                layout=plan.layout.name,
                steps=steps,
                hours=t / 3600,
                gpu_hours=t * inputs.gpus / 3600,
                memory_bytes=plan.memory.total,
            )
        stages.append(entry)
    total_tokens = sum(entry["tokens"] for entry in stages)
    tokens = inputs.separate_tokens or total_tokens
    separate = {
        str(b.run.budget): _separate(inputs, best.layout, b.run, tokens) * inputs.gpus / 3600
        for b in best.budgets
    }
    return {
        "stages": stages,
        "hours": seconds / 3600,
        "gpu_hours": seconds * inputs.gpus / 3600,
        "separate_layout": best.layout.name,
        "separate_tokens_per_budget": tokens,
        "separate_gpu_hours": separate,
        "separate_gpu_hours_total": sum(separate.values()),
    }


def make_plan(inputs: PlanInputs) -> tuple[list[LayoutPlan], dict[str, int]]:
    """Every valid layout at ``--seq-length``, ranked (``_rank``), budgets mixed by the first
    curriculum stage's probabilities; the best fitting one carries the curriculum's cost."""
    probs = inputs.curriculum[0].budget_probs if inputs.curriculum else None
    ranked, rejected = _rank(inputs, inputs.seq_length, probs)
    plans = [p for p, _ in ranked]
    if inputs.curriculum and plans and plans[0].fits:
        plans[0].curriculum = curriculum_cost(inputs, plans[0])
    _RUNS.clear()
    return plans, rejected
