"""Nemotron-H / Nemotron-3 (transformers' ``NemotronHForCausalLM``): Mamba-2, attention without
position embedding, squared-ReLU MLPs and sigmoid-routed MoE with a shared expert. Megatron
layer i is HF layer i; on disk the prefix is ``backbone.`` and routed experts are stored one
tensor each (``checkpoint/hub.py``'s Nemotron-H layout)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_plugin.families.base import Cut, Family, ImportLayout, QuantLayout
from elastic_plugin.families.nemotron_h.config import (
    HF_ARCHITECTURE,
    HF_MODEL_TYPE,
    MAMBA_NORM_EPS,
    hf_config_notes,
    model_config_from_hf,
)
from elastic_plugin.models.config import ModelConfig

__all__ = ["FAMILY", "NemotronH"]


class NemotronH(Family):
    architecture = HF_ARCHITECTURE
    model_type = HF_MODEL_TYPE
    description = "Nemotron-H / Nemotron-3: Mamba-2, attention, relu2 MLP, sigmoid MoE"

    def model_config(self, config_json: Mapping[str, Any], source: str) -> ModelConfig:
        return model_config_from_hf(config_json, source)

    def notes(self, config_json: Mapping[str, Any]) -> list[str]:
        return hf_config_notes(config_json)

    def holds(self, model: ModelConfig) -> str | None:
        rules: list[tuple[str, Any, tuple[Any, ...], str]] = [
            ("model.activation", model.activation, ("squared_relu",), "NemotronH MLPs are relu2"),
            (
                "model.position_embedding_type",
                model.position_embedding_type,
                ("none",),
                "NemotronH attention has no position embedding",
            ),
            ("model.add_bias_linear", model.add_bias_linear, (False,), "no linear biases"),
            ("model.add_qkv_bias", model.add_qkv_bias, (False,), "no q/k/v biases"),
            ("model.qk_layernorm", model.qk_layernorm, (False,), "no query/key norms"),
        ]
        if model.count("mamba"):  # NemotronH's gated Mamba norm shares the layer norms' epsilon
            rules.append(
                (
                    "model.layernorm_epsilon",
                    model.layernorm_epsilon,
                    (MAMBA_NORM_EPS,),
                    "Megatron's Mamba gated norm uses 1e-5, NemotronH uses one epsilon for all",
                )
            )
        if model.count("moe"):
            rules.append(
                (
                    "model.moe_router_score_function",
                    model.moe_router_score_function,
                    ("sigmoid",),
                    "NemotronH routes with sigmoid scores",
                )
            )
        for field, value, allowed, why in rules:
            if value not in allowed:
                return (
                    f"{field}={value!r} cannot be written as NemotronH ({why}); allowed: "
                    + ", ".join(map(repr, allowed))
                )
        return None

    def import_layout(
        self,
        config_json: Mapping[str, Any],
        model: ModelConfig,
        stored: Mapping[str, tuple[int, ...]],
        source: str,
    ) -> ImportLayout:
        from elastic_plugin.families.nemotron_h.keys import import_layout

        return import_layout(config_json, model, stored)

    def megatron_to_hf(self, state: Mapping[str, Any], model: ModelConfig) -> dict[str, Any]:
        from elastic_plugin.families.nemotron_h.keys import megatron_to_hf

        return megatron_to_hf(state, model)

    def hf_to_megatron(self, hf: Mapping[str, Any], model: ModelConfig) -> dict[str, Any]:
        from elastic_plugin.families.nemotron_h.keys import hf_to_megatron

        return hf_to_megatron(hf, model)

    def to_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        from elastic_plugin.checkpoint.hub import to_hub

        return to_hub(tensors)

    def from_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        from elastic_plugin.checkpoint.hub import from_hub

        return from_hub(tensors)

    def hub_name(self, name: str) -> str:
        from elastic_plugin.checkpoint.hub import hub_name

        return hub_name(name)

    def memory_name(self, name: str) -> str:
        from elastic_plugin.checkpoint.hub import memory_name

        return memory_name(name)

    quant_layout = QuantLayout(
        expert_stacks={"up_proj": ("up_proj",), "down_proj": ("down_proj",)},
        fused=(("q_proj", "k_proj", "v_proj"),),
    )

    def megatron_input(self, module: str) -> tuple[int, str] | None:
        """HF layer i is Megatron layer i; every linear sits under ``mixer``."""
        match = re.fullmatch(r"model\.layers\.(\d+)\.mixer\.(.+)", module)
        if match is None:
            return None
        roles = {
            "q_proj": "qkv",
            "k_proj": "qkv",
            "v_proj": "qkv",
            "o_proj": "proj",
            "in_proj": "mamba_in",
            "out_proj": "mamba_out",
            "up_proj": "fc1",
            "down_proj": "fc2",
            "shared_experts.up_proj": "shared_fc1",
            "shared_experts.down_proj": "shared_fc2",
            "experts.up_proj": "experts_fc1",
            "experts.down_proj": "experts_fc2",
        }
        role = roles.get(match[2])
        return None if role is None else (int(match[1]), role)

    def keep_fp32(self, name: str) -> bool:
        """NemotronH keeps its router and expert score bias in float32 whatever the dtype."""
        return super().keep_fp32(name) or name.endswith(("gate.weight", "e_score_correction_bias"))

    def tensor_cuts(
        self, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
    ) -> dict[str, Cut]:
        from elastic_plugin.families.nemotron_h.slicing import tensor_cuts

        return tensor_cuts(model, choice)

    def slice_hub_files(
        self, path: Path, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
    ) -> dict[str, Any]:
        from elastic_plugin.families.nemotron_h.slicing import slice_hub_files

        return slice_hub_files(path, model, choice)

    def hf_config(
        self,
        tensors: Mapping[str, Any],
        model: ModelConfig,
        torch_dtype: str,
        token_ids: Mapping[str, int],
    ) -> dict[str, Any]:
        from elastic_plugin.families.nemotron_h.builder import hf_config

        return hf_config(tensors, model, torch_dtype, token_ids)

    def build_hf_model(
        self, config_json: Mapping[str, Any], state: Mapping[str, Any], dtype: Any, source: str
    ) -> Any:
        from elastic_plugin.families.nemotron_h.builder import build_hf_model

        return build_hf_model(config_json, state, dtype, source)


FAMILY = NemotronH()
