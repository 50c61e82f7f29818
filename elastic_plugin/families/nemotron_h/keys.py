"""Nemotron-H's key layout, both ways: Megatron ``HybridModel`` state <-> transformers'
``NemotronHForCausalLM`` names <-> the Hub's files.

``model.layers.{i}.norm`` + ``model.layers.{i}.mixer`` per layer (Megatron layer i is HF layer
i), the mixer being a Mamba-2 block, GQA attention (no RoPE), a squared-ReLU MLP or a
sigmoid-routed MoE with a shared expert. The conversion is a renaming plus two re-layouts:
Megatron's fused ``linear_qkv`` becomes ``q_proj`` / ``k_proj`` / ``v_proj``
(``families/tensors.py``), and the per-expert ``local_experts.{e}`` linears become the stacked
3-D ``experts.up_proj`` / ``experts.down_proj``. On disk (``checkpoint/hub.py``'s Nemotron-H
layout) the prefix is ``backbone.`` and experts are stored one tensor each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from elastic_plugin.families.base import ImportLayout, Target
from elastic_plugin.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:  # torch loads with the tensors; the import table is checked without it
    import torch

__all__ = ["GLOBAL", "hf_to_megatron", "import_layout", "layer_pairs", "megatron_to_hf"]

_HUB_PREFIX, _MEMORY_PREFIX = "backbone.", "model."


def _expert_count(state: Mapping[str, torch.Tensor], prefix: str) -> int:
    head = f"{prefix}mlp.experts.local_experts."
    ids = {int(k[len(head) :].split(".", 1)[0]) for k in state if k.startswith(head)}
    if not ids:
        legacy = [k for k in state if k.startswith(f"{prefix}mlp.experts.")]
        raise ConfigError(
            f"--format hf: layer {prefix!r} has no per-expert linears "
            f"(SequentialMLP); found {legacy[:2]} (grouped-GEMM experts are not "
            "supported by the exporter)"
        )
    if ids != set(range(len(ids))):
        raise ConfigError(f"--format hf: layer {prefix!r} has experts {sorted(ids)}, not 0..E-1")
    return len(ids)


def layer_pairs(kind: str, src: str, dst: str) -> list[tuple[str, str]]:
    """(Megatron name, HF name) of the tensors renamed one to one."""
    if kind == "mamba":
        names = [("norm.weight", "norm.weight")] + [
            (f"mixer.{m}", f"mixer.{h}")
            for m, h in (
                ("in_proj.weight", "in_proj.weight"),
                ("conv1d_weight", "conv1d.weight"),
                ("conv1d_bias", "conv1d.bias"),
                ("dt_bias", "dt_bias"),
                ("A_log", "A_log"),
                ("D", "D"),
                ("norm.weight", "norm.weight"),
                ("out_proj.weight", "out_proj.weight"),
            )
        ]
    elif kind == "attention":
        names = [
            ("input_layernorm.weight", "norm.weight"),
            ("self_attention.linear_proj.weight", "mixer.o_proj.weight"),
        ]
    elif kind == "mlp":
        names = [
            ("pre_mlp_layernorm.weight", "norm.weight"),
            ("mlp.linear_fc1.weight", "mixer.up_proj.weight"),
            ("mlp.linear_fc2.weight", "mixer.down_proj.weight"),
        ]
    else:  # moe
        names = [
            ("pre_mlp_layernorm.weight", "norm.weight"),
            ("mlp.router.weight", "mixer.gate.weight"),
            ("mlp.router.expert_bias", "mixer.gate.e_score_correction_bias"),
            ("mlp.shared_experts.linear_fc1.weight", "mixer.shared_experts.up_proj.weight"),
            ("mlp.shared_experts.linear_fc2.weight", "mixer.shared_experts.down_proj.weight"),
        ]
    return [(src + m, dst + h) for m, h in names]


GLOBAL = (
    ("embedding.word_embeddings.weight", "model.embeddings.weight"),
    ("decoder.final_norm.weight", "model.norm_f.weight"),
    ("output_layer.weight", "lm_head.weight"),
)


def megatron_to_hf(
    state: Mapping[str, torch.Tensor], model: ModelConfig
) -> dict[str, torch.Tensor]:
    """A TP=1 Megatron ``HybridModel`` state dict (plain or sliced, homogeneous or per layer) in
    NemotronH names and layouts. ``_extra_state`` entries are dropped; anything else left over
    is an error (a tensor silently lost would make a different model)."""
    import torch

    from elastic_plugin.families.tensors import split_qkv

    left = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    out: dict[str, torch.Tensor] = {}

    def move(src: str, dst: str, optional: bool = False) -> None:
        if src in left:
            out[dst] = left.pop(src).detach().contiguous()
        elif not optional:
            raise ConfigError(f"--format hf: the model state has no {src!r}")

    for src, dst in GLOBAL:
        move(
            src,
            dst,
            optional=dst == "lm_head.weight" and not model.untie_embeddings_and_output_weights,
        )
    for i, kind in enumerate(model.layer_types):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for a, b in layer_pairs(kind, src, dst):
            move(
                a,
                b,
                optional=b.endswith(("e_score_correction_bias", "conv1d.bias"))
                or ".shared_experts." in b,
            )
        if kind == "attention":
            q, k, v = split_qkv(
                left.pop(src + "self_attention.linear_qkv.weight"),
                model.query_groups,
                model.head_dim,
            )
            out.update(
                {
                    dst + "mixer.q_proj.weight": q,
                    dst + "mixer.k_proj.weight": k,
                    dst + "mixer.v_proj.weight": v,
                }
            )
        elif kind == "moe":
            experts = _expert_count(left, src)
            for fc, name in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                out[f"{dst}mixer.experts.{name}"] = torch.stack(
                    [
                        left.pop(f"{src}mlp.experts.local_experts.{e}.{fc}.weight")
                        for e in range(experts)
                    ]
                ).contiguous()
            bias = dst + "mixer.gate.e_score_correction_bias"
            if bias not in out:  # no expert bias in Megatron: NemotronH adds zeros
                out[bias] = torch.zeros(experts, dtype=torch.float32)
    if left:
        raise ConfigError(
            f"--format hf: tensors without a NemotronH counterpart: {sorted(left)[:5]}"
        )
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`megatron_to_hf` (used to load exported, e.g. dequantized, weights
    back into our Megatron model and measure them). A zero expert bias stays in the state only
    when the model has ``moe_router_enable_expert_bias``."""
    from elastic_plugin.families.tensors import fuse_qkv

    left = dict(hf)
    out: dict[str, torch.Tensor] = {}
    for src, dst in GLOBAL:
        if dst in left:
            out[src] = left.pop(dst)
    for i, kind in enumerate(model.layer_types):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for a, b in layer_pairs(kind, src, dst):
            if b in left:
                out[a] = left.pop(b)
        if kind == "attention":
            q, k, v = (left.pop(f"{dst}mixer.{p}_proj.weight") for p in "qkv")
            out[src + "self_attention.linear_qkv.weight"] = fuse_qkv(
                q, k, v, model.query_groups, model.head_dim
            )
        elif kind == "moe":
            for fc, name in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj")):
                for e, w in enumerate(left.pop(f"{dst}mixer.experts.{name}")):
                    out[f"{src}mlp.experts.local_experts.{e}.{fc}.weight"] = w
            if not model.moe_router_enable_expert_bias:
                out.pop(src + "mlp.router.expert_bias", None)
    if left:
        raise ConfigError(f"HF state has tensors this model does not: {sorted(left)[:5]}")
    return out


