"""The choice table a frozen router keeps: the router's most likely nested model that meets
each budget.

Why not the plain argmax per axis: the axes are picked independently, so at the moment of
freezing the argmax combination can land well off its budget (measured on the products demo:
0.77 -> 0.93 of the parameters in one run, 0.4 -> 0.26 in another, depending only on where the
Gumbel noise had left the router). Freezing fixes the nested models for the rest of training, so
the freeze picks, among the full grid of homogeneous choices, the one with the highest joint
router log-probability whose cost is within ``tolerance`` of the budget (the closest one when
none is). Heterogeneous (per-layer) routers keep their argmax: the per-layer grid is too large to
enumerate.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from elastic_plugin.elastic.config import ResolvedElastic

__all__ = ["FREEZE_TOLERANCE", "constrained_choice", "constrained_table"]

FREEZE_TOLERANCE = 0.05  # relative: budget 0.77 accepts cost fractions in [0.73, 0.81]


@torch.no_grad()
def constrained_choice(router, resolved: ResolvedElastic, cost, budget: float,
                       tolerance: float = FREEZE_TOLERANCE) -> dict[str, int]:
    """The most likely homogeneous choice (sum over axes of the router's log-softmax) with
    ``|cost fraction / budget - 1| <= tolerance``; if none qualifies, the closest to the budget."""
    names = list(resolved.axes)
    logits = router.logits(router.encode(budget))
    logp = {n: torch.log_softmax(logits[n][0].double(), dim=-1).tolist() for n in names}
    best, best_key = None, None
    for picks in itertools.product(*(range(len(resolved.axes[n].candidates)) for n in names)):
        sizes = {n: resolved.axes[n].candidates[i] for n, i in zip(names, picks)}
        miss = abs(cost.of_choice(sizes) / cost.full / budget - 1.0)
        score = sum(logp[n][i] for n, i in zip(names, picks))
        # feasible choices first (by likelihood), then the rest by distance to the budget
        key = (0, -score) if miss <= tolerance else (1, miss)
        if best_key is None or key < best_key:
            best, best_key = sizes, key
    return best


def constrained_table(router, resolved: ResolvedElastic, cost,
                      tolerance: float = FREEZE_TOLERANCE) -> dict[str, dict[str, int]]:
    """Budget label -> :func:`constrained_choice` (homogeneous routers)."""
    return {f"{b:g}": constrained_choice(router, resolved, cost, b, tolerance)
            for b in resolved.budgets}
