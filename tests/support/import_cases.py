"""Rank-pool case for ``elastic-plugin import``: an imported checkpoint loaded under TP x EP gives
the logits transformers' ``NemotronHForCausalLM`` gives (the import is written at TP=1)."""

from __future__ import annotations

from typing import Any

import torch


def tp_ep_logits_case(ckpt: str, reference: str, tp: int = 2, ep: int = 2) -> dict[str, Any]:
    """Build the imported checkpoint under TP=``tp``, EP=``ep`` (sequence parallel, as Megatron
    needs with MoE), run the reference tokens, gather the vocab shards; max |ours - HF|."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.parallel import Layout, initialize_layout

    layout = Layout(tp=tp, ep=ep, sequence_parallel=tp > 1)
    initialize_layout(layout)
    (model,), _, _ = build_from_checkpoint(ckpt, layout)
    data = torch.load(reference)
    tokens, expected = data["tokens"], data["logits"]
    model.eval()
    with torch.no_grad():
        local = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        full = gather_from_tensor_model_parallel_region(local.contiguous())
    return {
        "max_abs_diff": float((full - expected).abs().max()),
        "local_vocab": int(local.shape[-1]),
    }
