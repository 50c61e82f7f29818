"""Depth pruning: the plain model with whole blocks of layers removed, and its checkpoint.

Width nesting (``nested.model``) keeps every layer and cuts prefixes of each axis; depth pruning,
the other half of Minitron's search space (num_layers), keeps a subset of the layers unchanged.
The pruned ``HybridModel`` is built from the parent's config with the dropped layers' symbols
taken out of ``hybrid_layer_pattern``, and the kept layers' tensors are renumbered
(``decoder.layers.{i}.``) in order; its forward equals the parent's forward with those layers
skipped (each skipped layer passes its input on unchanged, as ``importance.depth`` measures).

Layers are dropped by *blocks*: a mixer layer (attention ``*`` or Mamba ``M``) with the channel
layers (``-`` MLP, ``E`` MoE) that follow it, so a Llama-shaped ``*-*-...`` stays a sequence of
transformer blocks (what a Hugging Face family exports: HF layer i is Megatron layers 2i, 2i+1).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "DEPTH_PRUNED_KIND",
    "block_scores",
    "blocks",
    "depth_pruned_config",
    "depth_pruned_model",
    "depth_pruned_state_dict",
    "layers_of_blocks",
    "write_depth_pruned",
]

DEPTH_PRUNED_KIND = "depth_pruned"
_MIXERS = ("*", "M")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


def _plain_pattern(model: ModelConfig) -> str:
    if "|" in model.hybrid_layer_pattern:
        raise ConfigError(
            f"model.hybrid_layer_pattern={model.hybrid_layer_pattern!r}: depth pruning needs a "
            "pattern without pipeline-stage separators ('|'); allowed: M, *, -, E"
        )
    return model.hybrid_layer_pattern


def blocks(model: ModelConfig) -> list[tuple[int, ...]]:
    """The 1-based layer numbers of each block, in order (module docstring): a mixer layer and
    the channel layers after it; channel layers before the first mixer form a block of their own."""
    out: list[list[int]] = []
    for number, symbol in enumerate(_plain_pattern(model), start=1):
        if symbol in _MIXERS or not out:
            out.append([number])
        else:
            out[-1].append(number)
    return [tuple(b) for b in out]


def block_scores(model: ModelConfig, layer_scores: Mapping[int, float]) -> list[float]:
    """Per block, the sum of its layers' depth scores (``importance.depth``: the normalized
    logit change when one layer is skipped). A block's own skip is not measured; the sum is the
    first-order estimate of it. Every layer needs a score."""
    missing = [n for n in range(1, model.num_layers + 1) if n not in layer_scores]
    if missing:
        raise ConfigError(
            f"depth scores lack layers {missing[:5]}{'...' if len(missing) > 5 else ''} of "
            f"{model.num_layers}; rerun `elastic-plugin importance --depth`"
        )
    return [sum(float(layer_scores[n]) for n in block) for block in blocks(model)]


def layers_of_blocks(model: ModelConfig, dropped_blocks: Iterable[int]) -> list[int]:
    """The 1-based layer numbers of the given 0-based block indices."""
    spans = blocks(model)
    out: list[int] = []
    for index in sorted(set(dropped_blocks)):
        if not 0 <= index < len(spans):
            raise ConfigError(f"block {index}: allowed 0..{len(spans) - 1}")
        out.extend(spans[index])
    return out


def _checked_drop(model: ModelConfig, drop: Iterable[int]) -> list[int]:
    layers = sorted(set(int(n) for n in drop))
    bad = [n for n in layers if not 1 <= n <= model.num_layers]
    if bad:
        raise ConfigError(f"dropped layers {bad}: allowed 1..{model.num_layers}")
    if len(layers) >= model.num_layers:
        raise ConfigError(f"dropping all {model.num_layers} layers leaves no model")
    return layers


def depth_pruned_config(model: ModelConfig, drop: Iterable[int]) -> ModelConfig:
    """``model`` with the 1-based layers ``drop`` removed from ``hybrid_layer_pattern``."""
    dropped = set(_checked_drop(model, drop))
    pattern = "".join(s for n, s in enumerate(_plain_pattern(model), start=1) if n not in dropped)
    return dataclasses.replace(model, hybrid_layer_pattern=pattern).validate()


def depth_pruned_state_dict(
    state: Mapping[str, Any], num_layers: int, drop: Iterable[int]
) -> dict[str, Any]:
    """The kept layers' entries renumbered in order (0-based keys ``decoder.layers.{i}.``); every
    entry outside the decoder layers is kept as it is."""
    dropped = {int(n) for n in drop}
    new_index: dict[int, int] = {}
    for old in range(num_layers):
        if old + 1 not in dropped:
            new_index[old] = len(new_index)
    out: dict[str, Any] = {}
    for key, value in state.items():
        match = _LAYER_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        old = int(match.group(1))
        if old >= num_layers:
            raise ConfigError(f"state entry {key!r}: layer index {old} beyond {num_layers} layers")
        if old in new_index:
            out[f"decoder.layers.{new_index[old]}.{key[match.end() :]}"] = value
    return out


def depth_pruned_model(model, model_cfg: ModelConfig, drop: Sequence[int]):
    """``(plain pruned model, its config)`` from ``model`` (plain, TP=PP=EP=1), left unchanged.
    Call after Megatron's parallel state is initialized (as for building ``model``)."""
    from elastic_plugin.nested.model import plain_model

    small = depth_pruned_config(model_cfg, drop)
    inner = getattr(model, "module", model)
    state = depth_pruned_state_dict(inner.state_dict(), model_cfg.num_layers, drop)
    return plain_model(small, state, inner), small


