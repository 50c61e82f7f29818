"""Budget 1.0 is the parent (rank-pool case): never routed, never frozen smaller, and its
extracted model is the reordered teacher, tensor for tensor, before any training."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from tests.support import elastic_cases as ec


def _plain_state(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, loaded by plain Megatron code (canonical order)."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout, initialize_layout

    initialize_layout(Layout())
    chunks, _, _ = build_from_checkpoint(path, Layout())
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def full_budget_is_the_parent(config_path: str, workdir: str) -> dict[str, Any]:
    """Zero training steps -> extract budget 1.0 -> compare with the teacher; then the freeze
    (with the likelihood search) and the step's routing of budget 1.0 after real steps."""
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.freeze import constrained_table, feasible_choices
    from elastic_plugin.elastic.train import train_elastic
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.parallel import Layout

    work = Path(workdir)
    cfg = ec._experiment(config_path, None)
    ec.write_init_checkpoint(cfg, work / "init")
    ecfg = ec._elastic_config(cfg.model, "sliced", False)
    resolved = ecfg.resolve(cfg.model)
    sched = ec.tiny_schedule(4, 2e-2)

    def data(consumed: int):
        return ec._synthetic_iterator(cfg.model.vocab_size, 4, consumed)

    untrained = train_elastic(
        cfg, ecfg, Layout(), work / "init", work / "zero", data, None, sched, progress=False,
        stop_after=0,
    )  # fmt: skip
    extract_nested(untrained.checkpoint_dir, 1.0, work / "nested_1")
    teacher, nested = _plain_state(work / "init"), _plain_state(work / "nested_1")
    diffs = {
        name: (nested[name] - tensor).abs().max().item()
        for name, tensor in teacher.items()
        if name in nested and nested[name].shape == tensor.shape
    }
    # real steps with a freeze after 2: the table of budget 1.0 stays the full model
    frozen_cfg = dataclasses.replace(ecfg, router=dataclasses.replace(ecfg.router, freeze_after=2))
    trained = train_elastic(
        cfg, frozen_cfg, Layout(), work / "init", work / "trained", data, None, sched,
        progress=False,
    )  # fmt: skip
    cost = ElasticCost(cfg.model, resolved)
    return {
        "full_choice": resolved.full_choice(),
        "untrained_table": untrained.choices,
        "trained_table": trained.choices,
        "trained_params": trained.params,
        "feasible_full": feasible_choices(resolved, cost, 1.0),
        "missing": sorted(set(teacher) ^ set(nested)),
        "shape_mismatch": sorted(
            n for n in teacher if n in nested and nested[n].shape != teacher[n].shape
        ),
        "max_diff": max(diffs.values()),
        "num_params": len(diffs),
        "constrained_full": constrained_table(_fresh_router(resolved), resolved, cost)["1"],
    }


def _fresh_router(resolved):
    from elastic_plugin.elastic.router import make_router

    return make_router(resolved, seed=0)
