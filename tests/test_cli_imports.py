"""Parsing a command line imports no torch: `elastic-plugin`'s parser is built from every
command's ``cli`` module, so a bad flag fails in a fraction of a second, before the seconds it
takes to import torch and Megatron (``cli.py``'s promise; ``compat/lazy.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "megatron", "transformers", "numpy", "safetensors", "modelopt")

_PROBE = """
import json, sys
from elastic_plugin.cli import build_parser
parser = build_parser()
commands = sorted(parser._subparsers._group_actions[0].choices)
for argv in (["params", "--config", "x.yaml"], ["elastic-train", "--ckpt", "c", "--out", "o"],
             ["export", "--ckpt", "c", "--out", "o"], ["importance", "--ckpt", "c", "--out", "o"]):
    parser.parse_args(argv)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
print(json.dumps({"commands": commands, "heavy": heavy}))
"""


@pytest.mark.integration
def test_building_the_parser_and_parsing_import_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}" + _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"train", "elastic-train", "export", "generate", "importance", "plan"} <= set(
        result["commands"]
    )
    assert result["heavy"] == [], f"parsing imported {result['heavy'][:10]}"