# ------------------------------------------------------------------------------ import table
def _hub(name: str) -> str:
    return _HUB_PREFIX + name[len(_MEMORY_PREFIX) :] if name.startswith(_MEMORY_PREFIX) else name


def _layer_shapes(m: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and source fields of each per-layer NemotronH tensor, by its name in the layer."""
    h, di, nh = m.hidden_size, m.mamba_d_inner, m.mamba_num_heads
    conv = di + 2 * m.mamba_num_groups * m.mamba_state_dim
    mamba = "mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size"
    shared = m.moe_shared_expert_intermediate_size
    return {
        "norm.weight": ((h,), "hidden_size"),
        "mixer.in_proj.weight": ((di + conv + nh, h), f"hidden_size, {mamba}"),
        "mixer.conv1d.weight": ((conv, 1, m.mamba_conv_kernel), f"{mamba}, conv_kernel"),
        "mixer.conv1d.bias": ((conv,), mamba),
        "mixer.dt_bias": ((nh,), "mamba_num_heads"),
        "mixer.A_log": ((nh,), "mamba_num_heads"),
        "mixer.D": ((nh,), "mamba_num_heads"),
        "mixer.norm.weight": ((di,), "mamba_num_heads, mamba_head_dim"),
        "mixer.out_proj.weight": ((h, di), f"hidden_size, {mamba}"),
        "mixer.o_proj.weight": (
            (h, m.num_attention_heads * m.head_dim),
            "hidden_size, num_attention_heads, head_dim",
        ),
        "mixer.up_proj.weight": ((m.ffn_hidden_size, h), "intermediate_size, hidden_size"),
        "mixer.down_proj.weight": ((h, m.ffn_hidden_size), "intermediate_size, hidden_size"),
        "mixer.gate.weight": ((m.num_moe_experts, h), "n_routed_experts, hidden_size"),
        "mixer.gate.e_score_correction_bias": ((m.num_moe_experts,), "n_routed_experts"),
        "mixer.shared_experts.up_proj.weight": (
            (shared, h),
            "moe_shared_expert_intermediate_size, hidden_size",
        ),
        "mixer.shared_experts.down_proj.weight": (
            (h, shared),
            "moe_shared_expert_intermediate_size, hidden_size",
        ),
    }


def import_table(model: ModelConfig, conv_bias: bool = True) -> dict[str, Target]:
    """Every tensor a NemotronH directory of ``model`` stores (Hub names) -> its Target. The
    renaming is the exporter's own table (:func:`layer_pairs`), read in the other direction."""
    h, v = model.hidden_size, model.vocab_size
    table: dict[str, Target] = {}
    for megatron, memory in GLOBAL:
        if memory == "lm_head.weight" and not model.untie_embeddings_and_output_weights:
            continue  # tied: the output layer is the embedding
        size: tuple[int, ...] = (h,) if memory.endswith("norm_f.weight") else (v, h)
        table[_hub(memory)] = Target(megatron, size, "vocab_size, hidden_size")
    shapes = _layer_shapes(model)
    for i, kind in enumerate(model.layer_types):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron, memory in layer_pairs(kind, src, dst):
            leaf = memory[len(dst) :]
            if leaf == "mixer.conv1d.bias" and not conv_bias:
                continue
            shape, fields = shapes[leaf]
            table[_hub(memory)] = Target(megatron, shape, fields)
        if kind == "attention":
            _add_qkv(table, model, src, _hub(dst))
        elif kind == "moe":
            _add_experts(table, model, src, _hub(dst))
    return table


def _add_qkv(table: dict[str, Target], m: ModelConfig, src: str, dst: str) -> None:
    fields = "num_attention_heads, num_key_value_heads, head_dim, hidden_size"
    qkv = src + "self_attention.linear_qkv.weight"
    rows = {"q": m.num_attention_heads, "k": m.query_groups, "v": m.query_groups}
    for part, heads in rows.items():
        table[f"{dst}mixer.{part}_proj.weight"] = Target(
            qkv, (heads * m.head_dim, m.hidden_size), fields, part
        )


def _add_experts(table: dict[str, Target], m: ModelConfig, src: str, dst: str) -> None:
    fields = "n_routed_experts, moe_intermediate_size, hidden_size"
    f, h = m.moe_ffn_hidden_size, m.hidden_size
    for e in range(m.num_moe_experts):
        for proj, fc, shape in (
            ("up_proj", "linear_fc1", (f, h)),
            ("down_proj", "linear_fc2", (h, f)),
        ):
            table[f"{dst}mixer.experts.{e}.{proj}.weight"] = Target(
                f"{src}mlp.experts.local_experts.{e}.{fc}.weight", shape, fields
            )


def import_layout(
    config_json: Mapping[str, Any], model: ModelConfig, stored: Mapping[str, Any]
) -> ImportLayout:
    """The import of a NemotronH directory: a stored ``lm_head`` under tied embeddings is used
    untied (transformers' NemotronH ties nothing), and missing conv biases are zeros."""
    conv_bias = bool(config_json.get("use_conv_bias", config_json.get("mamba_conv_bias", True)))
    from elastic_plugin.families.nemotron_h.config import hf_config_notes

    notes = hf_config_notes(config_json) if model.count("mamba") else []
    if not model.untie_embeddings_and_output_weights and "lm_head.weight" in stored:
        model = dataclasses.replace(model, untie_embeddings_and_output_weights=True)
        notes.append(
            "tie_word_embeddings=true, but the files hold lm_head.weight, which transformers' "
            "NemotronH uses as its output layer (it ties no weights): imported untied"
        )
    table = import_table(model, conv_bias)
    zero_filled = [
        f"decoder.layers.{i}.mixer.conv1d_bias"
        for i, kind in enumerate(model.layer_types)
        if kind == "mamba" and not conv_bias
    ]
    if zero_filled:
        notes.append("use_conv_bias=false: the Mamba conv biases are zeros")
    return ImportLayout(model, table, zero_filled, notes)
