"""Every nested model of an elastic checkpoint, in every precision, measured: ``export_all``.

For each trained budget it writes the plain Megatron checkpoint (homogeneous choices) and the
Hugging Face export in BF16, FP8 and NVFP4, then measures each HF export as a user
would run it (``transformers``, weights as stored; quantized ones dequantized to the exact values
they hold) on the same validation tokens: validation loss, and its change relative to BF16. It
also reports the point of the method: one nested checkpoint holds every model, against the sum
of separate checkpoints. Written to ``exports.json``, ``exports.md`` and ``exports.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import (
    budget_label,
    read_elastic_meta,
    stored_choices,
    trained_budgets,
)
from elastic_plugin.export.extract import (
    ExtractPlan,
    QuantOptions,
    load_source,
    plan_extraction,
    run_extraction,
)
from elastic_plugin.export.hf_compat import QUANTIZE_FORMATS
from elastic_plugin.export.tokens import validation_tokens
from elastic_plugin.models.config import ConfigError

PRECISIONS = ("bf16", *QUANTIZE_FORMATS)
REPORT_JSON = "exports.json"
REPORT_MD = "exports.md"
REPORT_PNG = "exports.png"

__all__ = ["export_all", "PRECISIONS", "validation_tokens", "hf_validation_loss"]


@dataclass
class _Job:
    budget: float
    precision: str  # "megatron" (the plain Megatron checkpoint) or an HF precision
    plan: ExtractPlan


def _plans(
    ckpt: Path,
    out: Path,
    precisions: Sequence[str],
    megatron: bool,
    max_shard_size: str | int | None = None,
    quant: QuantOptions | None = None,
) -> list[_Job]:
    """Every export, checked before anything is loaded."""
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise ConfigError(f"--precisions {','.join(precisions)}: allowed: {', '.join(PRECISIONS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {out}: exists and is not an empty directory (nothing is overwritten)"
        )
    meta = read_elastic_meta(ckpt)
    jobs = []
    choices = stored_choices(meta)
    for budget in sorted(trained_budgets(meta), reverse=True):
        choice = choices.get(budget_label(budget), {})
        per_layer = any(isinstance(v, list) and len(set(v)) > 1 for v in choice.values())
        if megatron and not per_layer:
            jobs.append(
                _Job(
                    budget,
                    "megatron",
                    plan_extraction(ckpt, budget, out / f"megatron_{budget_label(budget)}"),
                )
            )
        for precision in precisions:
            quantize = None if precision == "bf16" else precision
            jobs.append(
                _Job(
                    budget,
                    precision,
                    plan_extraction(
                        ckpt,
                        budget,
                        out / f"hf_{budget_label(budget)}_{precision}",
                        fmt="hf",
                        dtype="bf16",
                        quantize=quantize,
                        max_shard_size=max_shard_size,
                        quant=quant if quantize else None,
                    ),
                )
            )
    return jobs


# ------------------------------------------------------------------------------ evaluation
def model_loss(model, tokens, batch_size: int = 8) -> float:
    """Mean next-token cross entropy of a transformers model over ``tokens`` (fp32 compute)."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for batch in tokens.split(batch_size):
            logits = model(batch[:, :-1]).logits
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                batch[:, 1:].reshape(-1),
                reduction="sum",
            )
            total += loss.item()
            count += batch[:, 1:].numel()
    return total / count


def quantized_loss(
    model, tokens, input_amax: dict[str, float], fmt: str | None, batch_size: int = 8
) -> float:
    """:func:`model_loss` with the export's static activation quantization applied (ModelOpt's
    fake quant of each calibrated module's input), as a runtime computes; weight-only exports
    (no ``input_amax``) as they are."""
    if not input_amax or fmt is None:
        return model_loss(model, tokens, batch_size)
    from elastic_plugin.export.calibrate import activation_fake_quant

    with activation_fake_quant(model, input_amax, fmt):
        return model_loss(model, tokens, batch_size)


def hf_validation_loss(path: Path, tokens, batch_size: int = 8) -> float:
    """Validation loss of an HF export as a runtime computes it: weights as stored (quantized
    ones dequantized to their exact values), activations quantized with its ``input_scale``."""
    import torch

    from elastic_plugin.export.hf import export_input_amax, load_hf_model

    model = load_hf_model(path, dtype=torch.float32)
    fmt, amax = export_input_amax(path)
    return quantized_loss(model, tokens, amax, fmt, batch_size)


