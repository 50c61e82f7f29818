"""Which budget each micro-batch trains, and the curriculum stages (docs/design.md,
"Budget sampling and the curriculum").

Every draw is a pure function of ``(seed, iteration, microbatch)`` through a stable hash (blake2b),
so every rank of a model replica draws the same budget and the same Gumbel noise without
communicating, a restarted run redraws exactly what it drew before, and a one-rank run with
``dp * num_microbatches`` micro-batches reproduces a data-parallel run (the caller passes the global
micro-batch index ``dp_rank * num_microbatches + local_index``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from elastic_plugin.elastic.config import CurriculumStage
from elastic_plugin.models.config import ConfigError


def _hash64(seed: int, iteration: int, microbatch: int, stream: str) -> int:
    """Stable 64-bit hash of the draw coordinates (Python's ``hash`` is salted per process)."""
    key = f"{int(seed)}:{int(iteration)}:{int(microbatch)}:{stream}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class BudgetSampler:
    """Draws the budget index of a micro-batch from the probabilities of the current curriculum stage.

    ``stages`` None/empty -> one uniform stage of ``total_iters``; when the stages cover fewer than
    ``total_iters`` iterations the last stage continues to the end (and beyond).
    """

    def __init__(
        self,
        budgets: Sequence[float],
        stages: Sequence[CurriculumStage] | None,
        seed: int,
        total_iters: int,
    ):
        self.budgets = tuple(float(b) for b in budgets)
        if not self.budgets:
            raise ConfigError("budgets: at least one trained budget is required, got []")
        if total_iters < 1:
            raise ConfigError(f"total_iters must be >= 1, got {total_iters}")
        self.seed = int(seed)
        self.total_iters = int(total_iters)
        stages = list(stages or [CurriculumStage(iters=total_iters)])
        self.stages: tuple[CurriculumStage, ...] = tuple(
            self._checked(i, s) for i, s in enumerate(stages)
        )
        self._cumulative = [self._cdf(s) for s in self.stages]
        ends, total = [], 0
        for s in self.stages:
            total += s.iters or 0
            ends.append(total)
        self._stage_ends = ends

    def _checked(self, index: int, stage: CurriculumStage) -> CurriculumStage:
        """The stage (checked when it was made) against these budgets, its probabilities
        normalised to sum to exactly 1."""
        stage.check(f"curriculum[{index}]", len(self.budgets))
        if stage.iters is None:  # the sampler counts iterations; tokens need the batch shape
            raise ConfigError(
                f"curriculum[{index}] is given in tokens ({stage.tokens:g}); allowed here: "
                "iterations (CurriculumStage.in_iterations(global_batch_size, seq_length))"
            )
        if stage.budget_probs is None:
            return stage
        total = sum(stage.budget_probs)
        return dataclasses.replace(stage, budget_probs=tuple(p / total for p in stage.budget_probs))

    def _cdf(self, stage: CurriculumStage) -> list[float]:
        n = len(self.budgets)
        probs = stage.budget_probs or tuple(1.0 / n for _ in range(n))
        cdf, acc = [], 0.0
        for p in probs:
            acc += p
            cdf.append(acc)
        return cdf

    def stage(self, iteration: int) -> tuple[int, CurriculumStage]:
        """(index, stage) for a 1-based ``iteration``; the last stage continues past the covered iterations."""
        if iteration < 1:
            raise ConfigError(f"iteration is 1-based, got {iteration}")
        for index, end in enumerate(self._stage_ends):
            if iteration <= end:
                return index, self.stages[index]
        return len(self.stages) - 1, self.stages[-1]

    def budget_index(self, iteration: int, microbatch: int) -> int:
        """Index into ``budgets`` for this (iteration, global micro-batch): stateless and identical on every rank."""
        index, _ = self.stage(iteration)
        cdf = self._cumulative[index]
        u = (_hash64(self.seed, iteration, microbatch, "budget") >> 11) / float(
            1 << 53
        )  # uniform [0, 1)
        for i, c in enumerate(cdf):
            if u < c:
                return i
        # u beyond the float sum of the probabilities: the last budget with non-zero probability.
        probs = [b - a for a, b in zip([0.0, *cdf], cdf)]
        return max(i for i, p in enumerate(probs) if p > 0)

    def budget(self, iteration: int, microbatch: int) -> float:
        """The budget value drawn for this micro-batch."""
        return self.budgets[self.budget_index(iteration, microbatch)]

    def seq_length(self, iteration: int) -> int | None:
        """The current stage's sequence length (None: keep the run's default)."""
        return self.stage(iteration)[1].seq_length

    def noise_generator(self, iteration: int, microbatch: int) -> torch.Generator:
        """A CPU generator for this micro-batch's Gumbel noise (a hash stream distinct from the budget draw)."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_hash64(self.seed, iteration, microbatch, "gumbel") >> 1)
        return gen
