"""llama.cpp (the ``xllamacpp`` wheel) on our GGUF files, and the weights it computes with in
transformers (tests/test_gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def llama_cpp_greedy(gguf_file: Path, text: str, max_new_tokens: int) -> dict[str, Any]:
    """llama.cpp's greedy completion of ``text`` (its own tokenizer, BOS as the file says),
    generating ``max_new_tokens`` whatever it emits: the token ids and the prompt's length."""
    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = str(gguf_file)
    params.n_ctx = 128
    params.n_predict = max_new_tokens
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.warmup = False
    server = xlc.Server(params)
    request = {"prompt": text, "n_predict": max_new_tokens, "temperature": 0.0,
               "ignore_eos": True, "cache_prompt": False, "logprobs": 1}  # fmt: skip
    result = server.handle_completions(request)
    result = json.loads(result) if isinstance(result, str) else result
    if "choices" not in result:
        raise RuntimeError(f"llama.cpp: {result}")
    content = result["choices"][0]["logprobs"]["content"]
    return {"tokens": [c["id"] for c in content], "prompt_tokens": result["usage"]["prompt_tokens"]}


def rounded_copy(hf_dir: Path, out: Path, ggml_type: str) -> Path:
    """``hf_dir`` with the weights the GGUF of ``ggml_type`` holds (matrices rounded to BF16,
    or to Q8_0 where a row divides into blocks of 32; vectors exact): transformers on this copy
    computes with llama.cpp's weights."""
    import shutil

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim < 2 or ggml_type == "f32":
                continue
            if ggml_type == "q8_0" and param.shape[-1] % 32:
                continue
            array = param.numpy()
            q = gguf.quants.quantize(array, qtype[ggml_type])
            param.copy_(
                torch.from_numpy(gguf.quants.dequantize(q, qtype[ggml_type]).reshape(array.shape))
            )
    model.save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out / name)
    return out
