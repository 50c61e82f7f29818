"""The iteration loop every trainer here runs: the teacher's and elastic training's.

What one iteration of training *is* differs (a plain LM step, or the elastic step that distils
every budget from the teacher); what happens around it does not, and lives here once: the fault
injection point, the per-rank heartbeat (which names a hung rank), the throughput meter, the log,
evaluation and save cadence (Megatron-LM's ``--log-interval``, ``--eval-interval``,
``--save-interval``), the progress line, the final save, and the preemption signal.

Preemption: a cluster stops a job with a signal (SLURM sends SIGTERM at the end of the time limit
or on preemption, or the signal a job asks for with ``--signal``; ``torchrun`` forwards SIGTERM
to its workers and waits 30 s before killing them). With ``exit_signal`` set, Megatron-LM's own
``DistributedSignalHandler`` records the signal; at the next step boundary every rank learns
whether any rank got it (one all-gather of a flag), and then all of them log, save and stop, so
the requeued job resumes exactly where this one left off.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from elastic_plugin.compat.faults import fault_point
from elastic_plugin.parallel import is_rank0
from elastic_plugin.training.heartbeat import Heartbeat
from elastic_plugin.training.throughput import ThroughputMeter

__all__ = ["Cadence", "Iterations", "LoopEnd", "run_iterations"]


@dataclass(frozen=True)
class Cadence:
    """When a run logs, evaluates and saves (Megatron-LM's intervals); iterations count from 1."""

    train_iters: int
    log_interval: int
    eval_interval: int
    save_interval: int = 0  # 0: only the final save

    def logs(self, iteration: int, last: int) -> bool:
        return iteration % self.log_interval == 0 or iteration == last

    def evaluates(self, iteration: int) -> bool:
        return iteration % self.eval_interval == 0 or iteration == self.train_iters

    def saves(self, iteration: int, last: int) -> bool:
        """An interval save; the loop's last iteration gets the final save instead."""
        return (
            bool(self.save_interval) and iteration % self.save_interval == 0 and iteration != last
        )


class Iterations(Protocol):
    """What a trainer gives the loop: one iteration, and its own records, evaluation and save."""

    name: str  # the progress line's label

    @property
    def evaluates(self) -> bool:
        """False: no validation data (or a profile run)."""

    def before_step(self, iteration: int, log: Callable[[str], None]) -> None:
        """Work due before this iteration's step (elastic training freezes its router here)."""

    def step(self, iteration: int) -> tuple[int, float]:
        """Train one iteration; return the tokens it trained on and its model FLOPs."""

    def log_record(self, iteration: int) -> dict[str, Any]:
        """The log window's figures (called at each log point on every rank)."""

    def evaluate(self, iteration: int) -> dict[str, Any]:
        """The validation figures to add to this iteration's record."""

    def write(self, iteration: int, record: dict[str, Any]) -> None:
        """Append the record to the run's metrics."""

    def postfix(self, record: dict[str, Any]) -> dict[str, str] | None:
        """What the progress line shows after this iteration (None: leave it)."""

    def save(self, iteration: int) -> Path:
        """Save a checkpoint of this iteration into the stage's history."""


@dataclass
class LoopEnd:
    """How the loop ended: the last iteration trained, its records, the final save."""

    iteration: int
    history: list[dict[str, Any]] = field(default_factory=list)
    saved: Path | None = None
    preempted_by: str | None = None  # the signal's name when a preemption stopped the run
    seconds: float = 0.0


class _Preemption:
    """Megatron-LM's ``DistributedSignalHandler`` behind one question: did any rank get it?"""

    def __init__(self, sig: signal.Signals | None) -> None:
        self.sig = sig
        self.handler = None
        # a handler can only be installed from the main thread (a library caller may train in
        # another one): there, the process' own signal disposition stays as it was
        if sig is not None and threading.current_thread() is threading.main_thread():
            from megatron.training.dist_signal_handler import DistributedSignalHandler

            self.handler = DistributedSignalHandler(sig).__enter__()

    def received(self) -> bool:
        return self.handler is not None and any(self.handler.signals_received())

    def release(self) -> None:
        if self.handler is not None:
            self.handler.release()


def run_iterations(
    job: Iterations,
    first: int,
    last: int,
    cadence: Cadence,
    out_dir: str | Path,
    *,
    world: int,
    data_parallel: int,
    progress: bool = True,
    final_save: bool = True,
    stop_signal: signal.Signals | None = signal.SIGTERM,
) -> LoopEnd:
    """Train iterations ``first..last`` of ``job``; save at the end (unless ``final_save`` is
    False, as for a profile) or when ``stop_signal`` reaches any rank, whichever comes first."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    heartbeat = Heartbeat(out_dir, rank, world)
    meter = ThroughputMeter(world=world, data_parallel=data_parallel)
    bar = None
    if progress and is_rank0():
        from elastic_plugin.data.progress import make_progress

        bar = make_progress(cadence.train_iters, job.name, initial=first - 1)
    log = bar.write if bar is not None else print
    end = LoopEnd(iteration=first - 1)
    preemption = _Preemption(stop_signal)
    start = time.time()
    iteration = first - 1
    heartbeat.beat(iteration, "start")
    try:
        for iteration in range(first, last + 1):
            fault_point("train.step")
            heartbeat.beat(iteration, "train")
            job.before_step(iteration, log)
            meter.start()
            tokens, flops = job.step(iteration)
            meter.stop(tokens, flops)
            stopping = preemption.received()
            record: dict[str, Any] = {}
            if cadence.logs(iteration, last) or stopping:
                record = job.log_record(iteration) | {
                    "elapsed_s": round(time.time() - start, 2),
                    "throughput": meter.report(),
                }
            if job.evaluates and cadence.evaluates(iteration):
                heartbeat.beat(iteration, "evaluation")
                record |= job.evaluate(iteration)
            if record:
                job.write(iteration, record)
                end.history.append({"iteration": iteration, **record})
            if bar is not None:
                bar.update(1)
                shown = job.postfix(record)
                if shown:
                    bar.set_postfix(shown)
            if stopping:
                end.preempted_by = preemption.sig.name if preemption.sig else None
                log(
                    f"{job.name}: {end.preempted_by} received: saving iteration {iteration} and exiting"
                )
                break
            if cadence.saves(iteration, last):
                heartbeat.beat(iteration, "checkpoint save")
                job.save(iteration)
            heartbeat.beat(iteration, "done")
        if bar is not None:
            bar.close()
        end.iteration = iteration
        if final_save or end.preempted_by:
            heartbeat.beat(iteration, "checkpoint save")
            end.saved = job.save(iteration)
        heartbeat.beat(iteration, "done")
    finally:
        preemption.release()
    end.seconds = time.time() - start
    return end
