"""Importance ranking of every width axis (embedding channels, FFN neurons, attention heads,
Mamba heads and head channels, MoE experts by REAP), under any TP/PP/EP/DP layout.

The names are resolved on first use, so that ``elastic-plugin``'s argument parsing (which imports
``importance.cli``) imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_plugin.compat.lazy import lazy_exports

_EXPORTS = {
    "AXES": "hooks",
    "CalibrationError": "collect",
    "ImportanceHooks": "hooks",
    "ImportanceScores": "scores",
    "LocalStats": "hooks",
    "check_calibration": "collect",
    "collect_importance": "collect",
    "rankings_agree": "scores",
    "reduce_local_stats": "scores",
}
__all__ = [
    "AXES",
    "CalibrationError",
    "ImportanceHooks",
    "ImportanceScores",
    "LocalStats",
    "check_calibration",
    "collect_importance",
    "rankings_agree",
    "reduce_local_stats",
]

if TYPE_CHECKING:
    from elastic_plugin.importance.collect import (
        CalibrationError,
        check_calibration,
        collect_importance,
    )
    from elastic_plugin.importance.hooks import AXES, ImportanceHooks, LocalStats
    from elastic_plugin.importance.scores import (
        ImportanceScores,
        rankings_agree,
        reduce_local_stats,
    )


__getattr__ = lazy_exports(__name__, _EXPORTS)
