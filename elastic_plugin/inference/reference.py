"""Generation by full recompute: every new token runs the model's own forward over the whole
sequence so far, with no cache.

Quadratic in the length, but it uses nothing of the cached path (only ``model(input_ids,
position_ids, None)``, Megatron's training forward), so it is the reference the cached path is
tested against and the baseline the benchmark compares with. It also runs models the cached
path does not (an elastic model at an active choice). Rows of equal length run as one batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from elastic_plugin.inference.generation import (
    GenerationResult,
    check_generation_input,
    stop_reason,
)
from elastic_plugin.inference.sampling import Sampler
from elastic_plugin.inference.steps import eval_mode

if TYPE_CHECKING:  # Megatron ships no types: this annotates the model inside a wrapper
    from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["full_logits", "recompute_generate"]


def full_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own forward: logits [b, s, vocab] of ``tokens`` [b, s] (positions 0..s-1)."""
    inner = getattr(model, "module", model)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with eval_mode(inner):
        return model(tokens, positions, None)


def recompute_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_tokens: Iterable[int] = (),
    max_length: int | None = None,
) -> GenerationResult:
    """``generate``'s contract (same checks, stop rules, and sampling draws in the same order),
    computed by a full forward per step. ``prefill_s`` is the first step (all prompts)."""
    inner: HybridModel = getattr(model, "module", model)
    vocab = int(inner.vocab_size)
    prompts, stops, max_length = check_generation_input(
        prompts, max_new_tokens, stop_tokens, max_length, vocab, int(inner.max_sequence_length)
    )
    sampler = Sampler(greedy, temperature, top_k, top_p).check(vocab)
    device = next(inner.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    sequences = [list(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    active = list(range(len(prompts)))
    times = []
    while active:
        begin = time.perf_counter()
        by_length: dict[int, list[int]] = {}
        for position, row in enumerate(active):
            by_length.setdefault(len(sequences[row]), []).append(position)
        last: dict[int, torch.Tensor] = {}  # position in active -> its last logits
        for positions in by_length.values():
            batch = torch.tensor([sequences[active[p]] for p in positions], device=device)
            logits = full_logits(model, batch)[:, -1]
            for p, row_logits in zip(positions, logits):
                last[p] = row_logits
        picks = sampler(torch.stack([last[p] for p in range(len(active))]), generator).tolist()
        times.append(time.perf_counter() - begin)
        still = []
        for row, token in zip(active, picks):
            sequences[row].append(token)
            tokens[row].append(token)
            reasons[row] = stop_reason(
                token, len(tokens[row]), len(prompts[row]), stops, max_new_tokens, max_length
            )
            if reasons[row] is None:
                still.append(row)
        active = still
    return GenerationResult(prompts, tokens, [str(r) for r in reasons], times[0], sum(times[1:]))
