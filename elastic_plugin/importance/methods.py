"""Which statistic ranks each width axis: ``--method axis=stat`` and the measured defaults.

Every statistic is read from an ``ImportanceScores`` file (activations collected once, reduced
the same way under any layout), so choosing another one needs no second calibration pass.
``PUBLISHED`` keeps the paper's statistic for each axis selectable; ``DEFAULTS`` is the one that
pruned best in ``bench/bench_importance_ablation.py`` (docs/importance.md, "The ablation").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from elastic_plugin.importance.scores import ImportanceScores

Layers = dict[int, torch.Tensor]


def _variant(key: str) -> Callable[[ImportanceScores], Layers]:
    def read(scores: ImportanceScores) -> Layers:
        if key not in scores.variants:
            raise ValueError(
                f"the scores file has no {key!r} statistic (written before it existed); "
                "collect the scores again with `elastic-plugin importance`"
            )
        return dict(scores.variants[key])

    return read


def _embedding(scores: ImportanceScores) -> Layers:
    return {} if scores.embedding is None else {0: scores.embedding}


def _mamba(source: str, per: str) -> Callable[[ImportanceScores], Layers]:
    def read(scores: ImportanceScores) -> Layers:
        if per == "heads":
            return {k: scores.mamba_head_scores(k, source=source) for k in scores.mamba}
        return {k: scores.mamba_channel_scores(k, source) for k in scores.mamba}

    return read


def _mamba_weight(per: str) -> Callable[[ImportanceScores], Layers]:
    def read(scores: ImportanceScores) -> Layers:
        layers = _variant("mamba_weight")(scores)
        return {k: v.sum(1 if per == "heads" else 0) for k, v in layers.items()}

    return read


def _experts_sum(scores: ImportanceScores) -> Layers:
    """REAP's numerator: summed over the tokens routed to an expert (mean x frequency)."""
    return {k: v * scores.expert_tokens[k] for k, v in scores.experts.items()}


# axis -> statistic -> scores per layer (higher = more important)
STATISTICS: dict[str, dict[str, Callable[[ImportanceScores], Layers]]] = {
    "embedding": {
        "norm_abs": _embedding,  # sum |norm(x)| over every norm (published)
        "norm_l2": _variant("embedding_sq"),  # sum norm(x)^2
        "residual_l2": _variant("embedding_in"),  # sum x^2 of the residual stream norms read
        "magnitude": _variant("embedding_weight"),  # word-embedding column norm
    },
    "ffn": {
        "abs": lambda s: dict(s.ffn),
        "l2": _variant("ffn_sq"),
        "magnitude": _variant("ffn_weight"),
    },
    "shared_ffn": {
        "abs": lambda s: dict(s.shared_ffn),
        "l2": _variant("shared_ffn_sq"),
        "magnitude": _variant("shared_ffn_weight"),
    },
    "attention_heads": {
        "head_l2": lambda s: dict(s.attention_heads),  # sum ||y_h|| (published)
        "output_l2": _variant("attention_heads_out"),  # sum ||W_o[:, h] y_h||
        "magnitude": _variant("attention_heads_weight"),
    },
    "mamba_heads": {
        "x_proj": _mamba("x_proj", "heads"),  # published
        "out_proj_input": _mamba("out_proj_input", "heads"),
        "output_l2": _variant("mamba_heads_out"),
        "magnitude": _mamba_weight("heads"),
    },
    "mamba_channels": {
        "x_proj": _mamba("x_proj", "channels"),  # published
        "out_proj_input": _mamba("out_proj_input", "channels"),
        "magnitude": _mamba_weight("channels"),
    },
    "experts": {
        "reap": lambda s: dict(s.experts),  # published: mean over routed tokens of g ||f||
        "reap_sum": _experts_sum,
        "frequency": lambda s: dict(s.expert_tokens),  # routed-token count
        "magnitude": _variant("experts_weight"),
    },
}
PUBLISHED = {
    "embedding": "norm_abs",
    "ffn": "abs",
    "shared_ffn": "abs",
    "attention_heads": "head_l2",
    "mamba_heads": "x_proj",
    "mamba_channels": "x_proj",
    "experts": "reap",
}
# the measured best on both teachers (docs/importance.md, "Defaults"). Embedding: activation
# statistics keep the high-energy residual channels, so every kept channel shrinks after the norms
# renormalize over fewer channels. Experts: magnitude beat REAP on the demo teacher (8 experts)
# and tied with it on 32. Mamba heads: what the head writes beat both Mamba sources.
DEFAULTS = dict(
    PUBLISHED,
    embedding="magnitude",
    mamba_heads="output_l2",
    mamba_channels="out_proj_input",
    experts="magnitude",
)


# not a statistic but the baseline every statistic must beat (``reorder --method ffn=random``):
# a seeded random order per layer, the same for every run and layout (seeded by axis and layer)
RANDOM = "random"


def parse_methods(items: Iterable[str] | None) -> dict[str, str]:
    """``["embedding=residual_l2", ...]`` -> ``{"embedding": "residual_l2"}``; clear errors."""
    methods: dict[str, str] = {}
    for item in items or ():
        axis, sep, stat = item.partition("=")
        if not sep or axis not in STATISTICS:
            raise ValueError(
                f"--method {item!r}: expected AXIS=STATISTIC with AXIS one of "
                f"{', '.join(STATISTICS)}"
            )
        if stat not in STATISTICS[axis] and stat != RANDOM:
            raise ValueError(
                f"--method {item!r}: {axis} statistics are "
                f"{', '.join(STATISTICS[axis])} (or {RANDOM}: the baseline)"
            )
        methods[axis] = stat
    return methods


def _random_scores(scores: ImportanceScores, axis: str) -> Layers:
    import zlib

    out = {}
    for layer, like in STATISTICS[axis][PUBLISHED[axis]](scores).items():
        gen = torch.Generator().manual_seed(zlib.crc32(f"{axis}/{layer}".encode()))
        out[layer] = torch.rand(like.shape, generator=gen, dtype=torch.float64).to(like.dtype)
    return out


def axis_scores(scores: ImportanceScores, axis: str, statistic: str) -> Layers:
    """Scores per layer for one axis under one statistic (key 0 for the embedding), or
    ``RANDOM``'s seeded random scores shaped like the published statistic's."""
    if axis in STATISTICS and statistic == RANDOM:
        return _random_scores(scores, axis)
    if axis not in STATISTICS or statistic not in STATISTICS[axis]:
        allowed = ", ".join(f"{a}={s}" for a in STATISTICS for s in (*STATISTICS[a], RANDOM))
        raise ValueError(f"{axis}={statistic} is not a statistic; allowed: {allowed}")
    return STATISTICS[axis][statistic](scores)


def resolve_methods(
    scores: ImportanceScores, methods: dict[str, str] | None, mamba_source: str | None = None
) -> dict[str, str]:
    """The statistic of every axis: those asked for, else the defaults; a default the scores
    file cannot provide (written before it was recorded) falls back to the published one, with
    a warning, so old scores files still reorder."""
    import warnings

    chosen = dict(DEFAULTS)
    if mamba_source is not None:  # the older flag: one statistic for both Mamba axes
        chosen.update(mamba_heads=mamba_source, mamba_channels=mamba_source)
    for axis, statistic in chosen.items():
        if axis in (methods or {}):
            continue
        try:
            axis_scores(scores, axis, statistic)
        except ValueError as exc:
            warnings.warn(f"{axis}: {exc}; using the published {PUBLISHED[axis]}", stacklevel=2)
            chosen[axis] = PUBLISHED[axis]
    chosen.update(methods or {})
    return chosen
