"""Batched incremental generation: a ragged prefill, then one batched decode step per token.

Prompts of different lengths are prefilled into their own cache rows without padding (a Mamba
state must end exactly at the prompt's last token): rows advance together up to each distinct
prompt length (``steps.extend_ragged``); decode steps then run all unfinished rows together,
each at its own position. A row that emits a stop token, reaches
``max_new_tokens`` or fills ``max_length`` is frozen: later steps leave its cache untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from elastic_plugin.inference.cache import InferenceCache
from elastic_plugin.inference.fast_decode import decode_plan
from elastic_plugin.inference.sampling import Sampler
from elastic_plugin.inference.steps import check_model, eval_mode, extend, extend_ragged
from elastic_plugin.models.config import ConfigError

__all__ = ["GenerationResult", "STOP_REASONS", "check_generation_input", "generate", "stop_reason"]

STOP_REASONS = ("stop_token", "max_new_tokens", "max_length", "policy")


@dataclass
class GenerationResult:
    """Generated tokens per prompt (a stop token, when hit, is the last one), why each sequence
    stopped (one of ``STOP_REASONS``), and timings: ``prefill_s`` (all prompts, including the
    first new token's logits), ``decode_s`` (the batched decode steps), ``tokens_per_s``
    (all generated tokens / (prefill_s + decode_s)) and ``decode_tokens_per_s`` (tokens from
    decode steps / decode_s)."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    stop_reasons: list[str]
    prefill_s: float
    decode_s: float

    @property
    def num_generated(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt + generated tokens per sequence."""
        return [p + t for p, t in zip(self.prompts, self.tokens)]

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return sum(self.num_generated) / total if total > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = sum(max(n - 1, 0) for n in self.num_generated)
        return decoded / self.decode_s if self.decode_s > 0 else float("nan")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_generation_input(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_tokens: Iterable[int],
    max_length: int | None,
    vocab_size: int,
    max_sequence_length: int,
) -> tuple[list[list[int]], set[int], int]:
    """Everything that can be wrong with a request, found before any compute; returns the
    prompts as int lists, the stop-token set and the effective ``max_length``."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("prompts: must be a non-empty list of token-id lists")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 1")
    if max_length is None:
        max_length = max_sequence_length
    if not _is_int(max_length) or not 2 <= max_length <= max_sequence_length:
        raise ConfigError(
            f"max_length={max_length!r}: must be an int in [2, "
            f"{max_sequence_length}] (the model's max_sequence_length)"
        )
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise ConfigError(
                f"prompts[{i}]: must be a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ConfigError(f"prompts[{i}] is empty: a prompt needs at least one token")
        if len(ids) >= max_length:
            limit = (
                "the model's max_sequence_length"
                if max_length == max_sequence_length
                else f"max_length (model max_sequence_length {max_sequence_length})"
            )
            raise ConfigError(
                f"prompts[{i}] has {len(ids)} tokens; {limit} is {max_length}, so "
                f"a prompt may have at most {max_length - 1} tokens"
            )
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(
                f"prompts[{i}]: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        out.append(list(ids))
    stops = list(stop_tokens or ())
    bad = [t for t in stops if not _is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"stop_tokens: {bad} are outside the vocabulary [0, {vocab_size})")
    return out, set(stops), max_length


def stop_reason(
    token: int,
    generated: int,
    prompt_length: int,
    stops: set[int],
    max_new_tokens: int,
    max_length: int,
) -> str | None:
    """Why a sequence stops after emitting ``token`` as its ``generated``-th token (None: go on)."""
    if token in stops:
        return "stop_token"
    if generated >= max_new_tokens:
        return "max_new_tokens"
    if prompt_length + generated >= max_length:
        return "max_length"
    return None


def generate(
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
    override: Callable[[int, list[int]], int | None] | None = None,
    finished: Callable[[int, list[int]], bool] | None = None,
    fast: bool = True,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt with KV / conv / SSM caches.

    ``model``: a plain TP=PP=EP=1 ``HybridModel`` (for a nested model of an elastic one, see
    ``nested_model`` / ``load_nested_model``). ``greedy`` takes the argmax; ``greedy=False``
    samples with ``temperature``, ``top_k``, ``top_p`` from a generator seeded with ``seed``.
    A sequence stops after emitting one of ``stop_tokens``, after ``max_new_tokens``, or when
    prompt + generated reach ``max_length`` (default: the model's max_sequence_length).
    ``override(row, generated_so_far)`` may return a token id to emit instead of the sampled
    one (e.g. a forced ``</think>`` when thinking reaches a cap); the cache just continues.
    ``finished(row, generated_so_far)`` returning True stops that row (reason ``"policy"``,
    e.g. an answer-length cap counted from ``</think>``).
    ``fast`` runs the decode steps with :class:`~elastic_plugin.inference.fast_decode.DecodePlan`
    (only the routed experts, few kernels per layer), the prefill's MLP / MoE layers the same
    way, and prefills ragged prompts in one padded forward; False is the reference path
    (``extend`` with the layer modules, one forward per distinct prompt length): the same
    tokens to rounding (tests/test_budget_control_fast.py).
    Raises ``ConfigError`` for bad input before any compute.
    """
    inner = check_model(model)
    vocab = int(inner.vocab_size)
    prompts, stops, max_length = check_generation_input(
        prompts, max_new_tokens, stop_tokens, max_length, vocab, int(inner.max_sequence_length)
    )
    sampler = Sampler(greedy, temperature, top_k, top_p).check(vocab)
    if not _is_int(seed):
        raise ConfigError(f"seed={seed!r}: must be an int")
    device = next(inner.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    batch = len(prompts)
    # the last generated token is never fed back, so the cache needs max_length - 1 positions
    cache = InferenceCache.allocate(inner, batch, max_length - 1)

    begin = time.perf_counter()
    next_tokens = sampler(
        extend_ragged(inner, cache, prompts, list(range(batch)), padded=fast, fast=fast),
        generator,
    )
    prefill_s = time.perf_counter() - begin

    tokens: list[list[int]] = [[] for _ in range(batch)]
    reasons: list[str | None] = [None] * batch
    active = list(range(batch))
    plan = decode_plan(inner) if fast else None
    begin = time.perf_counter()
    while True:
        keep = []
        for position, (row, token) in enumerate(zip(active, next_tokens.tolist())):
            forced = override(row, tokens[row]) if override is not None else None
            if forced is not None:
                token = int(forced)
                next_tokens[position] = token
            tokens[row].append(token)
            reasons[row] = stop_reason(
                token, len(tokens[row]), len(prompts[row]), stops, max_new_tokens, max_length
            )
            if reasons[row] is None and finished is not None and finished(row, tokens[row]):
                reasons[row] = "policy"
            if reasons[row] is None:
                keep.append(position)
        if not keep:
            break
        active = [active[k] for k in keep]
        feed = next_tokens[keep][:, None]
        if plan is None:
            logits = extend(inner, cache, feed, rows=active, last_only=True)[:, -1]
        else:
            rows = None if len(active) == batch else torch.tensor(active, device=device)
            with eval_mode(inner):
                logits = plan(cache, feed[:, 0], rows)
        next_tokens = sampler(logits, generator)
    decode_s = time.perf_counter() - begin
    return GenerationResult(prompts, tokens, [str(r) for r in reasons], prefill_s, decode_s)
