"""Which nested model a budget is: the stored choice of a trained budget, or the router's choice
for one in between, the one-size-per-axis form a plain Megatron model needs, and the checked
sizes per layer (``choice_sizes``) every slicer cuts by.

An elastic checkpoint's ``elastic_meta.json`` holds the choice table (``checkpoint.meta``); an
untrained budget strictly inside the trained range is answered by the trained budget router,
loaded on its own (a few kilobytes; no model is built).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import CHECKPOINT_META, budget_label
from elastic_plugin.models.axes import choice_sizes  # re-exported: the slicers cut by it
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "PLAIN_MEGATRON_REMEDY",
    "choice_sizes",
    "homogeneous_choice",
    "interpolated_choice",
    "nested_params",
]


PLAIN_MEGATRON_REMEDY = (
    "plain Megatron-Core builds every layer of a kind alike, so it cannot hold this model (use "
    "--format hf: the Hugging Face NemotronH export keeps per-layer widths)"
)


def homogeneous_choice(
    choice: Mapping[str, Any],
    budget: float | None = None,
    flag: str = "--budget",
    remedy: str = PLAIN_MEGATRON_REMEDY,
) -> dict[str, int]:
    """One size per axis; per-layer lists must be uniform (plain Megatron builds every layer of
    a kind from one config, so per-layer widths cannot be a Megatron model). The error names
    ``flag`` and the budget, then says ``remedy`` (what the caller's user can do instead)."""
    where = f"{flag} {budget_label(budget)}: " if budget is not None else ""
    out: dict[str, int] = {}
    for axis, value in choice.items():
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ConfigError(
                    f"{where}the nested model has per-layer sizes ({axis}={list(value)}); {remedy}"
                )
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}choice {axis}={value!r}: must be an int size")
        out[axis] = int(value)
    return out


def interpolated_choice(
    ckpt: str | Path, meta: Mapping[str, Any], model: ModelConfig, budget: float
) -> dict[str, Any]:
    """The trained router's hard choice for an untrained ``budget`` (candidates as trained):
    axis -> size, or a list of sizes (one per layer) for a heterogeneous axis."""
    import torch

    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.router import ROUTER_ATTR, RouterModule, load_router, make_router

    layout = meta.get("layout") or {}
    ecfg = ElasticConfig.from_dict(meta["config"]["elastic"], source=f"{ckpt}/{CHECKPOINT_META}")
    resolved = ecfg.resolve(model, int(layout.get("tp", 1)), int(layout.get("ep", 1)))
    holder, module = torch.nn.Module(), RouterModule(make_router(resolved))
    holder.add_module(ROUTER_ATTR, module)
    load_router(holder, ckpt)
    router = module.router
    with torch.no_grad():
        picks = router.choose(budget, interpolate=True)
    choice: dict[str, Any] = {}
    for name, spec in resolved.axes.items():
        sizes = [spec.candidates[i] for i in picks[name]]
        choice[name] = sizes if resolved.per_layer(name) else sizes[0]
    return choice


def nested_params(
    meta: Mapping[str, Any], model: ModelConfig, choice: Mapping[str, Any], ckpt: str | Path
) -> dict[str, int]:
    """Total / active parameters of the nested model of ``choice`` (``{"total", "active"}``):
    ``models.counting`` of the plain model for one size per axis, the elastic cost model (equal
    to it for integer choices) for per-layer sizes."""
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.counting import count_parameters

    if all(not isinstance(v, (list, tuple)) for v in choice.values()):
        counts = count_parameters(model_for_choice(model, choice))
        return {"total": counts.total, "active": counts.active}
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost

    layout = meta.get("layout") or {}
    ecfg = ElasticConfig.from_dict(meta["config"]["elastic"], source=f"{ckpt}/{CHECKPOINT_META}")
    resolved = ecfg.resolve(model, int(layout.get("tp", 1)), int(layout.get("ep", 1)))
    return {
        metric.split("_")[0]: int(ElasticCost(model, resolved, metric=metric).of_choice(choice))
        for metric in ("total_params", "active_params")
    }
