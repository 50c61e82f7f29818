"""A Hugging Face export as one GGUF file, llama.cpp's format (``export --gguf``).

Why: llama.cpp (and what is built on it) serves GGUF files only. The file is written with the
``gguf`` package's ``GGUFWriter`` from an export directory of a GPT family (its safetensors,
``config.json`` and the model's tokenizer files): the family's own tensor-name map
(``families/gpt/gguf.py``: llama.cpp's names, experts stacked, q / k rows reordered where
llama.cpp rotates interleaved pairs), the architecture's hyper-parameters, Llama 3.1's RoPE
scaling as llama.cpp's ``rope_freqs`` (the frequency divisors transformers' own ``llama3``
RoPE computes), and the tokenizer: byte-level BPE vocabulary and merges, its pre-tokenizer by
llama.cpp's name, BOS exactly when the tokenizer adds one, EOS / pad / stop ids and the chat
template as ``data/token_rule.py`` reads them.

Weights are written in F32, BF16 or Q8_0 (blocks of 32 along a row; a tensor whose rows do
not divide by 32 stays F32); norms, biases and ``rope_freqs`` are always F32, as llama.cpp
expects. Budgets with per-layer widths (``layer_overrides``) and MoE models that mix dense and
expert layers have no llama.cpp form and are refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = ["GGUF_TYPES", "write_gguf"]

GGUF_TYPES = ("f32", "bf16", "q8_0")
# llama.cpp's pre-tokenizer names for the byte-level BPE splits it knows (the regex a
# tokenizer.json's Split pre-tokenizer holds -> the name llama.cpp reads)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


def _pre_tokenizer(tok_json: Mapping[str, Any], file: Path) -> str:
    """llama.cpp's name of the tokenizer's pre-tokenizer, or a ConfigError naming it."""
    pre = tok_json.get("pre_tokenizer") or {}
    if tok_json.get("normalizer") is not None:
        raise ConfigError(
            f"--gguf: {file} has a normalizer ({tok_json['normalizer'].get('type')}); llama.cpp's "
            "byte-level BPE runs none"
        )
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        if pre.get("add_prefix_space"):
            raise ConfigError(f"--gguf: {file}: ByteLevel add_prefix_space=true is not supported")
        return "gpt-2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if (
        steps
        and len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[1].get("type") == "ByteLevel"
        and not steps[1].get("use_regex", True)
    ):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern in _SPLITS:
            return _SPLITS[pattern]
    raise ConfigError(
        f"--gguf: {file}: its pre-tokenizer {json.dumps(pre)[:200]} is none llama.cpp knows by "
        "name here (GPT-2's byte-level split, Llama 3's, Qwen2's)"
    )


def _tokenizer(writer: Any, hf_dir: Path, vocab_size: int) -> None:
    """The byte-level BPE tokenizer of ``hf_dir`` as llama.cpp's ``gpt2`` model."""
    import gguf

    from elastic_plugin.data.token_rule import read_token_rule

    file = hf_dir / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"--gguf: {hf_dir} has no tokenizer.json (llama.cpp needs the tokenizer)")
    tok_json = json.loads(file.read_text(encoding="utf-8"))
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(
            f"--gguf: {file}: model type {model.get('type')!r}; allowed: BPE (byte-level)"
        )
    pre = _pre_tokenizer(tok_json, file)
    rule = read_token_rule(file)
    added = {t["id"]: t for t in tok_json.get("added_tokens") or []}
    by_id = {i: t for t, i in model["vocab"].items()}
    by_id.update({i: t["content"] for i, t in added.items()})
    if max(by_id) >= vocab_size:
        raise ConfigError(
            f"--gguf: {file} has token id {max(by_id)}, beyond the model's {vocab_size} rows"
        )
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # the embedding's padded rows
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            special = added[i].get("special", False)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    bos = rule.special_tokens.get("bos_token")
    bos_id = rule.backend.token_to_id(bos) if bos is not None else None
    prefix = rule.prefix_ids
    if prefix and prefix != [bos_id]:
        raise ConfigError(
            f"--gguf: {file}: its post-processor adds {prefix}, not its BOS token alone; "
            "llama.cpp can only add the BOS"
        )
    suffix = rule.backend.encode("a", add_special_tokens=True).ids[len(prefix) + 1 :]
    if suffix != rule.backend.encode("a", add_special_tokens=False).ids[1:]:
        raise ConfigError(f"--gguf: {file}: its post-processor adds tokens after a text")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    writer.add_add_bos_token(bool(prefix))
    writer.add_add_eos_token(False)
    writer.add_eos_token_id(rule.eos_id)
    others = [i for i in rule.stop_ids if i != rule.eos_id]
    if others:  # generation_config.json's second stop id: llama.cpp's end-of-turn
        writer.add_eot_token_id(others[0])
    if rule.pad_id is not None:
        writer.add_pad_token_id(rule.pad_id)
    if rule.chat_template is not None:
        writer.add_chat_template(rule.chat_template)


