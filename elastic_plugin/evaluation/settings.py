"""One way of answering the problems (a setting), run and measured.

Settings: one model thinking and answering freely; **elastic budget control** (think with the
nested model of ``think``, answer with ``answer``: the answering model re-prefills prompt +
thinking); and **standard budget control** (one model, thinking capped at ``cap`` tokens, then
``</think>`` forced and the answer continues on the same cache). Each is measured for accuracy
and token counts over all problems (batched), and for latency per problem at batch size 1 over a
subset (what one user waits) as well as per problem in the batched run (throughput).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastic_plugin.evaluation.problems import Problems, score_completions

__all__ = ["Setting", "interleaved_latencies", "run_setting"]

MAX_THINK_TOKENS = 96
MAX_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class Setting:
    """``think``/``answer``: budgets of the two phases (equal: one model); ``cap``: the
    thinking cap of standard budget control (None: free); ``precision`` of the weights."""

    name: str
    think: float
    answer: float
    cap: int | None = None
    precision: str = "fp32"

    @property
    def kind(self) -> str:
        if self.cap is not None:
            return "capped"
        return "single" if self.think == self.answer else "elastic"


def _completions(setting: Setting, models: dict, problems: Problems) -> list[list[int]]:
    from elastic_plugin.inference import budget_control_generate, capped_thinking_generate, generate

    think = models[(setting.think, setting.precision)]
    answer = models[(setting.answer, setting.precision)]
    stops = [problems.eod]
    if setting.kind == "single":
        result = generate(
            think, problems.prompts, MAX_THINK_TOKENS + MAX_ANSWER_TOKENS, stop_tokens=stops
        )
        return result.tokens
    if setting.kind == "capped":
        assert setting.cap is not None  # what makes the kind "capped"
        return capped_thinking_generate(
            think,
            problems.prompts,
            problems.think_close,
            setting.cap,
            MAX_ANSWER_TOKENS,
            answer_stop_tokens=stops,
        ).tokens
    controlled = budget_control_generate(
        think,
        answer,
        problems.prompts,
        problems.think_close,
        MAX_THINK_TOKENS,
        MAX_ANSWER_TOKENS,
        answer_stop_tokens=stops,
    )
    return [t + a for t, a in zip(controlled.thinking, controlled.answers)]


def _warm_up(setting: Setting, models: dict, problems: Problems, batch_size: int) -> None:
    """One untimed pass at batch 1 and one over a small ragged batch. Why: Megatron fuses some
    element-wise functions with ``torch.compile``, which compiles on first use and again when
    shapes change; without this the first setting measured pays those compilations (measured:
    the full model's batched time per problem doubled)."""
    _completions(setting, models, problems.slice(0, 1))
    _completions(setting, models, problems.slice(0, min(batch_size, len(problems), 8)))


def run_setting(
    setting: Setting, models: dict, problems: Problems, batch_size: int, latency_problems: int
) -> dict[str, Any]:
    """Accuracy over ``problems`` in batches of ``batch_size``; latency per problem at batch 1
    over the first ``latency_problems`` (:func:`interleaved_latencies` of this one setting;
    None when 0)."""
    completions: list[list[int]] = []
    with torch.no_grad():
        _warm_up(setting, models, problems, batch_size)
        began = time.perf_counter()
        for start in range(0, len(problems), batch_size):
            completions += _completions(setting, models, problems.slice(start, start + batch_size))
        batched_s = time.perf_counter() - began
    latency = interleaved_latencies([setting], models, problems, latency_problems).get(
        setting.name, {}
    )
    scored = score_completions(problems, completions)
    return {
        **asdict(setting),
        "kind": setting.kind,
        "problems": len(problems),
        "accuracy": scored.accuracy,
        "correct": scored.correct,
        "think_tokens_mean": statistics.fmean(scored.think_tokens),
        "answer_tokens_mean": statistics.fmean(scored.answer_tokens),
        "prompt_tokens_mean": statistics.fmean(len(p) for p in problems.prompts),
        "latency_ms_batch1": latency.get("latency_ms_batch1"),
        "latency_ms_batch1_mean": latency.get("latency_ms_batch1_mean"),
        "latency_ms_batched": 1e3 * batched_s / len(problems),
        "examples": [
            {"prompt": e.prompt, "expected": e.answer, "answer": a, "correct": c}
            for e, a, c in list(zip(problems.examples, scored.answers, scored.correct))[:3]
        ],
    }


def interleaved_latencies(
    settings: list[Setting], models: dict, problems: Problems, count: int
) -> dict[str, dict[str, float]]:
    """Per setting name: the median and mean time to answer one problem at batch 1
    (``latency_ms_batch1`` / ``latency_ms_batch1_mean``) over the first ``count`` problems.

    Why interleaved: the settings are compared with each other, and this machine's speed drifts
    over minutes; so every problem is answered by every setting in turn (the order rotating
    from problem to problem), and a slow spell hits all settings alike."""
    times: dict[str, list[float]] = {s.name: [] for s in settings}
    if count < 1:
        return {}
    with torch.no_grad():
        for setting in settings:
            _completions(setting, models, problems.slice(0, 1))  # warm-up, untimed
        for index in range(min(count, len(problems))):
            one = problems.slice(index, index + 1)
            shift = index % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                began = time.perf_counter()
                _completions(setting, models, one)
                times[setting.name].append(time.perf_counter() - began)
    return {
        name: {
            "latency_ms_batch1": 1e3 * statistics.median(t),
            "latency_ms_batch1_mean": 1e3 * statistics.fmean(t),
        }
        for name, t in times.items()
        if t
    }
