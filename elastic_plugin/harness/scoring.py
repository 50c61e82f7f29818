"""Log-likelihoods of continuations, many sequences per forward, on a plain ``HybridModel``.

What lm-eval asks of a model for every multiple-choice and cloze task: for each ``(context,
continuation)`` token pair, the summed log-probability of the continuation and whether greedy
decoding would have produced it. Sequences of a batch are right-padded and run through the
model's own forward (causal attention and Mamba's scan: a row's real positions never see its
padding), stopped before the output layer (``models.logits.without_logits``); only the positions
that predict a continuation token go through the output layer and the log-softmax. Scoring a
4-way multiple-choice question thus costs the vocabulary GEMM of its answer tokens, not of every
prompt token (the output layer is a fifth of SmolLM2-135M's forward, and lm-eval's ``hf`` model
computes it for every position). Log-softmax in FP32 whatever the model's dtype.

Rows that share a context (a multiple-choice question's answers) go through the inference cache
instead: each distinct context is prefilled once (``inference.steps.extend``), its keys, values
and Mamba states are copied to one cache row per continuation, and only the continuations' tokens
are fed after it, so the question's prompt costs one forward, not one per answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elastic_plugin.inference.cache import InferenceCache
from elastic_plugin.inference.steps import check_model, eval_mode, extend
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.logits import without_logits

if TYPE_CHECKING:
    from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["Scored", "score_continuations"]

# the shared-context path runs when it feeds at most this share of the one-forward path's padded
# positions (bench/bench_lm_eval.py: its second pass and cache copies cost the rest)
SHARED_SAVING = 0.75


@dataclass(frozen=True)
class Scored:
    """One continuation: per-token log-probabilities, their sum, and whether every token is the
    argmax of its position (lm-eval's ``is_greedy``)."""

    token_logprobs: list[float]
    greedy: bool

    @property
    def logprob(self) -> float:
        return float(sum(self.token_logprobs))


def _check(sequences: Sequence[Sequence[int]], starts: Sequence[int], limit: int) -> None:
    if len(sequences) != len(starts):
        raise ConfigError(f"{len(sequences)} sequences but {len(starts)} continuation starts")
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        if not 1 <= start < len(seq):
            raise ConfigError(
                f"sequence {i}: the continuation starts at {start}; it needs at least one "
                f"context token and one continuation token (length {len(seq)})"
            )
        if len(seq) > limit + 1:
            raise ConfigError(
                f"sequence {i} has {len(seq)} tokens; the model reads at most {limit} (cut "
                "the context from the left first)"
            )


def score_continuations(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[Scored]:
    """Score ``sequences[i][starts[i]:]`` given ``sequences[i][:starts[i]]`` (the caller chooses
    the batch): rows sharing a context through the cache (see the module docstring), else all
    rows in one forward. A sequence may be one token longer than the model's
    ``max_sequence_length``: its last token is only predicted, never fed."""
    inner = check_model(model)
    if getattr(inner.config, "use_mup", False):  # without_logits would scale hidden states
        raise ConfigError("model: muP logit scaling is not supported by continuation scoring")
    _check(sequences, starts, int(inner.max_sequence_length))
    contexts = {tuple(seq[:start]) for seq, start in zip(sequences, starts)}
    tails = [len(seq) - start - 1 for seq, start in zip(sequences, starts)]
    # the branched cache holds the longest context and the longest fed tail (padding included)
    room = max(starts) + max(tails)
    # padded positions each path feeds: one forward of every row, or each context once and then
    # the rows' tails; sharing pays only when it feeds clearly fewer (it runs two passes and
    # copies the cache between them)
    forward = len(sequences) * (max(len(seq) for seq in sequences) - 1)
    longer = sum(1 for t in tails if t > 0)
    shared = len(contexts) * max(len(c) for c in contexts) + longer * max(tails)
    if shared <= SHARED_SAVING * forward and room <= int(inner.max_sequence_length):
        return _score_shared(inner, sequences, starts)
    return _score_forward(inner, sequences, starts)


def _branch(source: InferenceCache, rows: list[int], cache: InferenceCache) -> None:
    """Copy the states of ``source``'s ``rows`` into ``cache``'s rows 0.. in order."""
    index = torch.tensor(rows, device=source.lengths.device)
    width = min(source.max_length, cache.max_length)  # each copied row holds fewer tokens
    for mine, theirs in ((cache.keys, source.keys), (cache.values, source.values)):
        for layer, tensor in theirs.items():
            mine[layer][:, :width] = tensor[index, :width]
    for mine, theirs in ((cache.conv, source.conv), (cache.ssm, source.ssm)):
        for layer, tensor in theirs.items():
            mine[layer][:] = tensor[index]
    cache.lengths[:] = source.lengths[index]


def _logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[list[float], list[bool]]:
    logits = logits.float()
    chosen = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    return chosen.tolist(), (logits.argmax(dim=-1) == targets).tolist()


def _score_shared(
    inner: HybridModel, sequences: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[Scored]:
    """Each distinct context prefilled once; its cache branched to its continuations."""
    device = next(inner.parameters()).device
    order: dict[tuple[int, ...], int] = {}
    owner = [
        order.setdefault(tuple(seq[:start]), len(order)) for seq, start in zip(sequences, starts)
    ]
    contexts = list(order)
    widest = max(len(c) for c in contexts)
    prefix = InferenceCache.allocate(inner, len(contexts), widest)
    feed = torch.tensor([list(c) + [0] * (widest - len(c)) for c in contexts], device=device)
    with eval_mode(inner):
        last = extend(inner, prefix, feed, last_only=True, real_tokens=[len(c) for c in contexts],
                      fast=True)[:, -1]  # fmt: skip
    first = torch.tensor([seq[start] for seq, start in zip(sequences, starts)], device=device)
    values, hits = _logprobs(last[torch.tensor(owner, device=device)], first)
    out = [[v] for v in values]
    greedy = [bool(h) for h in hits]
    longer = [i for i, (seq, start) in enumerate(zip(sequences, starts)) if len(seq) - start > 1]
    if longer:
        tails = [list(sequences[i][starts[i] : -1]) for i in longer]  # fed; the last is predicted
        width = max(len(t) for t in tails)
        # room for each row's context and the padded tail fed after it
        cache = InferenceCache.allocate(inner, len(longer), max(starts[i] for i in longer) + width)
        _branch(prefix, [owner[i] for i in longer], cache)
        feed = torch.tensor([t + [0] * (width - len(t)) for t in tails], device=device)
        with eval_mode(inner):
            logits = extend(inner, cache, feed, real_tokens=[len(t) for t in tails], fast=True)
        rows = [r for r, t in enumerate(tails) for _ in t]
        cols = [c for t in tails for c in range(len(t))]
        targets = torch.tensor([tok for i in longer for tok in sequences[i][starts[i] + 1 :]],
                               device=device)  # fmt: skip
        values, hits = _logprobs(logits[torch.tensor(rows), torch.tensor(cols)], targets)
        for r, value, hit in zip(rows, values, hits):
            out[longer[r]].append(value)
            greedy[longer[r]] = greedy[longer[r]] and bool(hit)
    return [Scored(v, g) for v, g in zip(out, greedy)]


def _score_forward(
    inner: HybridModel, sequences: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[Scored]:
    """All rows right-padded through one forward, the output layer at continuation positions."""
    device = next(inner.parameters()).device
    width = max(len(s) for s in sequences) - 1  # the last token is never an input
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    rows, cols, targets, owner = [], [], [], []
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        fed = len(seq) - 1
        tokens[i, :fed] = torch.as_tensor(seq[:fed])
        # position p predicts token p + 1
        span = range(start - 1, fed)
        rows += [i] * len(span)
        cols += list(span)
        targets += list(seq[start:])
        owner += [i] * len(span)
    tokens = tokens.to(device)
    positions = torch.arange(width, device=device).expand_as(tokens)
    with eval_mode(inner), without_logits(inner):
        hidden = inner(tokens, positions, None)  # [b, s, h]: stopped before the output layer
    with eval_mode(inner):
        picked = hidden[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
        weight = (
            inner.shared_embedding_or_output_weight()
            if inner.share_embeddings_and_output_weights
            else None
        )
        logits, _ = inner.output_layer(picked[:, None], weight=weight, runtime_gather_output=True)
        logits = inner._scale_logits(logits)[:, 0]
        chosen, greedy = _logprobs(logits, torch.tensor(targets, device=device))
    out: list[list[float]] = [[] for _ in sequences]
    hits: list[bool] = [True] * len(sequences)
    for i, value, hit in zip(owner, chosen, greedy):
        out[i].append(value)
        hits[i] = hits[i] and bool(hit)
    return [Scored(values, hit) for values, hit in zip(out, hits)]
