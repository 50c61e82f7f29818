"""The experiment YAMLs of the separate routes, written from the elastic run's own config so
that data, model, batch and optimiser settings stay those of the elastic run.

- prune then distil: ``elastic-train`` with one budget whose every axis has one candidate, the
  elastic run's choice for that budget (the router has nothing to choose and the budget loss is
  0), no curriculum and no freeze: the importance-ordered teacher is cut to that architecture
  (sliced, the same prefixes) and distilled from the frozen teacher, alone;
- from scratch: ``train`` of the plain model of that choice (``models.axes.model_for_choice``),
  randomly initialised, on the same data with the teacher's recipe.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import config_from_dict

__all__ = ["distil_config", "scratch_config"]


def distil_config(
    config: Mapping[str, Any], choice: Mapping[str, int], budget: float, seed: int, iters: int
) -> dict[str, Any]:
    """The elastic run's config with an ``elastic:`` section of one fixed architecture.

    ``budget`` must be the choice's cost fraction in the run's budget metric (the elastic
    checkpoint's ``cost_fraction``), so the one candidate reaches it exactly."""
    out = copy.deepcopy(dict(config))
    elastic = dict(out["elastic"])
    router = dict(elastic.get("router") or {})
    router.update(freeze_after=None, freeze_select="likelihood", freeze_candidates=None)
    elastic.update(
        budgets=[float(budget)],
        sizes={axis: [int(size)] for axis, size in choice.items()},
        heterogeneous=False,
        curriculum=[],
        router=router,
    )
    out["elastic"] = elastic
    out["training"] = dict(out["training"], seed=int(seed), train_iters=int(iters))
    return out


def scratch_config(
    config: Mapping[str, Any], choice: Mapping[str, int], seed: int, iters: int
) -> dict[str, Any]:
    """The teacher's experiment config with the model narrowed to ``choice``, trained from a
    random initialisation (the teacher's optimiser, batch and data settings)."""
    cfg = config_from_dict({k: v for k, v in config.items() if k != "elastic"})
    training = dataclasses.replace(cfg.training, seed=int(seed), train_iters=int(iters))
    out = dataclasses.replace(
        cfg, model=model_for_choice(cfg.model, dict(choice)), training=training
    )
    return {k: v for k, v in out.to_dict().items() if k != "elastic"}
