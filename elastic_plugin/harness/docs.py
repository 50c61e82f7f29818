"""Document renames for local tasks whose data copy names a field differently from the dataset
lm-eval's built-in task reads (referenced from the written YAMLs as ``!function``)."""

from __future__ import annotations

from typing import Any

__all__ = ["boolq"]


def boolq(dataset: Any) -> Any:
    """BoolQ as ``google/boolq`` ships it (``answer``: a bool) -> SuperGLUE's BoolQ, which
    lm-eval's ``boolq`` reads (``label``: 0 no, 1 yes); question and passage are the same."""
    return dataset.map(lambda doc: {"label": int(bool(doc["answer"]))})
