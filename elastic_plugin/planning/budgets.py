"""The nested model each budget trains and its FLOPs: what a micro-batch at that budget runs.

Before training, the router has not picked a choice yet; the plan takes the homogeneous choice
whose cost (``elastic.cost``, the run's budget metric) is closest to the budget among those the
router's freeze would accept (``elastic.freeze.feasible_choices``, within 5%), the largest
FLOPs breaking ties (the conservative one). Budget 1.0 is the full model. Masked mode computes
the full widths whatever the budget. FLOPs are ``models.flops`` (equal to
``torch.utils.flop_counter`` on the model that runs): the student's ``training_flops`` with the
router over all experts, as the elastic sliced forward computes it, and the teacher's forward
of every micro-batch (the full model).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_plugin.elastic.config import ResolvedElastic
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import ModelConfig
from elastic_plugin.models.counting import count_parameters
from elastic_plugin.models.flops import FlopCount, forward_flops, training_flops
from elastic_plugin.planning.params import stage_layer_types

__all__ = ["BudgetRun", "budget_runs", "stage_flops"]


@dataclass(frozen=True)
class BudgetRun:
    """One budget's nested model and the FLOPs of one micro-batch of it."""

    budget: float
    choice: dict[str, int]
    nested: ModelConfig  # the widths that run (the full model in masked mode)
    total_params: int
    active_params: int
    train_flops: FlopCount  # one micro-batch, student forward + backward (+ recompute)
    teacher_flops: FlopCount  # one micro-batch, teacher forward (full model)


def stage_flops(model: ModelConfig, count: FlopCount, pp: int) -> list[int]:
    """``count`` split over pipeline stages: each stage's layers, the output layer on the last."""
    out, start = [], 0
    for index, kinds in enumerate(stage_layer_types(model, pp)):
        flops = sum(count.per_layer[start : start + len(kinds)])
        start += len(kinds)
        if index == pp - 1:
            flops += count.breakdown["output_layer"]
        out.append(flops)
    return out


def _pick(resolved: ResolvedElastic, budget: float, flops_of) -> dict[str, int]:
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.freeze import feasible_choices

    cost = ElasticCost(resolved.model, resolved)
    choices = feasible_choices(resolved, cost, budget)

    def key(choice: dict[str, int]) -> tuple[float, int]:
        return (abs(cost.of_choice(choice) / cost.full - budget), -flops_of(choice))

    return min(choices, key=key)


def budget_runs(
    model: ModelConfig,
    resolved: ResolvedElastic,
    seq_length: int,
    micro_batch_size: int,
    recompute: bool,
) -> list[BudgetRun]:
    """One ``BudgetRun`` per budget of ``resolved``, largest first."""
    sliced = resolved.config.mode == "sliced"
    teacher = forward_flops(model, seq_length, micro_batch_size)

    def flops_of(choice: dict[str, int]) -> int:
        return forward_flops(model, seq_length, micro_batch_size, choice, full_router=True).total

    out = []
    for budget in resolved.budgets:
        choice = _pick(resolved, budget, flops_of)
        plain = model_for_choice(model, choice)
        counts = count_parameters(plain)
        runs = choice if sliced else None
        nested = plain if sliced else model
        train = training_flops(
            model, seq_length, micro_batch_size, runs, recompute=recompute, full_router=True
        )
        out.append(BudgetRun(budget, choice, nested, counts.total, counts.active, train, teacher))
    return out
