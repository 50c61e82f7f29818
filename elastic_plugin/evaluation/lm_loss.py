"""Language-model loss of every nested model on the user's own data: ``evaluate --data-path``.

The demo's report scores a reasoning task; a model brought in with ``import`` and trained on the
user's corpus has no such task. What its users compare instead is held-out next-token loss (and
perplexity) per nested model and precision, on the same tokens: the fp32 budgets cut out of the
elastic checkpoint (Megatron, as training measured them), every HF export of an ``export``
directory as a runtime computes it (quantized weights dequantized, calibrated activation scales
applied), and, where the export wrote one, every budget sliced from the nested directory (the
file a deployment ships). Writes ``lm_report.json``, ``lm_report.md`` and ``loss_vs_params.png``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import budget_label, read_checkpoint_meta, trained_budgets
from elastic_plugin.models.config import ConfigError, config_from_dict

__all__ = [
    "LM_REPORT_JSON",
    "LM_REPORT_MD",
    "LM_PLOT",
    "evaluate_lm",
    "megatron_loss",
    "sequence_loss_sums",
]

LM_REPORT_JSON = "lm_report.json"
LM_REPORT_MD = "lm_report.md"
LM_PLOT = "loss_vs_params.png"
PRECISIONS = ("bf16", "fp8", "nvfp4")
NESTED_DIRS = {"bf16": "nested", "fp8": "nested_fp8", "nvfp4": "nested_nvfp4"}


def _positive(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{flag}={value!r}: must be an int >= 1")


def _check_vocab(tokens: Any, vocab_size: int, tokenizer: str, data_path: str) -> None:
    """Token ids the model has no row for would index past its embedding: refuse them, naming
    the file that brought them."""
    from elastic_plugin.data.jsonl import open_tokenizer

    size = open_tokenizer(tokenizer).vocab_size
    if size > vocab_size:
        raise ConfigError(
            f"--tokenizer {tokenizer}: {size} tokens, but the model's vocabulary holds "
            f"{vocab_size} (a different tokenizer than the model was trained with?)"
        )
    top = int(tokens.max())
    if top >= vocab_size:
        raise ConfigError(
            f"--data-path {data_path}: token id {top} >= the model's vocabulary ({vocab_size}); "
            "was it prepared with another tokenizer?"
        )


def megatron_loss(model: Any, tokens: Any, micro_batch_size: int) -> float:
    """Mean next-token cross entropy of a plain Megatron model (TP=1) over ``tokens``
    ``[n, s + 1]``: logits in fp32, summed over every token, divided once."""
    sums = sequence_loss_sums(model, tokens, micro_batch_size)
    return float(sum(sums)) / (tokens.shape[0] * (tokens.shape[1] - 1))


def sequence_loss_sums(model: Any, tokens: Any, micro_batch_size: int) -> list[float]:
    """Per window of ``tokens`` ``[n, s + 1]``: the summed next-token cross entropy (fp32
    logits). Why per window: comparing two models on the same windows needs the paired
    differences, whose spread says whether a gap is more than the windows' sampling noise."""
    import torch
    import torch.nn.functional as F

    sums: list[float] = []
    with torch.no_grad():
        for batch in tokens.split(micro_batch_size):
            inputs, labels = batch[:, :-1], batch[:, 1:]
            position = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
            logits = model(inputs, position, None).float()
            losses = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
            )
            sums += losses.reshape(labels.shape).double().sum(1).tolist()
    return sums


