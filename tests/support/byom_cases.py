"""Bring your own model, end to end on a CPU: a random transformers ``NemotronHForCausalLM`` (a
scaled-down Nemotron Nano v3, as tests/test_import_hf.py builds it) saved with a real byte-level
BPE ``tokenizer.json`` whose EOS is ``</s>`` (named only by ``tokenizer_config.json``), a JSONL
corpus, and an elastic config whose model is the imported one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support import elastic_cases

EOS = "</s>"
PAD = "<pad>"
BPE_VOCAB = 300  # byte-level: 256 bytes + 2 specials + a few merges
MODEL_VOCAB = 384  # the model's embedding rows (>= the tokenizer's ids)
_NOT_KWARGS = ("architectures", "model_type", "torch_dtype", "auto_map", "transformers_version")

SMALL_MODEL = dict(
    hidden_size=64,
    vocab_size=MODEL_VOCAB,
    hybrid_override_pattern="M*EM-E",
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    chunk_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    max_position_embeddings=256,
)

ELASTIC: dict[str, Any] = {**elastic_cases.ELASTIC, "budgets": [1.0, 0.7]}  # two budgets


def corpus(n: int = 64) -> list[str]:
    """Small English-ish documents (what the tokenizer is trained on and the JSONL holds)."""
    words = "the model reads a short line of text and learns which word comes next".split()
    return [
        " ".join(words[(i * 3 + j) % len(words)] for j in range(8 + i % 7)) + f" {i}."
        for i in range(n)
    ]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def write_bpe_tokenizer(directory: Path, texts: list[str]) -> Path:
    """A trained byte-level BPE ``tokenizer.json`` + ``tokenizer_config.json`` (eos ``</s>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    return directory / "tokenizer.json"


def write_hf_model(directory: Path, nano_config: Path, seed: int = 0) -> Path:
    """save_pretrained of a random transformers NemotronH (Nano v3's config, scaled down) with
    the BPE tokenizer beside it; eos/pad ids in config.json are the tokenizer's."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    raw = json.loads(nano_config.read_text())
    raw.update(SMALL_MODEL)
    texts = corpus()
    write_bpe_tokenizer(directory, texts)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    raw.update(eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD))
    torch.manual_seed(seed)
    config = NemotronHConfig(**{k: v for k, v in raw.items() if k not in _NOT_KWARGS})
    model = NemotronHForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory


def write_elastic_config(path: Path, ckpt_meta: dict[str, Any]) -> Path:
    """The imported model (as its checkpoint records it), short training, a 2-budget section."""
    import yaml

    config = dict(ckpt_meta["config"])
    config["training"] = dict(
        config.get("training") or {},
        seq_length=32,
        micro_batch_size=4,
        global_batch_size=4,
        train_iters=2,
        eval_interval=2,
        eval_iters=1,
        log_interval=1,
        lr_warmup_iters=0,
    )
    config["elastic"] = ELASTIC
    path.write_text(yaml.safe_dump(config))
    return path
