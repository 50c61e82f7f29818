"""A sweep of bad inputs over every subcommand: each must exit 2 with a message, never a traceback.

Run in a process of its own (``python -m tests.support.sweep_cases WORKDIR``): a few
commands start a process group before they find the input bad, which must not leak into a test
process. Prints one JSON list: per case the command line, exit code, the message and any
traceback that escaped.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path
from typing import Any

ELASTIC_YAML = str(
    Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_elastic.yaml"
)


def bad_inputs(work: Path) -> dict[str, Path]:
    """The kinds of bad path a user gives: missing, empty directory, a file where a directory
    belongs, a directory where a file belongs, truncated / non-object metadata, a checkpoint of
    the wrong kind, a checkpoint whose weights are gone."""
    made: dict[str, Path] = {"missing": work / "missing"}
    made["empty_dir"] = work / "empty_dir"
    made["empty_dir"].mkdir(parents=True, exist_ok=True)
    made["a_file"] = work / "a_file.txt"
    made["a_file"].write_text("not a checkpoint\n")
    made["empty_file"] = work / "empty_file"
    made["empty_file"].write_text("")
    truncated = work / "truncated_meta"
    truncated.mkdir(exist_ok=True)
    (truncated / "elastic_meta.json").write_text('{"kind": "elastic", "config": {"mod')
    (truncated / "export_meta.json").write_text('{"kind": "hf", "fil')
    (truncated / "config.json").write_text('{"architectures": ["NemotronHForCau')
    (truncated / "metadata.json").write_text("{}")
    made["truncated_meta"] = truncated
    not_object = work / "list_meta"
    not_object.mkdir(exist_ok=True)
    for name in ("elastic_meta.json", "export_meta.json", "config.json", "nested_config.json"):
        (not_object / name).write_text("[1, 2, 3]\n")
    (not_object / "metadata.json").write_text("{}")
    made["list_meta"] = not_object
    teacher = work / "teacher_kind"
    teacher.mkdir(exist_ok=True)
    (teacher / "elastic_meta.json").write_text(json.dumps({"kind": "teacher", "config": {}}))
    (teacher / "metadata.json").write_text("{}")
    made["wrong_kind"] = teacher
    no_weights = work / "no_weights"
    no_weights.mkdir(exist_ok=True)
    (no_weights / "elastic_meta.json").write_text(json.dumps({"kind": "elastic", "config": {}}))
    made["no_weights"] = no_weights
    return made


def commands(path: Path, out: Path) -> dict[str, list[str]]:
    """Every subcommand with ``path`` where it reads its main input (``out``: a fresh output)."""
    p, o = str(path), str(out)
    return {
        "params --config": ["params", "--config", p],
        "params --hf": ["params", "--hf", p],
        "train --config": ["train", "--config", p, "--out", o],
        "import --hf": ["import", "--hf", p, "--out", o],
        "import --megatron": ["import", "--megatron", p, "--out", o],
        "importance": ["importance", "--ckpt", p, "--out", f"{o}/scores.pt"],
        "reorder --ckpt": ["reorder", "--ckpt", p, "--scores", p, "--out", o],
        "elastic-train": ["elastic-train", "--ckpt", p, "--config", ELASTIC_YAML, "--out", o],
        "elastic-train --config": ["elastic-train", "--ckpt", p, "--config", p, "--out", o],
        "inspect": ["inspect", "--ckpt", p],
        "extract": ["extract", "--ckpt", p, "--budget", "0.4", "--out", o],
        "export": ["export", "--ckpt", p, "--out", o],
        "slice": ["slice", "--hf", p, "--budget", "0.4", "--out", o],
        "evaluate": ["evaluate", "--ckpt", p, "--out", o],
        "generate": ["generate", "--ckpt", p, "--prompt", "1+1="],
        "generate --prompts-file": ["generate", "--ckpt", p, "--prompts-file", p],
        "serve-check": ["serve-check", p],
        "verify": ["verify", p],
        "prepare-data --input": ["prepare-data", "--input", p, "--tokenizer", p, "--out", o],
    }


def run_one(argv: list[str]) -> dict[str, Any]:
    """One command in this process: exit code, stderr, and the traceback of anything raised."""
    from elastic_plugin.cli import main

    err = io.StringIO()
    escaped = None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse refusals
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException:  # noqa: BLE001 - what the sweep exists to find
            code, escaped = None, traceback.format_exc()
    return {"argv": argv, "exit": code, "stderr": err.getvalue()[-2000:], "traceback": escaped}


def sweep(workdir: str) -> list[dict[str, Any]]:
    work = Path(workdir)
    results = []
    for kind, path in bad_inputs(work).items():
        for name, argv in commands(path, work / "out" / kind).items():
            result = run_one(argv)
            results.append({"kind": kind, "command": name, **result})
    return results


if __name__ == "__main__":
    print(json.dumps(sweep(sys.argv[1])))