def _export_losses(
    exports: Path, tokens: Any, micro_batch_size: int, log: Any
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Per-budget HF exports, and budgets sliced from each nested directory, measured."""
    from elastic_plugin.export.nested_hf import budget_input_amax, load_nested, read_nested_config
    from elastic_plugin.export.report import hf_validation_loss, quantized_loss

    rows = []
    for row in json.loads((exports / "exports.json").read_text())["exports"]:
        if row["precision"] not in PRECISIONS:
            continue
        loss = hf_validation_loss(Path(row["path"]), tokens, micro_batch_size)
        rows.append({"budget": row["budget"], "precision": row["precision"], "loss": loss})
        log(f"export {budget_label(row['budget'])} {row['precision']}: loss {loss:.4f}")
    nested: dict[str, dict[str, float]] = {}
    for precision, name in NESTED_DIRS.items():
        path = exports / name
        if not (path / "nested_config.json").is_file():
            continue
        nested[precision] = {}
        for entry in read_nested_config(path)["budgets"]:
            budget = float(entry["budget"])
            model = load_nested(path, budget)
            amax = budget_input_amax(path, budget)
            fmt = None if precision == "bf16" else precision
            loss = quantized_loss(model, tokens, amax, fmt, micro_batch_size)
            nested[precision][budget_label(budget)] = loss
            log(f"sliced from {name}: {budget_label(budget)}: loss {loss:.4f}")
    return rows, nested


def evaluate_lm(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    data_path: str,
    tokenizer: str,
    exports_dir: str | Path | None = None,
    num_sequences: int = 64,
    seq_length: int | None = None,
    micro_batch_size: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure (see the module docstring); everything is checked before a model is loaded."""
    from elastic_plugin.evaluation.models import budget_params
    from elastic_plugin.export.tokens import token_windows

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    exports = Path(exports_dir) if exports_dir is not None else None
    meta = read_checkpoint_meta(ckpt)
    cfg = config_from_dict(meta["config"], source=f"--ckpt {ckpt}")
    _positive("--num-sequences", num_sequences)
    _positive("--micro-batch-size", micro_batch_size)
    if seq_length is not None:
        _positive("--seq-length", seq_length)
    seq = seq_length or cfg.training.seq_length
    tokens = token_windows(data_path, num_sequences, seq, "--data-path")
    _check_vocab(tokens, cfg.model.vocab_size, tokenizer, data_path)
    if exports is not None and not (exports / "exports.json").is_file():
        raise ConfigError(
            f"--exports {exports}: no exports.json (run `elastic-plugin export` first)"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    elastic = meta.get("kind") == "elastic"
    budgets: list[float | None] = [None]
    if elastic:
        budgets = list(sorted(trained_budgets(meta), reverse=True))
    started = time.time()

    def log(message: str) -> None:
        if progress:
            print(f"[evaluate {time.time() - started:6.1f}s] {message}", flush=True)

    from elastic_plugin.nested.model import load_nested_models

    params = budget_params(ckpt, meta, budgets)
    fp32: dict[str, float] = {}
    for budget, (model, _) in zip(budgets, load_nested_models(ckpt, budgets)):
        label = "full" if budget is None else budget_label(budget)
        fp32[label] = megatron_loss(model.eval(), tokens, micro_batch_size)
        log(f"budget {label} (fp32): loss {fp32[label]:.4f}")
    export_rows, nested = (
        _export_losses(exports, tokens, micro_batch_size, log) if exports else ([], {})
    )
    rows: list[dict[str, Any]] = []
    for budget in budgets:
        label = "full" if budget is None else budget_label(budget)
        losses = {"fp32": fp32[label]}
        losses |= {
            e["precision"]: e["loss"]
            for e in export_rows
            if budget is not None and abs(e["budget"] - budget) < 1e-9
        }
        row: dict[str, Any] = {"budget": budget, "params": params[label], "loss": losses}
        sliced = {p: v[label] for p, v in nested.items() if label in v}
        if sliced:
            row["sliced_from_nested"] = sliced
        rows.append(row)
    report = {
        "task": "language modelling",
        "checkpoint": str(ckpt),
        "data_path": data_path,
        "tokenizer": tokenizer,
        "sequences": int(tokens.shape[0]),
        "seq_length": seq,
        "tokens": int(tokens[:, 1:].numel()),
        "budgets": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = [str(_plot(report, out / LM_PLOT))]
    report["seconds"] = round(time.time() - started, 1)
    (out / LM_REPORT_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / LM_REPORT_MD).write_text(lm_markdown(report))
    return report


def _plot(report: dict[str, Any], path: Path) -> Path:
    """Held-out loss against active parameters, one line per precision."""
    from elastic_plugin.evaluation.plots import finish_figure, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for precision, marker in (("fp32", "o-"), ("bf16", "s--"), ("fp8", "^--"), ("nvfp4", "v--")):
        points = sorted(
            (r["params"]["active"], r["loss"][precision], r["budget"])
            for r in report["budgets"]
            if precision in r["loss"]
        )
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker, label=precision)
    return finish_figure(
        fig,
        ax,
        path,
        "active parameters",
        "held-out loss (nats/token)",
        f"Nested models on {Path(report['data_path']).name}",
    )


def lm_markdown(report: dict[str, Any]) -> str:
    import math

    precisions = [
        p for p in ("fp32", *PRECISIONS) if any(p in r["loss"] for r in report["budgets"])
    ]
    sliced = sorted({p for r in report["budgets"] for p in r.get("sliced_from_nested", {})})
    head = ["budget", "params (total / active)"] + [f"loss {p}" for p in precisions]
    head += ["perplexity fp32"] + [f"loss {p} (sliced from nested)" for p in sliced]
    lines = [
        f"# Held-out language-model loss of every nested model on `{report['data_path']}`",
        "",
        f"{report['sequences']} sequences of {report['seq_length']} tokens "
        f"({report['tokens']:,} predicted tokens), tokenizer `{report['tokenizer']}`.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in report["budgets"]:
        label = "full" if r["budget"] is None else budget_label(r["budget"])
        cells = [label, f"{r['params']['total']:,} / {r['params']['active']:,}"]
        cells += [f"{r['loss'][p]:.4f}" if p in r["loss"] else "-" for p in precisions]
        cells.append(f"{math.exp(r['loss']['fp32']):.2f}")
        nested = r.get("sliced_from_nested", {})
        cells += [f"{nested[p]:.4f}" if p in nested else "-" for p in sliced]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in report.get("plots", [])], ""]
    return "\n".join(lines)
