"""Hugging Face export: a (nested) Megatron ``HybridModel`` as a NemotronH (Nemotron-3) checkpoint.

NemotronH is the Hugging Face layout of Nemotron-H / Nemotron-3 models (``transformers``'
``NemotronHForCausalLM``): ``model.layers.{i}.norm`` + ``model.layers.{i}.mixer`` per layer, the
mixer being a Mamba-2 block, GQA attention (no RoPE), a squared-ReLU MLP or a sigmoid-routed MoE
with a shared expert. Our tiny and Nano configs are that architecture, so the conversion is a
renaming plus two re-layouts: Megatron's fused ``linear_qkv`` (rows interleaved per query group:
the group's query heads, then its K head, then its V head) becomes ``q_proj`` / ``k_proj`` /
``v_proj``, and the per-expert ``local_experts.{e}`` linears become the stacked 3-D
``experts.up_proj`` / ``experts.down_proj``.

Files are the Hub's layout (``checkpoint.hub``): ``backbone.*`` keys, one tensor per routed expert,
sharded safetensors with ``model.safetensors.index.json`` past ``max_shard_bytes``, plus
``generation_config.json`` and the tokenizer files, as the released checkpoints and
``save_pretrained`` have them; in memory (``megatron_to_hf`` and the quantizers) tensors keep
transformers' own names.

Sizes are read from the tensors, not from a config, so a heterogeneous nested model (a different
width per layer) converts the same way. Stock ``transformers`` builds every layer of a kind from
one set of config fields; for per-layer widths ``config.json`` carries ``layer_overrides`` (layer
index -> the fields that differ) and :func:`load_hf_model` builds those layers with them.
Homogeneous exports load with ``AutoModelForCausalLM.from_pretrained`` alone.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from elastic_plugin.checkpoint.hub import (
    DEFAULT_MAX_SHARD_BYTES,
    EXPORT_META,
    HUB_WEIGHTS,
    from_hub,
    hub_name,
    hub_weight_files,
    memory_name,
    read_hub_tensors,
    to_hub,
    write_hub_shards,
)
from elastic_plugin.export.hf_compat import check_hf_compatible
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "check_hf_compatible",
    "megatron_to_hf",
    "hf_to_megatron",
    "hf_config",
    "write_hf_checkpoint",
    "load_hf_model",
    "build_hf_model",
    "export_input_amax",
    "modelopt_quantization_config",
    "read_quant_config",
    "generation_config",
    "tokenizer_token_ids",
    "config_dtype",
    "HF_WEIGHTS",
    "HF_CONFIG",
]

HF_WEIGHTS = HUB_WEIGHTS  # the unsharded file; sharded exports add model.safetensors.index.json
HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
HF_ARCHITECTURE = "NemotronHForCausalLM"
# HF block types, keyed by our layer kinds (Mamba is "linear_attention" in transformers >= 5)
HF_BLOCK = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
PATTERN = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
# Megatron's Mamba mixer applies no dt floor (dt_limit (0, inf)); NemotronH clamps dt at
# time_step_min, whose log it also takes for initialisation: the smallest normal float32 keeps
# the clamp a no-op for every positive dt.
NO_DT_FLOOR = float(torch.finfo(torch.float32).tiny)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # config.json


# ------------------------------------------------------------------------------ renaming
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


def _split_qkv(
    qkv: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = qkv.shape[0] // (groups * head_dim)
    blocks = qkv.reshape(groups, per_group, head_dim, -1)
    q = blocks[:, : per_group - 2].reshape(-1, qkv.shape[-1])
    return q, blocks[:, -2].reshape(-1, qkv.shape[-1]), blocks[:, -1].reshape(-1, qkv.shape[-1])


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, head_dim: int
) -> torch.Tensor:
    width = q.shape[-1]
    blocks = torch.cat(
        [
            q.reshape(groups, -1, head_dim, width),
            k.reshape(groups, 1, head_dim, width),
            v.reshape(groups, 1, head_dim, width),
        ],
        dim=1,
    )
    return blocks.reshape(-1, width)


def _layer_pairs(kind: str, src: str, dst: str) -> list[tuple[str, str]]:
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


_GLOBAL = (
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
    check_hf_compatible(model)
    left = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    out: dict[str, torch.Tensor] = {}

    def move(src: str, dst: str, optional: bool = False) -> None:
        if src in left:
            out[dst] = left.pop(src).detach().contiguous()
        elif not optional:
            raise ConfigError(f"--format hf: the model state has no {src!r}")

    for src, dst in _GLOBAL:
        move(
            src,
            dst,
            optional=dst == "lm_head.weight" and not model.untie_embeddings_and_output_weights,
        )
    for i, kind in enumerate(model.layer_types):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for a, b in _layer_pairs(kind, src, dst):
            move(
                a,
                b,
                optional=b.endswith(("e_score_correction_bias", "conv1d.bias"))
                or ".shared_experts." in b,
            )
        if kind == "attention":
            q, k, v = _split_qkv(
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
    left = dict(hf)
    out: dict[str, torch.Tensor] = {}
    for src, dst in _GLOBAL:
        if dst in left:
            out[src] = left.pop(dst)
    for i, kind in enumerate(model.layer_types):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for a, b in _layer_pairs(kind, src, dst):
            if b in left:
                out[a] = left.pop(b)
        if kind == "attention":
            q, k, v = (left.pop(f"{dst}mixer.{p}_proj.weight") for p in "qkv")
            out[src + "self_attention.linear_qkv.weight"] = _fuse_qkv(
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


# ------------------------------------------------------------------------------ config.json
def _layer_fields(
    kind: str, hf: Mapping[str, torch.Tensor], i: int, head_dim: int
) -> dict[str, int]:
    """The NemotronH config fields of layer ``i``, read off its tensors."""
    p = f"model.layers.{i}.mixer."
    if kind == "mamba":
        heads = hf[p + "A_log"].numel()
        return {
            "mamba_num_heads": heads,
            "mamba_head_dim": hf[p + "out_proj.weight"].shape[1] // heads,
        }
    if kind == "attention":
        return {"num_attention_heads": hf[p + "q_proj.weight"].shape[0] // head_dim}
    if kind == "mlp":
        return {"intermediate_size": hf[p + "up_proj.weight"].shape[0]}
    up = hf[p + "experts.up_proj"]
    shared = hf.get(p + "shared_experts.up_proj.weight")
    return {
        "n_routed_experts": up.shape[0],
        "moe_intermediate_size": up.shape[1],
        "moe_shared_expert_intermediate_size": 0 if shared is None else shared.shape[0],
    }


def hf_config(
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    dtype: str = "bf16",
    token_ids: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """``config.json`` for the converted tensors. Global fields take the first layer of each
    kind; layers that differ go to ``layer_overrides`` (only heterogeneous models have any)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: allowed: {', '.join(_DTYPES)}")
    vocab, hidden = hf["model.embeddings.weight"].shape
    per_layer = [
        _layer_fields(kind, hf, i, model.head_dim) for i, kind in enumerate(model.layer_types)
    ]
    defaults: dict[str, int] = {}
    for fields in per_layer:
        for key, value in fields.items():
            defaults.setdefault(key, value)
    overrides = {
        str(i): diff
        for i, fields in enumerate(per_layer)
        if (diff := {k: v for k, v in fields.items() if defaults[k] != v})
    }
    blocks = [HF_BLOCK[kind] for kind in model.layer_types]
    ids = dict(token_ids or {})
    config = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": "nemotron_h",
        "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "layers_block_type": blocks,
        "num_hidden_layers": len(blocks),
        "hybrid_override_pattern": "".join(PATTERN[k] for k in model.layer_types),
        "num_attention_heads": defaults.get(
            "num_attention_heads", max(model.num_attention_heads, 1)
        ),
        "num_key_value_heads": model.query_groups if model.count("attention") else 1,
        "head_dim": model.head_dim,
        "attention_bias": False,
        "intermediate_size": defaults.get("intermediate_size", model.ffn_hidden_size or 1),
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "use_bias": False,
        "mamba_num_heads": defaults.get("mamba_num_heads", model.mamba_num_heads or 1),
        "mamba_head_dim": defaults.get("mamba_head_dim", model.mamba_head_dim),
        "n_groups": model.mamba_num_groups,
        "ssm_state_size": model.mamba_state_dim,
        "conv_kernel": model.mamba_conv_kernel,
        "chunk_size": model.mamba_chunk_size,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "time_step_min": NO_DT_FLOOR,
        "n_routed_experts": defaults.get("n_routed_experts", max(model.num_moe_experts, 2)),
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": defaults.get(
            "moe_intermediate_size", model.moe_ffn_hidden_size or 1
        ),
        "moe_shared_expert_intermediate_size": defaults.get(
            "moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size
        ),
        "n_shared_experts": 1,
        "norm_topk_prob": model.moe_router_topk > 1,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "n_group": 1,
        "topk_group": 1,
        "layer_norm_epsilon": model.layernorm_epsilon,
        "residual_in_fp32": False,
        "max_position_embeddings": model.max_sequence_length,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "pad_token_id": ids.get("pad"),
        "bos_token_id": ids.get("bos"),
        "eos_token_id": ids.get("eos"),
    }
    if overrides:
        config["layer_overrides"] = overrides
    return config


