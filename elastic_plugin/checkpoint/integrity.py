"""Content digests of a checkpoint's files: recorded at save, checked before any byte is used.

A flipped block in a ``.distcp`` shard loads silently (Megatron keeps no checksums) and a
truncated one dies deep inside ``torch.load``; both are caught here, before loading, with a
message naming the file and what was expected and found. Every file of a checkpoint directory
except ``elastic_meta.json`` (which holds the digests) gets its size and SHA-256 recorded
under ``"files"``: SHA-256 is a real content hash and, with the SHA extensions of current
CPUs, the fastest one in ``hashlib`` (``bench/bench_checkpoint_hash.py`` measures it against
BLAKE2b, CRC-32 and a plain read). Torch-free, so ``elastic-plugin verify`` runs in seconds.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.meta import CHECKPOINT_META
from elastic_plugin.models.config import ConfigError

__all__ = [
    "DIGEST_ALGORITHM",
    "FILES_KEY",
    "VerifyReport",
    "already_verified",
    "balanced_share",
    "check_hashes",
    "check_sizes",
    "digest_names",
    "file_digest",
    "file_digests",
    "files_signature",
    "forget_verified",
    "remember_verified",
    "recorded_digests",
    "verify_digests",
    "verify_directory",
]

DIGEST_ALGORITHM = "sha256"
FILES_KEY = "files"  # elastic_meta.json: relative name -> {"bytes": N, "sha256": hex}
CHUNK_BYTES = 8 << 20  # large reads: the hash runs at memory speed, not per-call overhead
_DAMAGED = "; the checkpoint is damaged (restore it or save it again)"


def digest_names(directory: str | Path, exclude: Iterable[str] = (CHECKPOINT_META,)) -> list[str]:
    """Every regular file under ``directory`` (relative POSIX paths, sorted), but ``exclude``:
    what a checkpoint's digests cover."""
    root = Path(directory)
    skip = set(exclude)
    names = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(n for n in names if n not in skip)


def file_digest(path: str | Path, algorithm: str = DIGEST_ALGORITHM) -> dict[str, Any]:
    """``{"bytes": size, algorithm: hex digest}`` of one file, streamed in 8 MiB reads."""
    hasher = hashlib.new(algorithm)
    size = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(view[:n])
            size += n
    return {"bytes": size, algorithm: hasher.hexdigest()}


def file_digests(
    directory: str | Path,
    names: Iterable[str] | None = None,
    exclude: Iterable[str] = (CHECKPOINT_META,),
) -> dict[str, dict[str, Any]]:
    """Digests of ``names`` (default: ``digest_names(directory, exclude)``) in ``directory``:
    name -> ``{"bytes", "sha256"}``, the form ``verify_digests`` checks."""
    root = Path(directory)
    chosen = digest_names(root, exclude) if names is None else list(names)
    return {name: file_digest(root / name) for name in chosen}


def recorded_digests(
    meta: Mapping[str, Any], where: str | Path, meta_name: str = CHECKPOINT_META
) -> dict[str, dict[str, Any]] | None:
    """The digests a checkpoint's (or an export's: ``meta_name``) metadata records (None for
    ones written before they were recorded); a ConfigError if they are malformed, since then
    nothing can be trusted."""
    files = meta.get(FILES_KEY)
    if files is None:
        return None
    if not isinstance(files, Mapping) or not all(
        isinstance(entry, Mapping)
        and isinstance(entry.get("bytes"), int)
        and _algorithm(entry) is not None
        for entry in files.values()
    ):
        raise ConfigError(
            f"{where}/{meta_name}: '{FILES_KEY}' is malformed (each file needs "
            f"'bytes' and a digest such as '{DIGEST_ALGORITHM}')"
        )
    return {str(name): dict(entry) for name, entry in files.items()}


def _algorithm(entry: Mapping[str, Any]) -> str | None:
    """The digest algorithm an entry records (any of hashlib's guaranteed ones)."""
    return next((k for k in entry if k in hashlib.algorithms_guaranteed), None)


def check_sizes(directory: str | Path, recorded: Mapping[str, Mapping[str, Any]]) -> None:
    """Every recorded file exists with its recorded size: a cheap ``stat`` pass that reports a
    missing or truncated file before any byte is hashed."""
    root = Path(directory)
    for name, entry in recorded.items():
        path = root / name
        if not path.is_file():
            raise ConfigError(
                f"checkpoint {root}: file {name} is missing: expected {entry['bytes']} bytes "
                f"({_describe(entry)}) as saved{_DAMAGED}"
            )
        found = path.stat().st_size
        if found != entry["bytes"]:
            change = "truncated" if found < entry["bytes"] else "longer than saved"
            raise ConfigError(
                f"checkpoint {root}: file {name} is {change}: expected {entry['bytes']} bytes "
                f"as saved, found {found} bytes{_DAMAGED}"
            )


