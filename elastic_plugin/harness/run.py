"""One benchmark run through lm-eval as a library, and what it measured.

:func:`open_model` gives the lm-eval model of a checkpoint of this plugin at a budget (our class,
``harness.lm``) or of any Hugging Face directory (lm-eval's own ``hf`` model on the transformers
model ``export.hf.load_hf_model`` builds: FP8 / NVFP4 exports dequantized, every family);
:func:`evaluate_tasks` runs ``lm_eval.simple_evaluate`` on the local tasks (``harness.tasks``,
lm-eval's built-in task index switched off so nothing online is consulted); :func:`summarize`
turns lm-eval's results into one row per task: its headline metric, the standard error lm-eval
computed, the number of documents and the accuracy of guessing (the mean of 1 / choices over
the evaluated documents; 0 where no choice is offered).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "HEADLINE",
    "TaskResult",
    "evaluate_tasks",
    "format_results",
    "offline",
    "open_model",
    "summarize",
]

# the metric a task's row reports (lm-eval reports every metric; the papers quote these)
HEADLINE = {
    "hellaswag": "acc_norm",
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "piqa": "acc_norm",
    "openbookqa": "acc_norm",
    "sciq": "acc_norm",
    "gsm8k": "exact_match,strict-match",
    "gsm8k_cot": "exact_match,strict-match",
    "nq_open": "exact_match,remove_whitespace",
    "triviaqa": "exact_match,remove_whitespace",
}


def offline() -> None:
    """No hub access from datasets / transformers / lm-eval: everything is local. lm-eval's
    bootstrapped standard errors (perplexity, F1) run in this process, not in a pool forked from
    a process holding torch and a process group (``DISABLE_MULTIPROC``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DISABLE_MULTIPROC", "1")


def open_model(
    ckpt: str | None = None,
    budget: float | None = None,
    hf: str | None = None,
    batch_size: int = 16,
    tokenizer: str | None = None,
) -> Any:
    """The lm-eval model of ``ckpt`` at ``budget`` (ours) or of the HF directory ``hf``
    (lm-eval's ``hf`` class, FP32, on the CPU or the first GPU)."""
    offline()
    if (ckpt is None) == (hf is None):
        from elastic_plugin.models.config import ConfigError

        raise ConfigError("give --ckpt (a checkpoint of this plugin) or --hf (a HF directory)")
    if ckpt is not None:
        from elastic_plugin.harness.lm import ElasticLM

        return ElasticLM(ckpt, budget=budget, tokenizer=tokenizer, batch_size=batch_size)
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from elastic_plugin.export.hf import load_hf_model

    assert hf is not None  # one of the two, checked above
    model = load_hf_model(hf, torch.float32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFLM(
        pretrained=model.to(device).eval(),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer or hf),
        batch_size=batch_size,
        device=device,
    )


def evaluate_tasks(
    lm: Any,
    tasks: Sequence[str],
    tasks_dir: str | os.PathLike,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 1000,
    seed: int = 1234,
    gen_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` (written by ``tasks.write_tasks`` into
    ``tasks_dir``), every sample logged (the per-example answers; the guessing accuracy);
    ``gen_kwargs`` override the tasks' generation settings (e.g. ``max_gen_toks``)."""
    offline()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        bootstrap_iters=bootstrap_iters,
        log_samples=True,
        task_manager=manager,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        gen_kwargs=dict(gen_kwargs) if gen_kwargs else None,
    )
    if results is None:  # lm-eval returns None on non-zero ranks only
        raise RuntimeError("lm_eval.simple_evaluate returned nothing")
    return results


class TaskResult(dict):
    """``{"task", "metric", "value", "stderr", "n", "chance", "fewshot"}`` (a dict, JSON-ready)."""


def _chance(samples: Sequence[Mapping[str, Any]], output_type: str | None) -> float:
    if output_type != "multiple_choice" or not samples:
        return 0.0
    return float(sum(1.0 / max(len(s["arguments"]), 1) for s in samples) / len(samples))


def _headline(task: str, metrics: Mapping[str, Any]) -> str:
    preferred = HEADLINE.get(task)
    if preferred is not None:
        key = preferred if "," in preferred else f"{preferred},none"
        if key in metrics:
            return key
    for candidate in ("acc,none", "exact_match,strict-match", "exact_match,none", "acc_norm,none"):
        if candidate in metrics:
            return candidate
    names = [k for k in metrics if "," in k and not k.split(",")[0].endswith("_stderr")]
    return sorted(names)[0]


def summarize(results: Mapping[str, Any]) -> list[TaskResult]:
    """One row per evaluated task (groups: lm-eval's size-weighted aggregate, chance 0.25 for
    MMLU's four choices read from its subjects' samples)."""
    rows: list[TaskResult] = []
    configs = results.get("configs", {})
    samples = results.get("samples", {})
    for task, metrics in results["results"].items():
        key = _headline(task, metrics)
        if "," not in key:
            key = f"{key},none"
        name, filt = key.split(",", 1)
        value = metrics.get(key)
        stderr = metrics.get(f"{name}_stderr,{filt}")
        config = configs.get(task, {})
        if task in samples:
            n = len(samples[task])
            chance = _chance(samples[task], config.get("output_type"))
        else:  # a group: its members' samples
            members = results.get("group_subtasks", {}).get(task, [])
            docs = [s for m in members for s in samples.get(m, [])]
            n = len(docs)
            types = {configs.get(m, {}).get("output_type") for m in members}
            chance = _chance(docs, types.pop() if len(types) == 1 else None)
        rows.append(
            TaskResult(
                task=task,
                metric=key,
                value=None if value is None else float(value),
                stderr=None
                if not isinstance(stderr, (int, float)) or math.isnan(stderr)
                else float(stderr),
                n=n,
                chance=chance,
                fewshot=results.get("n-shot", {}).get(task),
            )
        )
    return rows


def format_results(rows: Sequence[Mapping[str, Any]], title: str = "") -> str:
    """A plain-text table: task, metric, value +- standard error, documents, guessing."""
    lines = [title] if title else []
    lines.append(
        f"{'task':34s} {'metric':30s} {'value':>8s} {'stderr':>8s} {'n':>6s} {'chance':>7s}"
    )
    for r in rows:
        value = "n/a" if r["value"] is None else f"{r['value']:.4f}"
        stderr = "n/a" if r["stderr"] is None else f"{r['stderr']:.4f}"
        lines.append(
            f"{r['task']:34s} {r['metric']:30s} {value:>8s} {stderr:>8s} {r['n']:>6d} "
            f"{r['chance']:>7.3f}"
        )
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: Mapping[str, Any]) -> None:
    import json

    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
