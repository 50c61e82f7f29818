"""Global importance scores: reduction of every rank's local statistics, saving, rankings.

Reduction (so the ranking is the same whatever the layout):
- summed over data-parallel ranks (experts: over the expert-data-parallel group);
- sharded units (heads, FFN neurons, Mamba heads) gathered over TP into one global vector in
  Megatron's canonical (contiguous-shard) order; experts gathered over EP the same way;
- embedding channels summed over every norm, TP ranks (under sequence parallel each saw a
  different part of the sequence) and PP stages; per-layer tables gathered over PP.

Saved as safetensors plus JSON (``checkpoint.tensor_file``): a scores file from elsewhere is
data; reading it never runs code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_plugin.checkpoint.tensor_file import (
    layer_key,
    layers_from,
    read_tensor_file,
    write_tensor_file,
)
from elastic_plugin.importance.hooks import EMBEDDING_VARIANTS, SHARDED_VARIANTS, LocalStats
from elastic_plugin.importance.magnitude import WEIGHT_KEYS
from elastic_plugin.models.config import ConfigError

SHARDED_OVER_TP = ("ffn", "shared_ffn", "attention_heads", "mamba", "mamba_out")
# the per-layer fields of ImportanceScores, in their order
LAYER_AXES = (
    "ffn",
    "shared_ffn",
    "attention_heads",
    "mamba",
    "mamba_out",
    "experts",
    "expert_tokens",
)
FORMAT_VERSION = 1
SCORES_FORMAT = "importance_scores"
_REGENERATE = "; write it again with `elastic-plugin importance --out FILE`"


@dataclass
class ImportanceScores:
    """Per-axis scores in canonical order; per-layer axes keyed by global layer number (1-based)."""

    embedding: torch.Tensor | None = None
    ffn: dict[int, torch.Tensor] = field(default_factory=dict)
    shared_ffn: dict[int, torch.Tensor] = field(default_factory=dict)
    attention_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    mamba: dict[int, torch.Tensor] = field(default_factory=dict)  # [heads, head_dim] sum of s^2
    mamba_out: dict[int, torch.Tensor] = field(default_factory=dict)  # same, of out_proj's input
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # REAP
    expert_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    depth: dict[int, float] = field(default_factory=dict)  # normalized logit MSE (optional)
    # alternative statistics (hooks.VARIANT_KEYS -> layer -> scores; the embedding's at key 0),
    # reduced like their axis; files written before they existed load with none
    variants: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived views
    def _mamba_stats(self, layer: int, source: str) -> torch.Tensor:
        from elastic_plugin.importance.hooks import MAMBA_SOURCES

        if source not in MAMBA_SOURCES:
            raise ValueError(f"mamba source {source!r}; allowed: {', '.join(MAMBA_SOURCES)}")
        return getattr(self, MAMBA_SOURCES[source])[layer]

    def mamba_channel_scores(self, layer: int, source: str = "out_proj_input") -> torch.Tensor:
        """``||s_{:,d}||_2`` per head channel d (over tokens and heads); ``source`` picks s."""
        return self._mamba_stats(layer, source).sum(0).sqrt()

    def mamba_head_scores(
        self, layer: int, top_channels: int | None = None, source: str = "out_proj_input"
    ) -> torch.Tensor:
        """Head norms over the ``top_channels`` most important channels (all by default)."""
        acc = self._mamba_stats(layer, source)
        if top_channels is not None:
            keep = torch.argsort(self.mamba_channel_scores(layer, source), descending=True)[
                :top_channels
            ]
            acc = acc[:, keep]
        return acc.sum(1).sqrt()

    def axes(self) -> list[str]:
        present = [
            name
            for name in ("ffn", "shared_ffn", "attention_heads", "mamba", "experts")
            if getattr(self, name)
        ]
        depth = ["depth"] if self.depth else []
        return (["embedding"] if self.embedding is not None else []) + present + depth

    # ----------------------------------------------------------------------- storage
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "embedding": self.embedding,
            **{axis: getattr(self, axis) for axis in LAYER_AXES},
            "depth": self.depth,
            "variants": self.variants,
            "tokens": self.tokens,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> Path:
        """Atomic write (temp file + rename) of a safetensors file (``checkpoint.tensor_file``):
        tensors by name (``ffn/3``, ``variants/<key>/<layer>``), the rest as JSON. Whatever the
        name (``importance.pt`` as before), reading it never runs code."""
        tensors: dict[str, torch.Tensor] = {}
        if self.embedding is not None:
            tensors["embedding"] = self.embedding
        for axis in LAYER_AXES:
            for layer, value in getattr(self, axis).items():
                tensors[layer_key(axis, layer)] = value
        for key, layers in self.variants.items():
            for layer, value in layers.items():
                tensors[layer_key(f"variants/{key}", layer)] = value
        info = {
            "depth": {str(k): float(v) for k, v in self.depth.items()},
            "tokens": int(self.tokens),
            "meta": self.meta,
        }
        return write_tensor_file(path, tensors, info, SCORES_FORMAT, FORMAT_VERSION)

    @classmethod
    def load(cls, path: str | Path, what: str = "importance scores") -> ImportanceScores:
        """Read a file :meth:`save` wrote; one of the old ``torch.save`` format loads through
        the allowlist check and ``torch.load(weights_only=True)``. A ConfigError names the file
        for anything else (regenerate it with ``elastic-plugin importance``)."""
        where = f"{what} {path}"
        found = read_tensor_file(path, SCORES_FORMAT, FORMAT_VERSION, where)
        if found.legacy is not None:
            return cls._from_legacy(found.legacy, where)
        tensors, info = found.tensors, found.info
        known = {"embedding"} | {n.rpartition("/")[0] for n in tensors if "/" in n}
        unknown = sorted(
            k for k in known - {"embedding", *LAYER_AXES} if not k.startswith("variants/")
        )
        if unknown:
            raise ConfigError(f"{where}: unknown score tensors {unknown[:5]}{_REGENERATE}")
        depth, tokens, meta = info.get("depth", {}), info.get("tokens", 0), info.get("meta", {})
        if not (
            isinstance(depth, dict)
            and all(k.lstrip("-").isdigit() and _is_number(v) for k, v in depth.items())
            and isinstance(tokens, int)
            and isinstance(meta, dict)
        ):
            raise ConfigError(f"{where}: depth, tokens or meta has the wrong type{_REGENERATE}")
        variants: dict[str, dict[int, torch.Tensor]] = {}
        for name in sorted(k for k in known if k.startswith("variants/")):
            variants[name.removeprefix("variants/")] = layers_from(tensors, name, where)
        return cls(
            embedding=tensors.get("embedding"),
            **{axis: layers_from(tensors, axis, where) for axis in LAYER_AXES},
            depth={int(k): float(v) for k, v in depth.items()},
            variants=variants,
            tokens=tokens,
            meta=meta,
        )

    @classmethod
    def _from_legacy(cls, raw: Any, where: str) -> ImportanceScores:
        """The dict ``torch.save`` wrote before, each field checked (tensors, layer dicts)."""
        if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
            version = raw.get("format_version") if isinstance(raw, dict) else type(raw).__name__
            raise ConfigError(f"{where}: unsupported importance format {version}{_REGENERATE}")
        fields = {k: v for k, v in raw.items() if k != "format_version"}
        allowed = {"embedding", *LAYER_AXES, "depth", "variants", "tokens", "meta"}
        if set(fields) - allowed:
            raise ConfigError(
                f"{where}: unknown fields {sorted(set(fields) - allowed)[:5]}{_REGENERATE}"
            )

        def layers(value: Any) -> bool:
            return isinstance(value, dict) and all(
                isinstance(k, int) and isinstance(v, torch.Tensor) for k, v in value.items()
            )

        ok = (
            (fields.get("embedding") is None or isinstance(fields["embedding"], torch.Tensor))
            and all(layers(fields.get(axis, {})) for axis in LAYER_AXES)
            and isinstance(fields.get("variants", {}), dict)
            and all(layers(v) for v in fields.get("variants", {}).values())
            and isinstance(fields.get("depth", {}), dict)
            and all(_is_number(v) for v in fields.get("depth", {}).values())
            and isinstance(fields.get("tokens", 0), int)
            and isinstance(fields.get("meta", {}), dict)
        )
        if not ok:
            raise ConfigError(f"{where}: a field has the wrong type{_REGENERATE}")
        return cls(**fields)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------- reduction
def _sum_over(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
    return tensor


def _concat_over(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def reduce_local_stats(
    stats: LocalStats, hidden_size: int, sequence_parallel: bool, meta: dict[str, Any] | None = None
) -> ImportanceScores:
    """Collective: every rank of the job calls it and gets the same global scores."""
    from megatron.core import parallel_state as ps

    initialized = dist.is_initialized() and ps.model_parallel_is_initialized()
    dp = ps.get_data_parallel_group(with_context_parallel=True) if initialized else None
    tp = ps.get_tensor_model_parallel_group() if initialized else None
    pp = ps.get_pipeline_model_parallel_group() if initialized else None
    ep = ps.get_expert_model_parallel_group() if initialized else None
    edp = ps.get_expert_data_parallel_group() if initialized else None

    scores = ImportanceScores(meta=dict(meta or {}))

    def residual_stream(key: str) -> torch.Tensor:
        value = stats.sums.get(key, {}).get(0, torch.zeros(hidden_size, dtype=torch.float64))
        value = _sum_over(value, dp)
        if sequence_parallel:
            value = _sum_over(value, tp)
        return _sum_over(value, pp)

    scores.embedding = residual_stream("embedding")
    scores.variants = {key: {0: residual_stream(key)} for key in EMBEDDING_VARIANTS}

    local: dict[str, dict[int, torch.Tensor]] = {}
    for axis in SHARDED_OVER_TP + SHARDED_VARIANTS:
        local[axis] = {
            layer: _concat_over(_sum_over(value, dp), tp)
            for layer, value in sorted(stats.sums.get(axis, {}).items())
        }
    # weights are the same on every DP rank: joined over the model-parallel groups only
    for key in WEIGHT_KEYS:
        layers = stats.sums.get(key, {})
        if key == "embedding_weight":  # vocab rows sharded over TP; on the first PP stage only
            value = layers.get(0, torch.zeros(hidden_size, dtype=torch.float64))
            scores.variants[key] = {0: _sum_over(_sum_over(value, tp), pp)}
        elif key == "experts_weight":
            etp = ps.get_expert_tensor_parallel_group() if initialized else None
            local[key] = {n: _concat_over(_sum_over(v, etp), ep) for n, v in sorted(layers.items())}
        else:
            local[key] = {n: _concat_over(v, tp) for n, v in sorted(layers.items())}
    for layer, value in sorted(stats.sums.get("experts", {}).items()):
        numerator = _concat_over(_sum_over(value, edp), ep)
        count = _concat_over(_sum_over(stats.expert_tokens[layer], edp), ep)
        local.setdefault("experts", {})[layer] = numerator / count.clamp(min=1)
        local.setdefault("expert_tokens", {})[layer] = count
    tokens = _sum_over(torch.tensor([float(stats.tokens_seen)], dtype=torch.float64), dp)

    gathered: list[Any] = [local]  # every stage's dict (all_gather_object fills the list)
    if pp is not None and dist.get_world_size(pp) > 1:
        gathered = [None] * dist.get_world_size(pp)
        dist.all_gather_object(gathered, local, group=pp)
    for part in gathered:
        for axis, layers in part.items():
            if axis in SHARDED_VARIANTS or axis in WEIGHT_KEYS:
                scores.variants.setdefault(axis, {}).update(layers)
            else:
                getattr(scores, axis).update(layers)
    scores.tokens = int(tokens.item())
    return scores


def rankings_agree(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Same descending order, allowing swaps only between scores equal within ``rtol``."""
    order_a = torch.argsort(a, descending=True, stable=True)
    order_b = torch.argsort(b, descending=True, stable=True)
    if torch.equal(order_a, order_b):
        return True
    differ = order_a != order_b
    sa, sb = a[order_a][differ], a[order_b][differ]
    return bool(torch.allclose(sa, sb, rtol=rtol, atol=0.0))