def check_hashes(
    directory: str | Path,
    recorded: Mapping[str, Mapping[str, Any]],
    names: Sequence[str] | None = None,
) -> None:
    """The content of ``names`` (default: every recorded file) hashes to the recorded digest."""
    root = Path(directory)
    for name in recorded if names is None else names:
        entry = recorded[name]
        algorithm = _algorithm(entry) or DIGEST_ALGORITHM
        try:
            found = file_digest(root / name, algorithm)
        except OSError as exc:
            raise ConfigError(f"checkpoint {root}: file {name} is not readable ({exc})") from None
        if found[algorithm] != entry[algorithm] or found["bytes"] != entry["bytes"]:
            raise ConfigError(
                f"checkpoint {root}: file {name} differs from what was saved: expected "
                f"{algorithm} {entry[algorithm]} ({entry['bytes']} bytes), found {algorithm} "
                f"{found[algorithm]} ({found['bytes']} bytes){_DAMAGED}"
            )


def _describe(entry: Mapping[str, Any]) -> str:
    algorithm = _algorithm(entry) or DIGEST_ALGORITHM
    return f"{algorithm} {entry.get(algorithm)}"


# (directory, recorded digests, stat of every recorded file) of directories this process has
# verified: reading the same unchanged checkpoint or export again hashes nothing twice.
Signature = tuple[str, str, tuple[tuple[str, int, int, int, int], ...]]
_VERIFIED: set[Signature] = set()


def files_signature(
    root: str | Path, recorded: Mapping[str, Mapping[str, Any]]
) -> Signature | None:
    """What identifies an unchanged directory: its path, digests and recorded files' stats
    (None when a recorded file is missing: verifying names it)."""
    root = Path(root)
    try:
        stats = tuple(
            (name, (st := os.stat(root / name)).st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            for name in sorted(recorded)
        )
    except OSError:
        return None
    return str(root.resolve()), repr(sorted(recorded.items())), stats


def already_verified(signature: Signature | None) -> bool:
    return signature is not None and signature in _VERIFIED


def remember_verified(signature: Signature | None) -> None:
    if signature is not None:
        _VERIFIED.add(signature)


def forget_verified() -> None:
    """Hash everything again on the next read, as a fresh process does (benchmarks)."""
    _VERIFIED.clear()


def verify_digests(directory: str | Path, recorded: Mapping[str, Mapping[str, Any]]) -> None:
    """A ConfigError naming the first missing, resized or altered file of ``recorded``
    (``file_digests``' form); files not recorded are not looked at."""
    check_sizes(directory, recorded)
    check_hashes(directory, recorded)


def balanced_share(sizes: Mapping[str, int], rank: int, world: int) -> list[str]:
    """The names rank ``rank`` of ``world`` hashes when ranks split a checkpoint: largest file
    first to the least loaded rank, so the ranks finish together (every rank computes the same
    split from the same sizes)."""
    loads = [0] * world
    owned: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += sizes[name]
        owned[target].append(name)
    return sorted(owned[rank])


@dataclass
class VerifyReport:
    """What ``elastic-plugin verify`` found: how much was checked and how long it took."""

    ckpt: str
    kind: str | None
    verified: bool  # False: the checkpoint records no digests (written before they existed)
    files: int
    bytes: int
    seconds: float
    # pickles checked against the allowlist (checkpoint.safe_pickle): files and .distcp items
    pickles: int = 0


def verify_directory(
    ckpt: str | Path, meta: Mapping[str, Any], meta_name: str = CHECKPOINT_META
) -> VerifyReport:
    """Verify a checkpoint's (or an export's: ``meta_name``) files against its metadata's
    digests (read by the caller); a ConfigError names the first bad file."""
    start = time.perf_counter()
    recorded = recorded_digests(meta, ckpt, meta_name)
    if recorded is not None:
        verify_digests(ckpt, recorded)
    entries = (recorded or {}).values()
    return VerifyReport(
        ckpt=str(ckpt),
        kind=meta.get("kind"),
        verified=recorded is not None,
        files=len(entries),
        bytes=sum(int(e["bytes"]) for e in entries),
        seconds=time.perf_counter() - start,
    )
