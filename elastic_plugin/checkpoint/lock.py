"""One writer per output folder: an exclusive lock file in ``--out``.

Two runs writing the same ``--out`` overwrite each other's ``checkpoints/*.tmp`` and crash (or,
worse, publish a mix). ``train`` and ``elastic-train`` therefore hold ``<out>/.elastic_plugin.lock``
while they run: created atomically (``O_CREAT | O_EXCL``), holding JSON with the holder's host,
PID, start time and command line so a refusal can say who holds it. A lock left by a dead process
on this host (a killed job) is taken over with a message; one held on another host cannot be
checked from here, so it is refused unless ``--force-unlock``. Under ``torchrun`` only global
rank 0 takes it: the other ranks write nothing outside what rank 0 coordinates.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import signal
import socket
import sys
import time
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = ["FORCE_FLAG", "LOCK_NAME", "OutLock", "acquire_out_lock", "add_force_unlock_arg"]

LOCK_NAME = ".elastic_plugin.lock"
FORCE_FLAG = "--force-unlock"
_YOUNG_S = 5.0  # an unreadable lock younger than this may be mid-write by its creator


def add_force_unlock_arg(parser: argparse.ArgumentParser) -> None:
    """``--force-unlock``: the one way past a lock this host cannot prove stale."""
    parser.add_argument(
        FORCE_FLAG,
        action="store_true",
        help=f"take over --out's lock ({LOCK_NAME}) even if another run seems to hold it "
        "(a run on another host that is gone); two live writers corrupt each other",
    )


class OutLock:
    """A held (or, on ranks other than 0, a nominal) lock; a context manager that releases it.

    ``took_over`` describes the stale lock this one replaced, if any."""

    def __init__(self, path: Path | None, holder: dict[str, Any], took_over: str | None = None):
        self.path = path
        self.holder = holder
        self.took_over = took_over

    @property
    def held(self) -> bool:
        return self.path is not None

    def release(self) -> None:
        """Remove the lock file if it is still ours (idempotent; a run that was forced out
        leaves the new holder's lock alone)."""
        path, self.path = self.path, None
        if path is None:
            return
        if _read_holder(path) == self.holder:
            path.unlink(missing_ok=True)
        _HELD.discard(self)

    def __enter__(self) -> OutLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_HELD: set[OutLock] = set()  # released at exit and on SIGTERM, however the run ends
_HOOKED = False


def _release_all() -> None:
    for lock in list(_HELD):
        lock.release()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """torchrun and schedulers stop jobs with SIGTERM: free the lock, then die as before."""
    _release_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_release_hooks() -> None:
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(_release_all)
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: atexit and the caller's `with` must do
        pass


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
        f" ({holder.get('command')})"
    )


def _stale_reason(path: Path, holder: dict[str, Any] | None, host: str, force: bool) -> str | None:
    """Why the existing lock may be taken over, None to look again (it is being created or
    was just released); a ConfigError when it may not be taken over."""
    if holder is None:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        if age < _YOUNG_S and not force:
            return None  # its creator may still be writing it
        return f"an unreadable lock file ({age:.1f} s old)"
    if force:
        return f"{FORCE_FLAG}: the lock of {_describe(holder)}"
    if holder.get("host") == host:
        pid = holder.get("pid")
        if isinstance(pid, int) and not _pid_alive(pid):
            return f"the stale lock of a process that is gone ({_describe(holder)})"
        raise ConfigError(
            f"--out {path.parent}: another run is writing here ({_describe(holder)}); wait for "
            f"it, choose another --out, or pass {FORCE_FLAG} if pid {pid} is not that run"
        )
    raise ConfigError(
        f"--out {path.parent}: locked by a run on another host ({_describe(holder)}), which "
        f"cannot be checked from {host}; if that run is gone, pass {FORCE_FLAG}"
    )


def _create(path: Path, holder: dict[str, Any]) -> bool:
    """Atomically create the lock file with ``holder``; False if one exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(holder, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def acquire_out_lock(
    out_dir: str | Path, force: bool = False, command: str | None = None, rank: int | None = None
) -> OutLock:
    """Take ``<out_dir>/.elastic_plugin.lock`` (creating ``out_dir``) for this process, or raise
    a ConfigError naming the holder. ``rank`` (default: ``$RANK``, 0 outside torchrun) other
    than 0 gets a nominal lock: rank 0 holds it for the job. Use as ``with acquire_out_lock(out):``.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    host = socket.gethostname()
    holder = {
        "host": host,
        "pid": os.getpid(),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "token": secrets.token_hex(8),  # tells this holding apart from a later one of this pid
    }
    if rank != 0:
        return OutLock(None, holder)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    took_over = None
    while not _create(path, holder):
        reason = _stale_reason(path, _read_holder(path), host, force)
        if reason is None:
            time.sleep(0.1)
            continue
        took_over = reason
        print(f"elastic-plugin: taking over the lock of --out {out}: {reason}", file=sys.stderr)
        path.unlink(missing_ok=True)
    lock = OutLock(path, holder, took_over)
    _HELD.add(lock)
    _install_release_hooks()
    return lock
