"""``elastic-plugin generate``: text completions from a checkpoint, with elastic budget control.

    elastic-plugin generate --ckpt demo_out/checkpoints/elastic --budget 0.4 --prompt "12*3="
    elastic-plugin generate --ckpt CKPT --think-budget 0.4 --answer-budget 1 --prompts-file p.txt
    elastic-plugin generate --ckpt CKPT --budget 1 --max-think-tokens 32 --prompt "12*3=" --json

Three modes: plain generation with one model (``--budget B`` of an elastic checkpoint, or an
extracted / plain checkpoint as it is); standard budget control (``--max-think-tokens N`` with one
model: ``</think>`` is forced after N thinking tokens and the answer continues on the same cache);
elastic budget control (``--think-budget B1 --answer-budget B2``: think with the nested model of
B1, answer with that of B2). Every prompt is prefixed with the tokenizer's eod token, because
training packs documents with eod separators and a document always starts right after one.
Bad input (flags, checkpoint metadata, budgets, tokenizer, prompts) exits 2 before torch or
Megatron is imported; the summary goes to stdout (one JSON object with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import (
    budget_label,
    match_budget,
    read_checkpoint_meta,
    read_elastic_meta,
    stored_choice,
    trained_budgets,
    trained_listing,
)
from elastic_plugin.data.tasks import THINK_CLOSE, parse_completion
from elastic_plugin.models.config import ConfigError, config_from_dict

__all__ = [
    "GeneratePlan",
    "EXIT_BAD_INPUT",
    "format_summary",
    "plan_generation",
    "register_subcommand",
    "run_generate",
    "run_plan",
]

from elastic_plugin.cli_errors import EXIT_BAD_INPUT, report_bad_input

PROG = "elastic-plugin generate"
EOD_TOKEN = "<eod>"  # = data.tokenizer.EOD_TOKEN (that module imports Megatron)
MODES = ("generate", "capped_thinking", "budget_control")
# room budget control keeps after the prompt: a forced </think> and at least one answer token
_CONTROL_RESERVE = 2


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a (nested) model; elastic budget control",
        description="Complete text prompts with the nested model of a trained budget of an elastic "
        "checkpoint, or with an extracted / plain checkpoint. Every prompt is prefixed with the "
        "tokenizer's eod token: training packs documents with eod separators, so a document "
        "always starts right after one (on the demo teacher: 30% accuracy without the prefix, "
        "38% with it). Elastic budget control thinks with a small nested model and answers with "
        "a larger one.",
    )
    parser.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="an elastic checkpoint (needs a budget), or an extracted / plain "
        "Megatron checkpoint of this plugin (no budget flags)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json (or a directory holding one); default: the one the "
        "checkpoint's elastic_meta.json records",
    )
    budgets = parser.add_argument_group("budgets (elastic checkpoints: trained budgets only)")
    budgets.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="B",
        help="generate with the nested model of budget B",
    )
    budgets.add_argument(
        "--think-budget",
        type=float,
        default=None,
        metavar="B1",
        help="elastic budget control: think with budget B1 until </think> (or "
        "--max-think-tokens) ...",
    )
    budgets.add_argument(
        "--answer-budget",
        type=float,
        default=None,
        metavar="B2",
        help="... then answer with budget B2",
    )
    budgets.add_argument(
        "--max-think-tokens",
        "--think-cap",
        dest="max_think_tokens",
        type=int,
        default=None,
        metavar="N",
        help="cap thinking at N tokens, then force </think>. Without "
        "--think-budget: standard budget control with one model (the answer "
        "continues on the same cache); with it: the thinking cap of elastic "
        "budget control (default: the model's context)",
    )
    prompts = parser.add_argument_group("prompts (each gets the eod token prefixed)")
    source = prompts.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="a prompt (repeat for a batch); text, tokenized with the checkpoint's "
        "tokenizer after an eod token",
    )
    source.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="a text file with one prompt per line (blank lines are skipped)",
    )
    prompts.add_argument(
        "--allow-unknown-chars",
        action="store_true",
        help="generate even when a prompt has characters the tokenizer cannot represent "
        "(they become its unknown token or are dropped); refused by default",
    )
    gen = parser.add_argument_group("generation")
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens to generate (default 64); with budget control: answer tokens after </think>",
    )
    gen.add_argument(
        "--stop",
        action="extend",
        nargs="+",
        default=None,
        metavar="TOKEN",
        help=f"stop after any of these tokens (token strings of the checkpoint's "
        f"tokenizer, e.g. {EOD_TOKEN}; default: the eod token)",
    )
    gen.add_argument(
        "--greedy",
        action="store_true",
        help="greedy decoding (the default when no sampling flag is given)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="sample at temperature T > 0 (default 1 when sampling)",
    )
    gen.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample from the K most likely tokens"
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="sample from the smallest set of tokens with probability >= P",
    )
    gen.add_argument(
        "--seed", type=int, default=None, metavar="S", help="sampling seed (default 0)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of readable lines"
    )
    parser.set_defaults(func=run_generate)


# ------------------------------------------------------------------------------ input stage
@dataclass
class GeneratePlan:
    """Everything checked and resolved before any model is loaded."""

    ckpt: str
    kind: str
    mode: str  # one of MODES
    budgets: list[float | None]  # [one] for generate / capped_thinking, [think, answer]
    tokenizer_path: str
    prompts: list[str]
    prompt_ids: list[list[int]]  # eod + the tokenized text
    stop_tokens: list[str]
    stop_ids: list[int]
    eod: int
    think_close: int | None
    max_new_tokens: int
    max_think_tokens: int | None
    sampling: dict[str, Any] = field(default_factory=dict)  # greedy, temperature, top_k, top_p
    seed: int = 0
    max_sequence_length: int = 0


def _check_int(flag: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{flag} {value}: must be >= {low}")


def _per_layer_axis(choice: Mapping[str, Any]) -> tuple[str, list] | None:
    for axis, value in choice.items():
        if isinstance(value, (list, tuple)) and len(set(value)) != 1:
            return axis, list(value)
    return None


def _trained_budget(flag: str, budget: float, meta: Mapping[str, Any], ckpt: str) -> float:
    """The trained budget ``budget`` names (a plain model must exist for it), or a ConfigError
    naming ``flag`` and the trained budgets."""
    trained = trained_budgets(meta)
    listing = trained_listing(trained)
    if not math.isfinite(budget):
        raise ConfigError(f"{flag} {budget}: not a number; trained budgets: {listing}")
    match = match_budget(budget, trained)
    if match is None:
        raise ConfigError(
            f"{flag} {budget_label(budget)} was not trained; trained budgets: {listing}"
        )
    choice = stored_choice(meta, match, ckpt)
    per_layer = _per_layer_axis(choice)
    if per_layer is not None:
        axis, sizes = per_layer
        raise ConfigError(
            f"{flag} {budget_label(match)}: the nested model has per-layer sizes "
            f"({axis}={sizes}); generation runs a plain Megatron-Core model, which "
            f"builds every layer of a kind alike; choose another budget (one size "
            f"per axis)"
        )
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


def _eod_token(path: str, backend) -> tuple[str, int]:
    """The document separator prompts start with: data.jsonl.tokenizer_spec's EOS (<eod> for the
    demo's tokenizers; tokenizer_config.json / generation_config.json for an imported one)."""
    from elastic_plugin.data.jsonl import JsonlError, tokenizer_spec

    try:
        spec = tokenizer_spec(path)
        return spec.eos_token, spec.eos_id
    except JsonlError as exc:
        raise ConfigError(
            f"{exc} (every prompt is prefixed with it); special tokens: "
            f"{', '.join(_special_tokens(backend))}"
        ) from None


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
    eod_token, eod = _eod_token(path, backend)  # <eod>, or an imported (Hub) tokenizer's EOS
    think_close = backend.token_to_id(THINK_CLOSE)
    if mode != "generate" and think_close is None:
        flag = "--think-budget" if mode == "budget_control" else "--max-think-tokens"
        raise ConfigError(
            f"{flag}: budget control needs a {THINK_CLOSE} token, and the tokenizer {path} has none"
        )
    stop_tokens = list(args.stop) if args.stop else [eod_token]
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
        ids = [eod, *encoding.ids]
        if len(ids) > limit:
            why = (
                " (budget control keeps 2 positions for </think> and the answer)"
                if mode == "budget_control"
                else ""
            )
            raise ConfigError(
                f"{name} has {len(ids)} tokens with the {eod_token} prefix; the "
                f"model's max_sequence_length is {context}, so a prompt may have at "
                f"most {limit} tokens{why}"
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
        eod,
        think_close,
        args.max_new_tokens,
        args.max_think_tokens,
        sampling,
        seed,
        context,
    )


