"""No benchmark document in the training data: a 13-gram overlap check.

The test of the GPT-3 paper (Brown et al. 2020, appendix C) that lm-eval's decontamination tools
implement: text is normalised (lower case, punctuation dropped, split on whitespace: lm-eval's
``Janitor.normalize_string`` and ``word_ngrams``), and an evaluated document counts as
contaminated when any of its 13-word windows occurs in the training text. The training side is
streamed once into a set of hashed 13-grams (8-byte BLAKE2b digests: the demo's 1.9M training
tokens give ~0.4M grams, a few MB), then every document's text as lm-eval builds it (prompt plus
answer, ``doc_to_decontamination_query`` where the task defines one) is looked up.

Training data comes as Megatron indexed datasets (``prepare-data`` / the demo corpus; decoded
with the tokenizer they were built with) or as text / JSONL files (one document per line, or
the ``text`` field), the forms this plugin trains from.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "NGRAM",
    "Contamination",
    "check_documents",
    "normalize",
    "read_training_texts",
    "task_documents",
    "training_ngrams",
    "word_ngrams",
]

NGRAM = 13


_TABLE = str.maketrans(
    string.ascii_lowercase + string.ascii_uppercase, string.ascii_lowercase * 2, string.punctuation
)


def normalize(text: str) -> str:
    """lm-eval's ``Janitor.normalize_string``: ASCII letters lower-cased, ASCII punctuation
    deleted (the same translation table)."""
    return text.translate(_TABLE)


def word_ngrams(text: str, n: int = NGRAM) -> Iterator[str]:
    """The ``n``-word windows of the normalised text (a shorter text is one window)."""
    words = normalize(text).split()
    if len(words) < n:
        if words:
            yield " ".join(words)
        return
    for i in range(len(words) - n + 1):
        yield " ".join(words[i : i + n])


def _digest(gram: str) -> bytes:
    return hashlib.blake2b(gram.encode("utf-8"), digest_size=8).digest()


def training_ngrams(texts: Iterable[str], n: int = NGRAM) -> set[bytes]:
    """Hashed ``n``-grams of every training text (short texts: no window, nothing stored)."""
    grams: set[bytes] = set()
    for text in texts:
        words = normalize(text).split()
        for i in range(len(words) - n + 1):
            grams.add(_digest(" ".join(words[i : i + n])))
    return grams


@dataclass
class Contamination:
    """Per task: documents checked, those with a 13-gram in the training text (their index and
    the first shared window)."""

    checked: dict[str, int] = field(default_factory=dict)
    hits: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    training_grams: int = 0

    @property
    def clean(self) -> bool:
        return not any(self.hits.values())

    def summary(self) -> dict[str, Any]:
        return {
            "ngram": NGRAM,
            "training_ngrams": self.training_grams,
            "tasks": {
                task: {
                    "documents": n,
                    "contaminated": len(self.hits.get(task, [])),
                    "examples": self.hits.get(task, [])[:5],
                }
                for task, n in self.checked.items()
            },  # fmt: skip
            "clean": self.clean,
        }


def check_documents(
    documents: Mapping[str, Sequence[str]], grams: set[bytes], n: int = NGRAM
) -> Contamination:
    """Look every document's ``n``-grams up in the training set ``grams``. A document shorter
    than ``n`` words is checked as a whole only if the training side stored such short grams
    (it does not), so it is never flagged: the paper's rule."""
    result = Contamination(training_grams=len(grams))
    for task, docs in documents.items():
        result.checked[task] = len(docs)
        hits = []
        for i, doc in enumerate(docs):
            hit = next((g for g in word_ngrams(doc, n) if _digest(g) in grams), None)
            if hit is not None:
                hits.append((i, hit))
        result.hits[task] = hits
    return result


def _text_files(path: Path) -> Iterator[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if file.suffix == ".jsonl":
            with file.open(encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    text = record.get("text") if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        from elastic_plugin.models.config import ConfigError

                        raise ConfigError(
                            f"--train {file}:{number}: a JSONL record needs a 'text' string"
                        )
                    yield text
        elif file.suffix in (".txt", ".text", ".md", ""):
            yield file.read_text(encoding="utf-8", errors="replace")


def read_training_texts(
    train: Sequence[str | os.PathLike], tokenizer: str | os.PathLike | None = None
) -> Iterator[str]:
    """The documents of each training source: an indexed dataset prefix (``PREFIX.bin`` /
    ``.idx``, decoded with ``tokenizer``), a text / JSONL file, or a folder of them."""
    from elastic_plugin.models.config import ConfigError

    backend = None
    for source in train:
        path = Path(source)
        if Path(f"{path}.idx").is_file() and Path(f"{path}.bin").is_file():
            if tokenizer is None:
                raise ConfigError(
                    f"--train {path}: an indexed dataset holds token ids; give --tokenizer "
                    "(the tokenizer.json it was prepared with) to read its text"
                )
            if backend is None:
                from tokenizers import Tokenizer

                tok = Path(tokenizer)
                backend = Tokenizer.from_file(str(tok / "tokenizer.json" if tok.is_dir() else tok))
            from elastic_plugin.data.indexed import read_indexed_documents

            for doc in read_indexed_documents(path):
                yield backend.decode([int(t) for t in doc], skip_special_tokens=True)
        elif path.exists():
            yield from _text_files(path)
        else:
            raise ConfigError(
                f"--train {path}: not an indexed dataset prefix (no {path}.bin/.idx), a text / "
                "JSONL file or a folder of them"
            )


def _as_text(value: Any, choices: Sequence[str] | None) -> str:
    if isinstance(value, int) and choices:
        return str(choices[value])
    if isinstance(value, list):
        return " ".join(_as_text(v, choices) for v in value)
    return str(value)


def _decontamination_query(task: Any, doc: Mapping[str, Any]) -> str:
    """lm-eval's ``doc_to_decontamination_query``; a Jinja template rendering plain text (e.g.
    LAMBADA's ``{{text}}``) is taken as the text: lm-eval 0.4.13 feeds it to
    ``ast.literal_eval``, which fails on prose."""
    try:
        return str(task.doc_to_decontamination_query(doc))
    except (SyntaxError, ValueError):
        from lm_eval import utils

        return str(utils.apply_template(task.config.doc_to_decontamination_query, doc))


def task_documents(
    tasks_dir: str | os.PathLike, names: Sequence[str], limit: int | None = None
) -> dict[str, list[str]]:
    """The evaluated documents of each task as text: lm-eval's decontamination query where the
    task defines one, else its prompt with the correct answer (every choice of a
    multiple-choice task, which is what a leaked document would hold)."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    loaded = manager.load(list(names))
    out: dict[str, list[str]] = {}
    for name, task in loaded["tasks"].items():
        texts = []
        for i, doc in enumerate(task.eval_docs):
            if limit is not None and i >= limit:
                break
            if task.should_decontaminate():
                texts.append(_decontamination_query(task, doc))
                continue
            choices = task.doc_to_choice(doc) if task.config.doc_to_choice is not None else None
            prompt = _as_text(task.doc_to_text(doc), choices)
            answer = (
                " ".join(map(str, choices)) if choices else _as_text(task.doc_to_target(doc), None)
            )
            texts.append(f"{prompt} {answer}")
        out[name] = texts
    return out
