"""One budget cut out of GPT-family tensors (transformers' in-memory names), without Megatron.

The blocks are those ``nested/slicing.py`` keeps on the Megatron side: the first ``h'`` hidden
channels everywhere (embedding columns, norms, every projection's input or output), the first
query heads of every query group with all K/V heads (q rows and bias, o_proj columns, via
``models/prefix.py``'s ``query_rows``; the head_dim-sized Q/K norms are whole), the first FFN
neurons of gate and up together with the matching down_proj columns, the first routed experts
(router rows, expert stacks). HF layer i's attention is Megatron layer number 2i+1 and its
MLP/MoE 2i+2, the numbers ``models/axes.py``'s ``choice_sizes`` keys per-layer sizes by.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from elastic_plugin.families.base import Cut
from elastic_plugin.families.gpt.keys import GptKeys, check_pairs, expert_stack_of
from elastic_plugin.families.tensors import no_rule, read_cut
from elastic_plugin.models.axes import choice_sizes
from elastic_plugin.models.config import ConfigError, ModelConfig
from elastic_plugin.models.prefix import query_rows

__all__ = ["slice_hub_files", "tensor_cuts"]


def tensor_cuts(model: ModelConfig, choice: Mapping[str, int | Sequence[int]]) -> dict[str, Cut]:
    """The cut of every in-memory tensor of the nested model of ``choice``."""
    check_pairs(model)
    sizes = choice_sizes(model, choice)
    h = sizes["embedding"][None]
    cuts: dict[str, Cut] = {
        "model.embed_tokens.weight": ((1, h),),
        "model.norm.weight": ((0, h),),
        "lm_head.weight": ((1, h),),
    }
    groups, hd = model.query_groups, model.head_dim
    for i in range(model.num_layers // 2):
        d = f"model.layers.{i}."
        q = query_rows(
            groups,
            model.num_attention_heads // groups,
            hd,
            sizes["attention_heads"][2 * i + 1] // groups,
        )
        cuts.update(
            {
                d + "input_layernorm.weight": ((0, h),),
                d + "post_attention_layernorm.weight": ((0, h),),
                d + "self_attn.q_proj.weight": ((0, q), (1, h)),
                d + "self_attn.k_proj.weight": ((1, h),),
                d + "self_attn.v_proj.weight": ((1, h),),
                d + "self_attn.o_proj.weight": ((0, h), (1, q)),
                d + "self_attn.q_proj.bias": ((0, q),),
                d + "self_attn.k_proj.bias": (),
                d + "self_attn.v_proj.bias": (),
                d + "self_attn.q_norm.weight": (),
                d + "self_attn.k_norm.weight": (),
            }
        )
        if model.layer_types[2 * i + 1] == "mlp":
            f = sizes["ffn"][2 * i + 2]
            cuts.update(
                {
                    d + "mlp.gate_proj.weight": ((0, f), (1, h)),
                    d + "mlp.up_proj.weight": ((0, f), (1, h)),
                    d + "mlp.down_proj.weight": ((0, h), (1, f)),
                }
            )
        else:
            e = sizes["experts"][2 * i + 2]
            cuts.update(
                {
                    d + "mlp.gate.weight": ((0, e), (1, h)),
                    d + "mlp.experts.gate_up_proj": ((0, e), (2, h)),
                    d + "mlp.experts.down_proj": ((0, e), (1, h)),
                }
            )
    return cuts


@torch.no_grad()
def slice_hub_files(
    keys: GptKeys, path: Path, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The budget's in-memory tensors read from a directory's files: experts past the budget
    are not read, prefix cuts are read through ``get_slice`` (an expert's own cut is its stack's
    without the expert dimension: no expert FFN width is elastic)."""
    from safetensors import safe_open

    from elastic_plugin.checkpoint.hub import hub_weight_files

    cuts = tensor_cuts(model, choice)
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for file in hub_weight_files(path):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                expert = expert_stack_of(keys, key)
                if expert is None:
                    name = keys.memory_name(key)
                    if name in cuts:
                        out[key] = read_cut(handle, key, cuts[name])
                    else:
                        unknown.append(key)
                    continue
                stacked, index, _ = expert
                if stacked not in cuts:
                    unknown.append(key)
                    continue
                (_, keep), *rest = cuts[stacked]
                if any(dim == 1 for dim, _ in rest) and stacked.endswith("gate_up_proj"):
                    raise ConfigError(f"{stacked}: an expert FFN cut has no per-expert form")
                if index < int(keep):
                    out[key] = read_cut(handle, key, tuple((dim - 1, i) for dim, i in rest))
    if unknown:
        raise no_rule(unknown)
    return keys.from_hub(out)
