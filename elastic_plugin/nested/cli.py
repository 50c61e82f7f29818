"""``elastic-plugin inspect``: what each budget of an elastic checkpoint is, without loading it.

    elastic-plugin inspect --ckpt demo_out/checkpoints/elastic
    elastic-plugin inspect --ckpt demo_out/checkpoints/elastic --json --batch-size 8 --seq-length 4096

An elastic checkpoint (``elastic-train``'s output) records, in ``elastic_meta.json``, the sizes the
router chose per budget. Everything shown here follows from that metadata and the model config:
sizes per axis, total / active parameters and deployment memory per precision (``ElasticCost``,
which equals ``models.counting`` exactly), so it runs in seconds with no weights read and no
Megatron import. Bad input exits with code 2 and ``elastic-plugin inspect: error: ...``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import CHECKPOINT_META, stored_choices
from elastic_plugin.checkpoint.meta import read_elastic_meta as read_meta
from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.models.config import ConfigError

PROG = "elastic-plugin inspect"

FULL_LABEL = "full"
MEMORY_PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "nvfp4")  # = elastic.config.PRECISIONS


# ------------------------------------------------------------------------------ data
@dataclass
class BudgetRow:
    """One nested model: its sizes, parameters and memory (bytes, per precision)."""

    label: str  # budget label as in the checkpoint ("0.77"), or "full"
    budget: float | None  # the trained budget (None for the full model)
    choice: dict[str, Any]  # axis -> size, or a list of sizes (one per layer)
    total_params: int
    active_params: int
    memory_bytes: dict[str, float]  # precision -> bytes (weights + KV cache + Mamba state)
    fraction: float  # cost / full cost under the checkpoint's budget metric


@dataclass
class Inspection:
    """Everything ``inspect`` reports about one elastic checkpoint."""

    ckpt: str
    iteration: int | None
    layout: dict[str, Any]
    metric: str
    batch_size: int
    seq_length: int
    axes: dict[str, dict[str, Any]]  # name -> {full, candidates, layers, unit}
    rows: list[BudgetRow] = field(default_factory=list)  # the full model first, then the budgets

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory"] = {
            "batch_size": out.pop("batch_size"),
            "seq_length": out.pop("seq_length"),
            "precisions": list(MEMORY_PRECISIONS),
        }
        return out


# ------------------------------------------------------------------------------ reading
def read_elastic_meta(ckpt: str | Path) -> dict[str, Any]:
    """The checkpoint's metadata, checked to be an elastic checkpoint's (weights not needed)."""
    return read_meta(ckpt, "--ckpt", require_weights=False)


def inspect_checkpoint(
    ckpt: str | Path, batch_size: int = 1, seq_length: int | None = None
) -> Inspection:
    """Sizes, parameters and memory of every budget of an elastic checkpoint (and the full
    model). Memory is for ``batch_size`` sequences of ``seq_length`` tokens (default: the
    model's ``max_sequence_length``)."""
    _check_positive("--batch-size", batch_size)
    if seq_length is not None:
        _check_positive("--seq-length", seq_length)
    meta = read_elastic_meta(ckpt)
    from elastic_plugin.elastic.config import ElasticConfig, MemorySpec
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.models.config import config_from_dict

    where = f"--ckpt {ckpt}: {CHECKPOINT_META}"
    try:
        cfg = config_from_dict(meta["config"])
        model = cfg.model
        ecfg = ElasticConfig.from_dict(meta["config"]["elastic"])
        stored_layout = meta.get("layout")
        layout: Mapping[str, Any] = stored_layout if isinstance(stored_layout, Mapping) else {}
        resolved = ecfg.resolve(model, int(layout.get("tp", 1)), int(layout.get("ep", 1)))
        metric = meta["elastic"].get("metric") or ecfg.budget_metric
        budget_cost = ElasticCost(model, resolved, metric=metric)  # training metric + memory spec
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    seq = seq_length if seq_length is not None else model.max_sequence_length
    counts = {m: ElasticCost(model, resolved, metric=m) for m in ("total_params", "active_params")}
    memory = {
        p: ElasticCost(model, resolved, metric="memory", memory=MemorySpec(batch_size, seq, p))
        for p in MEMORY_PRECISIONS
    }
    choices: list[tuple[str, float | None, dict[str, Any]]] = [
        (FULL_LABEL, None, resolved.full_choice())
    ]
    for label, choice in stored_choices(meta).items():
        choices.append((str(label), _budget_of(label), _checked_choice(label, choice, resolved)))
    rows = []
    for label, budget, choice in choices:
        try:
            rows.append(
                BudgetRow(
                    label=label,
                    budget=budget,
                    choice=dict(choice),
                    total_params=round(counts["total_params"].of_choice(choice)),
                    active_params=round(counts["active_params"].of_choice(choice)),
                    memory_bytes={p: c.of_choice(choice) for p, c in memory.items()},
                    fraction=budget_cost.of_choice(choice) / budget_cost.full,
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: elastic.choices[{label!r}]: {exc}") from None
    axes = {
        name: {
            "full": s.full,
            "candidates": list(s.candidates),
            "layers": list(s.layers),
            "unit": s.unit,
        }
        for name, s in resolved.axes.items()
    }
    iteration = meta.get("iteration")
    return Inspection(
        ckpt=str(ckpt),
        iteration=int(iteration) if iteration is not None else None,
        layout=dict(layout),
        metric=metric,
        batch_size=batch_size,
        seq_length=seq,
        axes=axes,
        rows=rows,
    )


def _check_positive(flag: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{flag}={value!r}; allowed: a positive integer")


def _budget_of(label: Any) -> float | None:
    try:
        return float(label)
    except (TypeError, ValueError):
        return None


def _checked_choice(label: str, choice: Any, resolved) -> dict[str, Any]:
    """One budget's sizes, checked against the axes (names, per-layer lengths, integers)."""
    prefix = f"elastic.choices[{label!r}]"
    if not isinstance(choice, Mapping):
        raise ConfigError(f"{prefix}={choice!r}; allowed: a mapping axis -> size")
    unknown = sorted(set(choice) - set(resolved.axes))
    if unknown:
        raise ConfigError(
            f"{prefix}: unknown axis {', '.join(map(str, unknown))}; axes of this "
            f"model: {', '.join(resolved.axes)}"
        )
    out: dict[str, Any] = {}
    for axis, value in choice.items():
        spec = resolved.axes[axis]
        if isinstance(value, list):
            if not spec.layers or len(value) != len(spec.layers):
                raise ConfigError(
                    f"{prefix}[{axis!r}]={value!r}; allowed: one integer"
                    + (
                        f" or {len(spec.layers)}, one per layer {list(spec.layers)}"
                        if spec.layers
                        else ""
                    )
                )
        items = value if isinstance(value, list) else [value]
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= spec.full for v in items
        ):
            raise ConfigError(
                f"{prefix}[{axis!r}]={value!r}; allowed: integers in [1, {spec.full}] ({spec.unit})"
            )
        out[axis] = list(value) if isinstance(value, list) else value
    return out


# ------------------------------------------------------------------------------ formatting
def compact_sizes(value: Any) -> str:
    """A size, or per-layer sizes run-length encoded: ``[192x2, 128]``; equal ones: ``128 (x3)``."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return str(value)
    values = list(value)
    if values and all(v == values[0] for v in values):
        return f"{values[0]} (x{len(values)})" if len(values) > 1 else f"[{values[0]}]"
    runs: list[list[Any]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "[" + ", ".join(f"{v}x{n}" if n > 1 else str(v) for v, n in runs) + "]"


def human_bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"


def format_table(info: Inspection) -> str:
    """Header lines, then one column per model (full first) and one row per quantity."""
    layout = ", ".join(f"{k}={v}" for k, v in info.layout.items()) or "unknown"
    lines = [
        f"elastic checkpoint {info.ckpt}",
        f"  iteration {info.iteration}, layout: {layout}",
        f"  budget metric: {info.metric}; memory: batch {info.batch_size} x sequence "
        f"{info.seq_length} (weights + KV cache + Mamba state)",
        "",
    ]
    header = ["", *(r.label if r.budget is None else f"budget {r.label}" for r in info.rows)]
    body: list[list[str]] = [[f"{info.metric} fraction", *(f"{r.fraction:.4f}" for r in info.rows)]]
    for axis, spec in info.axes.items():
        body.append(
            [
                f"{axis} ({spec['unit']})",
                *(compact_sizes(r.choice.get(axis, spec["full"])) for r in info.rows),
            ]
        )
    body.append(["total params", *(f"{r.total_params:,}" for r in info.rows)])
    body.append(["active params", *(f"{r.active_params:,}" for r in info.rows)])
    for p in MEMORY_PRECISIONS:
        body.append([f"memory {p}", *(human_bytes(r.memory_bytes[p]) for r in info.rows)])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        return "  ".join([first, *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))]).rstrip()

    lines += [fmt(header), fmt(["-" * w for w in widths]), *(fmt(row) for row in body)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show each budget of an elastic checkpoint: sizes, parameters, memory",
        description="Read an elastic checkpoint's metadata (no weights, no Megatron) and show, per "
        "trained budget and for the full model: the chosen size of every axis, total and active "
        "parameters, and memory (weights + KV cache + Mamba state) at bf16, fp8 and nvfp4.",
    )
    parser.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="the elastic checkpoint (elastic-plugin elastic-train: OUT/checkpoints/elastic)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="B",
        help="sequences held in memory at once (default 1)",
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        metavar="S",
        help="tokens per sequence for the KV cache (default: the model's max_sequence_length)",
    )
    parser.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    try:
        info = inspect_checkpoint(args.ckpt, args.batch_size, args.seq_length)
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    print(json.dumps(info.to_json(), indent=2) if args.json else format_table(info))
    return 0
