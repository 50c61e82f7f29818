"""Elastic nested training: distil every budget of one model from the frozen teacher, in one run.

``train_elastic`` loads an importance-reordered checkpoint into any TP/PP/EP/DP layout, makes it
elastic (``elastic.model``), and trains model + budget router with Megatron's optimizer (router in
its own LR group) and LR schedule. It writes ``checkpoints/elastic`` (model, router, optimizer,
the choice table budget -> size per axis), ``elastic_metrics.jsonl`` and loss/router plots.
Stopping and rerunning with ``resume=True`` continues the same loss trace.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.meta import budget_label
from elastic_plugin.elastic.config import ElasticConfig, ResolvedElastic
from elastic_plugin.elastic.cost import ElasticCost
from elastic_plugin.elastic.freeze import constrained_table, loss_selected_table
from elastic_plugin.elastic.layers.fp8 import fp8_gemm
from elastic_plugin.elastic.layers.state import ElasticState
from elastic_plugin.elastic.model import build_elastic_chunks, router_of, router_param_groups
from elastic_plugin.elastic.router import AnnealSchedule
from elastic_plugin.elastic.sampling import BudgetSampler
from elastic_plugin.elastic.step import ElasticStep
from elastic_plugin.models.config import ConfigError, TrainingConfig
from elastic_plugin.models.runtime import Runtime, precision_note, with_saved_precision
from elastic_plugin.parallel import Layout, initialize_layout, is_rank0
from elastic_plugin.training.batching import microbatches_per_step
from elastic_plugin.training.loop import Cadence, run_iterations
from elastic_plugin.training.optimizer import optimizer_and_scheduler
from elastic_plugin.training.profile import StepProfile
from elastic_plugin.training.recovery import check_resumable_state, restart_metrics
from elastic_plugin.training.step import eval_step, share_from_last_stage
from elastic_plugin.training.throughput import progress_postfix

ELASTIC_CKPT = "elastic"


@dataclass
class ElasticRun:
    checkpoint_dir: str
    iterations: int
    history: list[dict[str, Any]] = field(default_factory=list)
    final_valid: dict[str, float] = field(default_factory=dict)
    teacher_valid: float | None = None
    choices: dict[str, dict[str, Any]] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0
    params: dict[str, dict[str, int]] = field(default_factory=dict)  # budget -> total/active
    preempted_by: str | None = None  # the signal that stopped the run early (it saved first)

    def table(self) -> str:
        """Validation loss of every nested model next to the teacher's, as a text table."""
        lines = [
            "budget  total params  active params  valid loss  (teacher "
            + (f"{self.teacher_valid:.4f})" if self.teacher_valid is not None else "-)")
        ]
        for label, counts in self.params.items():
            loss = self.final_valid.get(label)
            lines.append(
                f"{label:>6}  {counts['total']:>12,}  {counts['active']:>13,}  "
                + (f"{loss:>10.4f}" if loss is not None else f"{'-':>10}")
            )
        return "\n".join(lines)


def choice_table(router, resolved: ResolvedElastic) -> dict[str, dict[str, Any]]:
    """budget -> axis -> chosen size (a list per layer when heterogeneous): the router's answer."""
    table: dict[str, dict[str, Any]] = {}
    for budget in resolved.budgets:
        picks = router.choose(budget)
        row: dict[str, Any] = {}
        for name, spec in resolved.axes.items():
            sizes = [spec.candidates[i] for i in picks[name]]
            row[name] = sizes if resolved.per_layer(name) else sizes[0]
        table[budget_label(budget)] = row
    return table