# ------------------------------------------------------------------------------ the job
def export_all(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    precisions: Sequence[str] = PRECISIONS,
    megatron: bool = True,
    eval_sequences: int = 64,
    progress: bool = True,
    max_shard_size: str | int | None = None,
    nested: bool = False,
    quant: QuantOptions | None = None,
    gguf: Sequence[str] = (),
) -> dict[str, Any]:
    """Export every trained budget (see the module docstring); returns the report dict.
    ``max_shard_size``: of the HF exports' safetensors shards (default 5GB). ``quant``: how the
    FP8 / NVFP4 exports are made (block alignment, activation calibration). ``nested``: also
    write one directory per precision serving every budget (``OUT/nested`` for BF16,
    ``OUT/nested_fp8``, ``OUT/nested_nvfp4``; ``export.nested_hf``), check that each budget
    sliced from it equals that budget's own export, and measure the sliced budgets."""
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    precisions = list(precisions)
    _check_gguf(gguf, precisions)
    jobs = _plans(ckpt, out, precisions, megatron, max_shard_size, quant)
    meta = jobs[0].plan.meta
    out.mkdir(parents=True, exist_ok=True)
    seq_length = (quant or QuantOptions()).sequence_length(meta)
    tokens = validation_tokens(meta, eval_sequences, seq_length) if eval_sequences else None
    start = time.time()
    source = load_source(jobs[0].plan)
    rows = []
    for index, job in enumerate(jobs, 1):
        began = time.time()
        summary = run_extraction(job.plan, source)
        row = {
            "budget": job.budget,
            "precision": job.precision,
            "path": summary["out"],
            "bytes": summary["bytes"],
            "params": summary["params"],
            "choice": summary["choice"],
            "seconds": round(time.time() - began, 3),
        }
        if tokens is not None and job.precision != "megatron":
            row["valid_loss"] = hf_validation_loss(Path(summary["out"]), tokens)
        rows.append(row)
        if progress:
            loss = f", valid loss {row['valid_loss']:.4f}" if "valid_loss" in row else ""
            print(
                f"[{index}/{len(jobs)}] budget {budget_label(job.budget)} {job.precision}: "
                f"{row['bytes'] / 1e6:.2f} MB{loss} ({row['seconds']:.1f} s)",
                flush=True,
            )
    nested_report = (
        {
            p: _nested(ckpt, out, source, rows, max_shard_size, p, quant, tokens, progress)
            for p in precisions
        }
        if nested
        else None
    )
    del source
    gguf_rows = _gguf(out, rows, gguf, progress)
    report = {
        "source": str(ckpt),
        "eval": {"sequences": 0 if tokens is None else len(tokens), "seq_length": seq_length},
        "quant": dataclasses.asdict(quant or QuantOptions()),
        "exports": rows,
        "recovery": _recovery(rows),
        "sizes": _sizes(rows, ckpt),
        **({"nested": nested_report} if nested_report is not None else {}),
        **({"gguf": gguf_rows} if gguf else {}),
        "seconds": round(time.time() - start, 2),
    }
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2) + "\n")
    (out / REPORT_MD).write_text(markdown(report))
    plot_exports(report, out / REPORT_PNG)
    return report


def _check_gguf(types: Sequence[str], precisions: Sequence[str]) -> None:
    """``--gguf`` types are known and have the BF16 exports they are written from."""
    from elastic_plugin.export.gguf import GGUF_TYPES

    bad = [t for t in types if t not in GGUF_TYPES]
    if bad:
        raise ConfigError(f"--gguf {' '.join(types)}: allowed: {', '.join(GGUF_TYPES)}")
    if types and "bf16" not in precisions:
        raise ConfigError(
            f"--gguf is written from the BF16 exports: add bf16 to --precisions "
            f"{','.join(precisions)}"
        )


