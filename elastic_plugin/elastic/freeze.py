"""The choice table a frozen router keeps: per budget, the nested model the rest of training
(and extraction) uses.

Why not the plain argmax per axis: the axes are picked independently, so at the moment of
freezing the argmax combination can land well off its budget (measured on the products demo:
0.77 -> 0.93 of the parameters in one run, 0.4 -> 0.26 in another, depending only on where the
Gumbel noise had left the router). So the freeze looks at the full grid of homogeneous choices
whose cost is within ``tolerance`` of the budget (the closest one when none is) and keeps

* ``likelihood``: the one with the highest joint router log-probability, or
* ``loss``: the one with the lowest measured validation loss among the router's ``candidates``
  most likely ones (all when None). Why: in sliced mode the router's straight-through gradient
  only sees channels up to the drawn width, so it never learns what a wider candidate would add;
  on the products demo its 0.4 pick was the worst of all 102 feasible choices by zero-shot loss
  (2.89 nats vs 1.55 for the best), and it cut the Mamba channels the model relies on most.

Heterogeneous (per-layer) routers keep their argmax: the per-layer grid is too large to
enumerate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from elastic_plugin.checkpoint.meta import budget_label, is_full_budget
from elastic_plugin.elastic.config import ResolvedElastic

__all__ = [
    "FREEZE_TOLERANCE",
    "constrained_choice",
    "constrained_table",
    "feasible_choices",
    "loss_selected_table",
]

FREEZE_TOLERANCE = 0.05  # relative: budget 0.77 accepts cost fractions in [0.73, 0.81]

Choice = dict[str, int]


def feasible_choices(
    resolved: ResolvedElastic, cost, budget: float, tolerance: float = FREEZE_TOLERANCE
) -> list[Choice]:
    """Every homogeneous choice with ``|cost fraction / budget - 1| <= tolerance``, in grid
    order; when none qualifies, the one closest to the budget alone. Budget 1.0 is the parent:
    only the full choice (a 0.97 model within tolerance would make "full" a pruned model)."""
    if is_full_budget(budget):
        return [resolved.full_choice()]
    names = list(resolved.axes)
    feasible, closest, closest_miss = [], None, None
    for sizes in itertools.product(*(resolved.axes[n].candidates for n in names)):
        choice = dict(zip(names, sizes))
        miss = abs(cost.of_choice(choice) / cost.full / budget - 1.0)
        if miss <= tolerance:
            feasible.append(choice)
        elif closest_miss is None or miss < closest_miss:
            closest, closest_miss = choice, miss
    if feasible:
        return feasible
    assert closest is not None  # the grid is not empty: every axis has candidates
    return [closest]


@torch.no_grad()
def by_likelihood(
    router, resolved: ResolvedElastic, budget: float, choices: list[Choice]
) -> list[Choice]:
    """``choices`` sorted by the router's joint log-probability for ``budget``, most likely
    first (ties keep grid order)."""
    names = list(resolved.axes)
    logits = router.logits(router.encode(budget))
    logp = {n: torch.log_softmax(logits[n][0].double(), dim=-1).tolist() for n in names}

    def score(choice: Choice) -> float:
        return sum(logp[n][resolved.axes[n].candidates.index(choice[n])] for n in names)

    return sorted(choices, key=score, reverse=True)


def constrained_choice(
    router, resolved: ResolvedElastic, cost, budget: float, tolerance: float = FREEZE_TOLERANCE
) -> Choice:
    """The most likely homogeneous choice within ``tolerance`` of ``budget`` (the closest to
    the budget if none is)."""
    return by_likelihood(
        router, resolved, budget, feasible_choices(resolved, cost, budget, tolerance)
    )[0]


def constrained_table(
    router, resolved: ResolvedElastic, cost, tolerance: float = FREEZE_TOLERANCE
) -> dict[str, Choice]:
    """Budget label -> :func:`constrained_choice` (homogeneous routers)."""
    return {
        budget_label(b): constrained_choice(router, resolved, cost, b, tolerance)
        for b in resolved.budgets
    }


def loss_selected_table(
    router,
    resolved: ResolvedElastic,
    cost,
    evaluate: Callable[[Mapping[str, Choice]], Mapping[str, float | None]],
    candidates: int | None = None,
    tolerance: float = FREEZE_TOLERANCE,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Choice], dict[str, dict[str, Any]]]:
    """Per budget, the feasible choice with the lowest loss among the router's ``candidates``
    most likely ones (all when None). ``evaluate`` maps ``{key: choice}`` to ``{key: loss}`` (on
    every rank the same numbers, e.g. ``train.evaluate_budgets`` on fixed validation batches).
    Returns ``(table, search)``: ``search[label]`` holds how many choices were measured, the
    winner's loss and the loss of the router's own most likely choice (for the record)."""
    table: dict[str, Choice] = {}
    search: dict[str, dict[str, Any]] = {}
    for budget in resolved.budgets:
        label = budget_label(budget)
        ranked = by_likelihood(
            router, resolved, budget, feasible_choices(resolved, cost, budget, tolerance)
        )
        ranked = ranked[:candidates] if candidates is not None else ranked
        losses = evaluate({f"{label}#{i}": choice for i, choice in enumerate(ranked)})
        scored = [(losses[f"{label}#{i}"], i) for i in range(len(ranked))]
        measured = [(loss, i) for loss, i in scored if loss is not None]
        if not measured:
            raise RuntimeError(f"freeze: no validation loss came back for budget {label}")
        best_loss, best = min(measured)
        table[label] = ranked[best]
        search[label] = {
            "candidates": len(ranked),
            "loss": best_loss,
            "router_choice_loss": scored[0][0],
            "router_rank_of_choice": best,
            "cost_fraction": cost.of_choice(ranked[best]) / cost.full,
        }
        if log is not None:
            log(
                f"freeze {label}: {len(ranked)} choices measured, best loss {best_loss:.4f} "
                f"(router's most likely: {scored[0][0]:.4f}) -> {ranked[best]}"
            )
    return table, search
