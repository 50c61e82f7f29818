"""Real English text available offline, split by document into train / valid / test indexed datasets.

Why: a pretrained model has to be judged on text people wrote, and no hub dataset loads here. The
source is the Python Language Reference as every CPython installation ships it
(``pydoc_data.topics``: 79 documents, one per topic — statements, expressions, the data model,
string methods, ...; about 0.5 MB of English prose with code examples). Licence: the Python
Software Foundation License Version 2 (``LICENSE.txt`` of the Python distribution). It is what
``help("assert")`` prints, written by people, not generated.

Topics overlap (``specialnames`` contains ``customization``): topics sharing a paragraph are
merged into one document first (55 documents). Documents are assigned whole to one split (seeded
shuffle; the test split takes documents until it holds ``test_fraction`` of the characters, then
valid, the rest trains), so no test paragraph is ever in the training data. Each split is tokenized with the model's own
tokenizer into Megatron's indexed format (``{train,valid,test}_text_document.{bin,idx}``), each
document followed by the tokenizer's EOS; ``meta.json`` records the source, licence, split names
and token counts. The directory is written into a temporary sibling and renamed, and reused when
its settings match.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SOURCE = "pydoc_data.topics (the Python Language Reference shipped with CPython)"
LICENCE = "Python Software Foundation License Version 2"
SPLITS = ("train", "valid", "test")
META_FILE = "meta.json"
FORMAT_VERSION = 2
MIN_SHARED_CHARS = 80  # a shared paragraph this long joins two topics into one document


class CorpusError(ValueError):
    """Bad corpus settings (named by argument)."""


def python_reference_documents() -> dict[str, str]:
    """Topic name -> text, as this interpreter ships them."""
    from pydoc_data.topics import topics

    return {name: topics[name].strip() for name in sorted(topics) if topics[name].strip()}


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def merge_overlapping(docs: dict[str, str], min_chars: int = MIN_SHARED_CHARS) -> dict[str, str]:
    """Topics that share a paragraph (``specialnames`` contains ``customization``, ...) become
    one document, their repeated paragraphs kept once: a test paragraph must not also train.
    Keyed by the group's topics joined with ``+``."""
    owners: dict[str, list[str]] = {}
    for name, text in docs.items():
        for par in _paragraphs(text):
            if len(par) >= min_chars:
                owners.setdefault(par, []).append(name)
    root = {name: name for name in docs}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    for names in owners.values():
        for other in names[1:]:
            root[find(other)] = find(names[0])
    groups: dict[str, list[str]] = {}
    for name in sorted(docs):
        groups.setdefault(find(name), []).append(name)
    merged: dict[str, str] = {}
    for names in groups.values():
        seen: set[str] = set()
        kept: list[str] = []
        for name in names:
            for par in _paragraphs(docs[name]):
                if len(par) >= min_chars and par in seen:
                    continue
                seen.add(par)
                kept.append(par)
        merged["+".join(names)] = "\n\n".join(kept)
    return merged


def split_documents(
    docs: dict[str, str], *, test_fraction: float, valid_fraction: float, seed: int
) -> dict[str, list[str]]:
    """Split names (whole documents) by character share: test, then valid take shuffled
    documents until they hold their fraction (skipping one that would take more than twice
    it); every split gets at least one document."""
    for name, value in (("test_fraction", test_fraction), ("valid_fraction", valid_fraction)):
        if not 0.0 < value < 0.5:
            raise CorpusError(f"{name}={value} must be in (0, 0.5)")
    if len(docs) < 3:
        raise CorpusError(f"a train / valid / test split needs >= 3 documents, got {len(docs)}")
    names = sorted(docs)
    random.Random(seed).shuffle(names)
    total = sum(len(docs[n]) for n in names)
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    left = list(names)
    for split, fraction in (("test", test_fraction), ("valid", valid_fraction)):
        target, chars = fraction * total, 0
        for name in list(left):
            if len(left) <= 1 or (out[split] and chars >= target):
                break
            if out[split] and chars + len(docs[name]) > 2 * target:
                continue
            out[split].append(name)
            chars += len(docs[name])
            left.remove(name)
    out["train"] = left
    if not out["train"]:
        raise CorpusError("the fractions leave no training document")
    return out


