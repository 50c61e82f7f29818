"""GPT-family key layout, both ways: Megatron ``HybridModel`` state <-> transformers' names <->
the names on disk.

HF layer i is Megatron layers 2i (attention: ``input_layernorm``, fused ``linear_qkv`` with
optional bias, optional ``q_layernorm`` / ``k_layernorm``, ``linear_proj``) and 2i+1 (a dense
SwiGLU MLP: ``pre_mlp_layernorm`` + ``linear_fc1`` = [gate; up] + ``linear_fc2``, or an MoE:
``router`` + per-expert ``linear_fc1`` = [gate; up] and ``linear_fc2``). transformers 5 holds the
experts of a layer fused (``experts.gate_up_proj [E, 2f, h]``: gate then up, exactly Megatron's
per-expert fc1; ``experts.down_proj [E, h, f]``) but ``save_pretrained`` stores them one tensor
per expert and projection (Qwen3-MoE ``mlp.experts.{e}.gate_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1`` ...): :class:`GptKeys` names them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastic_plugin.families.base import ImportLayout, Target
from elastic_plugin.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch

__all__ = ["GptKeys", "GLOBAL"]

GLOBAL = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_norm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight"),
)
_ROLES = ("gate", "up", "down")
# transformers' own per-expert names (Qwen3-MoE's on disk; quantized experts in memory)
_PARTS = ("gate_proj", "up_proj", "down_proj")


def check_pairs(model: ModelConfig) -> None:
    """A GPT-family model is ``*-`` / ``*E`` pairs: HF layer i is Megatron layers 2i, 2i+1."""
    pattern = model.hybrid_layer_pattern.replace("|", "")
    if not re.fullmatch(r"(\*[-E])+", pattern):
        raise ConfigError(
            f"model.hybrid_layer_pattern={model.hybrid_layer_pattern!r}: a GPT-family export "
            "needs attention + MLP/MoE pairs ('*-' or '*E' repeated)"
        )


@dataclasses.dataclass(frozen=True)
class GptKeys:
    """The on-disk names of one family's MoE layers: the module (``mlp`` or
    ``block_sparse_moe``) and the per-expert gate / up / down projection names."""

    moe_module: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    # ------------------------------------------------------------------ per layer
    def _pairs(self, model: ModelConfig, i: int) -> list[tuple[str, str]]:
        """(Megatron name, in-memory HF name) of HF layer i's one-to-one tensors."""
        a, m, h = f"decoder.layers.{2 * i}.", f"decoder.layers.{2 * i + 1}.", f"model.layers.{i}."
        pairs = [
            (a + "input_layernorm.weight", h + "input_layernorm.weight"),
            (a + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight"),
            (m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"),
        ]
        if model.qk_layernorm:
            pairs += [
                (a + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight"),
                (a + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight"),
            ]
        if model.layer_types[2 * i + 1] == "mlp":
            pairs.append((m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight"))
        else:
            pairs.append((m + "mlp.router.weight", h + "mlp.gate.weight"))
        return pairs

    def megatron_to_hf(
        self, state: Mapping[str, torch.Tensor], model: ModelConfig
    ) -> dict[str, torch.Tensor]:
        """A TP=1 Megatron state dict (plain or sliced) in transformers' in-memory names;
        ``_extra_state`` is dropped, anything else left over is an error."""
        import torch

        from elastic_plugin.families.tensors import split_qkv

        check_pairs(model)
        left = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
        out: dict[str, torch.Tensor] = {}

        def take(key: str) -> torch.Tensor:
            if key not in left:
                raise ConfigError(f"--format hf: the model state has no {key!r}")
            return left.pop(key).detach()

        for src, dst in GLOBAL:
            if dst == "lm_head.weight" and not model.untie_embeddings_and_output_weights:
                left.pop(src, None)  # tied: transformers' lm_head is the embedding
                continue
            out[dst] = take(src).contiguous()
        for i in range(model.num_layers // 2):
            a, m, h = (
                f"decoder.layers.{2 * i}.",
                f"decoder.layers.{2 * i + 1}.",
                f"model.layers.{i}.",
            )
            for src, dst in self._pairs(model, i):
                out[dst] = take(src).contiguous()
            groups, hd = model.query_groups, model.head_dim
            parts = split_qkv(take(a + "self_attention.linear_qkv.weight"), groups, hd)
            for name, tensor in zip("qkv", parts):
                out[f"{h}self_attn.{name}_proj.weight"] = tensor.contiguous()
            if model.add_qkv_bias:
                parts = split_qkv(take(a + "self_attention.linear_qkv.bias"), groups, hd)
                for name, tensor in zip("qkv", parts):
                    out[f"{h}self_attn.{name}_proj.bias"] = tensor.contiguous()
            if model.layer_types[2 * i + 1] == "mlp":
                gate, up = take(m + "mlp.linear_fc1.weight").chunk(2)
                out[h + "mlp.gate_proj.weight"] = gate.contiguous()
                out[h + "mlp.up_proj.weight"] = up.contiguous()
            else:
                head = f"{m}mlp.experts.local_experts."
                ids = sorted(
                    {int(k[len(head) :].split(".", 1)[0]) for k in left if k.startswith(head)}
                )
                if not ids or ids != list(range(len(ids))):
                    raise ConfigError(
                        f"--format hf: layer {m!r} has experts {ids} (per-expert linears "
                        "0..E-1 expected; grouped-GEMM experts are not supported)"
                    )
                for fc, name in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
                    out[f"{h}mlp.experts.{name}"] = torch.stack(
                        [take(f"{head}{e}.{fc}.weight") for e in ids]
                    ).contiguous()
        if left:
            raise ConfigError(
                f"--format hf: tensors without a transformers counterpart: {sorted(left)[:5]}"
            )
        return out

    def hf_to_megatron(
        self, hf: Mapping[str, torch.Tensor], model: ModelConfig
    ) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`megatron_to_hf`."""
        import torch

        from elastic_plugin.families.tensors import fuse_qkv

        check_pairs(model)
        left = dict(hf)
        out: dict[str, torch.Tensor] = {}
        for src, dst in GLOBAL:
            if dst in left:
                out[src] = left.pop(dst)
        for i in range(model.num_layers // 2):
            a, m, h = (
                f"decoder.layers.{2 * i}.",
                f"decoder.layers.{2 * i + 1}.",
                f"model.layers.{i}.",
            )
            for src, dst in self._pairs(model, i):
                out[src] = left.pop(dst)
            groups, hd = model.query_groups, model.head_dim
            for leaf in ("weight", "bias") if model.add_qkv_bias else ("weight",):
                q, k, v = (left.pop(f"{h}self_attn.{p}_proj.{leaf}") for p in "qkv")
                out[f"{a}self_attention.linear_qkv.{leaf}"] = fuse_qkv(q, k, v, groups, hd)
            if model.layer_types[2 * i + 1] == "mlp":
                out[m + "mlp.linear_fc1.weight"] = torch.cat(
                    [left.pop(h + "mlp.gate_proj.weight"), left.pop(h + "mlp.up_proj.weight")]
                )
            else:
                for fc, name in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
                    for e, w in enumerate(left.pop(f"{h}mlp.experts.{name}")):
                        out[f"{m}mlp.experts.local_experts.{e}.{fc}.weight"] = w
        if left:
            raise ConfigError(f"HF state has tensors this model does not: {sorted(left)[:5]}")
        return out

    # ------------------------------------------------------------------ disk <-> memory
    def _disk_expert(self, name: str) -> re.Match[str] | None:
        names = "|".join(self.expert_names)
        return re.fullmatch(
            rf"(?P<layer>model\.layers\.\d+)\.{re.escape(self.moe_module)}\.experts\."
            rf"(?P<e>\d+)\.(?P<proj>{names})\.(?P<leaf>\w+)",
            name,
        )

    def hub_name(self, name: str) -> str:
        """A module name on disk: an MoE layer's ``mlp.`` is the family's MoE module, and a
        per-expert projection (quantized experts stay per expert in memory) its disk name."""
        if self.moe_module != "mlp":
            name = re.sub(
                r"^(model\.layers\.\d+)\.mlp\.(gate|experts)\b", rf"\1.{self.moe_module}.\2", name
            )
        return self._expert_proj(name, dict(zip(_PARTS, self.expert_names)))

    def memory_name(self, name: str) -> str:
        if self.moe_module != "mlp":
            name = re.sub(
                rf"^(model\.layers\.\d+)\.{re.escape(self.moe_module)}\.", r"\1.mlp.", name
            )
        return self._expert_proj(name, dict(zip(self.expert_names, _PARTS)))

    @staticmethod
    def _expert_proj(name: str, rename: Mapping[str, str]) -> str:
        match = re.fullmatch(r"(model\.layers\.\d+\.\w+\.experts\.\d+)\.(\w+)((\.\w+)?)", name)
        if match is None or match[2] not in rename:
            return name
        return f"{match[1]}.{rename[match[2]]}{match[3]}"

    def to_hub(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """In-memory names -> on disk: fused experts become one tensor per expert and projection
        (views of the stack, no copy)."""
        gate, up, down = self.expert_names
        out: dict[str, torch.Tensor] = {}
        for key, value in tensors.items():
            match = re.fullmatch(
                r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", key
            )
            if match is None:
                out[self.hub_name(key)] = value
                continue
            if value.dim() != 3:
                raise ConfigError(
                    f"{key}: fused experts must be [experts, out, in]; got {tuple(value.shape)}"
                )
            head = f"{match[1]}.{self.moe_module}.experts"
            for e in range(value.shape[0]):
                if match[2] == "down_proj":
                    out[f"{head}.{e}.{down}.weight"] = value[e]
                else:
                    first, second = value[e].chunk(2)
                    out[f"{head}.{e}.{gate}.weight"] = first
                    out[f"{head}.{e}.{up}.weight"] = second
        return out

    def from_hub(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On-disk names -> in memory: per-expert gate / up / down stacked into
        ``gate_up_proj`` / ``down_proj`` (experts 0..E-1 of one shape)."""
        import torch

        roles = dict(zip(self.expert_names, _ROLES))
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for key, value in tensors.items():
            match = self._disk_expert(key)
            quantized = key.removesuffix("weight") + "weight_scale" in tensors
            if match is None or match["leaf"] != "weight" or quantized:
                # quantized experts stay per expert (their scales go with them)
                out[self.memory_name(key)] = value
                continue
            found = experts.setdefault(match["layer"], {r: {} for r in _ROLES})
            found[roles[match["proj"]]][int(match["e"])] = value
        for layer, parts in experts.items():
            # gate + up stack together, down alone (one may be quantized, the other not)
            for stacked, members in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
                ids = sorted(parts[members[0]])
                if any(sorted(parts[r]) != ids for r in members) or ids != list(range(len(ids))):
                    raise ConfigError(
                        f"{layer}.{self.moe_module}.experts: {'/'.join(members)} of experts "
                        f"{[sorted(parts[r]) for r in members]}; expected 0..E-1 of each"
                    )
                if ids:
                    out[f"{layer}.mlp.experts.{stacked}"] = torch.stack(
                        [torch.cat([parts[r][e] for r in members]) for e in ids]
                    )
        return out

    # ------------------------------------------------------------------ import table
    def import_layout(self, model: ModelConfig) -> ImportLayout:
        """Every tensor a directory of ``model`` stores (disk names) -> its Target."""
        check_pairs(model)
        h, v = model.hidden_size, model.vocab_size
        heads, groups, hd = model.num_attention_heads, model.query_groups, model.head_dim
        table: dict[str, Target] = {}
        for megatron, memory in GLOBAL:
            if memory == "lm_head.weight" and not model.untie_embeddings_and_output_weights:
                continue  # tied: save_pretrained stores the embedding only
            shape: tuple[int, ...] = (h,) if memory == "model.norm.weight" else (v, h)
            table[memory] = Target(megatron, shape, "vocab_size, hidden_size")
        attn = "num_attention_heads, num_key_value_heads, head_dim, hidden_size"
        for i in range(model.num_layers // 2):
            a, m, d = (
                f"decoder.layers.{2 * i}.",
                f"decoder.layers.{2 * i + 1}.",
                f"model.layers.{i}.",
            )
            shapes = {
                d + "input_layernorm.weight": ((h,), "hidden_size"),
                d + "self_attn.o_proj.weight": ((h, heads * hd), attn),
                d + "post_attention_layernorm.weight": ((h,), "hidden_size"),
                d + "self_attn.q_norm.weight": ((hd,), "head_dim"),
                d + "self_attn.k_norm.weight": ((hd,), "head_dim"),
                d + "mlp.down_proj.weight": ((h, model.ffn_hidden_size), "intermediate_size"),
                d + "mlp.gate.weight": ((model.num_moe_experts, h), "experts, hidden_size"),
            }
            for megatron, memory in self._pairs(model, i):
                shape, fields = shapes[memory]
                table[self.hub_name(memory)] = Target(megatron, shape, fields)
            rows = {"q": heads, "k": groups, "v": groups}
            for part, n in rows.items():
                table[f"{d}self_attn.{part}_proj.weight"] = Target(
                    a + "self_attention.linear_qkv.weight", (n * hd, h), attn, part
                )
                if model.add_qkv_bias:
                    table[f"{d}self_attn.{part}_proj.bias"] = Target(
                        a + "self_attention.linear_qkv.bias", (n * hd,), attn, part
                    )
            if model.layer_types[2 * i + 1] == "mlp":
                f = model.ffn_hidden_size
                for part in ("gate", "up"):
                    table[f"{d}mlp.{part}_proj.weight"] = Target(
                        m + "mlp.linear_fc1.weight", (f, h), "intermediate_size, hidden_size", part
                    )
                continue
            f = model.moe_ffn_hidden_size
            gate, up, down = self.expert_names
            fields = "experts, moe_intermediate_size, hidden_size"
            for e in range(model.num_moe_experts):
                head = f"{d}{self.moe_module}.experts.{e}."
                fc = f"{m}mlp.experts.local_experts.{e}."
                table[f"{head}{gate}.weight"] = Target(
                    fc + "linear_fc1.weight", (f, h), fields, "gate"
                )
                table[f"{head}{up}.weight"] = Target(fc + "linear_fc1.weight", (f, h), fields, "up")
                table[f"{head}{down}.weight"] = Target(fc + "linear_fc2.weight", (h, f), fields)
        return ImportLayout(model, table, [], [])


def expert_stack_of(keys: GptKeys, name: str) -> tuple[str, int, str] | None:
    """(in-memory stacked name, expert, role) of an on-disk per-expert weight, else None."""
    match = keys._disk_expert(name)
    if match is None or match["leaf"] != "weight":
        return None
    role = dict(zip(keys.expert_names, _ROLES))[match["proj"]]
    stacked = "down_proj" if role == "down" else "gate_up_proj"
    return f"{match['layer']}.mlp.experts.{stacked}", int(match["e"]), role
