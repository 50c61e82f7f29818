"""One writer per --out: the lock file, its refusals and take-overs, and train / elastic-train
holding it while they run (their training part replaced: the lock is what is tested)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic_plugin.checkpoint.lock import LOCK_NAME, acquire_out_lock
from elastic_plugin.models.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny.yaml"

HOLD = (
    "import sys, time; from elastic_plugin.checkpoint.lock import acquire_out_lock; "
    "lock = acquire_out_lock(sys.argv[1], command='holder'); print('held', flush=True); "
    "time.sleep(60)"
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(out: Path, **holder) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    path.write_text(json.dumps({"started": "2024-01-01T00:00:00+00:00", "command": "x", **holder}))
    return path


def test_lock_records_its_holder_refuses_a_second_writer_and_is_released(tmp_path):
    out = tmp_path / "out"
    with acquire_out_lock(out, command="first") as lock:
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
        assert holder["command"] == "first" and holder["started"] and lock.took_over is None
        with pytest.raises(ConfigError) as exc:
            acquire_out_lock(out)
        msg = str(exc.value)
        assert f"pid {os.getpid()}" in msg and holder["started"] in msg and "--force-unlock" in msg
        assert "another run is writing here" in msg
    assert not (out / LOCK_NAME).exists()
    acquire_out_lock(out).release()  # free again


@pytest.mark.integration
def test_lock_of_another_live_process_is_refused_and_freed_when_it_is_terminated(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {proc.pid}, started .* \\(holder\\)"):
            acquire_out_lock(out)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM  # still dies of SIGTERM, after freeing the lock
    assert not (out / LOCK_NAME).exists()


@pytest.mark.integration
def test_stale_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    out = tmp_path / "out"
    pid = _dead_pid()
    _write_lock(out, host=socket.gethostname(), pid=pid)
    with acquire_out_lock(out) as lock:
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert lock.took_over and f"pid {pid}" in lock.took_over
    err = capsys.readouterr().err
    assert "taking over the lock" in err and "process that is gone" in err and f"pid {pid}" in err


def test_lock_held_on_another_host_needs_force_unlock(tmp_path, capsys):
    out = tmp_path / "out"
    _write_lock(out, host="node-elsewhere-17", pid=4242)
    with pytest.raises(ConfigError) as exc:
        acquire_out_lock(out)
    msg = str(exc.value)
    assert "another host" in msg and "node-elsewhere-17" in msg and "pid 4242" in msg
    assert "--force-unlock" in msg
    with acquire_out_lock(out, force=True) as lock:
        assert lock.took_over and "node-elsewhere-17" in lock.took_over
    assert "--force-unlock" in capsys.readouterr().err


def test_unreadable_old_lock_is_taken_over_and_a_forced_out_holder_leaves_the_new_lock(tmp_path):
    out = tmp_path / "out"
    path = _write_lock(out)
    path.write_text("{not json")
    old = time.time() - 60
    os.utime(path, (old, old))
    first = acquire_out_lock(out)
    assert first.took_over and "unreadable" in first.took_over
    second = acquire_out_lock(out, force=True)
    first.release()  # it was forced out: the second holder's lock stays
    assert json.loads(path.read_text())["token"] == second.holder["token"]
    second.release()
    assert not path.exists()


def test_ranks_other_than_0_take_no_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    lock = acquire_out_lock(tmp_path / "out")
    assert not lock.held and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ the commands
def _reordered_checkpoint(path: Path) -> Path:
    """What elastic-train's input checks read of its --ckpt (metadata, no weights)."""
    path.mkdir(parents=True)
    config = yaml.safe_load(TINY.read_text())
    meta = {"config": config, "kind": "reordered", "reordered": True}
    (path / "elastic_meta.json").write_text(json.dumps(meta))
    (path / "metadata.json").write_text("{}")
    return path


@pytest.fixture()
def commands(tmp_path, monkeypatch):
    """``train`` / ``elastic-train`` argv into one --out, their training part recording whether
    it ran while the lock was held by this process."""
    from elastic_plugin.elastic import command as elastic_command
    from elastic_plugin.training import cli as training_cli

    out = tmp_path / "out"
    seen: list[int] = []

    def fake_train(*_args, **_kwargs):
        seen.append(json.loads((out / LOCK_NAME).read_text())["pid"])
        return 0

    monkeypatch.setattr(training_cli, "_train", fake_train)
    monkeypatch.setattr(elastic_command, "train", fake_train)
    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    ckpt = _reordered_checkpoint(tmp_path / "reordered")
    return {
        "out": out,
        "seen": seen,
        "train": ["train", "--config", str(TINY), "--out", str(out)],
        "elastic-train": ["elastic-train", "--ckpt", str(ckpt), "--out", str(out)],
    }


@pytest.mark.parametrize("command", ["train", "elastic-train"])
def test_commands_hold_the_lock_while_running_and_release_it(commands, command, capsys):
    from elastic_plugin.cli import main

    assert main(commands[command]) == 0
    assert commands["seen"] == [os.getpid()]
    assert not (commands["out"] / LOCK_NAME).exists()


@pytest.mark.parametrize("command", ["train", "elastic-train"])
def test_commands_refuse_a_locked_out_unless_force_unlock(commands, command, capsys):
    from elastic_plugin.cli import main

    _write_lock(commands["out"], host="node-elsewhere-3", pid=99)
    assert main(commands[command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elastic-plugin {command}: error: --out {commands['out']}: locked")
    assert "node-elsewhere-3" in err and "--force-unlock" in err and not commands["seen"]
    assert main([*commands[command], "--force-unlock"]) == 0
    assert commands["seen"] == [os.getpid()] and "taking over" in capsys.readouterr().err
    assert not (commands["out"] / LOCK_NAME).exists()
