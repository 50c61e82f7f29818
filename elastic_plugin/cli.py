"""``elastic-plugin``: one entry point, one subcommand per job.

Subcommands live next to the code they drive (``register_subcommand`` in each package), so this
file only assembles them. Heavy imports (torch, Megatron) happen inside the subcommands, which
keeps ``elastic-plugin params`` instant.
"""

from __future__ import annotations

import argparse
import sys


def _register_all(subparsers: argparse._SubParsersAction) -> None:
    from elastic_plugin import info, serve_check
    from elastic_plugin.checkpoint import cli as verify_cli
    from elastic_plugin.comparison import cli as compare_cli
    from elastic_plugin.data import cli as data_cli
    from elastic_plugin.elastic import cli as elastic_cli
    from elastic_plugin.evaluation import cli as evaluate_cli
    from elastic_plugin.export import cli as export_cli
    from elastic_plugin.export import import_cli
    from elastic_plugin.harness import cli as benchmarks_cli
    from elastic_plugin.importance import cli as importance_cli
    from elastic_plugin.inference import cli as generate_cli
    from elastic_plugin.models import cli as models_cli
    from elastic_plugin.nested import cli as inspect_cli
    from elastic_plugin.planning import cli as plan_cli
    from elastic_plugin.training import cli as training_cli

    # data-flow order; export's module registers `extract` and `export`
    for module in (
        models_cli,
        info,
        data_cli,
        training_cli,
        import_cli,
        importance_cli,
        elastic_cli,
        plan_cli,
        inspect_cli,
        export_cli,
        evaluate_cli,
        benchmarks_cli,
        compare_cli,
        generate_cli,
        serve_check,
        verify_cli,
    ):
        module.register_subcommand(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-plugin",
        description="Elastic nested (many-in-one) training for Megatron-Core.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _register_all(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