def prepare_corpus(
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike,
    *,
    test_fraction: float = 0.1,
    valid_fraction: float = 0.05,
    seed: int = 1234,
    max_train_documents: int | None = None,
) -> dict[str, Any]:
    """Write the three splits into ``out_dir`` (reused when the settings match); return meta."""
    from .jsonl import open_tokenizer, tokenizer_spec

    spec = tokenizer_spec(tokenizer)
    docs = merge_overlapping(python_reference_documents())
    split = split_documents(
        docs, test_fraction=test_fraction, valid_fraction=valid_fraction, seed=seed
    )
    if max_train_documents is not None:
        if max_train_documents < 1:
            raise CorpusError(f"max_train_documents={max_train_documents} must be >= 1")
        split["train"] = split["train"][:max_train_documents]
    settings = {
        "format_version": FORMAT_VERSION,
        "source": SOURCE,
        "python": sys.version.split()[0],
        "tokenizer": str(Path(spec.path).resolve()),
        "tokenizer_size": os.path.getsize(spec.path),
        "test_fraction": test_fraction,
        "valid_fraction": valid_fraction,
        "seed": seed,
        "max_train_documents": max_train_documents,
    }
    out = Path(out_dir).resolve()
    reused = prepared_corpus(out, settings, CorpusError)
    if reused is not None:
        return reused

    from .indexed import write_text_documents

    tok = open_tokenizer(spec.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_corpus(out) as (tmp, publish):
        counts: dict[str, dict[str, int]] = {}
        for name in SPLITS:
            texts = [docs[d] for d in split[name]]
            stats = write_text_documents(tmp / f"{name}_text_document", texts, tok)
            counts[name] = {
                "documents": stats.num_documents,
                "tokens": stats.num_tokens,
                "characters": sum(len(t) for t in texts),
            }
        with (tmp / "test.jsonl").open("w") as fh:
            for d in split["test"]:
                fh.write(json.dumps({"name": d, "text": docs[d]}) + "\n")
        meta = {
            "settings": settings,
            "source": SOURCE,
            "licence": LICENCE,
            "documents": split,
            "counts": counts,
            "eos": {"token": spec.eos_token, "id": spec.eos_id},
            "vocab_size": tok.vocab_size,
        }
        publish(meta)
    return {**meta, "reused": False}


def prepared_corpus(
    out: Path, settings: dict[str, Any], error: type[Exception]
) -> dict[str, Any] | None:
    """The meta of the corpus already in ``out`` when it was made with ``settings`` and every
    split's files are there (``reused``: True), else None; ``error`` when ``out`` holds other
    files (nothing is overwritten that is not a corpus)."""
    meta_path = out / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == settings and all(
            (out / f"{s}_text_document.{ext}").is_file() for s in SPLITS for ext in ("bin", "idx")
        ):
            return {**meta, "reused": True}
    if out.exists() and any(out.iterdir()) and not meta_path.is_file():
        raise error(f"{out} is a non-empty directory that is not a prepared corpus")
    return None


@contextmanager
def staged_corpus(out: Path) -> Iterator[tuple[Path, Callable[[dict[str, Any]], None]]]:
    """``(a fresh folder beside out, publish)``: the block writes the corpus into the folder and
    calls ``publish(meta)``, which writes ``meta.json`` and puts the folder in ``out``'s place
    whole; on an error, or without ``publish``, the folder is removed and ``out`` is untouched
    (a reader never sees half a corpus)."""
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()

    def publish(meta: dict[str, Any]) -> None:
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)

    try:
        yield tmp, publish
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def prefix(out_dir: str | os.PathLike, split: str) -> str:
    """The indexed-dataset prefix of one split."""
    if split not in SPLITS:
        raise CorpusError(f"split {split!r}; allowed: {', '.join(SPLITS)}")
    return str(Path(out_dir).resolve() / f"{split}_text_document")
