"""``elastic-plugin verify CKPT``: is a checkpoint (or an HF export) intact, without loading a model.

    elastic-plugin verify demo_out/checkpoints/elastic
    elastic-plugin verify demo_out/checkpoints/elastic --json
    elastic-plugin verify demo_out/exports/nested          # an export: its export_meta.json

Hashes every file the checkpoint's ``elastic_meta.json`` records (``checkpoint.integrity``)
and compares size and digest: exit 0 with a summary when all match, exit 2 naming the first
missing, truncated or altered file otherwise. Imports no torch, so it is as fast as the disk.
Checkpoints saved before digests were recorded pass with "no digests recorded". Every pickle
torch would unpickle from it (``.metadata``, the ``.distcp`` byte items, ``*.pt``) is checked
against the allowlist of ``checkpoint.safe_pickle``, which a digest cannot replace: anyone who
can write a file can write its digest. A global off the allowlist is exit 2 naming both.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import resolve_checkpoint
from elastic_plugin.checkpoint.integrity import DIGEST_ALGORITHM, VerifyReport, verify_directory
from elastic_plugin.checkpoint.meta import CHECKPOINT_META, EXPORT_META, read_checkpoint_meta
from elastic_plugin.checkpoint.safe_pickle import check_checkpoint_pickles
from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.models.config import ConfigError

PROG = "elastic-plugin verify"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check a checkpoint's files against the digests recorded at save",
        description="Hash every file of a checkpoint and compare it with the size and digest "
        "recorded in its elastic_meta.json at save (no model is loaded). Exit 0 when intact, "
        "2 naming the first damaged file.",
    )
    parser.add_argument(
        "ckpt",
        metavar="CKPT",
        help="a checkpoint directory of this plugin, or an HF export it wrote (export_meta.json)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run_verify)


def format_report(report: VerifyReport) -> str:
    """One line: what was checked and how fast, or that there were no digests to check."""
    pickles = f"; {report.pickles} pickles hold only allowed globals"
    if not report.verified:
        return (
            f"{report.ckpt}: no digests recorded (saved before checkpoints recorded them); "
            f"nothing verified{pickles}"
        )
    rate = report.bytes / 1e6 / report.seconds if report.seconds > 0 else float("inf")
    return (
        f"OK {report.ckpt} ({report.kind}): {report.files} files, {report.bytes / 1e6:.1f} MB "
        f"match their {DIGEST_ALGORITHM} digests ({report.seconds:.2f} s, {rate:.0f} MB/s)"
        f"{pickles}"
    )


def run_verify(args: argparse.Namespace) -> int:
    try:
        path = Path(args.ckpt)
        if (path / EXPORT_META).is_file() and not (path / CHECKPOINT_META).is_file():
            report = verify_directory(path, _export_meta(path), EXPORT_META)
        else:
            meta = read_checkpoint_meta(args.ckpt, "CKPT")
            path = resolve_checkpoint(path)  # a stage: its newest
            report = verify_directory(path, meta)
        checked = check_checkpoint_pickles(path, use_cache=False)  # after the digests
        report.pickles = checked.files + checked.byte_items
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    if args.json:
        print(json.dumps({**asdict(report), "seconds": round(report.seconds, 3)}, indent=2))
    else:
        print(format_report(report))
    return 0


def _export_meta(path: Path) -> dict[str, Any]:
    """An export's ``export_meta.json`` (what it was cut from, and its files' digests)."""
    try:
        meta = json.loads((path / EXPORT_META).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"CKPT {path}/{EXPORT_META}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"CKPT {path}/{EXPORT_META}: not a JSON object")
    return meta
