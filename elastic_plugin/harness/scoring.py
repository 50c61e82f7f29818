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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elastic_plugin.inference.steps import check_model, eval_mode
from elastic_plugin.models.config import ConfigError
from elastic_plugin.models.logits import without_logits

__all__ = ["Scored", "score_continuations"]


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
    """Score ``sequences[i][starts[i]:]`` given ``sequences[i][:starts[i]]``, all rows in one
    forward (the caller chooses the batch). A sequence may be one token longer than the model's
    ``max_sequence_length``: its last token is only predicted, never fed."""
    inner = check_model(model)
    if getattr(inner.config, "use_mup", False):  # without_logits would scale hidden states
        raise ConfigError("model: muP logit scaling is not supported by continuation scoring")
    _check(sequences, starts, int(inner.max_sequence_length))
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
        logits = inner._scale_logits(logits)[:, 0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(targets, device=device)
        chosen = logprobs.gather(1, target[:, None])[:, 0].tolist()
        greedy = (logits.argmax(dim=-1) == target).tolist()
    out: list[list[float]] = [[] for _ in sequences]
    hits: list[bool] = [True] * len(sequences)
    for i, value, hit in zip(owner, chosen, greedy):
        out[i].append(value)
        hits[i] = hits[i] and bool(hit)
    return [Scored(values, hit) for values, hit in zip(out, hits)]
