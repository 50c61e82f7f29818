"""``--elastic-*`` command-line flags (usable as Megatron's ``extra_args_provider``).

Every flag defaults to None, so ``elastic_config_from_args`` can layer the sources:
dataclass defaults < YAML (``base`` mapping, then the ``--elastic-config`` file) < flags given on
the command line. A bad value raises ``ConfigError`` naming the flag (or file) it came from.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from elastic_plugin.elastic.config import (
    BUDGET_METRICS,
    FP8_GEMMS,
    FREEZE_SELECTS,
    MODES,
    PRECISIONS,
    ROUTER_INITS,
    TEACHERS,
    ElasticConfig,
    parse_curriculum,
)
from elastic_plugin.models.axes import ELASTIC_AXES
from elastic_plugin.models.config import ConfigError

_EXPERIMENT_SECTIONS = {"model", "parallel", "training", "data", "elastic"}


def _size(text: str) -> int | float:
    """``64`` -> absolute size 64; ``0.5`` / ``1.0`` -> fraction of the full size."""
    try:
        return int(text)
    except ValueError:
        return float(text)


_size.__name__ = "int-or-fraction"  # argparse: "invalid int-or-fraction value: 'x'"


def axis_flag(axis: str) -> str:
    return f"--elastic-{axis.replace('_', '-')}-sizes"


# (flag, field path in ElasticConfig, add_argument kwargs)
_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "--elastic-budgets",
        "budgets",
        dict(
            type=float,
            nargs="+",
            metavar="B",
            help="budgets, strictly descending in (0, 1], e.g. 1.0 0.77 0.4",
        ),
    ),
    (
        "--elastic-budget-metric",
        "budget_metric",
        dict(metavar="|".join(BUDGET_METRICS), help="what a budget is a fraction of"),
    ),
    (
        "--elastic-memory-batch-size",
        "memory.batch_size",
        dict(type=int, metavar="N", help="batch of the memory metric"),
    ),
    (
        "--elastic-memory-seq-length",
        "memory.seq_length",
        dict(type=int, metavar="N", help="sequence length of the memory metric"),
    ),
    (
        "--elastic-memory-precision",
        "memory.precision",
        dict(metavar="|".join(PRECISIONS), help="weight precision of the memory metric"),
    ),
    *(
        (
            axis_flag(axis),
            f"sizes.{axis}",
            dict(
                type=_size,
                nargs="+",
                metavar="S",
                help=f"candidate {axis} sizes: fractions (0.5) or absolute ints (64)",
            ),
        )
        for axis in ELASTIC_AXES
    ),
    (
        "--elastic-heterogeneous",
        "heterogeneous",
        dict(
            action=argparse.BooleanOptionalAction, help="per-layer sizes (embedding stays global)"
        ),
    ),
    ("--elastic-router-hidden-size", "router.hidden_size", dict(type=int, metavar="N")),
    (
        "--elastic-router-lr-mult",
        "router.lr_mult",
        dict(type=float, metavar="X", help="router lr / model lr"),
    ),
    (
        "--elastic-router-lr",
        "router.lr",
        dict(type=float, metavar="LR", help="router peak lr, absolute (instead of the lr-mult)"),
    ),
    (
        "--elastic-router-init",
        "router.init",
        dict(
            metavar="|".join(ROUTER_INITS),
            help="where the router starts: the size prior, or each budget's lowest zero-shot "
            "loss candidate measured before training (elastic/screening.py)",
        ),
    ),
    (
        "--elastic-router-screen-tokens",
        "router.screen_tokens",
        dict(
            type=int, metavar="N", help="validation tokens each screened candidate is measured on"
        ),
    ),
    (
        "--elastic-temperature",
        "router.temperature",
        dict(type=float, nargs=2, metavar=("START", "END"), help="Gumbel-Softmax temperature"),
    ),
    (
        "--elastic-logit-scale",
        "router.logit_scale",
        dict(type=float, nargs=2, metavar=("START", "END"), help="router logit scale"),
    ),
    (
        "--elastic-anneal-iters",
        "router.anneal_iters",
        dict(type=int, metavar="N", help="iterations to anneal over (default: the whole run)"),
    ),
    (
        "--elastic-router-freeze-after",
        "router.freeze_after",
        dict(
            type=int,
            metavar="N",
            help="after N iterations fix each budget's choice (the "
            "router's most likely one within 5%% of the budget); the "
            "rest trains those models",
        ),
    ),
    (
        "--elastic-router-freeze-select",
        "router.freeze_select",
        dict(
            metavar="|".join(FREEZE_SELECTS),
            help="how the freeze picks each budget's model: the router's likelihood, or the lowest "
            "validation loss among the feasible choices (elastic/freeze.py)",
        ),
    ),
    (
        "--elastic-router-freeze-candidates",
        "router.freeze_candidates",
        dict(
            type=int,
            metavar="N",
            help="with --elastic-router-freeze-select loss: evaluate the "
            "router's N most likely feasible choices per budget "
            "(default: all)",
        ),
    ),
    (
        "--elastic-soft-masks",
        "router.hard",
        dict(
            action=argparse.BooleanOptionalAction,
            help="soft masks instead of straight-through hard masks",
        ),
    ),
    (
        "--elastic-curriculum",
        "curriculum",
        dict(
            metavar="SPEC",
            help='stages "ITERS[:P1/P2/...[:SEQ]],...", e.g. "200,100:0.5/0.3/0.2:256"',
        ),
    ),
    ("--elastic-mode", "mode", dict(metavar="|".join(MODES))),
    ("--elastic-teacher", "teacher", dict(metavar="|".join(TEACHERS))),
    ("--elastic-kd-temperature", "kd_temperature", dict(type=float, metavar="T")),
    (
        "--elastic-kd-chunk-tokens",
        "kd_chunk_tokens",
        dict(
            type=int,
            metavar="N",
            help="the distillation loss runs N tokens at a time (default 1024): its FP32 "
            "[tokens, vocab/TP] temporaries are one chunk's, with the same loss and gradient",
        ),
    ),
    ("--elastic-budget-loss-weight", "budget_loss_weight", dict(type=float, metavar="W")),
    (
        "--elastic-ce-weight-full",
        "ce_weight_full",
        dict(type=float, metavar="W", help="CE weight on budget-1.0 micro-batches"),
    ),
    (
        "--elastic-fp8-gemm",
        "fp8_gemm",
        dict(
            metavar="|".join(FP8_GEMMS),
            help="the student's block linears (attention, MLPs, experts, Mamba projections) run "
            "their GEMM in FP8 E4M3 with per-tensor or per-row current scaling: "
            "torch._scaled_mm on an FP8 GPU (sm_89+), an exact emulation elsewhere; backward "
            "in the model dtype. The teacher, output layer and router stay in the model dtype",
        ),
    ),
    (
        "--elastic-interpolate",
        "interpolate",
        dict(action=argparse.BooleanOptionalAction, help="allow untrained budgets at inference"),
    ),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_elastic_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``elastic`` argument group; returns ``parser`` (Megatron's extra_args_provider)."""
    group = parser.add_argument_group(title="elastic", description="elastic nested training")
    group.add_argument(
        "--elastic-config",
        default=None,
        metavar="PATH",
        help="YAML file: its 'elastic:' section, or a top-level mapping",
    )
    for flag, _, kwargs in _FLAGS:
        group.add_argument(flag, default=None, **kwargs)
    return parser


