"""One budget cut out of NemotronH tensors: the nested model, without Megatron.

The same blocks as ``nested/slicing.py`` (the first ``h'`` hidden channels everywhere, the first
query heads of every query group with all K/V heads, the first Mamba heads of every group with
the first channels of every head, the first FFN / shared-expert neurons, the first routed
experts), found with the index helpers of ``models/prefix.py`` that the elastic layers and the
Megatron-side slicing use, so ``slice`` gives exactly the per-budget export's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from elastic_plugin.families.base import Cut
from elastic_plugin.families.tensors import no_rule, read_cut
from elastic_plugin.models.axes import choice_sizes
from elastic_plugin.models.config import ConfigError, ModelConfig
from elastic_plugin.models.prefix import mamba_rows, query_rows

__all__ = ["slice_hub_files", "tensor_cuts"]

_PER_EXPERT = re.compile(
    r"^(?P<head>.*\.mixer\.experts)\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.weight$"
)


def _layer_cuts(
    model: ModelConfig, kind: str, number: int, sizes: Mapping[str, Mapping[int | None, int]]
) -> dict[str, Cut]:
    """Cuts of one layer's tensors, by name below ``model.layers.{i}.``."""
    h = sizes["embedding"][None]
    cuts: dict[str, Cut] = {"norm.weight": ((0, h),)}
    if kind == "mamba":
        groups = model.mamba_num_groups
        per_group = model.mamba_num_heads // groups
        active = sizes["mamba_heads"][number] // groups
        rows = mamba_rows(
            groups,
            per_group,
            model.mamba_head_dim,
            model.mamba_state_dim,
            active,
            sizes["mamba_head_dim"][number],
        )
        cuts.update(
            {
                "mixer.in_proj.weight": ((0, rows["in_proj"]), (1, h)),
                "mixer.conv1d.weight": ((0, rows["conv"]),),
                "mixer.conv1d.bias": ((0, rows["conv"]),),
                "mixer.dt_bias": ((0, rows["heads"]),),
                "mixer.A_log": ((0, rows["heads"]),),
                "mixer.D": ((0, rows["heads"]),),
                "mixer.norm.weight": ((0, rows["channels"]),),
                "mixer.out_proj.weight": ((0, h), (1, rows["channels"])),
            }
        )
    elif kind == "attention":
        groups = model.query_groups
        q = query_rows(
            groups,
            model.num_attention_heads // groups,
            model.head_dim,
            sizes["attention_heads"][number] // groups,
        )
        cuts.update(
            {
                "mixer.q_proj.weight": ((0, q), (1, h)),
                "mixer.k_proj.weight": ((1, h),),
                "mixer.v_proj.weight": ((1, h),),
                "mixer.o_proj.weight": ((0, h), (1, q)),
            }
        )
    elif kind == "mlp":
        f = sizes["ffn"][number]
        cuts.update(
            {
                "mixer.up_proj.weight": ((0, f), (1, h)),
                "mixer.down_proj.weight": ((0, h), (1, f)),
            }
        )
    elif kind == "moe":
        e = sizes["experts"][number]
        cuts.update(
            {
                "mixer.gate.weight": ((0, e), (1, h)),
                "mixer.gate.e_score_correction_bias": ((0, e),),
                "mixer.experts.up_proj": ((0, e), (2, h)),
                "mixer.experts.down_proj": ((0, e), (1, h)),
            }
        )
        if "shared_ffn" in sizes:
            s = sizes["shared_ffn"][number]
            cuts.update(
                {
                    "mixer.shared_experts.up_proj.weight": ((0, s), (1, h)),
                    "mixer.shared_experts.down_proj.weight": ((0, h), (1, s)),
                }
            )
    else:
        raise ConfigError(f"layer {number}: no slicing rule for layer kind {kind!r}")
    return cuts


def tensor_cuts(model: ModelConfig, choice: Mapping[str, int | Sequence[int]]) -> dict[str, Cut]:
    """The cut of every tensor of the nested model of ``choice`` (transformers' names)."""
    sizes = choice_sizes(model, choice)
    h = sizes["embedding"][None]
    cuts: dict[str, Cut] = {
        "model.embeddings.weight": ((1, h),),
        "model.norm_f.weight": ((0, h),),
        "lm_head.weight": ((1, h),),
    }
    for i, kind in enumerate(model.layer_types):
        for name, cut in _layer_cuts(model, kind, i + 1, sizes).items():
            cuts[f"model.layers.{i}.{name}"] = cut
    return cuts


@torch.no_grad()
def slice_hub_files(
    path: str | Path, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The budget's tensors read from a Hub directory's files, reading only what the budget
    keeps: routed experts past the budget are not read at all, and a tensor cut to leading
    prefixes is read through ``safe_open(...).get_slice``."""
    from safetensors import safe_open

    from elastic_plugin.checkpoint.hub import HUB_PREFIX, MEMORY_PREFIX, hub_weight_files

    cuts = tensor_cuts(model, choice)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    unknown = []
    for file in hub_weight_files(path):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                name = MEMORY_PREFIX + key[len(HUB_PREFIX) :] if key.startswith(HUB_PREFIX) else key
                expert = _PER_EXPERT.match(name)
                if expert is not None:
                    stacked = f"{expert['head']}.{expert['proj']}"
                    if stacked not in cuts:
                        unknown.append(key)
                        continue
                    (_, keep), *rest = cuts[stacked]  # the expert axis, then the rest
                    if int(expert["e"]) < int(keep):
                        cut = tuple((dim - 1, index) for dim, index in rest)
                        experts.setdefault(stacked, {})[int(expert["e"])] = read_cut(
                            handle, key, cut
                        )
                elif name in cuts:
                    out[name] = read_cut(handle, key, cuts[name])
                else:
                    unknown.append(key)
    if unknown:
        raise no_rule(unknown)
    for stacked, members in experts.items():
        out[stacked] = torch.stack([members[e] for e in sorted(members)])
    return out
