"""Elastic budget control: think with a small nested model, answer with a larger one.

Thinking tokens are cheap with a small model; the answer benefits from the big one (docs/design.md,
"Budget control"). The two models share weights but not caches (their widths differ), so the switch
re-prefills prompt + thinking with the answering model (for a batch, one padded forward:
``steps.extend_ragged``). A sequence whose thinking reaches
``max_think_tokens`` without closing gets ``</think>`` appended (budget forcing), so the
answering model always starts right after a closed thinking block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastic_plugin.inference.generation import GenerationResult, generate
from elastic_plugin.inference.steps import check_model
from elastic_plugin.models.config import ConfigError

__all__ = [
    "BudgetControlResult",
    "arithmetic_ratio",
    "budget_control_generate",
    "capped_thinking_generate",
]


@dataclass
class BudgetControlResult:
    """Per prompt: the thinking tokens (ending with ``</think>``), whether it was forced
    (``think_forced``), the answer tokens, and both phases' own results (timings inside;
    ``answer.prefill_s`` is the re-prefill of prompt + thinking)."""

    prompts: list[list[int]]
    thinking: list[list[int]]
    think_forced: list[bool]
    answers: list[list[int]]
    think: GenerationResult
    answer: GenerationResult

    @property
    def sequences(self) -> list[list[int]]:
        return [p + t + a for p, t, a in zip(self.prompts, self.thinking, self.answers)]


def arithmetic_ratio(
    prompt: float,
    think: float,
    answer: float,
    active_ratio: float,
    alone_think: float | None = None,
    alone_answer: float | None = None,
) -> float:
    """Computed, not measured: the arithmetic of think-small / answer-full over the full model
    alone, counting each token a model processes at its active parameters (the thinking model's
    ``active_ratio`` of the full model's). The thinking model reads prompt + thinking, and the
    answering model re-reads both before it answers; alone, the full model reads the prompt
    and generates ``alone_think`` + ``alone_answer`` tokens (default: the same counts). Why it
    matters: above 1 the switch costs more arithmetic than the cheaper thinking saves, so the
    control can only be faster where a decode step is bound by reading the weights (large
    models, GPUs) and a re-read token costs a fraction of a decode step."""
    alone_think = think if alone_think is None else alone_think
    alone_answer = answer if alone_answer is None else alone_answer
    control = (prompt + think) * (active_ratio + 1) + answer
    return control / (prompt + alone_think + alone_answer)


def budget_control_generate(
    think_model: torch.nn.Module,
    answer_model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    think_close: int,
    max_think_tokens: int,
    max_answer_tokens: int,
    *,
    answer_stop_tokens: Iterable[int] = (),
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    max_length: int | None = None,
    fast: bool = True,
) -> BudgetControlResult:
    """Think with ``think_model`` until ``think_close`` (``</think>``'s id) or
    ``max_think_tokens``, then answer with ``answer_model`` for up to ``max_answer_tokens``
    (stopping at ``answer_stop_tokens``). Prompts usually end with ``<think>``. Sampling
    settings apply to both phases (the answer phase draws from ``seed + 1``). ``max_length``
    bounds prompt + thinking + answer (default and limit: the smaller model context).
    ``fast``: ``generate``'s (the fast decode step and the one-forward re-prefill; False: the
    reference path)."""
    think_inner, answer_inner = check_model(think_model), check_model(answer_model)
    vocab = int(think_inner.vocab_size)
    if int(answer_inner.vocab_size) != vocab:
        raise ConfigError(
            f"think_model and answer_model must share a vocabulary; got "
            f"{vocab} and {int(answer_inner.vocab_size)} tokens"
        )
    if (
        isinstance(think_close, bool)
        or not isinstance(think_close, int)
        or not 0 <= think_close < vocab
    ):
        raise ConfigError(f"think_close={think_close!r}: must be a token id in [0, {vocab})")
    context = min(int(think_inner.max_sequence_length), int(answer_inner.max_sequence_length))
    max_length = context if max_length is None else max_length
    if (
        isinstance(max_length, bool)
        or not isinstance(max_length, int)
        or not 3 <= max_length <= context
    ):
        raise ConfigError(
            f"max_length={max_length!r}: must be an int in [3, {context}] (the "
            f"smaller max_sequence_length of the two models)"
        )
    sampling: dict[str, Any] = dict(
        greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, fast=fast
    )
    # leave room for a forced </think> and at least one answer token
    think = generate(
        think_model,
        prompts,
        max_think_tokens,
        stop_tokens=[think_close],
        seed=seed,
        max_length=max_length - 2,
        **sampling,
    )
    thinking, forced = [], []
    for tokens in think.tokens:
        closed = bool(tokens) and tokens[-1] == think_close
        thinking.append(tokens if closed else tokens + [think_close])
        forced.append(not closed)
    answer = generate(
        answer_model,
        [p + t for p, t in zip(think.prompts, thinking)],
        max_answer_tokens,
        stop_tokens=answer_stop_tokens,
        seed=seed + 1,
        max_length=max_length,
        **sampling,
    )
    return BudgetControlResult(think.prompts, thinking, forced, answer.tokens, think, answer)


def capped_thinking_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    think_close: int,
    max_think_tokens: int,
    max_answer_tokens: int,
    *,
    answer_stop_tokens: Iterable[int] = (),
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    max_length: int | None = None,
    fast: bool = True,
) -> GenerationResult:
    """Standard budget control, the baseline of the elastic kind: one model, and a sequence
    whose thinking reaches ``max_think_tokens`` without ``think_close`` gets ``think_close``
    emitted in place of its next token; the answer continues on the same cache (no switch, no
    re-prefill). Stops at ``answer_stop_tokens`` or after ``max_answer_tokens`` answer tokens."""
    for name, value in (
        ("max_think_tokens", max_think_tokens),
        ("max_answer_tokens", max_answer_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: must be an int >= 1")

    def force_close(row: int, generated: list[int]) -> int | None:
        if think_close not in generated and len(generated) == max_think_tokens:
            return think_close
        return None

    def answer_done(row: int, generated: list[int]) -> bool:
        return (
            think_close in generated
            and len(generated) - generated.index(think_close) - 1 >= max_answer_tokens
        )

    return generate(
        model,
        prompts,
        max_think_tokens + 1 + max_answer_tokens,
        stop_tokens=answer_stop_tokens,
        seed=seed,
        max_length=max_length,
        override=force_close,
        finished=answer_done,
        greedy=greedy,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        fast=fast,
    )
