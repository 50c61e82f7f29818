"""``export --gguf``: an export as a GGUF file that llama.cpp (the prebuilt ``xllamacpp``
wheel, in this process) loads and generates from with transformers' greedy tokens.

Per family (random weights; each family's tokenizer with its released byte-level split: GPT-2's,
Llama 3's, Qwen2's; a BOS added by its post-processor or not), the GGUF of the export's
directory in F32 gives llama.cpp the prompt length of our tokenization rule and transformers'
greedy tokens on the same directory exactly (llama.cpp's own tokenizer, BOS and q / k layout).
BF16 and Q8_0 files hold rounded weights and llama.cpp also rounds the activations of those
matrix products (to BF16, to Q8_0 blocks): transformers on the rounded weights is the reference,
and every token llama.cpp picks must be within 0.1 nats of transformers' best at that step
(teacher-forced on llama.cpp's tokens; measured: BF16 the same tokens for every family, Q8_0 of
the dense families within 0.07). Under Q8_0 the MoE families' routers see rounded activations
and can pick another expert, so there the first token is compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.token_rule_cases import (
    FAMILIES,
    SPLIT,
    transformers_greedy,
    write_model,
    write_tokenizer,
)

pytest.importorskip("xllamacpp")

PROMPT = "What is the capital of France? 12345 sea"
NEW = 8
TOL_NATS = 0.1
SIZES = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 16}  # rows of 32-blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``get(family)``: the family's export directory, written once."""
    work = tmp_path_factory.mktemp("gguf")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            bos = family in ("llama", "mixtral", "qwen3")
            tok = write_tokenizer(work / f"{family}_tok", bos=bos, chat=True, split=SPLIT[family])
            extra = {"moe_intermediate_size": 64} if family == "qwen3_moe" else {}
            cache[family] = write_model(work / f"{family}_hf", family, tok.parent, **SIZES, **extra)
        return cache[family]

    return get


def _logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)


# every family in F32; the rounded types on a dense and an MoE family each (all 15 pairs
# measured: BF16 the same tokens everywhere, Q8_0 dense within 0.07 nats)
CASES = [(f, "f32") for f in sorted(FAMILIES)] + [
    ("llama", "bf16"), ("qwen3_moe", "bf16"), ("qwen2", "q8_0"), ("mixtral", "q8_0"),
]  # fmt: skip


@pytest.mark.parametrize("family, ggml_type", CASES)
def test_llama_cpp_generates_transformers_tokens(models, tmp_path, family, ggml_type):
    from elastic_plugin.data.token_rule import read_token_rule
    from elastic_plugin.export.gguf import write_gguf
    from tests.support.gguf_cases import llama_cpp_greedy, rounded_copy

    model_dir = models(family)
    summary = write_gguf(model_dir, tmp_path / f"m.{ggml_type}.gguf", ggml_type)
    assert summary["architecture"] == {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2",
                                       "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[family]  # fmt: skip
    if ggml_type != "f32":  # every matrix in the type, vectors in F32
        assert summary["tensors"][ggml_type] > 0 and set(summary["tensors"]) == {ggml_type, "f32"}
    ours = llama_cpp_greedy(Path(summary["out"]), PROMPT, NEW)
    prompt = read_token_rule(model_dir).encode(PROMPT)
    assert ours["prompt_tokens"] == len(prompt)
    reference = rounded_copy(model_dir, tmp_path / "reference", ggml_type)
    expected = transformers_greedy(reference, PROMPT, False, NEW, stop=False)
    print(f"{family} {ggml_type}: llama.cpp {ours['tokens']}, transformers {expected}")
    if ggml_type == "f32":
        assert ours["tokens"] == expected
        return
    logprobs = _logprobs(reference, prompt + ours["tokens"])
    gaps = [float(logprobs[len(prompt) - 1 + i].max() - logprobs[len(prompt) - 1 + i][t])
            for i, t in enumerate(ours["tokens"])]  # fmt: skip
    print(f"  gaps to transformers' best (nats): {[round(g, 4) for g in gaps]}")
    if ggml_type == "q8_0" and family in ("mixtral", "qwen3_moe"):
        # Q8_0 activations move near-tied router scores, and a different expert is a different
        # function (measured gaps up to 2.8 nats after the first token): the first token only
        assert ours["tokens"][0] == expected[0]
        return
    assert max(gaps) <= TOL_NATS, gaps


def test_what_llama_cpp_cannot_compute_is_refused_by_name(models, tmp_path):
    from elastic_plugin.export.gguf import write_gguf
    from elastic_plugin.models.config import ConfigError

    model_dir = models("llama")
    with pytest.raises(ConfigError, match="--gguf 'q4_0': allowed: f32, bf16, q8_0"):
        write_gguf(model_dir, tmp_path / "x.gguf", "q4_0")
    config = json.loads((model_dir / "config.json").read_text())
    bad = tmp_path / "overrides"
    bad.mkdir()
    for file in model_dir.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "layer_overrides": {"0": {}}}))
    with pytest.raises(ConfigError, match="per-layer widths"):
        write_gguf(bad, tmp_path / "y.gguf")
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Whitespace"}
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="is none llama.cpp knows by name"):
        write_gguf(bad, tmp_path / "z.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_llama31_rope_scaling_is_written_as_llama_cpps_frequency_factors(tmp_path):
    """Llama 3.1's ``llama3`` RoPE scaling: the file carries ``rope_freqs`` (transformers' own
    default over ``llama3`` inverse frequencies, what llama.cpp divides by) and llama.cpp gives
    transformers' tokens in F32. (At a short prompt's positions the scaled frequencies move the
    angles by < 1e-2 rad, so this shows the file loads and computes, not the factors' size.)"""
    from elastic_plugin.export.gguf import write_gguf
    from tests.support.gguf_cases import llama_cpp_greedy

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    tok = write_tokenizer(tmp_path / "tok", bos=True, chat=False, split="llama3")
    model_dir = write_model(tmp_path / "hf", "llama", tok.parent, rope_parameters=rope, **SIZES)
    summary = write_gguf(model_dir, tmp_path / "m.gguf", "f32")
    assert summary["tensors"]["f32"] == 21  # the weights and rope_freqs
    ours = llama_cpp_greedy(Path(summary["out"]), PROMPT, NEW)
    assert ours["tokens"] == transformers_greedy(model_dir, PROMPT, False, NEW, stop=False)
    from gguf import GGUFReader

    (freqs,) = [t for t in GGUFReader(summary["out"]).tensors if t.name == "rope_freqs.weight"]
    factors = freqs.data.tolist()
    assert len(factors) == SIZES["head_dim"] // 2 and factors[0] == 1.0 and factors[-1] > 1.0