def _gguf(out: Path, rows: list[dict[str, Any]], types: Sequence[str], progress: bool) -> list:
    """Each budget's BF16 export as GGUF files (``OUT/gguf/<budget>.<type>.gguf``)."""
    from elastic_plugin.export.gguf import write_gguf

    written: list[dict[str, Any]] = []
    for row in rows:
        if row["precision"] != "bf16":
            continue
        config = json.loads((Path(row["path"]) / "config.json").read_text())
        if config.get("layer_overrides"):  # llama.cpp builds every layer of a kind alike
            reason = "per-layer widths (layer_overrides): no llama.cpp form"
            written.append({"budget": row["budget"], "skipped": reason})
            continue
        for ggml_type in types:
            label = budget_label(row["budget"])
            target = out / "gguf" / f"{label}.{ggml_type}.gguf"
            summary = write_gguf(row["path"], target, ggml_type)
            written.append({"budget": row["budget"], **summary})
            if progress:
                print(
                    f"gguf budget {label} {ggml_type}: {summary['bytes'] / 1e6:.2f} MB", flush=True
                )
    return written


def nested_dir_name(precision: str) -> str:
    """``nested`` (BF16) or ``nested_<precision>``: where ``export --nested`` writes it."""
    return "nested" if precision == "bf16" else f"nested_{precision}"


def _nested(
    ckpt: Path,
    out: Path,
    source: Any,
    rows: list[dict[str, Any]],
    max_shard_size: str | int | None,
    precision: str,
    quant: QuantOptions | None,
    tokens: Any,
    progress: bool,
) -> dict[str, Any]:
    """Write one precision's nested directory; measure its bytes against that precision's
    separate exports, check every budget sliced from it against that budget's own export tensor
    by tensor, and measure the sliced budgets' validation loss (activation quantization applied)."""
    from elastic_plugin.checkpoint.hub import from_hub, read_hub_tensors
    from elastic_plugin.export.nested_hf import (
        budget_input_amax,
        load_nested,
        sliced_tensors,
        write_nested_export,
    )
    from elastic_plugin.export.quantize import same_bits

    quantize = None if precision == "bf16" else precision
    path = out / nested_dir_name(precision)
    written = write_nested_export(
        ckpt, path, source, "bf16", max_shard_size, quantize, quant if quantize else None
    )
    mine = [r for r in rows if r["precision"] == precision]
    equal, losses = {}, {}
    for r in mine:
        label = budget_label(r["budget"])
        sliced = sliced_tensors(path, r["budget"])
        exported = from_hub(read_hub_tensors(r["path"]))
        equal[label] = sliced.keys() == exported.keys() and all(
            same_bits(sliced[k].to(exported[k].dtype), exported[k]) for k in exported
        )
        if tokens is not None:
            model = load_nested(path, r["budget"])
            amax = budget_input_amax(path, r["budget"])
            losses[label] = quantized_loss(model, tokens, amax, quantize)
    separate = sum(r["bytes"] for r in mine)
    if progress:
        print(
            f"nested {precision}: {written['bytes'] / 1e6:.2f} MB (separate: "
            f"{separate / 1e6:.2f} MB); sliced == export: {equal}",
            flush=True,
        )
    return {
        "path": written["out"],
        "bytes": written["bytes"],
        "separate_bytes": separate,
        "saving": 1 - written["bytes"] / separate if separate else None,
        "sliced_equals_export": equal,
        **({"sliced_valid_loss": losses} if losses else {}),
    }


