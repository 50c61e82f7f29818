"""GPT families as llama.cpp reads them: its architecture name, its tensor names and layouts
(torch-free; the tensors are numpy arrays).

llama.cpp names a Llama / Qwen tensor after its role in block ``i`` (``blk.{i}.attn_q.weight``,
``blk.{i}.ffn_gate_exps.weight`` ...), stacks MoE experts into one 3-D tensor per projection
and, for its ``llama`` architecture (Llama, Mixtral), rotates interleaved pairs of q / k
channels where transformers rotates the two halves of a head: q and k rows (and biases) are
reordered so that both compute the same attention. ``qwen2`` / ``qwen3`` / ``qwen3moe`` rotate
halves, as transformers does, so their rows are kept. llama.cpp's ``qwen2`` assumes square
query and output projections (heads x head_dim = hidden); a Qwen2 budget that narrows only the
embedding is written as its ``llama`` (which takes q / k / v biases) instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = ["GGUF_ARCH", "GgufTensors", "gguf_tensors"]

# transformers architecture -> llama.cpp's general.architecture
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# in-memory names (transformers') -> llama.cpp's, per layer
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GgufTensors:
    """What one GPT-family model is in llama.cpp's terms."""

    arch: str
    tensors: dict[str, Any]  # GGUF name -> numpy array (PyTorch dimension order)


def _interleave_rotary(weight: Any, heads: int) -> Any:
    """Rows of each head reordered from halves-rotated (transformers) to pairs-rotated
    (llama.cpp's ``llama``): row ``j`` of the first half and row ``j`` of the second become
    rows ``2j`` and ``2j + 1``."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _items(hf: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, tensor in hf.items():
        if name in _GLOBAL:
            yield _GLOBAL[name], tensor
            continue
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            raise ConfigError(f"--gguf: no llama.cpp name for the tensor {name!r}")
        layer, rest = match.groups()
        if rest == "mlp.experts.gate_up_proj":  # [E, 2f, h]: gate rows first, then up
            half = tensor.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", tensor[:, :half]
            yield f"blk.{layer}.ffn_up_exps.weight", tensor[:, half:]
            continue
        if rest not in _LAYER:
            raise ConfigError(f"--gguf: no llama.cpp name for the tensor {name!r}")
        yield f"blk.{layer}.{_LAYER[rest]}", tensor


def gguf_tensors(
    architecture: str, config: Mapping[str, Any], hf: Mapping[str, Any]
) -> GgufTensors:
    """``hf`` (transformers' in-memory names, numpy arrays) in llama.cpp's names and layouts."""
    if architecture not in GGUF_ARCH:
        raise ConfigError(
            f"--gguf: {architecture} has no llama.cpp architecture here; allowed: "
            f"{', '.join(sorted(GGUF_ARCH))}"
        )
    arch = GGUF_ARCH[architecture]
    heads, groups = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    if arch == "qwen2" and heads * head_dim != int(config["hidden_size"]):
        # llama.cpp's qwen2 has square query / output projections; a nested budget that keeps
        # the heads but narrows the embedding is its llama (optional q/k/v biases, pairs rotated)
        arch = "llama"
    out = {}
    for name, tensor in _items(hf):
        if arch == "llama" and ".attn_q." in name:
            tensor = _interleave_rotary(tensor, heads)
        elif arch == "llama" and ".attn_k." in name:
            tensor = _interleave_rotary(tensor, groups)
        out[name] = tensor
    return GgufTensors(arch, out)
