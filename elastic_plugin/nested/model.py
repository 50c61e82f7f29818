"""The plain model of one budget, in memory: a nested model cut out of an elastic one, or any
checkpoint of this plugin loaded for TP=PP=EP=1.

A nested model is a genuinely smaller plain ``HybridModel`` (``models.axes.model_for_choice``)
holding the prefix blocks of the elastic weights (``slicing.nested_state_dict``), the same recipe
as zero-shot extraction (``export.extract``), without writing a checkpoint. Its caches are those
of the smaller model (fewer K/V groups' heads, Mamba heads and channels, a narrower residual
stream), so the cached step functions of ``inference`` run it unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.checkpoint.meta import (
    match_trained_budget,
    read_checkpoint_meta,
    read_elastic_meta,
    stored_choice,
    trained_budgets,
    trained_listing,
)
from elastic_plugin.cli_args import start_ranks
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import ConfigError, ModelConfig, config_from_dict
from elastic_plugin.nested.choice import homogeneous_choice

__all__ = ["load_nested_model", "load_nested_models", "nested_model"]


def nested_model(
    model: torch.nn.Module, model_cfg: ModelConfig, choice: Mapping[str, Any]
) -> tuple[torch.nn.Module, ModelConfig]:
    """``(plain smaller model, its config)`` of ``choice`` (axis -> size; axes left out stay
    full), cut from ``model`` (elastic or plain, TP=PP=EP=1, importance-ordered). The elastic
    model is left unchanged; call after Megatron's parallel state is initialized (as for
    building ``model``)."""
    from elastic_plugin.nested.slicing import nested_state_dict

    choice = homogeneous_choice(choice)
    small = model_for_choice(model_cfg, choice)
    plain = plain_model(small, nested_state_dict(model, model_cfg, choice), model)
    plain.eval()
    return plain, small


def plain_model(config, state: dict, like) -> Any:
    """A plain single-rank ``HybridModel`` of ``config`` holding ``state`` (strict), in ``like``'s
    dtype and on its device; building draws init weights, so the caller's RNG stream is kept."""
    from elastic_plugin.parallel import Layout, build_model_chunks

    reference = next(like.parameters())
    rng = torch.get_rng_state()
    try:
        plain = build_model_chunks(config, Layout(), params_dtype=reference.dtype, wrap_ddp=False)[
            0
        ][0]
    finally:
        torch.set_rng_state(rng)
    plain.load_state_dict(state, strict=True)
    return plain.to(reference.device)


def _checked_choices(
    ckpt_dir: str | Path, budgets: Sequence[float | None]
) -> tuple[dict[str, Any], list[dict[str, int] | None]]:
    """The checkpoint's meta and, per requested budget, its stored choice (None: the model as
    stored, for a non-elastic checkpoint). Reads metadata only."""
    meta = read_checkpoint_meta(ckpt_dir)
    if meta.get("kind") != "elastic":
        for budget in budgets:
            if budget is not None:
                raise ConfigError(
                    f"--budget {budget!r}: {ckpt_dir} is a {meta.get('kind')!r} "
                    "checkpoint, not an elastic one; it holds one model (drop "
                    "--budget)"
                )
        return meta, [None] * len(budgets)
    meta = read_elastic_meta(ckpt_dir)
    budgets_trained = trained_budgets(meta)
    trained = trained_listing(budgets_trained)
    choices: list[dict[str, int] | None] = []
    for budget in budgets:
        if budget is None or isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ConfigError(
                f"--budget {budget!r}: {ckpt_dir} is an elastic checkpoint; "
                f"choose one of the trained budgets: {trained}"
            )
        match = match_trained_budget(budget, meta)
        choices.append(homogeneous_choice(stored_choice(meta, match, ckpt_dir), match))
    return meta, choices


def load_nested_models(
    ckpt_dir: str | Path, budgets: Sequence[float | None]
) -> list[tuple[torch.nn.Module, ModelConfig]]:
    """:func:`load_nested_model` for several budgets of one checkpoint, read once (e.g. a small
    thinking model and the full answering model for budget control). (Re)initializes
    Megatron's parallel state for one rank (TP=PP=EP=1); budget 1.0 of an elastic checkpoint
    and a non-elastic checkpoint return the loaded model itself."""
    meta, choices = _checked_choices(ckpt_dir, list(budgets))
    cfg = config_from_dict(meta["config"], source=f"--ckpt {ckpt_dir}")

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout

    start_ranks(Layout(), one_process="generation loads the model in one process")
    chunks, _, _ = build_from_checkpoint(ckpt_dir, Layout(), wrap_ddp=False)
    full = chunks[0]
    full.eval()

    def pick(choice):
        if choice is None or model_for_choice(cfg.model, choice) == cfg.model:
            return full, cfg.model  # the full budget: the loaded model itself, no copy
        return nested_model(full, cfg.model, choice)

    return [pick(choice) for choice in choices]


def load_nested_model(
    ckpt_dir: str | Path, budget: float | None = None
) -> tuple[torch.nn.Module, ModelConfig]:
    """``(model, model_cfg)`` to generate with, loaded for TP=PP=EP=1 in this process.

    An elastic checkpoint needs a trained ``budget`` (its stored choice is cut out with
    :func:`nested_model`); an extracted or plain checkpoint is loaded as it is (``budget``
    must then be None). Bad input -> ``ConfigError`` naming ``--ckpt`` / ``--budget``, raised
    before any weights are read.
    """
    return load_nested_models(ckpt_dir, [budget])[0]
