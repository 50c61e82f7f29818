"""Importance ranking of every width axis (embedding channels, FFN neurons, attention heads,
Mamba heads and head channels, MoE experts by REAP), under any TP/PP/EP/DP layout."""

from elastic_plugin.importance.collect import (
    CalibrationError,
    check_calibration,
    collect_importance,
)
from elastic_plugin.importance.hooks import AXES, ImportanceHooks, LocalStats
from elastic_plugin.importance.scores import ImportanceScores, rankings_agree, reduce_local_stats

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
