"""Next-token choice from logits: greedy, or sampling with temperature / top-k / top-p.

Sampling draws from one ``torch.Generator`` seeded by the caller, so a run is reproducible
from its seed (for the same batch composition: rows draw in batch order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elastic_plugin.models.config import ConfigError

__all__ = ["Sampler"]


@dataclass(frozen=True)
class Sampler:
    """``greedy``: argmax (the first of equal maxima). Otherwise sample from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and to
    the smallest set whose probability reaches ``top_p`` (the most likely token always stays)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self, vocab_size: int) -> Sampler:
        """Validate against the vocabulary; returns self."""
        if not isinstance(self.greedy, bool):
            raise ConfigError(f"greedy={self.greedy!r}: must be True or False")
        if self.greedy and (
            self.temperature != 1.0 or self.top_k is not None or self.top_p is not None
        ):
            raise ConfigError(
                "temperature / top_k / top_p are sampling settings: pass greedy=False with them"
            )
        t = self.temperature
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not (math.isfinite(t) and t > 0)
        ):
            raise ConfigError(f"temperature={t!r}: must be a finite number > 0")
        k = self.top_k
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size
        ):
            raise ConfigError(f"top_k={k!r}: must be an int in [1, {vocab_size}] (or None)")
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1
        ):
            raise ConfigError(f"top_p={p!r}: must be a number in (0, 1] (or None)")
        return self

    def __call__(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Token ids [b] for logits [b, vocab]."""
        if self.greedy:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.temperature
        if self.top_k is not None:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
            drop = before >= self.top_p
            drop[:, 0] = False
            scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).reshape(-1)