# ------------------------------------------------------------------------------ generation
def _record(
    plan: GeneratePlan,
    tokenizer,
    index: int,
    tokens: Sequence[int],
    reason: str,
    think_forced: bool | None,
) -> dict[str, Any]:
    """One prompt's result: the completion without its stop token, split by ``parse_completion``."""
    tokens = [int(t) for t in tokens]
    body = tokens[:-1] if reason == "stop_token" else tokens
    completion = tokenizer.detokenize(body)
    thinking, answer = parse_completion(completion)
    think, closed = 0, False
    if plan.think_close is not None and plan.think_close in body:
        think, closed = body.index(plan.think_close) + 1, True
    return {
        "prompt": plan.prompts[index],
        "prompt_tokens": len(plan.prompt_ids[index]),
        "tokens": tokens,
        "generated_tokens": len(tokens),
        "completion": completion,
        "thinking": thinking,
        "answer": answer,
        "think_tokens": think,
        "think_closed": closed,
        "think_forced": think_forced,
        "answer_tokens": len(body) - think,
        "stop_reason": reason,
        "stop_token": tokenizer.backend.id_to_token(tokens[-1]) if reason == "stop_token" else None,
    }


def _timings(phases: Mapping[str, Any]) -> dict[str, Any]:
    """Prefill / decode seconds and throughput over the phases' ``GenerationResult``s."""
    prefill = sum(r.prefill_s for r in phases.values())
    decode = sum(r.decode_s for r in phases.values())
    generated = sum(sum(r.num_generated) for r in phases.values())
    decoded = sum(sum(max(n - 1, 0) for n in r.num_generated) for r in phases.values())
    out: dict[str, Any] = {
        "prefill_s": prefill,
        "decode_s": decode,
        "generated_tokens": generated,
        "tokens_per_s": generated / (prefill + decode) if prefill + decode > 0 else None,
        "decode_tokens_per_s": decoded / decode if decode > 0 else None,
    }
    if len(phases) > 1:
        out["phases"] = {
            name: {
                "prefill_s": r.prefill_s,
                "decode_s": r.decode_s,
                "generated_tokens": sum(r.num_generated),
            }
            for name, r in phases.items()
        }
    return out


