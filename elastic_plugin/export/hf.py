"""Hugging Face export: a (nested) Megatron ``HybridModel`` as a checkpoint of its family.

Which family (Nemotron-H, Llama, Qwen, Mixtral ...) and how its tensors are named, laid out and
described in ``config.json`` is ``elastic_plugin/families/``: this module asks the registry
(``families.family_for_model`` for our models, ``families.family_for_config`` for a directory)
and keeps what every family shares: the file writing (the Hub's sharded safetensors, ``config.json``,
``generation_config.json``, the tokenizer, ``export_meta.json`` with digests), quantization
configs in ModelOpt's layout, and loading a directory back into transformers.

In memory (``megatron_to_hf``, the quantizers, ``build_hf_model``) tensors keep transformers'
own names; on disk they carry the family's Hub names (``Family.to_hub`` / ``from_hub``).
Homogeneous exports load with ``AutoModelForCausalLM.from_pretrained`` alone; per-layer widths
are the family's business (Nemotron-H writes ``layer_overrides``).
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
    hub_weight_files,
    read_hub_tensors,
    write_hub_shards,
)
from elastic_plugin.export.hf_compat import check_hf_compatible
from elastic_plugin.families import family_for_config, family_for_model
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
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # config.json


# ------------------------------------------------------------------------------ renaming
def megatron_to_hf(
    state: Mapping[str, torch.Tensor], model: ModelConfig
) -> dict[str, torch.Tensor]:
    """A TP=1 Megatron ``HybridModel`` state dict (plain or sliced, homogeneous or per layer) in
    its family's transformers names and layouts; anything without a counterpart is an error."""
    return family_for_model(model).megatron_to_hf(state, model)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`megatron_to_hf` (used to load exported, e.g. dequantized, weights
    back into our Megatron model and measure them)."""
    return family_for_model(model).hf_to_megatron(hf, model)


# ------------------------------------------------------------------------------ config.json
def hf_config(
    hf: Mapping[str, torch.Tensor],
    model: ModelConfig,
    dtype: str = "bf16",
    token_ids: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """``config.json`` for the converted tensors, written by the model's family (sizes read off
    the tensors, so nested and per-layer models describe themselves)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: allowed: {', '.join(_DTYPES)}")
    family = family_for_model(model)
    return family.hf_config(hf, model, _TORCH_DTYPE_NAMES[dtype], dict(token_ids or {}))


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
    family = family_for_config(config, HF_CONFIG)
    cast = {
        k: (
            v.to(target)
            if v.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            and not family.keep_fp32(k)
            else v
        )
        .detach()
        .contiguous()
        .cpu()
        for k, v in tensors.items()
    }
    write_hub_shards(out, family.to_hub(cast), max_shard_bytes)
    config = dict(config)
    if quant_config is not None:  # as ModelOpt's unified export: both files, Hub module names
        quant_config = _renamed_excludes(quant_config, family.hub_name)
        (out / HF_QUANT_CONFIG).write_text(json.dumps(quant_config, indent=2) + "\n")
        config["quantization_config"] = modelopt_quantization_config(quant_config)
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer_files(out, config, tokenizer_file)
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
    """pad / bos / eos ids for ``config.json`` by the tokenizer's own files
    (``data/token_rule.py``: its BOS token, its EOS, its pad); {} when there is no tokenizer."""
    if not tokenizer_file or not Path(tokenizer_file).is_file():
        return {}
    from elastic_plugin.data.token_rule import read_token_rule

    rule = read_token_rule(tokenizer_file)
    bos = rule.special_tokens.get("bos_token")
    ids = {
        "pad": rule.pad_id,
        "bos": rule.backend.token_to_id(bos) if bos is not None else None,
        "eos": rule.eos_id,
    }
    return {k: v for k, v in ids.items() if v is not None}


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


def _write_tokenizer_files(
    out: Path, config: Mapping[str, Any], tokenizer_file: str | Path | None
) -> None:
    """The model's own tokenizer files beside the weights (``data/token_rule.TOKENIZER_FILES``
    next to ``tokenizer_file``: its config, chat template and generation config, so transformers
    tokenizes and stops as the source model did), and ``generation_config.json`` derived from
    ``config`` where the tokenizer brings none. A bare ``tokenizer.json`` gets a
    ``tokenizer_config.json`` naming the EOS / pad the rule found for it."""
    from elastic_plugin.data.token_rule import TOKENIZER_FILES, read_token_rule

    source = Path(tokenizer_file) if tokenizer_file is not None else None
    if source is not None and source.is_file():
        for name in TOKENIZER_FILES:
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, out / name)
        if not (out / "tokenizer_config.json").is_file():
            rule = read_token_rule(source)
            named = {"eos_token": rule.eos_token, "pad_token": rule.pad_token}
            payload = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **{k: v for k, v in named.items() if v is not None},
            }
            (out / "tokenizer_config.json").write_text(json.dumps(payload, indent=2) + "\n")
    if not (out / HF_GENERATION_CONFIG).is_file():
        payload = generation_config(config)
        (out / HF_GENERATION_CONFIG).write_text(json.dumps(payload, indent=2) + "\n")


def _read_config(path: Path) -> dict[str, Any]:
    file = path / HF_CONFIG
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: the top level must be a JSON object")
    return raw


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers model of an export (any of the Hub's file forms, any supported family;
    Nemotron-H's per-layer widths included). A quantized export is dequantized (its weights are exactly
    the values the quantized model multiplies with), which is how its quality is measured on a
    CPU."""
    path = Path(path)
    if not (path / HF_CONFIG).is_file():
        raise ConfigError(f"{path}: not a complete Hugging Face export (needs {HF_CONFIG})")
    config = _read_config(path)
    family = family_for_config(config, str(path / HF_CONFIG))
    hub_weight_files(path)  # the weights must be there too, before anything is built
    state = family.from_hub(read_hub_tensors(path))
    if (path / HF_QUANT_CONFIG).is_file():  # FP8 / NVFP4: the weights it computes with
        from elastic_plugin.export.quantize import dequantize_state_dict

        state = dequantize_state_dict(state, json.loads((path / HF_QUANT_CONFIG).read_text()))
    return family.build_hf_model(config, state, dtype, str(path))


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
    family = family_for_config(_read_config(Path(path)), str(Path(path) / HF_CONFIG))
    quant_config = _renamed_excludes(json.loads(file.read_text()), family.memory_name)
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
    family = family_for_config(_read_config(Path(path)), str(Path(path) / HF_CONFIG))
    scales = {k: v for k, v in read_hub_tensors(path).items() if k.endswith(".input_scale")}
    return fmt, stored_input_amax(family.from_hub(scales), fmt)


def build_hf_model(
    config_json: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    source: str = "the model",
):
    """The transformers model of a ``config.json`` dict holding ``state`` (transformers'
    names), built by the family ``config_json`` names."""
    family = family_for_config(config_json, source)
    return family.build_hf_model(config_json, state, dtype, source)
