"""Optional tqdm progress bars (a no-op object when disabled, so callers need no branches)."""

from __future__ import annotations

from typing import Any


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, desc: str, enabled: bool, unit: str = "it") -> Any:
    """A tqdm bar when ``enabled`` (for steps that take seconds or more), else a no-op."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False)