def _recovery(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget and quantized precision: loss change and ratio vs the BF16 export."""
    base = {r["budget"]: r for r in rows if r["precision"] == "bf16" and "valid_loss" in r}
    out = []
    for r in rows:
        ref = base.get(r["budget"])
        if ref is None or r["precision"] in ("bf16", "megatron") or "valid_loss" not in r:
            continue
        out.append(
            {
                "budget": r["budget"],
                "precision": r["precision"],
                "valid_loss": r["valid_loss"],
                "bf16_valid_loss": ref["valid_loss"],
                "delta_loss": r["valid_loss"] - ref["valid_loss"],
                "loss_ratio": r["valid_loss"] / ref["valid_loss"],
                "bytes_ratio": r["bytes"] / ref["bytes"],
            }
        )
    return out


def _sizes(rows: list[dict[str, Any]], ckpt: Path) -> dict[str, Any]:
    """One nested checkpoint vs separate ones, per precision: the largest budget's export holds
    every nested model (they are its prefixes); separate checkpoints sum the exports."""
    out: dict[str, Any] = {
        "elastic_checkpoint_bytes": sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    }
    for precision in sorted({r["precision"] for r in rows}):
        mine = [r for r in rows if r["precision"] == precision]
        nested = max(mine, key=lambda r: r["budget"])["bytes"]
        separate = sum(r["bytes"] for r in mine)
        out[precision] = {
            "nested_bytes": nested,
            "separate_bytes": separate,
            "saving": 1 - nested / separate,
            "models": len(mine),
        }
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Nested model exports",
        "",
        f"Source: `{report['source']}`; validation: "
        f"{report['eval']['sequences']} sequences of {report['eval']['seq_length']} tokens.",
        "",
        "| budget | format | params (total / active) | size (MB) | valid loss |",
        "|---|---|---|---|---|",
    ]
    for r in report["exports"]:
        loss = f"{r['valid_loss']:.4f}" if "valid_loss" in r else "-"
        lines.append(
            f"| {budget_label(r['budget'])} | {r['precision']} | {r['params']['total']:,} / "
            f"{r['params']['active']:,} | {r['bytes'] / 1e6:.3f} | {loss} |"
        )
    if report["recovery"]:
        lines += [
            "",
            "## Quantized vs BF16",
            "",
            "| budget | format | Δ valid loss | loss ratio | bytes ratio |",
            "|---|---|---|---|---|",
        ]
        for r in report["recovery"]:
            lines.append(
                f"| {budget_label(r['budget'])} | {r['precision']} | {r['delta_loss']:+.4f} | "
                f"{r['loss_ratio']:.4f} | {r['bytes_ratio']:.3f} |"
            )
    lines += [
        "",
        "## One nested checkpoint vs separate checkpoints",
        "",
        "| format | models | nested (MB) | separate (MB) | saving |",
        "|---|---|---|---|---|",
    ]
    for precision, s in report["sizes"].items():
        if isinstance(s, dict):
            lines.append(
                f"| {precision} | {s['models']} | {s['nested_bytes'] / 1e6:.3f} | "
                f"{s['separate_bytes'] / 1e6:.3f} | {100 * s['saving']:.1f}% |"
            )
    lines += [
        "",
        f"The elastic checkpoint itself (weights, router, optimizer state): "
        f"{report['sizes']['elastic_checkpoint_bytes'] / 1e6:.3f} MB.",
        "",
    ]
    nested = report.get("nested")
    if nested:
        lines += [
            "## One nested directory per precision (export --nested)",
            "",
            "Measured on disk; every budget sliced from it (`elastic-plugin slice`, `load_nested`)"
            " is compared with its own export, tensor by tensor, and evaluated.",
            "",
            "| format | nested (MB) | separate (MB) | saving | sliced == export | "
            "sliced valid loss |",
            "|---|---|---|---|---|---|",
        ]
        for precision, n in nested.items():
            same = ", ".join(
                f"{b}: {'yes' if ok else 'NO'}" for b, ok in n["sliced_equals_export"].items()
            )
            loss = ", ".join(f"{b}: {v:.4f}" for b, v in (n.get("sliced_valid_loss") or {}).items())
            lines.append(
                f"| {precision} | {n['bytes'] / 1e6:.3f} | {n['separate_bytes'] / 1e6:.3f} | "
                f"{100 * (n['saving'] or 0):.1f}% | {same} | {loss or '-'} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_exports(report: dict[str, Any], path: Path) -> Path | None:
    """Validation loss against bytes on disk, one line per precision, points labelled by budget."""
    rows = [r for r in report["exports"] if "valid_loss" in r and math.isfinite(r["valid_loss"])]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for precision in PRECISIONS:
        mine = sorted((r for r in rows if r["precision"] == precision), key=lambda r: r["bytes"])
        if not mine:
            continue
        ax.plot(
            [r["bytes"] / 1e6 for r in mine], [r["valid_loss"] for r in mine], "o-", label=precision
        )
        for r in mine:
            ax.annotate(
                budget_label(r["budget"]),
                (r["bytes"] / 1e6, r["valid_loss"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(3, 3),
            )
    ax.set_xlabel("export size on disk (MB)")
    ax.set_ylabel("validation loss")
    ax.set_title("Nested models: size vs quality per precision")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
