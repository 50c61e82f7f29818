"""``generate``'s run: load the plan's model(s), generate in its mode, and summarise.

Three modes: plain generation with one model; standard budget control (``</think>`` forced after
``--max-think-tokens`` thinking tokens, the answer continuing on the same cache); elastic budget
control (think with one nested model, answer with another). The summary is JSON-ready
(``--json``); :func:`format_summary` is its readable form.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from elastic_plugin.checkpoint.meta import budget_label
from elastic_plugin.data.tasks import parse_completion
from elastic_plugin.inference.request import GeneratePlan

__all__ = ["format_summary", "run_plan"]


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
            "stop_ids": plan.stop_ids,
            "chat": plan.chat,
        },
        "token_rule": plan.rule,
        "timings": timings,
        "results": records,
    }


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