def run_plan(plan: GeneratePlan) -> dict[str, Any]:
    """Load the model(s) and generate; returns the JSON-ready summary."""
    from elastic_plugin.data.jsonl import open_tokenizer
    from elastic_plugin.inference import budget_control_generate, capped_thinking_generate, generate
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.model import load_nested_models

    tokenizer = open_tokenizer(plan.tokenizer_path)  # EOS of an imported (Hub) tokenizer too
    begin = time.perf_counter()
    loaded = load_nested_models(plan.ckpt, plan.budgets)
    load_s = time.perf_counter() - begin
    roles = ("think", "answer") if plan.mode == "budget_control" else ("generate",)
    models = {}
    for role, budget, (_, cfg) in zip(roles, plan.budgets, loaded):
        count = count_parameters(cfg)
        models[role] = {"budget": budget, "params": count.total, "active_params": count.active}
    sampling = dict(plan.sampling, seed=plan.seed)
    n = len(plan.prompt_ids)

    if plan.mode == "budget_control":
        assert plan.think_close is not None  # the plan has it in every mode but "generate"
        max_think = plan.max_think_tokens or plan.max_sequence_length
        controlled = budget_control_generate(
            loaded[0][0],
            loaded[1][0],
            plan.prompt_ids,
            plan.think_close,
            max_think,
            plan.max_new_tokens,
            answer_stop_tokens=plan.stop_ids,
            **sampling,
        )
        records = [
            _record(
                plan,
                tokenizer,
                i,
                controlled.thinking[i] + controlled.answers[i],
                controlled.answer.stop_reasons[i],
                controlled.think_forced[i],
            )
            for i in range(n)
        ]
        timings = _timings({"think": controlled.think, "answer": controlled.answer})
    elif plan.mode == "capped_thinking":
        # the plan has both in this mode (it is the mode of --max-think-tokens)
        assert plan.think_close is not None and plan.max_think_tokens is not None
        result = capped_thinking_generate(
            loaded[0][0],
            plan.prompt_ids,
            plan.think_close,
            plan.max_think_tokens,
            plan.max_new_tokens,
            answer_stop_tokens=plan.stop_ids,
            **sampling,
        )
        records = []
        for i, tokens in enumerate(result.tokens):
            # the override emits </think> exactly at index max_think_tokens when thinking had
            # not closed; "policy" is the answer reaching --max-new-tokens
            forced = (
                plan.think_close in tokens
                and tokens.index(plan.think_close) == plan.max_think_tokens
            )
            reason = result.stop_reasons[i]
            records.append(
                _record(
                    plan,
                    tokenizer,
                    i,
                    tokens,
                    "max_new_tokens" if reason == "policy" else reason,
                    forced,
                )
            )
        timings = _timings({"generate": result})
    else:
        result = generate(
            loaded[0][0],
            plan.prompt_ids,
            plan.max_new_tokens,
            stop_tokens=plan.stop_ids,
            **sampling,
        )
        records = [
            _record(plan, tokenizer, i, tokens, result.stop_reasons[i], None)
            for i, tokens in enumerate(result.tokens)
        ]
        timings = _timings({"generate": result})
    timings["load_s"] = load_s
    return {
        "ckpt": plan.ckpt,
        "kind": plan.kind,
        "mode": plan.mode,
        "tokenizer": plan.tokenizer_path,
        "budgets": {role: models[role]["budget"] for role in roles},
        "models": models,
        "settings": {
            "max_new_tokens": plan.max_new_tokens,
            "max_think_tokens": plan.max_think_tokens,
            **sampling,
            "stop": plan.stop_tokens,
            "eod_prefix": True,
        },
        "timings": timings,
        "results": records,
    }


