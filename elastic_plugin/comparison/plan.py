"""What ``compare`` trains, and for how many tokens: torch-free arithmetic on the elastic run's
metadata, so bad flags and impossible plans fail in seconds.

The elastic run's cost is its tokens (every iteration's global batch times that iteration's
sequence length, as the curriculum set it). A separate route gets either that total split over
the sizes it must produce (``equal_cost``: all sizes together cost what the one elastic run cost)
or that total for each size (``equal_tokens``: each separate model saw as many tokens as the
whole elastic run). The full model is the teacher every route starts from, so the sizes a
separate route must produce are the elastic run's trained budgets below 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = [
    "ROUTES",
    "TOKEN_BUDGETS",
    "RunSpec",
    "elastic_tokens",
    "iters_for_tokens",
    "plan_runs",
    "route_tokens",
]

# (a) the elastic run, (b) prune then distil each size alone, (c) each size from scratch,
# (d) the pruned teacher with no training (the floor)
ROUTES = ("elastic", "prune_distil", "scratch", "zero_shot")
TRAINED_ROUTES = ("prune_distil", "scratch")
TOKEN_BUDGETS = ("equal_cost", "equal_tokens")


def elastic_tokens(config: Mapping[str, Any], iterations: int) -> int:
    """Tokens the elastic run trained on: per iteration, the global batch times the sequence
    length of the curriculum stage it fell in (a stage without one: ``training.seq_length``)."""
    training = config["training"]
    seq, batch = int(training["seq_length"]), int(training["global_batch_size"])
    stages = (config.get("elastic") or {}).get("curriculum") or []
    tokens, done = 0, 0
    for stage in stages:
        n = min(int(stage["iters"]), iterations - done)
        if n <= 0:
            break
        tokens += n * batch * int(stage.get("seq_length") or seq)
        done += n
    if done < iterations and stages and stages[-1].get("seq_length"):
        # the last stage continues past the covered iterations (elastic.sampling)
        return tokens + (iterations - done) * batch * int(stages[-1]["seq_length"])
    return tokens + max(0, iterations - done) * batch * seq


def route_tokens(token_budget: str, elastic_total: int, num_sizes: int, scale: float = 1.0) -> int:
    """Tokens one separately made model gets under ``token_budget`` (times ``scale``, for a
    reduced run): the elastic total split over ``num_sizes`` sizes, or the whole total."""
    if token_budget not in TOKEN_BUDGETS:
        raise ConfigError(f"--token-budgets: {token_budget!r}; allowed: {', '.join(TOKEN_BUDGETS)}")
    if num_sizes < 1:
        raise ConfigError("the elastic checkpoint has no trained budget below 1.0 to compare")
    share = elastic_total / num_sizes if token_budget == "equal_cost" else elastic_total
    return max(1, int(share * scale))


def iters_for_tokens(tokens: int, global_batch_size: int, seq_length: int) -> int:
    """Iterations of ``global_batch_size`` sequences of ``seq_length`` that cover ``tokens``
    (at least one; rounded to the nearest, so the reported tokens are within half a batch)."""
    return max(1, math.floor(tokens / (global_batch_size * seq_length) + 0.5))


@dataclass(frozen=True)
class RunSpec:
    """One model to make: ``route`` for the size of trained budget ``label``; trained routes
    carry their token budget, seed and iterations (zero-shot and elastic train nothing here)."""

    route: str
    label: str
    token_budget: str | None = None
    seed: int | None = None
    iters: int = 0
    tokens: int = 0

    @property
    def name(self) -> str:
        parts = [self.route, self.label]
        if self.token_budget is not None:
            parts += [self.token_budget, f"s{self.seed}"]
        return "_".join(parts)


def plan_runs(
    labels: Sequence[str],
    routes: Sequence[str],
    token_budgets: Sequence[str],
    seeds: Sequence[int],
    elastic_total: int,
    num_sizes: int,
    global_batch_size: int,
    seq_length: int,
    scale: float = 1.0,
) -> list[RunSpec]:
    """Every model the comparison makes, in the order it makes them (cheap routes first)."""
    runs: list[RunSpec] = []
    for label in labels:
        for route in routes:
            if route not in TRAINED_ROUTES:
                runs.append(RunSpec(route, label))
                continue
            for budget in token_budgets:
                tokens = route_tokens(budget, elastic_total, num_sizes, scale)
                iters = iters_for_tokens(tokens, global_batch_size, seq_length)
                for seed in seeds:
                    runs.append(
                        RunSpec(
                            route,
                            label,
                            budget,
                            seed,
                            iters,
                            iters * global_batch_size * seq_length,
                        )
                    )
    order = {"equal_cost": 0, "equal_tokens": 1, None: -1}
    return sorted(runs, key=lambda r: (order[r.token_budget], r.seed or 0))
