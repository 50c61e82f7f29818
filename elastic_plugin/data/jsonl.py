"""``prepare-data --input``: a user's JSONL text as Megatron indexed datasets, tokenized with a
Hub ``tokenizer.json`` (an imported model's ``CKPT/iter_0000000/hf_tokenizer/tokenizer.json``).

    elastic-plugin prepare-data --input corpus.jsonl --text-key text \\
        --tokenizer teacher/iter_0000000/hf_tokenizer/tokenizer.json --out data

writes ``data/train_text_document.{bin,idx}``, ``data/valid_text_document.{bin,idx}`` and
``data/meta.json``; each document is the text followed by the model's EOS (Megatron's
preprocess_data convention), as ``data/token_rule.py`` reads it from the files beside the
tokenizer. :func:`open_tokenizer` applies the same rule wherever a stage opens a ``--tokenizer``
file. Every line is checked before anything is written.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tokenizer import JsonTokenizer

TRAIN_PREFIX = "train_text_document"
VALID_PREFIX = "valid_text_document"
META_FILE = "meta.json"


class JsonlError(ValueError):
    """Bad ``prepare-data --input`` input (named by file, line and key)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokens of a ``tokenizer.json`` end documents and pad, and where that was read."""

    path: str
    eos_token: str
    eos_id: int
    eos_source: str
    pad_token: str | None


def tokenizer_spec(path: str | os.PathLike) -> TokenizerSpec:
    """The EOS / pad of ``path`` (a ``tokenizer.json`` or a directory holding one), by the one
    rule of ``data/token_rule.py``."""
    from .token_rule import TokenRuleError, read_token_rule

    try:
        rule = read_token_rule(path)
    except TokenRuleError as exc:
        raise JsonlError(str(exc)) from None
    pad = rule.pad_token
    if pad == rule.eos_token:
        pad = None  # GPTDataset masks pad labels: a pad equal to EOS would never train EOS
    return TokenizerSpec(rule.path, rule.eos_token, rule.eos_id, rule.eos_source, pad)


def open_tokenizer(path: str | os.PathLike) -> JsonTokenizer:
    """A ``JsonTokenizer`` of ``path`` whose ``eod`` is the EOS of :func:`tokenizer_spec` (the
    demo's tokenizers give ``<eod>`` as before)."""
    from .tokenizer import JsonTokenizer

    spec = tokenizer_spec(path)
    return JsonTokenizer.from_file(spec.path, eod_token=spec.eos_token, pad_token=spec.pad_token)


def read_jsonl_texts(path: str | os.PathLike, text_key: str) -> list[str]:
    """The non-empty ``text_key`` strings of a JSONL file; any bad line raises naming it."""
    file = Path(path)
    if not file.is_file():
        raise JsonlError(f"--input {path}: no such file")
    texts: list[str] = []
    with file.open(encoding="utf-8") as fh:
        try:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise JsonlError(f"--input {file}:{number}: not a JSON line ({exc})") from None
                if not isinstance(record, dict) or text_key not in record:
                    raise JsonlError(
                        f"--input {file}:{number}: no key {text_key!r} (--text-key) in this line"
                    )
                text = record[text_key]
                if not isinstance(text, str):
                    raise JsonlError(
                        f"--input {file}:{number}: key {text_key!r} is a "
                        f"{type(text).__name__}, not a string"
                    )
                if text:
                    texts.append(text)
        except UnicodeDecodeError as exc:
            raise JsonlError(f"--input {file}: not UTF-8 text ({exc})") from None
    if not texts:
        raise JsonlError(f"--input {file}: no non-empty {text_key!r} text in any line")
    return texts


def split_texts(texts: list[str], valid_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Shuffle (seeded) and cut ``valid_fraction`` off (at least one document each)."""
    if not 0.0 < valid_fraction < 1.0:
        raise JsonlError(f"--valid-fraction={valid_fraction} must be in (0, 1)")
    if len(texts) < 2:
        raise JsonlError(
            f"--input has {len(texts)} non-empty document(s); a train / valid split needs >= 2"
        )
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    num_valid = min(len(texts) - 1, max(1, round(len(texts) * valid_fraction)))
    valid = [texts[i] for i in order[:num_valid]]
    train = [texts[i] for i in order[num_valid:]]
    return train, valid


def prepare_jsonl(
    input_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike,
    text_key: str = "text",
    valid_fraction: float = 0.05,
    seed: int = 1234,
    force: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Check everything, then write the train / valid indexed datasets and ``meta.json``."""
    out_dir = Path(out)
    spec = tokenizer_spec(tokenizer)
    texts = read_jsonl_texts(input_path, text_key)
    train, valid = split_texts(texts, valid_fraction, seed)
    existing = [p for p in out_dir.glob("*_text_document.*")] if out_dir.is_dir() else []
    if existing and not force:
        raise JsonlError(f"--out {out_dir}: holds {existing[0].name}; pass --force to overwrite")

    from .indexed import write_text_documents

    tok = open_tokenizer(spec.path)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = {
        name: write_text_documents(out_dir / prefix, docs, tok, progress=progress)
        for name, prefix, docs in (("train", TRAIN_PREFIX, train), ("valid", VALID_PREFIX, valid))
    }
    meta = {
        "input": str(Path(input_path).resolve()),
        "text_key": text_key,
        "tokenizer": str(Path(spec.path).resolve()),
        "eos": {"token": spec.eos_token, "id": spec.eos_id, "source": spec.eos_source},
        "pad_token": spec.pad_token,
        "vocab_size": tok.vocab_size,
        "valid_fraction": valid_fraction,
        "seed": seed,
        "data_path": str((out_dir / TRAIN_PREFIX).resolve()),
        "valid_data_path": str((out_dir / VALID_PREFIX).resolve()),
        "counts": {k: s.num_documents for k, s in stats.items()},
        "tokens": {k: s.num_tokens for k, s in stats.items()},
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