# ------------------------------------------------------------------------------ output
def _model_line(role: str, info: Mapping[str, Any]) -> str:
    from elastic_plugin.models.counting import format_count

    budget = "full model" if info["budget"] is None else f"budget {budget_label(info['budget'])}"
    return (
        f"{role}: {budget}, {format_count(info['params'])} params "
        f"({format_count(info['active_params'])} active)"
    )


def format_summary(summary: Mapping[str, Any]) -> str:
    """The readable form of ``run_plan``'s summary."""
    lines = [f"{summary['ckpt']} ({summary['kind']}), mode {summary['mode']}"]
    lines += ["  " + _model_line(role, info) for role, info in summary["models"].items()]
    for i, r in enumerate(summary["results"], 1):
        think = f"think {r['think_tokens']} tokens"
        if r["think_forced"]:
            think += " (</think> forced)"
        elif not r["think_closed"]:
            think += " (no </think>)"
        stop = r["stop_reason"] + (f" {r['stop_token']}" if r["stop_token"] else "")
        lines += [
            f"[{i}] {r['prompt']}",
            f"    completion: {r['completion']!r}",
            f"    answer: {r['answer']!r} | {think} | answer {r['answer_tokens']} tokens "
            f"| stop: {stop}",
        ]
    t = summary["timings"]
    rate = "n/a" if t["tokens_per_s"] is None else f"{t['tokens_per_s']:.1f}"
    lines.append(
        f"load {t['load_s']:.2f} s, prefill {t['prefill_s']:.3f} s, decode "
        f"{t['decode_s']:.3f} s, {t['generated_tokens']} tokens, {rate} tokens/s"
    )
    return "\n".join(lines)


def run_generate(args: argparse.Namespace) -> int:
    try:
        plan = plan_generation(args)
        summary = run_plan(plan)
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0
