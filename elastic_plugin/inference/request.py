"""``generate``'s request: every flag, the checkpoint's metadata, the budgets, the tokenizer and
the prompts checked and resolved into a :class:`GeneratePlan`, before any model is loaded.

Torch-free (the tokenizer is the ``tokenizers`` backend), so bad input fails in a second with a
``ConfigError`` naming the flag; ``inference.command`` runs the plan. Prompts and stop ids follow
the model's own tokenizer files (``data/token_rule.py``), as transformers' ``generate`` reads them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import (
    budget_label,
    match_trained_budget,
    read_checkpoint_meta,
    read_elastic_meta,
    stored_choice,
    trained_budgets,
    trained_listing,
)
from elastic_plugin.data.tasks import THINK_CLOSE
from elastic_plugin.models.config import ConfigError, config_from_dict
from elastic_plugin.nested.choice import homogeneous_choice

__all__ = ["MODES", "GeneratePlan", "plan_generation", "unknown_chars"]

MODES = ("generate", "capped_thinking", "budget_control")
# room budget control keeps after the prompt: a forced </think> and at least one answer token
_CONTROL_RESERVE = 2
_PER_LAYER_REMEDY = (
    "generation runs a plain Megatron-Core model, which builds every layer of a kind alike; "
    "choose another budget (one size per axis)"
)


@dataclass
class GeneratePlan:
    """Everything checked and resolved before any model is loaded."""

    ckpt: str
    kind: str
    mode: str  # one of MODES
    budgets: list[float | None]  # [one] for generate / capped_thinking, [think, answer]
    tokenizer_path: str
    prompts: list[str]
    prompt_ids: list[list[int]]  # as the model's tokenizer (or chat template) encodes them
    stop_tokens: list[str]
    stop_ids: list[int]
    eos: int
    think_close: int | None
    max_new_tokens: int
    max_think_tokens: int | None
    sampling: dict[str, Any] = field(default_factory=dict)  # greedy, temperature, top_k, top_p
    seed: int = 0
    max_sequence_length: int = 0
    chat: bool = False
    rule: dict[str, Any] = field(default_factory=dict)  # what the token rule resolved to


def _check_int(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{flag} {value}: must be >= {low}")


def _trained_budget(flag: str, budget: float, meta: Mapping[str, Any], ckpt: str) -> float:
    """The trained budget ``budget`` names (a plain model must exist for it), or a ConfigError
    naming ``flag`` and the trained budgets."""
    match = match_trained_budget(budget, meta, flag)
    homogeneous_choice(stored_choice(meta, match, ckpt), match, flag, _PER_LAYER_REMEDY)
    return match


def _budgets(args: argparse.Namespace, meta: Mapping[str, Any]) -> tuple[str, list[float | None]]:
    """The mode and the budget(s) of the models to load."""
    control = args.think_budget is not None or args.answer_budget is not None
    if control and args.budget is not None:
        raise ConfigError(
            "--budget and --think-budget/--answer-budget exclude each other: --budget "
            "B for one model (with --max-think-tokens N: capped thinking), or "
            "--think-budget B1 --answer-budget B2 for elastic budget control"
        )
    if control and (args.think_budget is None or args.answer_budget is None):
        given, missing = (
            ("--think-budget", "--answer-budget")
            if args.answer_budget is None
            else ("--answer-budget", "--think-budget")
        )
        raise ConfigError(
            f"{given} needs {missing}: elastic budget control thinks with the "
            f"--think-budget model and answers with the --answer-budget model"
        )
    mode = (
        "budget_control"
        if control
        else ("capped_thinking" if args.max_think_tokens is not None else "generate")
    )
    kind = meta.get("kind")
    if kind != "elastic":
        if control or args.budget is not None:
            flag, value = (
                ("--budget", args.budget)
                if args.budget is not None
                else ("--think-budget", args.think_budget)
            )
            raise ConfigError(
                f"{flag} {budget_label(value)}: --ckpt {args.ckpt} is a {kind!r} "
                f"checkpoint holding one model; budget flags (--budget, "
                f"--think-budget, --answer-budget) need an elastic checkpoint "
                f"(drop them)"
            )
        return mode, [None]
    meta = read_elastic_meta(args.ckpt)
    if not control and args.budget is None:
        listing = trained_listing(trained_budgets(meta))
        raise ConfigError(
            f"--ckpt {args.ckpt} is an elastic checkpoint: choose a trained budget "
            f"with --budget B (or --think-budget B1 --answer-budget B2); trained "
            f"budgets: {listing}"
        )
    if control:
        return mode, [
            _trained_budget("--think-budget", args.think_budget, meta, args.ckpt),
            _trained_budget("--answer-budget", args.answer_budget, meta, args.ckpt),
        ]
    return mode, [_trained_budget("--budget", args.budget, meta, args.ckpt)]


def _tokenizer_path(args: argparse.Namespace, meta: Mapping[str, Any]) -> str:
    def resolve(path: Path) -> Path:
        return path / "tokenizer.json" if path.is_dir() else path

    if args.tokenizer is not None:
        path = resolve(Path(args.tokenizer))
        if not path.is_file():
            raise ConfigError(
                f"--tokenizer {args.tokenizer}: no such file (a tokenizer.json, or "
                f"a directory holding one)"
            )
        return str(path)
    recorded = meta.get("tokenizer")
    if not recorded:
        raise ConfigError(
            f"--ckpt {args.ckpt}: its elastic_meta.json records no tokenizer; pass "
            f"--tokenizer PATH (the tokenizer.json the model was trained with)"
        )
    path = resolve(Path(recorded))
    if not path.is_file():
        raise ConfigError(
            f"--ckpt {args.ckpt} was trained with the tokenizer {recorded}, which is "
            f"not readable here; pass --tokenizer PATH"
        )
    return str(path)


def _load_backend(path: str):
    """The ``tokenizers.Tokenizer`` (torch-free; ``JsonTokenizer`` wraps the same object)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises plain Exceptions for bad files
        raise ConfigError(f"--tokenizer {path}: not a readable tokenizer.json ({exc})") from None


