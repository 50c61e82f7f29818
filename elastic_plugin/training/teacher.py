"""Train the teacher: the full-size model every nested model is later distilled from.

A Megatron-Core training loop (``get_forward_backward_func``, Megatron's optimizer and LR
schedule, dist checkpointing) over Megatron indexed datasets, under any TP/PP/EP/DP layout.
It writes, into ``out_dir``: ``checkpoints/teacher/iter_NNNNNNN/`` (a Megatron dist checkpoint
plus ``elastic_meta.json``, in Megatron-LM's layout with ``latest_checkpointed_iteration.txt``;
``checkpoint.history``), ``teacher_metrics.jsonl`` and ``teacher_loss.png``.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_plugin.checkpoint.io import (
    load_checkpoint,
    load_optimizer,
    resume_source,
    save_checkpoint,
)
from elastic_plugin.checkpoint.meta import TEACHER_SUBDIR, read_checkpoint_meta
from elastic_plugin.models.config import ExperimentConfig
from elastic_plugin.models.flops import training_flops
from elastic_plugin.models.runtime import Runtime, precision_note, with_saved_precision
from elastic_plugin.parallel import (
    Layout,
    build_model_chunks,
    initialize_layout,
    is_rank0,
)
from elastic_plugin.training.batching import microbatches_per_step
from elastic_plugin.training.loop import Cadence, run_iterations
from elastic_plugin.training.optimizer import optimizer_and_scheduler
from elastic_plugin.training.recovery import (
    check_resumable_training,
    read_metrics,
    restart_metrics,
)
from elastic_plugin.training.step import (
    eval_step,
    share_from_last_stage,
    train_step,
)
from elastic_plugin.training.throughput import progress_postfix


@dataclass
class TeacherRun:
    """Result of a teacher training run (rank 0 has all fields)."""

    checkpoint_dir: str
    iterations: int
    final_train_loss: float | None
    final_valid_loss: float | None
    metrics_path: str
    plot_path: str | None
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    preempted_by: str | None = None  # the signal that stopped the run early (it saved first)


def plot_losses(history: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Training and validation loss over iterations, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["iteration"], h["train_loss"]) for h in history if h.get("train_loss") is not None]
    valid = [(h["iteration"], h["valid_loss"]) for h in history if h.get("valid_loss") is not None]
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(*zip(*train), label="train (lm loss)", lw=1.2)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation", lw=1.5)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class SavePolicy:
    """How this launch of the teacher run starts and ends (when it saves and what it keeps:
    ``training.save_interval`` / ``keep_last``, Megatron-LM's ``--save-interval``)."""

    resume: bool = False  # continue from the newest save that verifies
    stop_after: int | None = None  # end (with a save) after this many iterations
    exit_signal: signal.Signals | None = signal.SIGTERM  # save at the next step and stop


def train_teacher(
    cfg: ExperimentConfig,
    layout: Layout,
    out_dir: str | Path,
    make_train_iterator: Callable[[int], Iterator[dict] | None],
    valid_dataset_factory,
    vocab_size: int | None = None,
    progress: bool = True,
    extra_meta: dict[str, Any] | None = None,
    saves: SavePolicy = SavePolicy(),
) -> TeacherRun:
    """Train ``cfg.model`` for ``cfg.training.train_iters`` steps and checkpoint it.

    ``make_train_iterator(consumed_samples)``: Megatron-format micro-batches for this DP rank
    from that sample on (None on middle PP stages); ``valid_dataset_factory()``: a fresh
    validation iterator (or None). Saves (with the optimizer and LR-schedule state) go to the
    stage's history; with ``saves.resume`` the run continues the newest save that verifies and
    its loss trace is the one an uninterrupted run writes.
    """
    t = cfg.training
    out_dir = Path(out_dir)
    stage = out_dir.joinpath(*TEACHER_SUBDIR)
    model_cfg = cfg.model if vocab_size is None else replace(cfg.model, vocab_size=vocab_size)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = layout.data_parallel(world)
    num_microbatches = microbatches_per_step(
        t.global_batch_size,
        t.micro_batch_size,
        dp,
        names=("training.global_batch_size", "training.micro_batch_size"),
    )
    resumed = resume_source(stage) if saves.resume else None
    start_iter, consumed, resumed_meta = 1, 0, {}
    if resumed is not None:
        resumed_meta = read_checkpoint_meta(resumed)
        check_resumable_training(resumed_meta, cfg, layout, f"resume: {resumed}")
        t = with_saved_precision(t, resumed_meta)
        start_iter = int(resumed_meta["iteration"]) + 1
        consumed = int(resumed_meta.get("consumed_samples", 0))
    runtime = Runtime.of(t)
    initialize_layout(layout, seed=t.seed)
    if is_rank0():
        print(precision_note(t), file=sys.stderr, flush=True)
    chunks, _ = build_model_chunks(  # only run: Transformer Engine's layers where they can run
        model_cfg, layout, runtime.params_dtype, role="trained", **runtime.transformer_overrides()
    )
    optimizer, scheduler = optimizer_and_scheduler(chunks, t, layout)
    if resumed is not None:
        load_checkpoint(chunks, resumed)
        load_optimizer(chunks, optimizer, resumed)
        scheduler.load_state_dict(resumed_meta["scheduler"])
    metrics_path = out_dir / "teacher_metrics.jsonl"
    history: list[dict[str, Any]] = []
    if is_rank0():
        out_dir.mkdir(parents=True, exist_ok=True)
        restart_metrics(metrics_path, start_iter)
        history = read_metrics(metrics_path)  # the resumed run's earlier records: one plot
    train_iterator = make_train_iterator(consumed)
    last = (
        t.train_iters
        if saves.stop_after is None
        else min(t.train_iters, start_iter - 1 + saves.stop_after)
    )
    job = _TeacherIterations(
        chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        train_iterator=train_iterator,
        valid_factory=valid_dataset_factory,
        num_microbatches=num_microbatches,
        replica_flops=training_flops(
            model_cfg, t.seq_length, t.global_batch_size // dp, recompute=runtime.full_recompute
        ).total,
        training=t,
        consumed=consumed,
        train_loss=resumed_meta.get("final_train_loss"),
        valid_loss=resumed_meta.get("final_valid_loss"),
        metrics_path=metrics_path,
        history=history,
        save_to=stage,
        keep_last=t.keep_last,
        meta={
            "kind": "teacher",
            "layout": asdict(layout),
            "params_dtype": runtime.dtype_name,
            "config": cfg.to_dict() | {"model": asdict(model_cfg)},
            **(extra_meta or {}),
        },
    )
    end = run_iterations(
        job,
        start_iter,
        last,
        Cadence(t.train_iters, t.log_interval, t.eval_interval, t.save_interval),
        out_dir,
        world=world,
        data_parallel=dp,
        progress=progress,
        stop_signal=saves.exit_signal,
    )
    iteration = end.iteration
    plot = None
    if is_rank0():
        plot = plot_losses(
            history,
            out_dir / "teacher_loss.png",
            f"teacher training ({model_cfg.hybrid_layer_pattern}, "
            f"TP{layout.tp} PP{layout.pp} EP{layout.ep} DP{dp})",
        )
    return TeacherRun(
        str(end.saved),
        iteration,
        job.train_loss,
        job.valid_loss,
        str(metrics_path),
        str(plot) if plot else None,
        end.seconds,
        history,
        end.preempted_by,
    )


@dataclass
class _TeacherIterations:
    """One teacher iteration (a plain LM step) and its records, evaluation and save, for
    ``training.loop.run_iterations``."""

    chunks: list
    optimizer: Any
    scheduler: Any
    train_iterator: Iterator[dict] | None
    valid_factory: Callable[[], Iterator[dict] | None] | None
    num_microbatches: int
    replica_flops: float
    training: Any  # TrainingConfig
    consumed: int
    train_loss: float | None
    valid_loss: float | None
    metrics_path: Path
    history: list[dict[str, Any]]  # rank 0: the metrics file's records, earlier runs included
    save_to: Path
    keep_last: int
    meta: dict[str, Any]
    name: str = "teacher"
    window: list[float] = field(default_factory=list)
    last_rate: dict[str, Any] | None = None

    @property
    def evaluates(self) -> bool:
        return self.valid_factory is not None

    def before_step(self, iteration: int, log: Callable[[str], None]) -> None:
        pass

    def step(self, iteration: int) -> tuple[int, float]:
        t = self.training
        result = train_step(
            self.chunks,
            self.optimizer,
            self.train_iterator,
            self.num_microbatches,
            t.seq_length,
            t.micro_batch_size,
        )
        self.scheduler.step(increment=1)
        self.consumed += t.global_batch_size
        loss = share_from_last_stage(result["loss"])
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(
                f"teacher training diverged at iteration {iteration}: loss={loss}"
            )
        self.window.append(loss if loss is not None else float("nan"))
        self.grad_norm = float(result.get("grad_norm") or 0.0)
        return t.global_batch_size * t.seq_length, self.replica_flops

    def log_record(self, iteration: int) -> dict[str, Any]:
        self.train_loss = sum(self.window) / len(self.window)
        self.window.clear()
        return {
            "train_loss": self.train_loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": self.grad_norm,
        }

    def evaluate(self, iteration: int) -> dict[str, Any]:
        t = self.training
        assert self.valid_factory is not None  # evaluates is False without validation data
        self.valid_loss = share_from_last_stage(
            eval_step(
                self.chunks, self.valid_factory(), t.eval_iters, t.seq_length, t.micro_batch_size
            )
        )
        return {"valid_loss": self.valid_loss}

    def write(self, iteration: int, record: dict[str, Any]) -> None:
        record = {"iteration": iteration, **record}
        self.history.append(record)
        if "throughput" in record:
            self.last_rate = record["throughput"]
        if is_rank0():
            with self.metrics_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    def postfix(self, record: dict[str, Any]) -> dict[str, str] | None:
        return {
            "loss": f"{self.train_loss:.3f}" if self.train_loss is not None else "-",
            "val": f"{self.valid_loss:.3f}" if self.valid_loss is not None else "-",
            **progress_postfix(self.last_rate),
        }

    def save(self, iteration: int) -> Path:
        meta = {
            **self.meta,
            "iteration": iteration,
            "consumed_samples": self.consumed,
            "final_train_loss": self.train_loss,
            "final_valid_loss": self.valid_loss,
            "scheduler": self.scheduler.state_dict(),
        }
        return save_checkpoint(
            self.chunks,
            self.save_to,
            meta,
            optimizer=self.optimizer,
            iteration=iteration,
            keep_last=self.keep_last,
        )