# ------------------------------------------------------------------------------ files
def write_hf_checkpoint(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    dtype: str = "bf16",
    tokenizer_file: str | Path | None = None,
    quant_config: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> int:
    """Write the weights in the Hub's layout (floating tensors cast to ``dtype``; quantized and
    integer tensors as they are; sharded past ``max_shard_bytes``), ``config.json``,
    ``generation_config.json``, optional ``hf_quant_config.json``, the tokenizer and JSON
    extras into an existing directory. An ``export_meta.json`` extra is written last, with the
    size and SHA-256 of every other file (``checkpoint.hub.verify_export_files`` checks them
    whenever the directory is read). Returns the bytes written."""
    out = Path(out_dir)
    target = _DTYPES[dtype]
    cast = {
        k: (
            v.to(target)
            if v.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            and not _keep_fp32(k)
            else v
        )
        .detach()
        .contiguous()
        .cpu()
        for k, v in tensors.items()
    }
    write_hub_shards(out, to_hub(cast), max_shard_bytes)
    config = dict(config)
    if quant_config is not None:  # as ModelOpt's unified export: both files, Hub module names
        quant_config = _renamed_excludes(quant_config, hub_name)
        (out / HF_QUANT_CONFIG).write_text(json.dumps(quant_config, indent=2) + "\n")
        config["quantization_config"] = modelopt_quantization_config(quant_config)
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (out / HF_GENERATION_CONFIG).write_text(json.dumps(generation_config(config), indent=2) + "\n")
    if tokenizer_file is not None and Path(tokenizer_file).is_file():
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "pad_token": "<pad>",
                    "eos_token": "<eod>",
                    "unk_token": "<unk>",
                },
                indent=2,
            )
            + "\n"
        )
    extras = dict(extra_files or {})
    export_meta = extras.pop(EXPORT_META, None)
    for name, payload in extras.items():
        (out / name).write_text(json.dumps(payload, indent=2) + "\n")
    if export_meta is not None:  # last: the digests cover every other file, as verify reads them
        from elastic_plugin.checkpoint.integrity import FILES_KEY, file_digests

        digests = file_digests(out, exclude=(EXPORT_META,))
        payload = {**export_meta, FILES_KEY: digests}
        (out / EXPORT_META).write_text(json.dumps(payload, indent=2) + "\n")
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def config_dtype(config: Mapping[str, Any]) -> str:
    """Our dtype name ("bf16", "fp16", "fp32") of a ``config.json``'s ``torch_dtype`` (bf16 when
    it names none of them)."""
    names = {v: k for k, v in _TORCH_DTYPE_NAMES.items()}
    return names.get(str(config.get("torch_dtype")), "bf16")


