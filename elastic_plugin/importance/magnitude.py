"""Weight-magnitude statistics: the sum of squares of the weights that write each unit.

The baseline every activation statistic is compared with, and a statistic ``--method`` can
select (it pruned embedding channels better than any activation statistic on the demo teacher;
docs/importance.md, "The ablation"). Values are this rank's shard; ``scores.reduce_local_stats``
joins them like the activations (``WEIGHT_KEYS``), so they are layout independent too.
"""

from __future__ import annotations

from typing import Any

import torch

# key in LocalStats.sums / ImportanceScores.variants -> what it holds
WEIGHT_KEYS = (
    "embedding_weight",  # [hidden]: word-embedding column (vocab-sharded over TP: summed)
    "ffn_weight",  # [ffn]: fc1 row (gate + up rows of a gated unit)
    "shared_ffn_weight",
    "attention_heads_weight",  # [heads]: linear_proj columns of the head
    "mamba_weight",  # [heads, head_dim]: in_proj's x rows
    "experts_weight",  # [experts]: the expert's fc1
)


@torch.no_grad()
def weight_magnitudes(model: torch.nn.Module) -> dict[str, dict[int, torch.Tensor]]:
    """Per key and global layer number (0: the embedding), this rank's local units."""
    from megatron.core.ssm.mamba_layer import MambaLayer

    inner: Any = getattr(model, "module", model)  # Megatron ships no types
    out: dict[str, dict[int, torch.Tensor]] = {key: {} for key in WEIGHT_KEYS}

    def sq(w: torch.Tensor, dims) -> torch.Tensor:
        return w.detach().double().pow(2).sum(dims)

    def fc1_rows(mlp: Any) -> torch.Tensor:
        """Per neuron: a gated unit (SwiGLU) stores this rank's gate rows then its up rows in
        fc1, so neuron i is written by rows i and ffn + i."""
        rows = sq(mlp.linear_fc1.weight, 1)
        if getattr(mlp.config, "gated_linear_unit", False):
            rows = rows.view(2, -1).sum(0)
        return rows

    embedding = getattr(inner, "embedding", None)
    if embedding is not None:
        out["embedding_weight"][0] = sq(embedding.word_embeddings.weight, 0)
    for layer in inner.decoder.layers:
        n = int(layer.layer_number)
        if isinstance(layer, MambaLayer):
            m = layer.mixer
            x = m.in_proj.weight[m.d_inner_local_tp : 2 * m.d_inner_local_tp]
            out["mamba_weight"][n] = sq(x.view(m.nheads_local_tp, m.headdim, -1), -1)
            continue
        att = getattr(layer, "self_attention", None)
        if att is not None and hasattr(att, "linear_proj"):
            w = att.linear_proj.weight
            heads = w.shape[1] // att.hidden_size_per_attention_head
            out["attention_heads_weight"][n] = sq(w.view(w.shape[0], heads, -1), (0, 2))
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        if hasattr(mlp, "router"):
            local = getattr(mlp.experts, "local_experts", None)
            if local is not None:
                out["experts_weight"][n] = torch.stack(
                    [sq(e.linear_fc1.weight, (0, 1)) for e in local]
                )
            if getattr(mlp, "shared_experts", None) is not None:
                out["shared_ffn_weight"][n] = fc1_rows(mlp.shared_experts)
        elif hasattr(mlp, "linear_fc1"):
            out["ffn_weight"][n] = fc1_rows(mlp)
    return out