def _world_sum_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """Reports live on the last stage, replicated over its TP ranks: sum over DP, share with all."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    if not ps.is_pipeline_last_stage():
        values = torch.zeros_like(values)
    dist.all_reduce(values)
    return values / ps.get_tensor_model_parallel_world_size()


def evaluate_budgets(
    chunks,
    state: ElasticState,
    table: dict[str, dict[str, Any]],
    valid_factory: Callable[[], Iterator[dict] | None],
    sched: TrainingConfig,
) -> dict[str, float | None]:
    """Validation LM loss of every budget's nested model (sliced, the router's hard choice),
    with the GEMM precision the student trains in (``elastic.fp8_gemm``)."""
    out: dict[str, float | None] = {}
    try:
        for label, sizes in table.items():
            state.set_sizes(sizes)
            with fp8_gemm(state.resolved.config.fp8_gemm):
                loss = eval_step(
                    chunks,
                    valid_factory(),
                    sched.eval_iters,
                    sched.seq_length,
                    sched.micro_batch_size,
                )
            out[label] = share_from_last_stage(loss)
    finally:
        state.clear()
    return out


def _save(chunks, optimizer, scheduler, stage: Path, meta: dict[str, Any], keep_last: int) -> Path:
    """One save into the stage's history (``iter_NNNNNNN``; ``checkpoint.history``)."""
    from elastic_plugin.checkpoint.io import save_checkpoint

    return save_checkpoint(
        chunks,
        stage,
        {**meta, "scheduler": scheduler.state_dict()},
        optimizer=optimizer,
        iteration=int(meta["iteration"]),
        keep_last=keep_last,
    )


@dataclass
class ElasticTrainer:
    """What one elastic run trains with: the student chunks (elastic, in Megatron DDP), their
    elastic state, the frozen teacher (None: the student at full budget), Megatron's optimizer
    and LR schedule, and the per-micro-batch step. ``train_elastic`` drives it through the
    training loop; ``bench/bench_train.py`` times its ``step.train_step`` as it is."""

    chunks: list
    state: ElasticState
    teacher_chunks: list | None
    optimizer: Any
    scheduler: Any
    step: ElasticStep
    meta_src: dict[str, Any]


