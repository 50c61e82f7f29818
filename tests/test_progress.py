"""Progress without a terminal: whole lines at most once per interval (a log file never gets a
tqdm carriage-return stream), a tqdm bar on a terminal, and the training loops use it."""

from __future__ import annotations

import io

import pytest

from elastic_plugin.data.progress import (
    INTERVAL_ENV,
    LineProgress,
    make_progress,
    progress_interval_s,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_one_line_per_interval_and_one_at_the_end(capsys):
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(200, "elastic", initial=50, interval_s=30, stream=out, clock=clock)
    for _ in range(10):  # 10 iterations within 20 s: no line yet
        clock.now += 2
        bar.update(1)
    assert out.getvalue() == ""
    clock.now += 10  # 30 s since the start: the 11th update prints
    bar.set_postfix({"loss": 0.123456, "budget": "0.77"})
    bar.update(1)
    bar.write("validation: 0.42")
    for _ in range(5):
        clock.now += 1
        bar.update(1)
    bar.close()
    bar.close()  # a second close prints nothing more
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0] == (
        "elastic: 61/200 it (30%), 0.37 it/s, eta 6m19s, elapsed 0m30s | loss=0.1235, budget=0.77"
    )
    assert lines[1].startswith("elastic: 66/200 it (33%)") and "elapsed 0m35s" in lines[1]
    assert capsys.readouterr().out == "validation: 0.42\n"  # where tqdm.write prints


def test_unknown_total_and_byte_counts_read_naturally():
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(None, "import", unit="B", interval_s=0, stream=out, clock=clock)
    clock.now += 4
    bar.update(3_000_000)
    assert out.getvalue().splitlines() == ["import: 3.0M B, 750.0k B/s, elapsed 0m04s"]


def test_a_terminal_gets_tqdm_and_a_file_gets_lines(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    from tqdm import tqdm

    assert isinstance(make_progress(3, "x", stream=Tty()), tqdm)
    monkeypatch.setenv(INTERVAL_ENV, "5")
    plain = make_progress(3, "x", stream=io.StringIO())
    assert isinstance(plain, LineProgress) and plain.interval_s == 5
    for bad in ("soon", "-1"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        assert progress_interval_s() == 30.0


@pytest.mark.parametrize(
    "module",
    [
        "elastic_plugin.training.loop",  # the teacher's and elastic training's progress line
        "elastic_plugin.importance.collect",
        "elastic_plugin.importance.depth",
        "elastic_plugin.export.hf_import",
    ],
)
def test_long_steps_report_through_make_progress(module):
    """No stage builds a tqdm bar of its own (which would stream refreshes into a log); the
    trainers' is the one loop's (``training/loop.py``)."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(module))
    assert "make_progress(" in source and "from tqdm" not in source