def tokenizer_token_ids(tokenizer_file: str | Path | None) -> dict[str, int]:
    """pad / eos ids of one of our tokenizers (fixed special tokens), for ``config.json``; {}
    when there is no tokenizer file."""
    if not tokenizer_file or not Path(tokenizer_file).is_file():
        return {}
    vocab = json.loads(Path(tokenizer_file).read_text()).get("model", {}).get("vocab", {})
    return {key: vocab[tok] for key, tok in (("pad", "<pad>"), ("eos", "<eod>")) if tok in vocab}


def generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` as ``save_pretrained`` derives it from the model config: the
    special token ids (those the tokenizer has)."""
    import transformers

    ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "_from_model_config": True,
        **{k: v for k, v in ids.items() if v is not None},
        "transformers_version": transformers.__version__,
    }


def _keep_fp32(name: str) -> bool:
    """Tensors NemotronH keeps in float32 whatever the model dtype: the router and its bias,
    and quantization scales."""
    return name.endswith(
        ("gate.weight", "e_score_correction_bias", "weight_scale", "weight_scale_2", "input_scale")
    )


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """``NemotronHForCausalLM`` from an export (any of the Hub's file forms), per-layer widths
    included (``layer_overrides``). A quantized export is dequantized (its weights are exactly
    the values the quantized model multiplies with), which is how its quality is measured on a
    CPU."""
    path = Path(path)
    if not (path / HF_CONFIG).is_file():
        raise ConfigError(f"{path}: not a complete Hugging Face export (needs {HF_CONFIG})")
    hub_weight_files(path)  # the weights must be there too, before anything is built
    state = from_hub(read_hub_tensors(path))
    if (path / HF_QUANT_CONFIG).is_file():  # FP8 / NVFP4: the weights it computes with
        from elastic_plugin.export.quantize import dequantize_state_dict

        state = dequantize_state_dict(state, json.loads((path / HF_QUANT_CONFIG).read_text()))
    return build_hf_model(json.loads((path / HF_CONFIG).read_text()), state, dtype, str(path))


def _renamed_excludes(quant_config: Mapping[str, Any], rename) -> dict[str, Any]:
    """``quant_config`` with its ``exclude_modules`` renamed (Hub <-> in-memory names)."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in quant_config.items()}
    quantization = out.get("quantization")
    if isinstance(quantization, dict) and "exclude_modules" in quantization:
        quantization["exclude_modules"] = [rename(m) for m in quantization["exclude_modules"]]
    return out


def modelopt_quantization_config(quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for an ``hf_quant_config.json`` dict, as
    ModelOpt's unified export writes it (``quant_method: modelopt``, compressed-tensors style
    ``config_groups``; what transformers and vLLM detect a ModelOpt checkpoint by). Tested equal
    to ModelOpt's own ``convert_hf_quant_config_format``."""
    details = quant_config.get("quantization") or {}
    algo = details.get("quant_algo")
    if algo == "FP8":
        group: dict[str, Any] = {
            "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
        }
    elif algo == "NVFP4":
        size = details.get("group_size", 16)
        group = {
            "input_activations": {
                "dynamic": False,
                "num_bits": 4,
                "type": "float",
                "group_size": size,
            },
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": size},
        }
    else:
        raise ConfigError(f"hf_quant_config.json quant_algo {algo!r}: allowed: FP8, NVFP4")
    out: dict[str, Any] = {
        "config_groups": {"group_0": {**group, "targets": ["Linear"]}},
        "ignore": list(details.get("exclude_modules") or []),
        "quant_algo": algo,
    }
    kv_cache = details.get("kv_cache_quant_algo")
    if kv_cache:
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        out["kv_cache_scheme"] = fp8 if kv_cache == "FP8" else kv_cache
    if quant_config.get("producer"):
        out["producer"] = dict(quant_config["producer"])
    out["quant_method"] = "modelopt"
    return out


def read_quant_config(path: str | Path) -> tuple[str | None, dict[str, Any] | None]:
    """``("fp8" / "nvfp4", hf_quant_config.json)`` of a quantized export (``exclude_modules``
    in transformers' in-memory names, as the tensors are held), ``(None, None)`` for an
    unquantized one; a ConfigError for a quant_algo this package does not write."""
    from elastic_plugin.export.quantize import QUANT_ALGO

    file = Path(path) / HF_QUANT_CONFIG
    if not file.is_file():
        return None, None
    quant_config = _renamed_excludes(json.loads(file.read_text()), memory_name)
    algo = (quant_config.get("quantization") or {}).get("quant_algo")
    fmt = {v: k for k, v in QUANT_ALGO.items()}.get(str(algo))
    if fmt is None:
        raise ConfigError(
            f"{file}: quant_algo {algo!r} is not one of {', '.join(QUANT_ALGO.values())}"
        )
    return fmt, quant_config


def export_input_amax(path: str | Path) -> tuple[str | None, dict[str, float]]:
    """``(format, calibrated input |x|max per module)`` of a quantized export with static
    activation scales; ``(format, {})`` for a weight-only one, ``(None, {})`` unquantized."""
    from elastic_plugin.export.quantize import stored_input_amax

    fmt, _ = read_quant_config(path)
    if fmt is None:
        return None, {}
    scales = {k: v for k, v in read_hub_tensors(path).items() if k.endswith(".input_scale")}
    return fmt, stored_input_amax(from_hub(scales), fmt)


def build_hf_model(
    config_json: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    source: str = "the model",
):
    """``NemotronHForCausalLM`` of a ``config.json`` dict holding ``state`` (transformers'
    names): each layer in ``layer_overrides`` is built from a copy of the config with its own
    fields, since stock transformers builds every layer of a kind alike."""
    import copy

    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    raw = dict(config_json)
    overrides = raw.pop("layer_overrides", {})
    config = NemotronHConfig(
        **{
            k: v
            for k, v in raw.items()
            if k not in ("architectures", "model_type", "torch_dtype", "quantization_config")
        }
    )
    model = NemotronHForCausalLM(config)
    for index, fields in overrides.items():
        layer_config = copy.deepcopy(config)
        for key, value in fields.items():
            setattr(layer_config, key, value)
        model.model.layers[int(index)] = NemotronHBlock(layer_config, int(index))
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    if unexpected or [
        k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings
    ]:
        raise ConfigError(
            f"{source}: weights do not match config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    # transformers wraps ``to`` with functools.wraps(Module.to): its type loses the self binding
    return model.to(dtype).eval()  # type: ignore[arg-type]
