"""``elastic-plugin prepare-data``: write the demo's tokenizer, indexed datasets and held-out set,
or (``--input FILE.jsonl --tokenizer tokenizer.json``) a user's text as indexed datasets."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .tasks import available_tasks


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Add ``prepare-data`` to the ``elastic-plugin`` command line."""
    p = subparsers.add_parser(
        "prepare-data",
        help="generate reasoning problems and write Megatron indexed datasets",
        description=(
            "Generate reasoning-gym problems (PROMPT<think>STEPS</think>ANSWER), train a small "
            "tokenizer and write tokenizer.json, train/valid_text_document.{bin,idx}, "
            "heldout.jsonl and meta.json into --out (reused when the settings match). With "
            "--input FILE.jsonl --tokenizer TOKENIZER_JSON: your JSONL text (--text-key) as "
            "train/valid_text_document.{bin,idx} + meta.json, each document ended by the "
            "tokenizer's EOS (for importance / elastic-train --data-path)."
        ),
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--task",
        default="chain_sum",
        choices=available_tasks(),
        help="reasoning task (default: chain_sum)",
    )
    p.add_argument(
        "--num-train", type=int, default=50_000, help="training examples (default: 50000)"
    )
    p.add_argument("--num-valid", type=int, default=500, help="held-out examples (default: 500)")
    p.add_argument("--seed", type=int, default=1234, help="training-set seed (default: 1234)")
    p.add_argument(
        "--heldout-seed", type=int, default=None, help="held-out seed (default: seed + 1)"
    )
    p.add_argument(
        "--task-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a reasoning-gym config field, e.g. --task-arg max_digits=1 (repeatable)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="BPE vocabulary size (default: character-level)",
    )
    p.add_argument(
        "--input",
        default=None,
        metavar="FILE.jsonl",
        help="your text, one JSON object a line (instead of --task)",
    )
    p.add_argument(
        "--text-key", default="text", help="--input: the field holding the text (default: text)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="TOKENIZER_JSON",
        help="--input: the model's tokenizer.json (an import's CKPT/iter_0000000/hf_tokenizer/tokenizer.json)",
    )
    p.add_argument(
        "--valid-fraction",
        type=float,
        default=0.05,
        help="--input: share of documents held out as valid (default: 0.05)",
    )
    p.add_argument("--force", action="store_true", help="regenerate even if --out matches")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run_prepare_data)


def parse_task_args(items: list[str]) -> dict[str, Any]:
    """``["max_digits=1", "allow_negation=true"]`` -> ``{"max_digits": 1, "allow_negation": True}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--task-arg must be KEY=VALUE, got {item!r}")
        lowered = raw.strip().lower()
        if lowered in ("true", "false"):
            out[key.strip()] = lowered == "true"
        else:
            try:
                out[key.strip()] = int(raw)
            except ValueError:
                try:
                    out[key.strip()] = float(raw)
                except ValueError:
                    out[key.strip()] = raw
    return out


def run_prepare_data(args: argparse.Namespace) -> int:
    """Run ``prepare_dataset`` from parsed arguments; prints a summary, returns an exit code."""
    if args.input is not None or args.tokenizer is not None:
        return _run_jsonl(args)
    from .prepare import prepare_dataset

    try:
        prepared = prepare_dataset(
            args.out,
            task=args.task,
            num_train=args.num_train,
            num_valid=args.num_valid,
            seed=args.seed,
            heldout_seed=args.heldout_seed,
            task_kwargs=parse_task_args(args.task_arg),
            vocab_size=args.vocab_size,
            force=args.force,
            progress=not args.no_progress,
        )
    except (ValueError, TypeError) as err:
        print(f"prepare-data: error: {err}", file=sys.stderr)
        return 2
    meta = prepared.meta
    state = "reused" if prepared.reused else "wrote"
    print(
        f"{state} {prepared.out_dir}: task {meta['task']}, {meta['counts']['train']} train / "
        f"{meta['counts']['valid']} held-out examples, vocab {meta['vocab_size']}, "
        f"{meta['tokens']['per_example_mean']} tokens/example, "
        f"{meta['overlaps_removed']} train/held-out overlaps removed"
    )
    return 0


def _run_jsonl(args: argparse.Namespace) -> int:
    """``--input``: check every line and the tokenizer, then write; exit 2 on bad input."""
    import json

    from .jsonl import prepare_jsonl

    try:
        if args.input is None or args.tokenizer is None:
            raise ValueError("--input and --tokenizer go together (your JSONL and its tokenizer)")
        meta = prepare_jsonl(
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            text_key=args.text_key,
            valid_fraction=args.valid_fraction,
            seed=args.seed,
            force=args.force,
            progress=not args.no_progress,
        )
    except ValueError as err:
        print(f"prepare-data: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(meta, indent=2))
    return 0