def load_elastic_yaml(path: str | Path) -> dict[str, Any]:
    """The ``elastic:`` section of a YAML file (an experiment config), or its top-level mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--elastic-config {path}: no such file")
    with path.open() as fh:
        raw = yaml.safe_load(fh)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"--elastic-config {path}: the top level must be a mapping")
    if "elastic" in raw or set(raw) & (_EXPERIMENT_SECTIONS - {"elastic"}):
        section = raw.get("elastic") or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"--elastic-config {path}: the 'elastic' section must be a mapping")
        return dict(section)
    return dict(raw)


def _flag_value(field_path: str, value: Any) -> Any:
    if field_path == "router.hard":
        return not value  # --elastic-soft-masks
    if field_path == "curriculum":
        return parse_curriculum(value)
    return list(value) if isinstance(value, (list, tuple)) else value


def _set(raw: dict[str, Any], field_path: str, value: Any, flag: str) -> None:
    *parents, leaf = field_path.split(".")
    node = raw
    for key in parents:
        child = node.get(key)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            raise ConfigError(f"{flag}: elastic.{key} from the YAML is {child!r}, not a mapping")
        node[key] = child = dict(child)
        node = child
    node[leaf] = value


def _merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    """Later sources override earlier ones key by key, one level deep into sections
    (``router``, ``memory``, ``sizes``), so a file that sets one router key keeps the rest."""
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), Mapping):
            dst[key] = {**dst[key], **value}
        else:
            dst[key] = copy.deepcopy(value)


def elastic_config_from_args(
    args: argparse.Namespace, base: Mapping[str, Any] | None = None, base_source: str = "<dict>"
) -> ElasticConfig:
    """ElasticConfig from dataclass defaults < ``base`` < ``--elastic-config`` < explicit flags."""
    raw: dict[str, Any] = copy.deepcopy(dict(base or {}))
    source = base_source
    path = getattr(args, "elastic_config", None)
    if path:
        _merge(raw, load_elastic_yaml(path))
        source = f"--elastic-config {path}"
    origins: dict[str, str] = {}
    for flag, field_path, _ in _FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        origins[field_path] = flag
        try:
            value = _flag_value(field_path, value)
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
        _set(raw, field_path, value, flag)
    return ElasticConfig.from_dict(raw, source=source, origins=origins)
