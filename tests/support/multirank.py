"""A persistent pool of gloo ranks for multi-rank tests on CPU.

Starting a Python process that imports Megatron-Core costs 5-9 s; a test suite that launched
``torchrun`` per test would spend most of its time starting up. ``RankPool`` starts N worker
processes once, joins them into one gloo world, and then runs any number of *cases* on all ranks:
a case is an importable function ``module:function`` called as ``fn(**kwargs)`` on every rank.
Model-parallel groups are (re)made per case with ``parallel_state``; the world group persists.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from tests.support.rendezvous import client_env, serve_store

_STOP = "__stop__"


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""


class MultiRankError(RuntimeError):
    """A case failed (or timed out) on at least one rank; the message holds each rank's traceback."""


def _resolve(target: str):
    module_name, _, fn_name = target.partition(":")
    if not fn_name:
        raise ValueError(f"case target {target!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module_name), fn_name)


def _worker(
    rank: int,
    rendezvous_env: dict[str, str],
    tasks: mp.Queue,
    results: mp.Queue,
    sys_path: list[str],
    env: dict[str, str],
) -> None:
    """One rank: join the gloo world, then run cases until told to stop."""
    os.environ.update(env)
    os.environ.update(rendezvous_env)
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        _join_world(env)
    except BaseException:  # a start-up failure is reported with its traceback, not just "died"
        results.put(RankResult(rank, False, error=traceback.format_exc()))
        return
    results.put(RankResult(rank, True, "ready"))
    while True:
        item = tasks.get()
        if item == _STOP:
            break
        target, kwargs = item
        try:
            value = _resolve(target)(**kwargs)
            results.put(RankResult(rank, True, value))
        except BaseException:  # report everything; the pool decides what to do
            results.put(RankResult(rank, False, error=traceback.format_exc()))
        finally:
            _reset_model_parallel()
    _reset_model_parallel()
    import torch.distributed as dist

    dist.destroy_process_group()


def _join_world(env: dict[str, str]) -> None:
    """Import torch and Megatron-Core, then join the gloo world through the pool's store."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(env.get("ELASTIC_PLUGIN_THREADS_PER_RANK", "1"))))
    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    dist.init_process_group("gloo")


def _reset_model_parallel() -> None:
    """Leave no model-parallel state behind for the next case.

    Megatron's ``destroy_model_parallel`` only drops its references to the groups; a gloo group
    lives on with a TCP loop thread per peer. Each case makes a fresh set, so a worker that ran
    a few hundred cases held ~1600 such threads, which took half a core between them and slowed
    every later case (and any process sharing the machine). The groups are destroyed here."""
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    from elastic_plugin.parallel import destroy_subgroups

    destroy_subgroups()


class RankPool:
    """N persistent gloo ranks; ``run("pkg.mod:fn", **kw)`` returns each rank's return value."""

    def __init__(
        self, world_size: int, start_timeout: float = 300.0, env: dict[str, str] | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results: mp.Queue = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._store = serve_store()  # served from here while the ranks live: no port race
        worker_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
        self._procs = [
            ctx.Process(
                target=_worker,
                daemon=False,  # dist-checkpointing forks helpers
                args=(
                    r,
                    client_env(self._store, r, world_size),
                    self._tasks[r],
                    self._results,
                    list(sys.path),
                    worker_env,
                ),
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        import atexit

        atexit.register(self.close, force=True)  # non-daemonic ranks must not outlive us
        failed = [r for r in self._collect(start_timeout, "start-up") if not r.ok]
        if failed:
            self.close(force=True)
            details = "".join(f"\n--- rank {r.rank} ---\n{r.error}" for r in failed)
            raise MultiRankError(f"start-up failed on ranks {[r.rank for r in failed]}{details}")

    def _collect(
        self, timeout: float, what: str, grace_after_failure: float = 20.0
    ) -> list[RankResult]:
        """Gather one result per rank; fail fast if a rank dies, or after ``timeout`` seconds.

        When one rank fails, the others are usually stuck in a collective waiting for it:
        they get ``grace_after_failure`` seconds, then the pool is torn down and the failing
        rank's traceback is reported.
        """
        import time

        got: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            try:
                res: RankResult = self._results.get(timeout=2.0)
                got[res.rank] = res
                if not res.ok:
                    deadline = min(deadline, time.monotonic() + grace_after_failure)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(got))
                codes = ", ".join(f"rank {r}: exit code {self._procs[r].exitcode}" for r in dead)
                self.close(force=True)
                failed = [r for r in got.values() if not r.ok]
                reason = (
                    f"ranks {dead} died ({codes})" if dead else f"no result within {timeout:.0f} s"
                )
                if failed:
                    reason = f"ranks {[r.rank for r in failed]} failed, others hung"
                details = "".join(f"\n--- rank {r.rank} ---\n{r.error}" for r in failed)
                raise MultiRankError(
                    f"{what}: {reason} (missing ranks {missing}); pool closed{details}"
                )
        return [got[r] for r in range(self.world_size)]

    def run(self, target: str, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """Run ``target(**kwargs)`` on every rank; raise with all tracebacks if any rank failed."""
        if not self.alive:
            raise MultiRankError("the rank pool is closed")
        for q in self._tasks:
            q.put((target, kwargs))
        results = self._collect(timeout, target)
        failures = [r for r in results if not r.ok]
        if failures:
            details = "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in failures)
            raise MultiRankError(
                f"{target} failed on ranks {[r.rank for r in failures]}:\n{details}"
            )
        return [r.value for r in results]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(_STOP)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PoolCache:
    """Reuse rank pools across tests: pools of different world sizes stay alive together up to
    ``max_ranks`` ranks in all (8 Megatron ranks are ~5 GB), the oldest closed first."""

    def __init__(self, max_ranks: int = 4) -> None:
        self.max_ranks = max_ranks
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive:
            self._pools[world_size] = self._pools.pop(world_size)  # most recently used last
            return pool
        if pool is not None:
            pool.close(force=True)
            del self._pools[world_size]
        while self._pools and sum(self._pools) + world_size > max(self.max_ranks, world_size):
            oldest = next(iter(self._pools))
            self._pools.pop(oldest).close()
        self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close(force=not pool.alive)
        self._pools.clear()
