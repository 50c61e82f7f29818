"""Every subcommand against every kind of bad path a user gives (missing, an empty directory, a
file where a directory belongs, truncated or non-object metadata, a checkpoint of the wrong kind,
one whose weights are gone): each exits 2 with ``PROG: error:`` naming the path, no traceback
escapes, and no output is created."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOWN = {  # the name each kind of bad input must be reported by
    "missing": "missing",
    "empty_dir": "empty_dir",
    "a_file": "a_file.txt",
    "empty_file": "empty_file",
    "truncated_meta": "truncated_meta",
    "list_meta": "list_meta",
    "wrong_kind": "teacher_kind",
    "no_weights": "no_weights",
}
# verify on a complete checkpoint that records no digests passes it unchecked, by design
# (checkpoints written before digests existed), and says "nothing verified"
EXPECTED_PASS = {("wrong_kind", "verify")}


@pytest.mark.integration
def test_every_subcommand_refuses_every_bad_path_cleanly(tmp_path):
    from tests.support.sweep_cases import commands

    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.sweep_cases", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(SHOWN) * len(commands(tmp_path, tmp_path))
    problems = []
    for r in results:
        if (r["kind"], r["command"]) in EXPECTED_PASS:
            ok = r["exit"] == 0 and not r["traceback"]
        else:
            ok = (
                r["exit"] == 2
                and not r["traceback"]
                and ": error: " in r["stderr"]
                and SHOWN[r["kind"]] in r["stderr"]
                and "Traceback" not in r["stderr"]
            )
        if not ok:
            problems.append((r["kind"], r["command"], r["exit"], r["traceback"] or r["stderr"]))
    counts = Counter("ok" if all(p[:2] != (r["kind"], r["command"]) for p in problems) else "bad"
                     for r in results)  # fmt: skip
    print(f"bad-input sweep: {len(results)} cases, {dict(counts)}")
    assert not problems, problems[:5]
    assert not (tmp_path / "out").exists(), "a refused command created its output"
