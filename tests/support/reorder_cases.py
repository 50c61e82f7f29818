"""Rank-pool cases for reordering: function preservation per layout, and layout independence
(reorder under TP x EP, save canonical, load under TP=1 == reorder under TP=1)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.layout import canonical_weights, strided_index
from elastic_plugin.importance import ImportanceScores
from elastic_plugin.importance.reorder import Permutations, apply_permutations
from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout
from tests.support.equivalence import load_dist, reference_batches, save_dist, tiny_model

if TYPE_CHECKING:  # Megatron ships no types: this annotates what a function takes
    from megatron.core.models.hybrid.hybrid_model import HybridModel


def _perms(workdir: Path, model_cfg) -> Permutations:
    scores = ImportanceScores.load(workdir / "scores_ref.pt")
    return Permutations.from_scores(scores, model_cfg.query_groups, model_cfg.mamba_num_groups)


@torch.no_grad()
def _logits(model: HybridModel, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-model logits (local vocab shard) on the last stage; ``None`` elsewhere (PP<=2)."""
    from megatron.core import parallel_state as ps

    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(tokens, positions, None)
    seq = tokens.shape[1] // (
        ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
    )
    if ps.is_pipeline_first_stage():
        hidden = model(tokens, positions, None)
        dist.send(hidden.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    hidden = torch.empty(seq, tokens.shape[0], model.config.hidden_size)
    dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
    model.set_input_tensor(hidden)
    return model(None, positions, None)


def logits_preserved(
    config_path: str,
    workdir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """Reorder under a layout; the full model's logits must not change (and weights must)."""
    work = Path(workdir)
    model_cfg = tiny_model(config_path)
    layout = Layout(tp, pp, ep, sequence_parallel)
    initialize_layout(layout)
    (model,), _ = build_model_chunks(model_cfg, layout, wrap_ddp=False)
    load_dist(model, work / "init")
    tokens = reference_batches(model_cfg)[0]["tokens"]
    before = _logits(model, tokens)
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_permutations(model, _perms(work, model_cfg))
    after = _logits(model, tokens)
    moved = sum(not torch.equal(weights_before[n], p) for n, p in model.named_parameters())
    return {
        "max_abs_diff": (  # both None off the last stage
            None if before is None or after is None else float((after - before).abs().max())
        ),
        "logit_scale": None if before is None else float(before.abs().max()),
        "params_moved": moved,
        "num_params": len(weights_before),
    }


def reorder_and_save(
    config_path: str,
    workdir: str,
    name: str,
    tp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """Reorder under a layout, check the strided prefix property, save canonically."""
    work = Path(workdir)
    model_cfg = tiny_model(config_path)
    layout = Layout(tp, 1, ep, sequence_parallel)
    initialize_layout(layout)
    (model,), _ = build_model_chunks(model_cfg, layout, wrap_ddp=False)
    load_dist(model, work / "init")
    apply_permutations(model, _perms(work, model_cfg))
    strided_ok = (
        _check_strided_prefix(model, work, model_cfg, layout)
        if (work / "reordered_tp1").exists() and (tp > 1 or ep > 1)
        else None
    )
    with canonical_weights(model):
        save_dist(model, work / name)
    return {"strided_prefix_ok": strided_ok}


def _check_strided_prefix(model, work: Path, model_cfg, layout: Layout) -> bool:
    """Each rank's local FFN neurons / experts are canonical positions r, r+t, ... of the
    single-rank reordered model: so any local prefix is the global top-w."""
    from megatron.core import parallel_state as ps

    (canonical,), _ = build_model_chunks(model_cfg, layout, wrap_ddp=False)
    load_dist(canonical, work / "reordered_tp1")  # Megatron loads contiguous canonical shards
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    ok = True
    for (name, ours), (_, ref) in zip(model.named_parameters(), canonical.named_parameters()):
        if name.endswith("linear_fc2.weight") and "local_experts" not in name and layout.tp > 1:
            parts = [torch.empty_like(ref) for _ in range(layout.tp)]
            dist.all_gather(parts, ref.contiguous(), group=tp_group)
            full = torch.cat(parts, dim=1)
            ok &= torch.equal(ours, full[:, tp_rank :: layout.tp])
        if name.endswith("router.weight") and layout.ep > 1:
            ok &= torch.equal(ours, ref[strided_index(ref.shape[0], layout.ep)])
    return bool(ok)


def compare_saved(config_path: str, workdir: str, first: str, second: str) -> dict[str, Any]:
    """Load two checkpoints into TP=1 models and compare every parameter bit for bit."""
    work = Path(workdir)
    model_cfg = tiny_model(config_path)
    initialize_layout(Layout())
    (a,), _ = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)
    (b,), _ = build_model_chunks(model_cfg, Layout(), wrap_ddp=False)
    load_dist(a, work / first)
    load_dist(b, work / second)
    mismatched = [
        n
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters())
        if not torch.equal(p, q)
    ]
    return {"mismatched": mismatched, "num_params": sum(1 for _ in a.parameters())}