def plot_scores(scores: ImportanceScores, path: str | Path) -> Path:
    """Sorted, normalized scores per axis (one line per layer): how peaked each ranking is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, dict[int, torch.Tensor]]] = []
    if scores.embedding is not None:
        panels.append(("embedding channels", {0: scores.embedding}))
    panels += [
        (title, getattr(scores, axis))
        for axis, title in (
            ("ffn", "FFN neurons"),
            ("shared_ffn", "shared-expert neurons"),
            ("attention_heads", "attention heads"),
            ("experts", "experts (REAP)"),
        )
        if getattr(scores, axis)
    ]
    if scores.mamba:
        panels.append(("Mamba heads", {k: scores.mamba_head_scores(k) for k in scores.mamba}))
        panels.append(
            ("Mamba head channels", {k: scores.mamba_channel_scores(k) for k in scores.mamba})
        )
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=100, squeeze=False)
    for ax, (title, layers) in zip(axes.flat, panels):
        for layer, values in sorted(layers.items()):
            v = torch.sort(values.double(), descending=True).values
            ax.plot(
                (v / v.max().clamp(min=1e-30)).numpy(),
                label=f"layer {layer}" if layer else "all norms",
            )
        ax.set_title(title)
        ax.set_xlabel("rank")
        ax.set_ylabel("score / max")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"importance over {scores.tokens} calibration tokens")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
