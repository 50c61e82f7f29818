"""``elastic-plugin params``: parameter counts of a model config, without building the model.

Kept free of torch/Megatron imports so it answers instantly (sizing a run before a job starts).
Also runnable on its own: ``python -m elastic_plugin.models.cli params --config FILE [--json]``;
``--hf DIR`` counts a Hugging Face model of a supported family (``elastic_plugin/families/``)
from its ``config.json`` alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.families import model_config_from_hf
from elastic_plugin.models.config import ConfigError, ModelConfig, load_config
from elastic_plugin.models.counting import COMPONENTS, ParamCount, count_parameters, format_count
from elastic_plugin.models.hf_config import HF_CONFIG_FILE, read_hf_config


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Add ``params (--config FILE | --hf DIR) [--json]`` to an ``elastic-plugin`` subparser set."""
    parser = subparsers.add_parser(
        "params",
        help="count total and active parameters of a model config (no weights allocated)",
        description="Count the parameters of the Megatron-Core HybridModel a config describes. "
        "Active = what one token touches (top-k of the routed experts); embeddings count in both.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="FILE", help="model YAML config")
    source.add_argument(
        "--hf",
        metavar="DIR",
        help="a Hugging Face model directory of a supported family (its config.json alone is read)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"total": N, "active": N, "breakdown": {...}} as JSON',
    )
    parser.set_defaults(func=run_params)


def run_params(args: argparse.Namespace) -> int:
    """Print the counts; bad input (missing file, unknown key, bad value) -> stderr, exit 2."""
    try:
        model, source = _model(args)
        counts = count_parameters(model)
    except (ConfigError, yaml.YAMLError, OSError) as exc:
        return report_bad_input("elastic-plugin params", exc)
    if args.json:
        print(json.dumps(counts.to_dict()))
    else:
        print(render_table(counts, source=source))
    return 0


def _model(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    """The model to count and where it came from: ``--config`` YAML or ``--hf``'s config.json
    (a directory, or the config.json itself)."""
    if args.config is not None:
        return load_config(args.config).model, str(args.config)
    path = Path(args.hf)
    if path.is_file():
        raw, source = read_hf_config(path.parent, path.name), str(path)
    else:
        raw, source = read_hf_config(path), str(path / HF_CONFIG_FILE)
    return model_config_from_hf(raw, source), source


def render_table(counts: ParamCount, source: str = "") -> str:
    """A readable table: one row per non-empty component, then the totals."""
    rows = [
        (name, counts.breakdown[name], counts.active_breakdown[name])
        for name in COMPONENTS
        if counts.breakdown[name]
    ]
    rows.append(("TOTAL", counts.total, counts.active))
    width = max(len(name) for name, _, _ in rows)
    lines = [
        f"parameters of {source}" if source else "parameters",
        f"{'component':<{width}}  {'total':>9} {'(exact)':>15}  {'active':>9} {'(exact)':>15}",
    ]
    for i, (name, total, active) in enumerate(rows):
        if i == len(rows) - 1:
            lines.append("-" * len(lines[1]))
        lines.append(
            f"{name:<{width}}  {format_count(total):>9} {total:>15,}  "
            f"{format_count(active):>9} {active:>15,}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point until ``elastic_plugin.cli`` wires the subcommand."""
    parser = argparse.ArgumentParser(prog="elastic-plugin")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_subcommand(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
