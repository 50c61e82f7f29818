"""One budget cut out of a Hugging Face state dict: the nested model, without Megatron.

A nested directory (``export --nested``) holds the full importance-ordered model once; every
budget is a prefix of it. This is the Hugging Face side of ``nested.slicing``: which blocks of
which tensor a budget keeps is the model family's (``Family.tensor_cuts`` in
``elastic_plugin/families/``), found from the model config and the index helpers of
``models.prefix`` that the elastic layers and Megatron-side slicing use, so ``slice`` gives
exactly the per-budget export's tensors.

Tensors use transformers' in-memory names (``Family.from_hub`` of the stored files).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from elastic_plugin.families import family_for_model
from elastic_plugin.families.base import Cut
from elastic_plugin.families.tensors import cut_tensor, no_rule, read_cut
from elastic_plugin.models.config import ModelConfig

__all__ = ["Cut", "cut_tensor", "read_cut", "slice_hf_state", "slice_hub_files", "tensor_cuts"]


def tensor_cuts(model: ModelConfig, choice: Mapping[str, int | Sequence[int]]) -> dict[str, Cut]:
    """The cut of every tensor of the nested model of ``choice`` (transformers' names)."""
    return family_for_model(model, "slice").tensor_cuts(model, choice)


@torch.no_grad()
def slice_hf_state(
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    choice: Mapping[str, int | Sequence[int]],
) -> dict[str, torch.Tensor]:
    """The nested model of ``choice`` (axis -> size, or one size per layer of the axis) cut
    from the full model's transformers tensors (``model`` their config). Raises ``ConfigError``
    for a choice the model cannot take or a tensor no rule covers (fresh copies returned)."""
    cuts = tensor_cuts(model, choice)
    unknown = sorted(set(hf) - set(cuts))
    if unknown:
        raise no_rule(unknown)
    return {key: cut_tensor(value, cuts[key]) for key, value in hf.items()}


@torch.no_grad()
def slice_hub_files(
    path: str | Path, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
) -> dict[str, torch.Tensor]:
    """:func:`slice_hf_state` of a Hub directory's files (equal to it), reading only what the
    budget keeps where the family's layout allows (routed experts past the budget are not
    read; prefix cuts go through ``safe_open(...).get_slice``)."""
    return family_for_model(model, "slice").slice_hub_files(Path(path), model, choice)
