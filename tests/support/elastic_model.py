"""An elastic tiny model in this process (TP=PP=EP=1), as the single-rank elastic tests use it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def make_elastic(
    model: torch.nn.Module,
    model_cfg,
    sizes: Mapping[str, Sequence[float]] | None = None,
    budgets: Sequence[float] = (1.0, 0.5),
):
    """Elastify ``model`` with candidate ``sizes`` per axis; returns ``(state, resolved)``.

    ``sizes=None``: every axis has only its full size (budget 1.0): the model runs through the
    elastic layers at full width, e.g. to run an extracted nested model in FP8."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.layers.modules import elastify
    from elastic_plugin.elastic.layers.state import ElasticState, RankInfo
    from elastic_plugin.models.axes import model_axes

    if sizes is None:
        sizes, budgets = {axis: [1.0] for axis in model_axes(model_cfg)}, (1.0,)
    resolved = ElasticConfig.from_dict({"budgets": list(budgets), "sizes": dict(sizes)}).resolve(
        model_cfg
    )
    state = ElasticState(
        resolved,
        RankInfo(),
        groups={
            "attention_heads": model_cfg.query_groups,
            "mamba_heads": model_cfg.mamba_num_groups,
        },
    )
    elastify(model, state)
    return state, resolved