def _rope(config: Mapping[str, Any], head_dim: int) -> tuple[float, Any]:
    """RoPE base, and Llama 3.1's frequency divisors (None for plain RoPE): transformers' own
    default inverse frequencies over its ``llama3`` ones, what llama.cpp divides by."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"--gguf: rope_type={kind!r}; allowed: 'default', 'llama3'")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * int(config["num_attention_heads"]),
        num_attention_heads=int(config["num_attention_heads"]),
        head_dim=head_dim,
        rope_parameters={**params, "rope_theta": theta},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / (theta ** (_arange(0, head_dim, 2) / head_dim))
    return theta, (plain / scaled.double().numpy()).astype("float32")


def _arange(*args: int) -> Any:
    import numpy as np

    return np.arange(*args, dtype=np.float64)


def _store(writer: Any, name: str, array: Any, ggml_type: str) -> str:
    """One tensor in ``ggml_type`` (1-D tensors and rows not a multiple of 32 for Q8_0: F32);
    returns the type written."""
    import gguf
    import numpy as np

    array = np.ascontiguousarray(array, dtype=np.float32)
    kind = "f32" if array.ndim == 1 or name == "rope_freqs.weight" else ggml_type
    if kind == "q8_0" and array.shape[-1] % 32:
        kind = "f32"
    if kind == "f32":
        writer.add_tensor(name, array)
        return kind
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    return kind


def write_gguf(
    hf_dir: str | os.PathLike, out_file: str | os.PathLike, ggml_type: str = "bf16"
) -> dict[str, Any]:
    """Write the GGUF of the export ``hf_dir`` to ``out_file`` (``<out>.tmp`` renamed at the
    end); returns what was written (architecture, tensors per type, bytes)."""
    import gguf

    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.families import family_for_config, model_config_from_hf

    if ggml_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf {ggml_type!r}: allowed: {', '.join(GGUF_TYPES)}")
    hf_dir, out = Path(hf_dir), Path(out_file)
    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("layer_overrides"):
        raise ConfigError(
            f"--gguf: {hf_dir} has per-layer widths (layer_overrides); llama.cpp builds every "
            "layer of a kind alike, so only budgets with one size per axis are written"
        )
    if config.get("quantization_config"):
        raise ConfigError(f"--gguf: {hf_dir} is quantized; write the GGUF of a BF16 / FP32 export")
    family = family_for_config(config, str(hf_dir / "config.json"))
    model = model_config_from_hf(config, str(hf_dir / "config.json"))
    hf = {k: v.float().numpy() for k, v in family.from_hub(read_hub_tensors(hf_dir)).items()}
    mapped = family.gguf_tensors(config, hf)
    kinds = set(model.layer_types[1::2])
    if kinds == {"mlp", "moe"}:
        raise ConfigError(
            f"--gguf: {hf_dir} mixes dense and expert layers ({model.hybrid_layer_pattern}); "
            "llama.cpp's architectures have one kind"
        )
    arch, head_dim = mapped.arch, model.head_dim
    theta, rope_freqs = _rope(config, head_dim)
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(hf_dir.name)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[ggml_type]  # fmt: skip
    writer.add_file_type(file_type)
    writer.add_context_length(model.max_sequence_length)
    writer.add_embedding_length(model.hidden_size)
    writer.add_block_count(model.num_layers // 2)
    ffn = (
        model.moe_ffn_hidden_size if kinds == {"moe"} and arch == "llama" else model.ffn_hidden_size
    )
    writer.add_feed_forward_length(int(ffn or model.moe_ffn_hidden_size or 0))
    writer.add_head_count(model.num_attention_heads)
    writer.add_head_count_kv(model.query_groups)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(model.layernorm_epsilon)
    writer.add_vocab_size(model.vocab_size)
    if kinds == {"moe"}:
        writer.add_expert_count(model.num_moe_experts)
        writer.add_expert_used_count(model.moe_router_topk)
        if arch != "llama":
            writer.add_expert_feed_forward_length(model.moe_ffn_hidden_size)
    _tokenizer(writer, hf_dir, model.vocab_size)
    written: dict[str, int] = {}
    tensors = dict(mapped.tensors)
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    for name, array in tensors.items():
        kind = _store(writer, name, array, ggml_type)
        written[kind] = written.get(kind, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return {
        "out": str(out),
        "architecture": arch,
        "type": ggml_type,
        "tensors": written,
        "bytes": out.stat().st_size,
        "params": int(sum(math.prod(a.shape) for a in mapped.tensors.values())),
    }
