"""Rank-pool cases on the real pretrained model of ``make demo-real`` (tests/test_real_model_e2e.py):
a few elastic training steps of SmolLM2-135M (its importance-reordered checkpoint, real weights)
with the budgets and sizes of ``examples/configs/smollm2_elastic.yaml``, on one rank and under
TP=3 (its 3 query groups allow TP 1 or 3); each returns the per-iteration, per-budget KD losses and the routed budget trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.elastic_cases import (
    REF_MICROBATCHES,
    STEPS,
    _gather_losses,
    _run,
)


def real_elastic_losses(
    ckpt: str, config_path: str, tp: int = 1, sequence_parallel: bool = False, seed: int = 1234
) -> dict[str, Any]:
    """STEPS elastic iterations from ``ckpt`` under TP=``tp`` (random token batches, the same on
    every layout; budgets drawn from a fixed seed)."""
    import torch.distributed as dist
    import yaml

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.model import build_elastic_chunks, router_param_groups
    from elastic_plugin.elastic.router import AnnealSchedule
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.elastic.step import ElasticStep
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import Layout, build_optimizer, initialize_layout

    cfg = load_config(config_path)
    raw = yaml.safe_load(Path(config_path).read_text())["elastic"]
    raw = {k: v for k, v in raw.items() if k in ("budgets", "budget_metric", "sizes", "mode")}
    resolved = ElasticConfig.from_dict(raw).resolve(cfg.model, tp, 1)
    layout = Layout(tp, 1, 1, sequence_parallel)
    initialize_layout(layout, seed=seed)
    chunks, state, _ = build_elastic_chunks(Path(ckpt), layout, resolved)
    teacher, _, _ = build_from_checkpoint(Path(ckpt), layout)
    for chunk in teacher:
        chunk.requires_grad_(False)
    optimizer = build_optimizer(
        chunks, lr=1e-4, adam_eps=1e-8, config_overrides=router_param_groups(1e-4, 1e-3, 10.0)
    )
    step = ElasticStep(
        state=state,
        sampler=BudgetSampler(resolved.budgets, None, seed=5, total_iters=STEPS),
        cost=ElasticCost(cfg.model, resolved),
        temperature=AnnealSchedule(1.0, 0.5, STEPS),
        logit_scale=AnnealSchedule(1.0, 2.0, STEPS),
        num_microbatches=REF_MICROBATCHES,
        teacher_chunks=teacher,
        trace=[],
    )
    losses, _ = _run(cfg, chunks, optimizer, step, None)
    return {"rank": dist.get_rank(), "losses": _gather_losses(losses), "trace": step.trace}
