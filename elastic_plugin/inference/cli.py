"""``elastic-plugin generate``: text completions from a checkpoint, with elastic budget control.

    elastic-plugin generate --ckpt demo_out/checkpoints/elastic --budget 0.4 --prompt "12*3="
    elastic-plugin generate --ckpt CKPT --think-budget 0.4 --answer-budget 1 --prompts-file p.txt
    elastic-plugin generate --ckpt CKPT --budget 1 --max-think-tokens 32 --prompt "12*3=" --json

Three modes: plain generation with one model (``--budget B`` of an elastic checkpoint, or an
extracted / plain checkpoint as it is); standard budget control (``--max-think-tokens N`` with one
model: ``</think>`` is forced after N thinking tokens and the answer continues on the same cache);
elastic budget control (``--think-budget B1 --answer-budget B2``: think with the nested model of
B1, answer with that of B2). Prompts are tokenized by the model's own files
(``data/token_rule.py``): its tokenizer's special tokens (a BOS exactly when it adds one; the
toy's ``<eod>``), or with ``--chat`` its chat template with the generation prompt; generation
stops at ``generation_config.json``'s EOS ids. This module parses; ``inference.request`` checks (bad input: flags, checkpoint metadata,
budgets, tokenizer, prompts, exits 2 before torch or Megatron is imported) and
``inference.command`` runs; the summary goes to stdout (one JSON object with ``--json``).
"""

from __future__ import annotations

import argparse
import json

from elastic_plugin.cli_errors import EXIT_BAD_INPUT, report_bad_input
from elastic_plugin.inference import command
from elastic_plugin.inference.request import plan_generation
from elastic_plugin.models.config import ConfigError

__all__ = ["EXIT_BAD_INPUT", "register_subcommand", "run_generate"]

PROG = "elastic-plugin generate"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a (nested) model; elastic budget control",
        description="Complete text prompts with the nested model of a trained budget of an elastic "
        "checkpoint, or with an extracted / plain checkpoint. A prompt is tokenized as the "
        "model's own tokenizer files say (the BOS exactly when its tokenizer adds one; with "
        "--chat, its chat template with the generation prompt) and generation stops at its "
        "generation_config.json EOS ids, as transformers' generate does. Elastic budget "
        "control thinks with a small nested model and answers with a larger one.",
    )
    parser.add_argument(
        "--ckpt",
        required=True,
        metavar="DIR",
        help="an elastic checkpoint (needs a budget), or an extracted / plain "
        "Megatron checkpoint of this plugin (no budget flags)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json (or a directory holding one); default: the one the "
        "checkpoint's elastic_meta.json records",
    )
    budgets = parser.add_argument_group("budgets (elastic checkpoints: trained budgets only)")
    budgets.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="B",
        help="generate with the nested model of budget B",
    )
    budgets.add_argument(
        "--think-budget",
        type=float,
        default=None,
        metavar="B1",
        help="elastic budget control: think with budget B1 until </think> (or "
        "--max-think-tokens) ...",
    )
    budgets.add_argument(
        "--answer-budget",
        type=float,
        default=None,
        metavar="B2",
        help="... then answer with budget B2",
    )
    budgets.add_argument(
        "--max-think-tokens",
        "--think-cap",
        dest="max_think_tokens",
        type=int,
        default=None,
        metavar="N",
        help="cap thinking at N tokens, then force </think>. Without "
        "--think-budget: standard budget control with one model (the answer "
        "continues on the same cache); with it: the thinking cap of elastic "
        "budget control (default: the model's context)",
    )
    prompts = parser.add_argument_group(
        "prompts (tokenized by the model's tokenizer, with its special tokens)"
    )
    source = prompts.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="a prompt (repeat for a batch); text, tokenized with the checkpoint's tokenizer",
    )
    source.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="a text file with one prompt per line (blank lines are skipped)",
    )
    prompts.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is one user message of the model's chat template, with the "
        "generation prompt (as apply_chat_template(..., add_generation_prompt=True))",
    )
    prompts.add_argument(
        "--allow-unknown-chars",
        action="store_true",
        help="generate even when a prompt has characters the tokenizer cannot represent "
        "(they become its unknown token or are dropped); refused by default",
    )
    gen = parser.add_argument_group("generation")
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens to generate (default 64); with budget control: answer tokens after </think>",
    )
    gen.add_argument(
        "--stop",
        action="extend",
        nargs="+",
        default=None,
        metavar="TOKEN",
        help="stop after any of these tokens (token strings of the checkpoint's tokenizer, "
        "e.g. </s>; default: generation_config.json's eos_token_id, one id or a list)",
    )
    gen.add_argument(
        "--greedy",
        action="store_true",
        help="greedy decoding (the default when no sampling flag is given)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="sample at temperature T > 0 (default 1 when sampling)",
    )
    gen.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample from the K most likely tokens"
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="sample from the smallest set of tokens with probability >= P",
    )
    gen.add_argument(
        "--seed", type=int, default=None, metavar="S", help="sampling seed (default 0)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of readable lines"
    )
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    try:
        plan = plan_generation(args)
        summary = command.run_plan(plan)
    except ConfigError as exc:
        return report_bad_input(PROG, exc)
    print(json.dumps(summary, indent=2) if args.json else command.format_summary(summary))
    return 0
