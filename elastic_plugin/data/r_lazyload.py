"""Character vectors out of an R package's lazy-load data base (``data/Rdata.rdx`` + ``.rdb``).

Why: Jane Austen's novels install offline only as the R package ``janeaustenr`` (Debian's
``r-cran-janeaustenr``), which stores each novel as a character vector in R's lazy-load format.
The PyPI reader ``rdata`` does not read that format and needs ``xarray``, which this project does
not install; the subset R writes there is small: an XDR serialization (R's ``serialize``, format
2 or 3) of vectors, lists, symbols and strings. This reader parses only that subset and refuses
anything else by name, so a changed package is an error, not silent garbage. Nothing is
evaluated: the bytes are parsed as data.

Layout: ``Rdata.rdx`` is a gzip-compressed serialization of a named list whose ``variables`` entry
maps each object name to ``(offset, length)`` in ``Rdata.rdb``; there each object is a 4-byte
big-endian uncompressed length followed by a zlib stream (``compressed`` = 1; 2 is bzip2, 3 is
xz with a one-byte type tag) holding the object's serialization.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RDataError", "RVector", "parse_serialized", "read_lazyload_strings"]

# SEXP types (R Internals, "Serialization Formats")
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP = (
    1,
    2,
    9,
    10,
    13,
    14,
    16,
    19,
)
_REFSXP, _NILVALUE_SXP = 255, 254
_NA_LENGTH = -1
_UTF8_MASK = 1 << 15
_METHOD3: dict[bytes, Callable[[bytes], bytes]] = {
    b"Z": lzma.decompress,
    b"2": bz2.decompress,
    b"1": zlib.decompress,
    b"0": bytes,
}


class RDataError(ValueError):
    """Bytes that are not the R serialization subset this reader knows (message names the file)."""


@dataclass(frozen=True)
class RVector:
    """An R vector: its SEXP type, its items and its attributes (``names`` etc.)."""

    kind: int
    items: list[Any]
    attributes: dict[str, Any]

    def named(self) -> dict[str, Any]:
        """Items by the ``names`` attribute (a named list or vector)."""
        names = self.attributes.get("names")
        if not isinstance(names, RVector) or len(names.items) != len(self.items):
            raise RDataError("the vector has no names attribute of its length")
        return dict(zip(names.items, self.items, strict=True))


class _Reader:
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where
        self.refs: list[Any] = []

    def _fail(self, what: str) -> RDataError:
        return RDataError(f"{self.where}: {what} at byte {self.pos}")

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self._fail(f"truncated ({n} bytes wanted)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int32(self) -> int:
        return int(struct.unpack(">i", self.raw(4))[0])

    def header(self) -> None:
        if self.raw(2) != b"X\n":
            raise self._fail("not an XDR R serialization (no 'X\\n' header)")
        version = self.int32()
        self.raw(8)  # the writer's and the minimal reader's R versions
        if version == 3:
            self.raw(self.int32())  # the native encoding's name
        elif version != 2:
            raise self._fail(f"serialization format {version}; known: 2, 3")

    def attributes(self) -> dict[str, Any]:
        pairs = self.item()
        if not isinstance(pairs, list):
            raise self._fail("attributes that are not a pairlist")
        return {str(tag): value for tag, value in pairs}

    def item(self) -> Any:
        flags = self.int32()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NILVALUE_SXP:
            return None
        if kind == _REFSXP:
            index = (flags >> 8) - 1
            if not 0 <= index < len(self.refs):
                raise self._fail(f"reference {index + 1} to an unknown object")
            return self.refs[index]
        if kind == _SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _CHARSXP:
            n = self.int32()
            if n == _NA_LENGTH:
                return None
            return self.raw(n).decode("utf-8" if flags & _UTF8_MASK else "latin-1")
        if kind == _LISTSXP:
            attrs = self.attributes() if has_attr else {}
            del attrs  # a pairlist's own attributes are not used by the lazy-load index
            tag = self.item() if has_tag else None
            head = self.item()
            rest = self.item()
            return [(tag, head), *(rest or [])]
        if kind in (_LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP):
            n = self.int32()
            if n < 0:
                raise self._fail(f"vector length {n} (long vectors are not supported)")
            items: list[Any]
            if kind in (_LGLSXP, _INTSXP):
                items = list(struct.unpack(f">{n}i", self.raw(4 * n)))
            elif kind == _REALSXP:
                items = list(struct.unpack(f">{n}d", self.raw(8 * n)))
            else:
                items = [self.item() for _ in range(n)]
            return RVector(kind, items, self.attributes() if has_attr else {})
        raise self._fail(f"SEXP type {kind}, outside the subset this reader knows")


def parse_serialized(data: bytes, where: str = "<bytes>") -> Any:
    """One object of R's XDR serialization (vectors as :class:`RVector`, pairlists as lists of
    ``(tag, value)``, strings as ``str``, NA as ``None``)."""
    reader = _Reader(data, where)
    reader.header()
    return reader.item()


def _decompress(blob: bytes, method: int, where: str) -> bytes:
    if len(blob) < 4:
        raise RDataError(f"{where}: an object shorter than its length header")
    size = int(struct.unpack(">i", blob[:4])[0])
    body = blob[4:]
    try:
        if method == 1:
            out = zlib.decompress(body)
        elif method == 2:
            out = bz2.decompress(body)
        elif method == 3:  # a one-byte tag says how: Z xz, 2 bzip2, 1 zlib, 0 stored
            tag, rest = body[:1], body[1:]
            if tag not in _METHOD3:
                raise RDataError(f"{where}: compression 3 with tag {tag!r}; known: Z, 2, 1, 0")
            out = _METHOD3[tag](rest)
        else:
            raise RDataError(f"{where}: compression {method}; known: 1 (zlib), 2 (bzip2), 3 (xz)")
    except (zlib.error, OSError, lzma.LZMAError) as exc:
        raise RDataError(f"{where}: an object that does not decompress ({exc})") from None
    if len(out) != size:
        raise RDataError(f"{where}: an object of {len(out)} bytes, its header says {size}")
    return out


def read_lazyload_strings(rdx: bytes, rdb: bytes, where: str = "Rdata") -> dict[str, list[str]]:
    """Every character vector of a lazy-load data base, by object name (NA items dropped)."""
    try:
        index = parse_serialized(gzip.decompress(rdx), f"{where}.rdx")
    except (OSError, EOFError) as exc:
        raise RDataError(f"{where}.rdx: not gzip-compressed ({exc})") from None
    if not isinstance(index, RVector):
        raise RDataError(f"{where}.rdx: not a named list")
    entries = index.named()
    compressed = entries.get("compressed")
    method = compressed.items[0] if isinstance(compressed, RVector) and compressed.items else 1
    variables = entries.get("variables")
    if not isinstance(variables, RVector):
        raise RDataError(f"{where}.rdx: no 'variables' entry")
    out: dict[str, list[str]] = {}
    for name, span in variables.named().items():
        if not isinstance(span, RVector) or len(span.items) != 2:
            raise RDataError(f"{where}.rdx: variable {name!r} has no (offset, length)")
        offset, length = (int(v) for v in span.items)
        if offset < 0 or offset + length > len(rdb):
            raise RDataError(f"{where}.rdb: variable {name!r} lies outside the file")
        blob = _decompress(rdb[offset : offset + length], int(method), f"{where}.rdb[{name}]")
        value = parse_serialized(blob, f"{where}.rdb[{name}]")
        if isinstance(value, RVector) and value.kind == _STRSXP:
            out[str(name)] = [s for s in value.items if s is not None]
    return out
