"""Rank-pool case for the GPT families: imported checkpoints (written at TP=1) loaded under
TP=2 + sequence parallel (and EP=2 for MoE) give transformers' logits and greedy tokens.

One case covers every family, so the pool's ranks build each model in turn without a process
start per family (tests/test_families.py writes the imports and the references)."""

from __future__ import annotations

from typing import Any

import torch


def _full_logits(model, tokens: torch.Tensor, tp: int) -> torch.Tensor:
    """Logits over the whole vocabulary for ``tokens``: sequence parallel needs a length that
    TP divides, so the batch is padded at the end with token 0 (causal attention: the padding
    changes no earlier position) and the padding's logits are dropped."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    length = tokens.shape[1]
    pad = -length % tp
    padded = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad)], dim=1)
    with torch.no_grad():
        local = model(padded, torch.arange(padded.shape[1]).expand_as(padded), None)
        full = gather_from_tensor_model_parallel_region(local.contiguous())
    return full[:, :length]


def families_tp_sp_case(cases: list[dict[str, Any]], tp: int = 2) -> list[dict[str, Any]]:
    """For each ``{"name", "ckpt", "reference", "ep"}``: build the checkpoint under TP=``tp``
    with sequence parallel and EP=``ep``; max |ours - transformers| over the reference tokens'
    logits, and our greedy tokens (the whole prefix recomputed per step, like the reference's)."""
    from megatron.core import parallel_state

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout, initialize_layout

    results = []
    for case in cases:
        layout = Layout(tp=tp, ep=case["ep"], sequence_parallel=True)
        initialize_layout(layout)
        (model,), _, _ = build_from_checkpoint(case["ckpt"], layout)
        model.eval()
        data = torch.load(case["reference"])
        tokens, expected = data["tokens"], data["logits"]
        logits = _full_logits(model, tokens, tp)
        out = tokens
        for _ in range(data["greedy"].shape[1]):
            out = torch.cat([out, _full_logits(model, out, tp)[:, -1:].argmax(-1)], dim=1)
        results.append(
            {
                "name": case["name"],
                "max_abs_diff": float((logits - expected).abs().max()),
                "greedy_equal": bool(torch.equal(out[:, tokens.shape[1] :], data["greedy"])),
                "local_experts": _local_experts(model),
                "tp": parallel_state.get_tensor_model_parallel_world_size(),
                "sequence_parallel": bool(model.config.sequence_parallel),
            }
        )
    return results


def _local_experts(model) -> int:
    """Experts this rank holds in its first MoE layer (0 for a dense model): EP really split."""
    for module in model.modules():
        experts = getattr(module, "num_local_experts", None)
        if isinstance(experts, int):
            return experts
    return 0