def write_depth_pruned(ckpt: str | Path, out: str | Path, drop: Sequence[int]) -> Path:
    """Load ``ckpt`` (one process), drop the 1-based layers ``drop`` and save the pruned model
    as a checkpoint at ``out`` (atomic; the source's metadata with the shortened model, kind
    ``depth_pruned``, the dropped layers and the source). Reused when ``out`` already holds
    the same pruning of the same source. Returns ``out``."""
    import json

    from elastic_plugin.checkpoint.meta import CHECKPOINT_META, read_checkpoint_meta
    from elastic_plugin.models.config import config_from_dict

    out = Path(out)
    meta = read_checkpoint_meta(ckpt)
    cfg = config_from_dict(meta["config"], source=f"{ckpt}/{CHECKPOINT_META}")
    dropped = _checked_drop(cfg.model, drop)
    small = depth_pruned_config(cfg.model, dropped)  # bad input fails before any weight is read
    if (out / CHECKPOINT_META).is_file():
        done = json.loads((out / CHECKPOINT_META).read_text())
        if done.get("dropped_layers") == dropped and done.get("source_ckpt") == str(ckpt):
            return out
    from elastic_plugin.checkpoint.io import build_from_checkpoint, save_checkpoint
    from elastic_plugin.checkpoint.layout import mark_loaded_reordered
    from elastic_plugin.cli_args import start_ranks
    from elastic_plugin.parallel import Layout

    start_ranks(Layout(), one_process="depth pruning runs in one process")
    chunks, _, _ = build_from_checkpoint(ckpt, Layout(), wrap_ddp=False)
    pruned, _ = depth_pruned_model(chunks[0], cfg.model, dropped)
    if meta.get("reordered"):
        mark_loaded_reordered(pruned)  # TP = EP = 1: the order is unchanged, the flag is kept
    config = {**meta["config"], "model": dataclasses.asdict(small)}
    skip = {"files", "reordered"}
    new_meta = {k: v for k, v in meta.items() if k not in skip}
    new_meta.update(
        kind=DEPTH_PRUNED_KIND, config=config, dropped_layers=dropped, source_ckpt=str(ckpt)
    )
    return save_checkpoint([pruned], out, new_meta)
