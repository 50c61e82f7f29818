"""What the GPT-family folders share (not a family itself: it has no ``FAMILY``).

Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral are one decoder with different options, so each of
their folders is a :class:`GptFamily` built from a ``GptSpec`` (config.json: ``config.py``), a
``GptKeys`` (on-disk MoE names: ``keys.py``) and the family's own ``config.json`` fields; the
slicing (``slicing.py``) and the transformers builder (``builder.py``) are common.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_plugin.families.base import Cut, Family, ImportLayout, QuantLayout
from elastic_plugin.families.gpt.config import GptSpec, gpt_model_config
from elastic_plugin.families.gpt.keys import GptKeys
from elastic_plugin.models.config import ModelConfig

__all__ = ["GptFamily", "GptKeys", "GptSpec"]

# dense (Llama, Qwen2, Qwen3), MoE only (Mixtral), or both (Qwen3-MoE)
LAYERS = ("dense", "moe", "mixed")


class GptFamily(Family):
    """A GPT-family architecture: ``*-`` / ``*E`` pairs, SwiGLU, RoPE, RMSNorm, GQA."""

    def __init__(
        self,
        spec: GptSpec,
        description: str,
        layers: str,
        family_fields: Callable[[ModelConfig, dict[str, int], list[str]], dict[str, Any]],
        keys: GptKeys | None = None,
        experts_field: str = "num_experts",
    ) -> None:
        assert layers in LAYERS
        self.spec = spec
        self.architecture = spec.architecture
        self.model_type = spec.model_type
        self.description = description
        self.layers = layers
        self.family_fields = family_fields
        self.keys = keys or GptKeys()
        self.experts_field = experts_field

    # ------------------------------------------------------------------ config.json
    def model_config(self, config_json: Mapping[str, Any], source: str) -> ModelConfig:
        return gpt_model_config(self.spec, config_json, source)

    def holds(self, model: ModelConfig) -> str | None:
        kinds = set(model.layer_types)
        pairs = model.hybrid_layer_pattern.replace("|", "")
        wanted = {"dense": "'*-' pairs", "moe": "'*E' pairs", "mixed": "'*-' / '*E' pairs"}
        ok_kinds = {"dense": {"attention", "mlp"}, "moe": {"attention", "moe"}}
        shape_ok = (
            len(pairs) % 2 == 0
            and all(pairs[j] == "*" and pairs[j + 1] in "-E" for j in range(0, len(pairs), 2))
            and (kinds <= ok_kinds[self.layers] if self.layers in ok_kinds else "moe" in kinds)
        )
        if not shape_ok:
            return (
                f"model.hybrid_layer_pattern={model.hybrid_layer_pattern!r}; allowed: "
                + wanted[self.layers]
                + (" with at least one '*E'" if self.layers == "mixed" else "")
            )
        rules: list[tuple[str, Any, Any]] = [
            ("model.activation", model.activation, "swiglu"),
            ("model.position_embedding_type", model.position_embedding_type, "rope"),
            ("model.add_bias_linear", model.add_bias_linear, False),
            ("model.qk_layernorm", model.qk_layernorm, self.spec.qk_norm),
            ("model.add_qkv_bias", model.add_qkv_bias, self.spec.qkv_bias),
        ]
        if not self.spec.has_head_dim:
            rules.append(
                (
                    "model.kv_channels",
                    model.head_dim,
                    model.hidden_size // model.num_attention_heads,
                )
            )
        if "moe" in kinds:
            rules += [
                ("model.moe_router_score_function", model.moe_router_score_function, "softmax"),
                ("model.moe_router_enable_expert_bias", model.moe_router_enable_expert_bias, False),
                (
                    "model.moe_router_topk_scaling_factor",
                    model.moe_router_topk_scaling_factor,
                    None,
                ),
                (
                    "model.moe_shared_expert_intermediate_size",
                    model.moe_shared_expert_intermediate_size,
                    0,
                ),
            ]
        for field, value, allowed in rules:
            if value != allowed:
                return f"{field}={value!r} cannot be written as {self.architecture}; allowed: {allowed!r}"
        return None

    # ------------------------------------------------------------------ key layout
    def import_layout(
        self,
        config_json: Mapping[str, Any],
        model: ModelConfig,
        stored: Mapping[str, tuple[int, ...]],
        source: str,
    ) -> ImportLayout:
        return self.keys.import_layout(model)

    def megatron_to_hf(self, state: Mapping[str, Any], model: ModelConfig) -> dict[str, Any]:
        return self.keys.megatron_to_hf(state, model)

    def hf_to_megatron(self, hf: Mapping[str, Any], model: ModelConfig) -> dict[str, Any]:
        return self.keys.hf_to_megatron(hf, model)

    def to_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return self.keys.to_hub(tensors)

    def from_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return self.keys.from_hub(tensors)

    def hub_name(self, name: str) -> str:
        return self.keys.hub_name(name)

    def gguf_tensors(self, config_json: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
        from elastic_plugin.families.gpt.gguf import gguf_tensors

        return gguf_tensors(self.architecture, config_json, tensors)

    def memory_name(self, name: str) -> str:
        return self.keys.memory_name(name)

    # ------------------------------------------------------------------ quantized layout
    # transformers' fused gate_up_proj is written per expert as gate_proj + up_proj (ModelOpt's
    # export: one weight quantizer per expert of the fused parameter, so they share its scales)
    quant_layout = QuantLayout(
        expert_stacks={"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    )

    def megatron_input(self, module: str) -> tuple[int, str] | None:
        """HF layer i's attention is Megatron layer 2i, its MLP / MoE layer 2i+1."""
        match = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(.+)", module)
        if match is None:
            return None
        i, block, leaf = int(match[1]), match[2], match[3]
        if block == "self_attn":
            role = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "proj"}
            return (2 * i, role[leaf]) if leaf in role else None
        roles = {
            "gate_proj": "fc1",
            "up_proj": "fc1",
            "down_proj": "fc2",
            "experts.gate_up_proj": "experts_fc1",
            "experts.down_proj": "experts_fc2",
        }
        return (2 * i + 1, roles[leaf]) if leaf in roles else None

    # ------------------------------------------------------------------ slicing
    def tensor_cuts(
        self, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
    ) -> dict[str, Cut]:
        from elastic_plugin.families.gpt.slicing import tensor_cuts

        return tensor_cuts(model, choice)

    def slice_hub_files(
        self, path: Path, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
    ) -> dict[str, Any]:
        from elastic_plugin.families.gpt.slicing import slice_hub_files

        return slice_hub_files(self.keys, path, model, choice)

    # ------------------------------------------------------------------ transformers
    def hf_config(
        self,
        tensors: Mapping[str, Any],
        model: ModelConfig,
        torch_dtype: str,
        token_ids: Mapping[str, int],
    ) -> dict[str, Any]:
        from elastic_plugin.families.gpt.builder import hf_config

        return hf_config(
            self.architecture,
            self.model_type,
            tensors,
            model,
            torch_dtype,
            token_ids,
            self.family_fields,
            self.experts_field,
        )

    def build_hf_model(
        self, config_json: Mapping[str, Any], state: Mapping[str, Any], dtype: Any, source: str
    ) -> Any:
        from elastic_plugin.families.gpt.builder import build_hf_model

        return build_hf_model(self.architecture, config_json, state, dtype, source)