def _token_rule(path: str, backend):
    """The model's tokenization rule (``data/token_rule.py``), or a ConfigError naming the file."""
    from elastic_plugin.data.token_rule import TokenRuleError, read_token_rule

    try:
        return read_token_rule(path)
    except TokenRuleError as exc:
        raise ConfigError(f"{exc}; special tokens: {', '.join(_special_tokens(backend))}") from None


def _special_tokens(backend) -> list[str]:
    return [t.content for _, t in sorted(backend.get_added_tokens_decoder().items())]


def _read_prompts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The prompt texts and how each is named in messages."""
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {path}: no such file")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--prompts-file {path}: not readable UTF-8 text ({exc})") from None
        numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
        if not numbered:
            raise ConfigError(f"--prompts-file {path}: has no prompts (one per line)")
        return [line for _, line in numbered], [
            f"--prompts-file {path} line {n}" for n, _ in numbered
        ]
    for i, text in enumerate(args.prompt):
        if not text.strip():
            raise ConfigError(f"--prompt {i + 1} is empty: a prompt needs some text")
    return list(args.prompt), [f"--prompt {i + 1}" for i in range(len(args.prompt))]


def _sampling(args: argparse.Namespace, vocab: int) -> tuple[dict[str, Any], int]:
    sampled = [
        flag
        for flag, value in (
            ("--temperature", args.temperature),
            ("--top-k", args.top_k),
            ("--top-p", args.top_p),
        )
        if value is not None
    ]
    if args.greedy and sampled:
        raise ConfigError(
            f"--greedy and {'/'.join(sampled)} exclude each other: greedy decoding "
            f"is the default; the sampling flags switch to sampling"
        )
    if not sampled:
        if args.seed is not None:
            raise ConfigError(
                f"--seed {args.seed}: goes with sampling (--temperature T, --top-k K, "
                f"--top-p P); greedy decoding draws nothing"
            )
        return {"greedy": True, "temperature": 1.0, "top_k": None, "top_p": None}, 0
    temperature = 1.0 if args.temperature is None else args.temperature
    if not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(
            f"--temperature {args.temperature}: must be a number > 0 (for greedy "
            f"decoding pass --greedy, or leave out the sampling flags)"
        )
    if args.top_k is not None and not 1 <= args.top_k <= vocab:
        raise ConfigError(f"--top-k {args.top_k}: must be in [1, {vocab}] (the vocabulary)")
    if args.top_p is not None and not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
    return (
        {
            "greedy": False,
            "temperature": float(temperature),
            "top_k": args.top_k,
            "top_p": args.top_p,
        },
        0 if args.seed is None else args.seed,
    )


def _unk_id(backend: Any) -> int | None:
    """The id of the tokenizer model's unknown token, if it has one."""
    unk = getattr(backend.model, "unk_token", None)
    return backend.token_to_id(unk) if unk else None


