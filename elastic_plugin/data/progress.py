"""Progress for long steps: a tqdm bar on a terminal, one log line per interval otherwise.

Run without a terminal (a SLURM job's log file, CI), every tqdm refresh lands in the log: a
demo's log held one line of several hundred thousand characters of carriage-return updates.
There a step reports like Megatron-LM's loop does, one plain line per interval
(``ELASTIC_PLUGIN_PROGRESS_INTERVAL`` seconds, default 30) and one when it ends.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

INTERVAL_ENV = "ELASTIC_PLUGIN_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)  # where tqdm.write prints: stdout

    def close(self) -> None:
        pass


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``write`` / ``close``, printed as whole lines:
    ``desc: n/total unit (pct), rate, eta | postfix`` at most once per ``interval_s``."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        interval_s: float = DEFAULT_INTERVAL_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self._start_n = initial
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._start = self._last = clock()
        self._postfix = ""
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._clock() - self._last >= self.interval_s:
            self._emit()

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={_short(v)}" for k, v in items.items())

    def write(self, text: str) -> None:
        """A message between progress lines, where ``tqdm.write`` puts it (stdout)."""
        print(text, flush=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._emit()

    def line(self) -> str:
        elapsed = max(self._clock() - self._start, 1e-9)
        done = self.n - self._start_n
        rate = done / elapsed
        parts = [f"{self.desc}: {_count(self.n)}"]
        if self.total:
            parts[0] += f"/{_count(self.total)} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            parts[0] += f" {self.unit}"
        parts.append(f"{_count(rate)} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"eta {_duration((self.total - self.n) / rate)}")
        parts.append(f"elapsed {_duration(elapsed)}")
        text = ", ".join(parts)
        return f"{text} | {self._postfix}" if self._postfix else text

    def _emit(self) -> None:
        self._last = self._clock()
        print(self.line(), file=self.stream, flush=True)


def make_progress(
    total: int | None,
    desc: str,
    unit: str = "it",
    initial: int = 0,
    unit_scale: bool = False,
    stream: TextIO | None = None,
) -> Any:
    """A tqdm bar when ``stream`` (stderr) is a terminal, else a :class:`LineProgress`."""
    stream = stream if stream is not None else sys.stderr
    if stream.isatty():
        from tqdm.auto import tqdm

        return tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            unit_scale=unit_scale,
            dynamic_ncols=True,
            file=stream,
        )
    return LineProgress(total, desc, unit, initial, interval_s=progress_interval_s(), stream=stream)


def progress_interval_s() -> float:
    """Seconds between progress lines in a log (``ELASTIC_PLUGIN_PROGRESS_INTERVAL``)."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_INTERVAL_S
    except ValueError:
        value = DEFAULT_INTERVAL_S
    return value if value >= 0 else DEFAULT_INTERVAL_S


def progress_bar(total: int | None, desc: str, enabled: bool, unit: str = "it") -> Any:
    """:func:`make_progress` when ``enabled`` (steps that take seconds or more), else a no-op."""
    if not enabled:
        return _NoBar()
    return make_progress(total, desc, unit)


def _count(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