def build_elastic_trainer(
    cfg,
    ecfg: ElasticConfig,
    layout: Layout,
    resolved: ResolvedElastic,
    source: str | Path,
    sched: TrainingConfig,
    num_microbatches: int,
    teacher_ckpt: str | Path | None = None,
    prepare_router: Callable[[list, ElasticState, dict[str, Any]], None] | None = None,
) -> ElasticTrainer:
    """Load ``source`` as the elastic student and ``teacher_ckpt`` (default ``source``) as the
    frozen teacher (unless ``ecfg.teacher == "self"``), and build the optimizer and the step.
    ``prepare_router(chunks, state, meta)`` runs on the student before the optimizer copies its
    weights (the zero-shot screening sets the router's start there). ``initialize_layout(layout)``
    must have been called."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint

    runtime = Runtime.of(cfg.training)
    chunks, state, meta_src = build_elastic_chunks(
        source, layout, resolved, router_seed=sched.seed, runtime=runtime
    )
    if prepare_router is not None:
        prepare_router(chunks, state, meta_src)
    teacher_chunks = None
    if ecfg.teacher == "frozen":
        # forward only: the model dtype, no recomputation, no DDP (no gradient buffers), no
        # optimizer state
        teacher_chunks, _, _ = build_from_checkpoint(
            teacher_ckpt or source, layout, params_dtype=runtime.params_dtype, role="teacher"
        )
        for chunk in teacher_chunks:
            chunk.requires_grad_(False)
    optimizer, scheduler = optimizer_and_scheduler(
        chunks,
        sched,
        layout,
        config_overrides=router_param_groups(
            sched.lr, sched.min_lr, ecfg.router.lr_multiplier(sched.lr)
        ),
    )
    anneal = ecfg.router.anneal_iters or sched.train_iters
    stages = ecfg.curriculum_in_iterations(sched.global_batch_size, sched.seq_length)
    step = ElasticStep(
        state=state,
        sampler=BudgetSampler(resolved.budgets, stages, sched.seed, sched.train_iters),
        cost=ElasticCost(cfg.model, resolved),
        temperature=AnnealSchedule(*ecfg.router.temperature, anneal),
        logit_scale=AnnealSchedule(*ecfg.router.logit_scale, anneal),
        num_microbatches=num_microbatches,
        teacher_chunks=teacher_chunks,
        recompute=runtime.full_recompute,
    )
    return ElasticTrainer(chunks, state, teacher_chunks, optimizer, scheduler, step, meta_src)


def train_elastic(
    cfg,
    ecfg: ElasticConfig,
    layout: Layout,
    student_ckpt: str | Path,
    out_dir: str | Path,
    make_train_iterator: Callable[[int], Iterator[dict] | None],
    valid_factory: Callable[[], Iterator[dict] | None] | None,
    sched: TrainingConfig,
    teacher_ckpt: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    extra_meta: dict[str, Any] | None = None,
    profile: int | None = None,
    exit_signal: signal.Signals | None = signal.SIGTERM,
    save_optimizer: bool = True,
) -> ElasticRun:
    """Train all budgets of ``ecfg`` from ``student_ckpt`` (importance-reordered).

    ``make_train_iterator(consumed_samples)``: this DP rank's micro-batches from that point;
    ``teacher_ckpt``: the frozen teacher (default: ``student_ckpt`` itself, which computes the
    same function); ignored when ``ecfg.teacher == "self"``. ``stop_after``: end (with a
    checkpoint) after that many iterations, as an interrupted job would; resume continues.
    ``extra_meta`` goes into the checkpoint's metadata (e.g. ``data`` and ``tokenizer``, which
    extraction and export read to evaluate the nested models). ``profile``: train that many
    iterations for a scaling measurement (``training.profile``: one record per iteration and
    rank), with no evaluation and no checkpoint. ``exit_signal``: the preemption signal that
    makes the run save at the next step boundary and stop (``training.loop``; None: none).
    ``save_optimizer=False`` (``--no-save-optim``, Megatron-LM's flag) saves the model without
    the optimizer state (a third of the bytes), for a checkpoint that only seeds another run; a
    ``--resume`` from such a save is refused.
    """
    from elastic_plugin.checkpoint.io import load_optimizer, resume_source
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.elastic.metrics import ElasticMetrics

    sched.check("elastic training")
    model_cfg = cfg.model
    resolved = ecfg.resolve(model_cfg, layout.tp, layout.ep)
    if ecfg.router.freeze_select == "loss" and valid_factory is None:
        raise ConfigError(
            "elastic.router.freeze_select=loss measures candidates on validation "
            "data; give validation data (--valid-data-path, or a prepared task) or "
            "use freeze_select=likelihood"
        )
    grid_size = math.prod(len(spec.candidates) for spec in resolved.axes.values())
    if ecfg.router.init == "screened" and valid_factory is None and grid_size > 1:
        raise ConfigError(
            "elastic.router.init=screened measures every candidate on validation data; give "
            "validation data (--valid-data-path, or a prepared task) or use init=prior"
        )
    if ecfg.mode == "sliced" and not ecfg.router.hard:
        raise ConfigError(
            "elastic.mode=sliced needs hard router choices (elastic.router.hard=true); "
            "soft masks need elastic.mode=masked"
        )
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints" / ELASTIC_CKPT
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = layout.data_parallel(world)
    num_microbatches = microbatches_per_step(sched.global_batch_size, sched.micro_batch_size, dp)
    start_iter, consumed = 1, 0
    source = Path(student_ckpt)
    resumed = resume_source(ckpt_dir) if resume else None
    if resumed is not None:
        meta = read_checkpoint_meta(resumed)
        if meta.get("optimizer_saved") is False:
            raise ConfigError(
                f"--resume: {resumed} was saved with --no-save-optim (no optimizer state to "
                "continue from); start a new run from it with --ckpt instead"
            )
        cfg = replace(cfg, training=with_saved_precision(cfg.training, meta))
        check_resumable_state(meta, Runtime.of(cfg.training), layout, f"resume: {resumed}")
        source, start_iter = resumed, int(meta["iteration"]) + 1
        consumed = int(meta["consumed_samples"])
    initialize_layout(layout, seed=sched.seed)
    if is_rank0():
        print(precision_note(cfg.training), file=sys.stderr, flush=True)
    screen = None
    if ecfg.router.init == "screened" and resumed is None and profile is None:
        screen = partial(
            _screen_router, ecfg=ecfg, resolved=resolved, sched=sched, dp=dp, out_dir=out_dir,
            valid_factory=valid_factory,
        )  # fmt: skip
    trainer = build_elastic_trainer(
        cfg, ecfg, layout, resolved, source, sched, num_microbatches,
        teacher_ckpt=teacher_ckpt or student_ckpt, prepare_router=screen,
    )  # fmt: skip
    chunks, state, step = trainer.chunks, trainer.state, trainer.step
    optimizer, scheduler, meta_src = trainer.optimizer, trainer.scheduler, trainer.meta_src
    if resumed is not None:
        load_optimizer(chunks, optimizer, resumed)
        scheduler.load_state_dict(meta_src["scheduler"])
    teacher_chunks = trainer.teacher_chunks
    router = router_of(chunks[0])
    elastic_src = (meta_src.get("elastic") or {}) if start_iter > 1 else {}
    frozen_table = elastic_src.get("frozen_choices")
    freeze_search = elastic_src.get("freeze_search")
    if frozen_table:
        step.freeze(frozen_table)

    metrics = ElasticMetrics(
        out_dir,
        resolved.budgets,
        log_rank=0,
        full_sizes={n: s.full for n, s in resolved.axes.items()},
    )
    if is_rank0():
        out_dir.mkdir(parents=True, exist_ok=True)
        restart_metrics(out_dir / "elastic_metrics.jsonl", start_iter)
    train_iterator = make_train_iterator(consumed)
    teacher_valid = None
    if valid_factory is not None and profile is None:
        eval_chunks = teacher_chunks or chunks
        state.clear()
        teacher_valid = share_from_last_stage(
            eval_step(
                eval_chunks,
                valid_factory(),
                sched.eval_iters,
                sched.seq_length,
                sched.micro_batch_size,
            )
        )
    run_for = profile if profile is not None else stop_after
    last = (
        sched.train_iters if run_for is None else min(sched.train_iters, start_iter - 1 + run_for)
    )
    job = _ElasticIterations(
        chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        step_fn=step,
        state=state,
        router=router,
        ecfg=ecfg,
        resolved=resolved,
        sched=sched,
        train_iterator=train_iterator,
        valid_factory=valid_factory,
        metrics=metrics,
        consumed=consumed,
        frozen_table=frozen_table,
        freeze_search=freeze_search,
        profiler=(
            StepProfile(out_dir, dist.get_rank() if dist.is_initialized() else 0, world, dp)
            if profile is not None
            else None
        ),
        save_to=ckpt_dir,
        save_optimizer=save_optimizer,
        meta=lambda iteration, consumed, table, frozen, search: (
            checkpoint_meta(
                cfg,
                ecfg,
                layout,
                resolved,
                table,
                iteration,
                consumed,
                teacher_valid,
                frozen=frozen,
                freeze_search=search,
            )
            | dict(extra_meta or {})
        ),
    )
    end = run_iterations(
        job,
        start_iter,
        last,
        Cadence(
            sched.train_iters,
            sched.log_interval,
            sched.eval_interval,
            sched.save_interval if profile is None else 0,
        ),
        out_dir,
        world=world,
        data_parallel=dp,
        progress=progress,
        final_save=profile is None,  # a profile measures; it leaves no checkpoint
        stop_signal=exit_signal if profile is None else None,
    )
    iteration, saved = end.iteration, end.saved
    table = job.table()
    plots = [str(p) for p in metrics.plot()] if is_rank0() else []
    counts = {
        metric: ElasticCost(model_cfg, resolved, metric=f"{metric}_params")
        for metric in ("total", "active")
    }
    params = {
        label: {m: int(c.of_choice(sizes)) for m, c in counts.items()}
        for label, sizes in table.items()
    }
    return ElasticRun(
        str(saved) if saved is not None else "",
        iteration,
        end.history,
        {k: v for k, v in job.valid.items() if v is not None},
        teacher_valid,
        table,
        plots,
        end.seconds,
        params,
        end.preempted_by,
    )


@dataclass
class _ElasticIterations:
    """One elastic iteration (every budget distilled from the teacher, ``ElasticStep``), its
    log window, evaluation of every budget, router freezing and save, for
    ``training.loop.run_iterations``."""

    chunks: list
    optimizer: Any
    scheduler: Any
    step_fn: ElasticStep
    state: ElasticState
    router: Any
    ecfg: ElasticConfig
    resolved: ResolvedElastic
    sched: TrainingConfig
    train_iterator: Iterator[dict] | None
    valid_factory: Callable[[], Iterator[dict] | None] | None
    metrics: Any  # ElasticMetrics
    consumed: int
    frozen_table: dict[str, dict[str, Any]] | None
    freeze_search: dict[str, Any] | None
    profiler: StepProfile | None
    save_to: Path
    save_optimizer: bool
    meta: Callable[..., dict[str, Any]]
    name: str = "elastic"
    valid: dict[str, float | None] = field(default_factory=dict)
    grad_norm: float = 0.0

    def __post_init__(self) -> None:
        # kd_sum, tokens, budget_loss_sum, count per budget, over the log window
        self.window = torch.zeros(len(self.resolved.budgets), 4, dtype=torch.float64)

    @property
    def evaluates(self) -> bool:
        return self.valid_factory is not None and self.profiler is None

    def table(self) -> dict[str, dict[str, Any]]:
        """The choice per budget: fixed once the router is frozen, else the router's answer."""
        return self.frozen_table or choice_table(self.router, self.resolved)

    def before_step(self, iteration: int, log: Callable[[str], None]) -> None:
        self.step_fn.iteration = iteration
        freeze_after = self.ecfg.router.freeze_after
        if freeze_after is None or iteration <= freeze_after or self.frozen_table:
            return

        def measure(table: dict[str, dict[str, Any]]) -> dict[str, float | None]:
            """The loss search's measure: only freeze_select=loss calls it."""
            assert self.valid_factory is not None  # freeze_select=loss: checked at the start
            return evaluate_budgets(self.chunks, self.state, table, self.valid_factory, self.sched)

        self.frozen_table, self.freeze_search = _freeze_table(
            self.ecfg, self.router, self.resolved, self.step_fn.cost, measure, log=log
        )
        self.step_fn.freeze(self.frozen_table)

    def step(self, iteration: int) -> tuple[int, float]:
        sched, step = self.sched, self.step_fn
        began = time.perf_counter()
        result = step.train_step(
            self.chunks,
            self.optimizer,
            self.train_iterator,
            sched.seq_length,
            sched.micro_batch_size,
        )
        self.scheduler.step(increment=1)
        self.consumed += sched.global_batch_size
        tokens = sched.global_batch_size * (step.sampler.seq_length(iteration) or sched.seq_length)
        flops = step.take_flops()
        if self.profiler is not None:
            drawn = [
                budget_label(self.resolved.budgets[step.budget_index(i)])
                for i in range(step.num_microbatches)
            ]
            budgets = {label: drawn.count(label) for label in sorted(set(drawn))}
            self.profiler.record(iteration, budgets, time.perf_counter() - began, tokens, flops)
        for index, agg in (result["loss"] or {}).items():
            self.window[index] += torch.tensor(
                [agg["kd_sum"], agg["tokens"], agg["budget_loss_sum"], agg["count"]],
                dtype=torch.float64,
            )
        self.grad_norm = float(result.get("grad_norm") or 0.0)
        return tokens, flops

    def log_record(self, iteration: int) -> dict[str, Any]:
        totals = _world_sum_from_last_stage(self.window.clone())
        self.window.zero_()
        budgets = self.resolved.budgets
        kd = {
            budget_label(b): float(totals[i, 0] / totals[i, 1])
            for i, b in enumerate(budgets)
            if totals[i, 1] > 0
        }
        if any(not math.isfinite(v) for v in kd.values()):
            raise FloatingPointError(f"elastic training diverged at iteration {iteration}: {kd}")
        return {
            "train_loss": kd,
            "budget_loss": {
                budget_label(b): float(totals[i, 2] / totals[i, 3])
                for i, b in enumerate(budgets)
                if totals[i, 3] > 0
            },
            "choices": self.table(),
            "temperature": self.step_fn.temperature.value(iteration - 1),
            "logit_scale": self.step_fn.logit_scale.value(iteration - 1),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": self.grad_norm,
        }

    def evaluate(self, iteration: int) -> dict[str, Any]:
        assert self.valid_factory is not None  # evaluates is False without validation data
        self.valid = evaluate_budgets(
            self.chunks, self.state, self.table(), self.valid_factory, self.sched
        )
        return {"valid_loss": self.valid}

    def write(self, iteration: int, record: dict[str, Any]) -> None:
        self.metrics.log(iteration, record)

    def postfix(self, record: dict[str, Any]) -> dict[str, str] | None:
        if not record.get("train_loss"):
            return None
        return {k: f"{v:.3f}" for k, v in record["train_loss"].items()} | progress_postfix(
            record["throughput"]
        )

    def save(self, iteration: int) -> Path:
        meta = self.meta(
            iteration, self.consumed, self.table(), bool(self.frozen_table), self.freeze_search
        )
        if not self.save_optimizer:
            meta = {**meta, "optimizer_saved": False}
        return _save(
            self.chunks, self.optimizer if self.save_optimizer else None, self.scheduler,
            self.save_to, meta, self.sched.keep_last,
        )  # fmt: skip


def _screen_router(
    chunks,
    state: ElasticState,
    meta: dict[str, Any],
    *,
    ecfg: ElasticConfig,
    resolved: ResolvedElastic,
    sched: TrainingConfig,
    dp: int,
    out_dir: Path,
    valid_factory: Callable[[], Iterator[dict] | None] | None,
) -> None:
    """``router.init=screened``: measure every candidate zero-shot and start the router on each
    budget's pick (``elastic/screening.py``; writes ``OUT/screening.json``)."""
    from elastic_plugin.elastic.screening import depth_importance, grid_choices, screen_router

    assert valid_factory is not None  # init=screened: checked at the start
    log = _rank0_log
    if len(grid_choices(resolved)) == 1:
        log("screening: one candidate per axis, nothing to choose (router.init=screened skipped)")
        return
    scores, source, flops = depth_importance(chunks, meta, valid_factory, sched, resolved.model, dp)
    screen_router(
        chunks, state, router_of(chunks[0]), resolved, ElasticCost(resolved.model, resolved),
        evaluate_budgets, valid_factory, sched, data_parallel=dp, depth_scores=scores,
        depth_source=source, depth_flops=flops, logit_scale=ecfg.router.logit_scale[0],
        out_dir=out_dir, log=log,
    )  # fmt: skip


def _rank0_log(line: str) -> None:
    if is_rank0():
        print(line, file=sys.stderr, flush=True)


def _freeze_table(
    ecfg: ElasticConfig,
    router,
    resolved: ResolvedElastic,
    cost,
    evaluate: Callable,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """The table the router freezes to (``elastic/freeze.py``), and the loss search's record."""
    if ecfg.heterogeneous:
        return choice_table(router, resolved), None
    if ecfg.router.freeze_select == "loss":
        return loss_selected_table(
            router, resolved, cost, evaluate, ecfg.router.freeze_candidates, log=log
        )
    return constrained_table(router, resolved, cost), None


def checkpoint_meta(
    cfg,
    ecfg: ElasticConfig,
    layout: Layout,
    resolved: ResolvedElastic,
    table: dict[str, dict[str, Any]],
    iteration: int,
    consumed: int,
    teacher_valid: float | None,
    frozen: bool = False,
    freeze_search: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An elastic checkpoint's ``elastic_meta.json`` (without the digests): what ``inspect``,
    ``extract``, ``export`` and a resume read. Also written into Megatron-LM's ``--save``
    directories by ``elastic.megatron_lm``."""
    from elastic_plugin.elastic.cost import ElasticCost

    cost = ElasticCost(cfg.model, resolved)
    return {
        "kind": "elastic",
        "iteration": iteration,
        "consumed_samples": consumed,
        "layout": asdict(layout),
        "params_dtype": Runtime.of(cfg.training).dtype_name,
        "config": cfg.to_dict() | {"elastic": ecfg.to_dict()},
        "elastic": {
            "budgets": list(resolved.budgets),
            "metric": ecfg.budget_metric,
            "axes": {
                n: {
                    "full": s.full,
                    "candidates": list(s.candidates),
                    "layers": list(s.layers),
                    "unit": s.unit,
                }
                for n, s in resolved.axes.items()
            },
            "choices": table,
            "cost_fraction": {b: cost.of_choice(sizes) / cost.full for b, sizes in table.items()},
            **({"frozen_choices": table} if frozen else {}),
            **({"freeze_search": freeze_search} if freeze_search else {}),
        },
        "teacher_valid_loss": teacher_valid,
    }
