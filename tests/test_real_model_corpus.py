"""The offline English corpus of ``make demo-real`` (elastic_plugin/data/corpus.py): topics that
share text are one document, the splits are disjoint by document and share no paragraph, and
the indexed files hold exactly each split's text (tokenized, EOS-terminated)."""

from __future__ import annotations

import json

import pytest

from elastic_plugin.data.corpus import (
    MIN_SHARED_CHARS,
    CorpusError,
    merge_overlapping,
    prepare_corpus,
    python_reference_documents,
    split_documents,
)


def _long_paragraphs(text: str) -> set[str]:
    return {p.strip() for p in text.split("\n\n") if len(p.strip()) >= MIN_SHARED_CHARS}


def test_overlapping_topics_merge_and_no_long_paragraph_is_in_two_documents():
    topics = python_reference_documents()
    merged = merge_overlapping(topics)
    assert 3 <= len(merged) < len(topics)
    assert any("customization" in k.split("+") and "specialnames" in k.split("+") for k in merged)
    seen: dict[str, str] = {}
    for name, text in merged.items():
        for par in _long_paragraphs(text):
            assert par not in seen, f"{name} and {seen[par]} share a paragraph"
            seen[par] = name
    # every topic's text survives (its long paragraphs are in its group's document)
    for name, text in topics.items():
        group = next(k for k in merged if name in k.split("+"))
        assert _long_paragraphs(text) <= _long_paragraphs(merged[group])


def test_splits_are_disjoint_whole_documents_near_their_fractions():
    docs = merge_overlapping(python_reference_documents())
    split = split_documents(docs, test_fraction=0.1, valid_fraction=0.05, seed=1234)
    names = [n for s in split.values() for n in s]
    assert sorted(names) == sorted(docs) and len(set(names)) == len(names)
    total = sum(map(len, docs.values()))
    for name, fraction in (("test", 0.1), ("valid", 0.05)):
        share = sum(len(docs[n]) for n in split[name]) / total
        assert fraction <= share <= 2.5 * fraction, (name, share)
    train_pars = set().union(*(_long_paragraphs(docs[n]) for n in split["train"]))
    for name in split["test"]:
        assert not _long_paragraphs(docs[name]) & train_pars
    assert split_documents(docs, test_fraction=0.1, valid_fraction=0.05, seed=1234) == split
    with pytest.raises(CorpusError, match="test_fraction=0.7"):
        split_documents(docs, test_fraction=0.7, valid_fraction=0.05, seed=1)


def test_prepare_corpus_writes_each_split_with_the_models_tokenizer(tmp_path):
    from elastic_plugin.data.indexed import read_indexed_documents
    from elastic_plugin.data.jsonl import open_tokenizer
    from tests.support.byom_cases import corpus, write_bpe_tokenizer

    tok_file = write_bpe_tokenizer(tmp_path / "tok", corpus(40))
    meta = prepare_corpus(tmp_path / "data", tok_file, max_train_documents=3)
    assert not meta["reused"] and meta["licence"].startswith("Python Software Foundation")
    docs = merge_overlapping(python_reference_documents())
    tok = open_tokenizer(tok_file)
    for split in ("train", "valid", "test"):
        written = read_indexed_documents(tmp_path / "data" / f"{split}_text_document")
        assert len(written) == len(meta["documents"][split]) == meta["counts"][split]["documents"]
        assert sum(len(d) for d in written) == meta["counts"][split]["tokens"]
        for ids, name in zip(written, meta["documents"][split]):
            assert ids[-1] == tok.eod
            assert ids[:-1].tolist() == tok.tokenize(docs[name])
    lines = (tmp_path / "data" / "test.jsonl").read_text().splitlines()
    assert [json.loads(x)["name"] for x in lines] == meta["documents"]["test"]
    again = prepare_corpus(tmp_path / "data", tok_file, max_train_documents=3)
    assert again["reused"] and again["documents"] == meta["documents"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
