"""What one elastic run on a real pretrained model buys, measured on held-out text (``make demo-real``).

Every model is scored on the *same* test windows (the corpus' test split, documents no training
or validation step read): per window the summed next-token NLL, the number of tokens whose
greedy (argmax) prediction is the next token, and the token count. From those come perplexity,
next-token accuracy, retention against the parent, and paired standard errors between any two
models (the per-window differences' spread / sqrt(windows): the windows' own difficulty cancels).

Models measured:
- the parent: the converted Hugging Face directory in stock transformers (fp32);
- each trained budget cut out of the elastic checkpoint (fp32, our Megatron nested model);
- each budget of the HF exports in BF16 / FP8 / NVFP4, as a runtime computes it (stock
  transformers; quantized weights dequantized, calibrated activation scales applied);
- zero-shot pruning: the same architecture (the budget's stored choice) cut from the
  importance-reordered parent, no training; and from parents reordered by weight magnitude
  (and at random) when those checkpoints exist: which importance order prunes best.
It also answers instruction prompts greedily with every budget's BF16 export (chat template),
times greedy decoding at batch 1 and batched per budget, and runs elastic budget control (a small
budget drafts, the parent answers) on questions whose answers can be checked.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "What is the opposite of hot?",
    "Write one sentence about the sea.",
    "How many days are in a week?",
)


# ------------------------------------------------------------------------------ per-window stats
def window_stats(
    logits_of: Callable[[Any], Any], tokens: Any, batch_size: int
) -> dict[str, list[float]]:
    """``nll`` (summed, nats), ``correct`` (argmax == next token) and ``count`` per window of
    ``tokens`` ``[n, s + 1]``; logits in fp32."""
    import torch
    import torch.nn.functional as F

    out: dict[str, list[float]] = {"nll": [], "correct": [], "count": []}
    with torch.no_grad():
        for batch in tokens.split(batch_size):
            inputs, labels = batch[:, :-1], batch[:, 1:]
            logits = logits_of(inputs).float()
            nll = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
            ).reshape(labels.shape)
            out["nll"] += nll.double().sum(1).tolist()
            out["correct"] += (logits.argmax(-1) == labels).sum(1).double().tolist()
            out["count"] += [float(labels.shape[1])] * labels.shape[0]
    return out


def summarize(stats: dict[str, list[float]]) -> dict[str, float]:
    """Perplexity and next-token accuracy over all windows (token-weighted)."""
    tokens = sum(stats["count"])
    loss = sum(stats["nll"]) / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": sum(stats["correct"]) / tokens}


def paired(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, Any]:
    """``a`` minus ``b`` on the same windows: mean per-window difference of loss (nats/token)
    and accuracy, each with its standard error."""
    out: dict[str, Any] = {}
    for metric, key in (("loss", "nll"), ("accuracy", "correct")):
        diffs = [(x - y) / n for x, y, n in zip(a[key], b[key], a["count"])]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        out[metric] = {"diff": statistics.fmean(diffs), "se": se, "windows": len(diffs)}
    return out


# ------------------------------------------------------------------------------ the models
def hf_logits(model: Any) -> Callable[[Any], Any]:
    return lambda inputs: model(inputs).logits


def megatron_logits(model: Any) -> Callable[[Any], Any]:
    import torch

    def run(inputs: Any) -> Any:
        position = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        return model(inputs, position, None)

    return run


def measure_hf_dir(path: Path, tokens: Any, batch_size: int) -> dict[str, list[float]]:
    """An HF export (or the converted parent) as a runtime computes it."""
    import torch

    from elastic_plugin.export.calibrate import activation_fake_quant
    from elastic_plugin.export.hf import export_input_amax, load_hf_model

    model = load_hf_model(path, dtype=torch.float32).eval()
    fmt, amax = export_input_amax(path)
    if amax and fmt is not None:
        with activation_fake_quant(model, amax, fmt):
            return window_stats(hf_logits(model), tokens, batch_size)
    return window_stats(hf_logits(model), tokens, batch_size)


def measure_checkpoint(
    ckpt: Path, budget: float, tokens: Any, batch_size: int
) -> dict[str, list[float]]:
    """One budget of an elastic checkpoint (a size distilled alone: its one trained budget)."""
    from elastic_plugin.nested.model import load_nested_models

    ((model, _),) = load_nested_models(ckpt, [budget])
    return window_stats(megatron_logits(model), tokens, batch_size)


def measure_megatron(
    elastic_ckpt: Path,
    reordered: dict[str, Path],
    budgets: Sequence[float],
    tokens: Any,
    batch_size: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """fp32 budgets of the elastic checkpoint, and the same choices cut zero-shot from each
    reordered parent (``reordered``: order name -> checkpoint)."""
    from elastic_plugin.checkpoint.meta import budget_label, read_elastic_meta, stored_choice
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.model import load_nested_models, nested_model

    meta = read_elastic_meta(elastic_ckpt)
    cfg = config_from_dict(meta["config"], source=str(elastic_ckpt))
    out: dict[str, Any] = {"elastic": {}, "zero_shot": {}, "params": {}, "choices": {}}
    for budget, (model, small) in zip(budgets, load_nested_models(elastic_ckpt, list(budgets))):
        label = budget_label(budget)
        out["params"][label] = count_parameters(small).total
        out["choices"][label] = stored_choice(meta, budget, elastic_ckpt)
        out["elastic"][label] = window_stats(megatron_logits(model), tokens, batch_size)
        log(f"elastic {label}: {summarize(out['elastic'][label])}")
        del model
    for order, ckpt in reordered.items():
        ((full, _),) = load_nested_models(ckpt, [None])
        out["zero_shot"][order] = {}
        for budget in budgets:
            label = budget_label(budget)
            if out["params"][label] == count_parameters(cfg.model).total:
                continue  # every width whole: the parent itself, nothing pruned
            model, _ = nested_model(full, cfg.model, out["choices"][label])
            out["zero_shot"][order][label] = window_stats(
                megatron_logits(model), tokens, batch_size
            )
            log(f"zero-shot ({order}) {label}: {summarize(out['zero_shot'][order][label])}")
            del model
        del full
    return out


def _load_fp32(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _chat_ids(rule: Any, text: str) -> Any:
    """``text`` as one user turn of the model's chat template, ready for the reply: ``[1, n]``
    ids, by the one tokenization rule of every command (``data/token_rule.py``)."""
    import torch

    return torch.tensor([rule.chat_ids(text)])


def _greedy(model: Any, rule: Any, ids: Any, max_new_tokens: int) -> Any:
    """``ids`` followed by up to ``max_new_tokens`` greedy tokens (stock ``generate``, stopping
    at the rule's stop ids: generation_config.json's)."""
    import torch

    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(rule.stop_ids),
            pad_token_id=rule.pad_id if rule.pad_id is not None else rule.eos_id,
        )


def answer_prompts(
    path: Path, tokenizer_dir: Path, prompts: Sequence[str], max_new_tokens: int
) -> list[str]:
    """Greedy answers (chat template) of an HF directory in stock transformers."""
    from transformers import AutoTokenizer

    from elastic_plugin.data.token_rule import read_token_rule

    tok: Any = AutoTokenizer.from_pretrained(tokenizer_dir)
    rule = read_token_rule(tokenizer_dir)
    model = _load_fp32(path)
    answers = []
    for prompt in prompts:
        ids = _chat_ids(rule, prompt)
        out = _greedy(model, rule, ids, max_new_tokens)
        text: str = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        answers.append(text.strip())
    return answers


# questions whose answer a substring check settles (lower-case; any of the spellings)
CHECKABLE = (
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("How many days are in a week?", ("seven", "7")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What colour is the sky on a clear day?", ("blue",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("What do bees make?", ("honey",)),
    ("What is frozen water called?", ("ice",)),
)


def budget_control(
    parent_dir: Path,
    small_dirs: dict[str, Path],
    tokenizer_dir: Path,
    questions: Sequence[tuple[str, Sequence[str]]],
    draft_tokens: int,
    answer_tokens: int,
) -> dict[str, Any]:
    """Elastic budget control on questions whose answers can be checked, batch 1, greedy.

    SmolLM2-Instruct has no thinking block, so the small model's "thinking" is the first
    ``draft_tokens`` of the reply: it drafts them, the parent re-reads prompt + draft (the
    switch's re-prefill: the two widths share no cache) and writes the rest, up to
    ``answer_tokens`` in all. Against: the parent alone and each small model alone. Per route:
    which answers are right (the reply holds an accepted spelling), the replies, the tokens
    each model read and wrote, and the wall seconds (cache on, fp32)."""
    from transformers import AutoTokenizer

    from elastic_plugin.data.token_rule import read_token_rule

    tok: Any = AutoTokenizer.from_pretrained(tokenizer_dir)
    rule = read_token_rule(tokenizer_dir)

    def greedy(model: Any, ids: Any, new: int) -> Any:
        return _greedy(model, rule, ids, new)

    prompts = [_chat_ids(rule, question) for question, _ in questions]

    def record(route: str, runs: list[tuple[Any, Any, float]]) -> dict[str, Any]:
        replies = [tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) for ids, out, _
                   in runs]  # fmt: skip
        right = [any(a in r.lower() for a in accepted) for r, (_, accepted) in
                 zip(replies, questions)]  # fmt: skip
        return {
            "route": route,
            "correct": right,
            "replies": [r.strip() for r in replies],
            "prompt_tokens": [int(ids.shape[1]) for ids, _, _ in runs],
            "new_tokens": [int(out.shape[1] - ids.shape[1]) for ids, out, _ in runs],
            "seconds": [t for _, _, t in runs],
        }

    def timed(fn: Callable[[Any], Any], ids: Any) -> tuple[Any, Any, float]:
        start = time.perf_counter()
        out = fn(ids)
        return ids, out, time.perf_counter() - start

    def alone(model: Any) -> list[tuple[Any, Any, float]]:
        return [timed(lambda x: greedy(model, x, answer_tokens), p) for p in prompts]

    def switched(small: Any, parent: Any) -> list[tuple[Any, Any, float]]:
        def control(ids: Any) -> Any:
            draft = greedy(small, ids, draft_tokens)
            if draft.shape[1] - ids.shape[1] < draft_tokens:  # the reply ended in the draft
                return draft
            return greedy(parent, draft, answer_tokens - draft_tokens)

        return [timed(control, p) for p in prompts]

    parent = _load_fp32(parent_dir)
    routes = [record("parent", alone(parent))]
    for label, path in small_dirs.items():
        small = _load_fp32(path)
        routes.append(record(label, alone(small)))
        routes.append(record(f"{label}->parent", switched(small, parent)))
    return {
        "questions": [q for q, _ in questions],
        "accepted": [list(a) for _, a in questions],
        "draft_tokens": draft_tokens,
        "answer_tokens": answer_tokens,
        "routes": routes,
    }


def decode_speed(path: Path, batch_sizes: Sequence[int], new_tokens: int) -> dict[str, float]:
    """Greedy decode tokens/s (generated tokens per second, cache on, fp32) per batch size,
    from a fixed 16-token prompt, best of two runs."""
    import torch

    model = _load_fp32(path)
    speeds = {}
    for batch in batch_sizes:
        ids = torch.arange(100, 116).repeat(batch, 1)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                )
            best = min(best, time.perf_counter() - start)
        speeds[str(batch)] = batch * new_tokens / best
    return speeds


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
