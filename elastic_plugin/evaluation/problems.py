"""Held-out reasoning problems as generation prompts, and completions scored by reasoning-gym.

A prompt is the problem text as the tokenizer's own files say to encode it (``data/token_rule.py``):
the toy's tokenizer puts its ``<eod>`` in front, since training packs documents with ``<eod>``
separators and a document always starts right after one (measured on the products teacher: 30%
accuracy without the separator, 38% with it). The model then writes
``<think>steps</think>answer<eod>``;
the answer (text after ``</think>``) is scored by the task's own reasoning-gym scorer, correct
meaning score 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastic_plugin.data.tasks import Example, parse_completion, score

__all__ = ["Problems", "load_problems", "Scored", "score_completions"]


@dataclass
class Problems:
    """Examples with their prompt token ids and the special ids generation needs."""

    examples: list[Example]
    prompts: list[list[int]]
    eod: int
    think_close: int
    tokenizer: Any

    def __len__(self) -> int:
        return len(self.examples)

    def slice(self, start: int, stop: int) -> Problems:
        return Problems(
            self.examples[start:stop],
            self.prompts[start:stop],
            self.eod,
            self.think_close,
            self.tokenizer,
        )


def load_problems(prepared_dir: str, count: int) -> Problems:
    """The first ``count`` held-out problems of a prepared data directory."""
    from elastic_plugin.data.prepare import PreparedData
    from elastic_plugin.data.token_rule import read_token_rule

    prepared = PreparedData.load(prepared_dir)
    tokenizer = prepared.load_tokenizer()
    rule = read_token_rule(prepared.tokenizer_path)
    examples = prepared.load_heldout()[:count]
    if not examples:
        raise ValueError(f"{prepared_dir}: no held-out problems")
    if tokenizer.think_close is None:
        raise ValueError(f"{prepared.tokenizer_path}: the tokenizer has no </think> token")
    prompts = [rule.encode(e.prompt) for e in examples]
    return Problems(examples, prompts, rule.eos_id, tokenizer.think_close, tokenizer)


@dataclass
class Scored:
    """Per problem: correct (score == 1), thinking tokens (up to and including ``</think>``;
    all generated tokens when it never closed), answer tokens, and the answer text."""

    correct: list[bool]
    think_tokens: list[int]
    answer_tokens: list[int]
    answers: list[str]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def score_completions(problems: Problems, completions: Sequence[Sequence[int]]) -> Scored:
    """Score generated token ids (after the prompt) of every problem."""
    correct, think, answer, texts = [], [], [], []
    for example, tokens in zip(problems.examples, completions):
        tokens = list(tokens)
        if problems.eod in tokens:
            tokens = tokens[: tokens.index(problems.eod)]
        if problems.think_close in tokens:
            cut = tokens.index(problems.think_close) + 1
        else:
            cut = len(tokens)
        think.append(cut)
        answer.append(len(tokens) - cut)
        _, text = parse_completion(problems.tokenizer.detokenize(tokens))
        texts.append(text)
        correct.append(score(example, text) == 1.0)
    return Scored(correct, think, answer, texts)