def unknown_chars(text: str, encoding: Any, unk_id: int | None) -> list[str]:
    """The distinct characters of ``text`` the encoding lost: not covered by any token's offsets
    (dropped) or covered only by the unknown token. Whitespace a pre-tokenizer splits on is not
    counted (it is a separator, not lost content)."""
    covered = [False] * len(text)
    for ident, (start, end) in zip(encoding.ids, encoding.offsets):
        if ident != unk_id:
            for i in range(start, min(end, len(text))):
                covered[i] = True
    lost = [c for c, ok in zip(text, covered) if not ok and not c.isspace()]
    return sorted(set(lost), key=lost.index)


def plan_generation(args: argparse.Namespace) -> GeneratePlan:
    """Check every flag, the checkpoint's metadata, the budgets, the tokenizer and the prompts;
    torch-free, so bad input fails in a second. Raises ``ConfigError`` naming the flag."""
    _check_int("--max-new-tokens", args.max_new_tokens, 1)
    _check_int("--max-think-tokens", args.max_think_tokens, 1)
    meta = read_checkpoint_meta(args.ckpt)
    mode, budgets = _budgets(args, meta)
    model = config_from_dict(meta["config"], source=f"--ckpt {args.ckpt}").model
    vocab, context = int(model.vocab_size), int(model.max_sequence_length)
    sampling, seed = _sampling(args, vocab)

    path = _tokenizer_path(args, meta)
    backend = _load_backend(path)
    size = backend.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise ConfigError(
            f"--tokenizer {path}: {size} tokens, more than the model's vocabulary "
            f"({vocab}); is it the tokenizer this model was trained with?"
        )
    rule = _token_rule(path, backend)
    chat = bool(getattr(args, "chat", False))
    if chat and rule.chat_template is None:
        raise ConfigError(
            f"--chat: the tokenizer {path} has no chat template beside it (no "
            f"chat_template.jinja, no chat_template in tokenizer_config.json)"
        )
    think_close = backend.token_to_id(THINK_CLOSE)
    if mode != "generate" and think_close is None:
        flag = "--think-budget" if mode == "budget_control" else "--max-think-tokens"
        raise ConfigError(
            f"{flag}: budget control needs a {THINK_CLOSE} token, and the tokenizer {path} has none"
        )
    stop_tokens = list(args.stop) if args.stop else [backend.id_to_token(i) for i in rule.stop_ids]
    stop_ids = []
    for token in stop_tokens:
        ident = backend.token_to_id(token)
        if ident is None:
            raise ConfigError(
                f"--stop {token!r}: not a token of the tokenizer {path}; its special "
                f"tokens: {', '.join(_special_tokens(backend))}"
            )
        stop_ids.append(ident)

    texts, names = _read_prompts(args)
    limit = context - 1 - (_CONTROL_RESERVE if mode == "budget_control" else 0)
    prompt_ids = []
    for name, text in zip(names, texts):
        encoding = backend.encode(text, add_special_tokens=False)
        unknown = unknown_chars(text, encoding, _unk_id(backend))
        if unknown and not getattr(args, "allow_unknown_chars", False):
            shown = ", ".join(repr(c) for c in unknown[:10]) + (" ..." if len(unknown) > 10 else "")
            raise ConfigError(
                f"{name} has characters the tokenizer {path} cannot represent: {shown} (they "
                f"would become its unknown token or vanish); rephrase the prompt, or pass "
                f"--allow-unknown-chars to generate anyway"
            )
        ids = rule.prompt_ids(text, chat=chat)
        if len(ids) > limit:
            why = (
                " (budget control keeps 2 positions for </think> and the answer)"
                if mode == "budget_control"
                else ""
            )
            how = "in the chat template" if chat else "with the tokenizer's special tokens"
            raise ConfigError(
                f"{name} has {len(ids)} tokens {how}; the model's max_sequence_length is "
                f"{context}, so a prompt may have at most {limit} tokens{why}"
            )
        prompt_ids.append(ids)
    return GeneratePlan(
        str(args.ckpt),
        str(meta.get("kind")),
        mode,
        budgets,
        path,
        texts,
        prompt_ids,
        stop_tokens,
        stop_ids,
        rule.eos_id,
        think_close,
        args.max_new_tokens,
        args.max_think_tokens,
        sampling,
        seed,
        context,
        chat,
        {**rule.summary(), "chat": chat},
    )
