"""Reading a checkpoint's ``elastic_meta.json`` without importing torch or Megatron.

The command lines (``elastic-train``, ``extract``, ``inspect``) check their input before anything
heavy is loaded; they all read checkpoints through these two functions, so a user gets the same
message for the same mistake everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError

CHECKPOINT_META = "elastic_meta.json"  # = checkpointing.CHECKPOINT_META (that module imports torch)
DIST_METADATA = "metadata.json"        # Megatron dist checkpoint's own index
ELASTIC_SUBDIR = ("checkpoints", "elastic")
_ELASTIC_HINT = "the output of elastic-plugin elastic-train (OUT/checkpoints/elastic)"


def read_checkpoint_meta(ckpt: str | Path, flag: str = "--ckpt",
                         require_weights: bool = True) -> dict[str, Any]:
    """The metadata of a complete checkpoint written by this plugin, or a ConfigError naming ``flag``.

    ``require_weights``: also insist on Megatron's dist-checkpoint index (an interrupted save
    leaves only ``<dir>.tmp``); commands that read metadata only can skip it."""
    path = Path(ckpt)
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: no such checkpoint directory")
    if not (path / CHECKPOINT_META).is_file():
        nested = path.joinpath(*ELASTIC_SUBDIR)
        hint = f" (did you mean {flag} {nested}?)" if (nested / CHECKPOINT_META).is_file() else ""
        raise ConfigError(f"{flag} {path}: not a complete checkpoint (no {CHECKPOINT_META}){hint}")
    if require_weights and not (path / DIST_METADATA).is_file():
        raise ConfigError(f"{flag} {path}: not a complete checkpoint (needs {CHECKPOINT_META} and "
                          f"{DIST_METADATA}; an interrupted save leaves only {path.name}.tmp)")
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: {CHECKPOINT_META} is not readable JSON ({exc})") from None
    if not isinstance(meta, Mapping) or not isinstance(meta.get("config"), Mapping):
        raise ConfigError(f"{flag} {path}: {CHECKPOINT_META} has no experiment config")
    return dict(meta)


def read_elastic_meta(ckpt: str | Path, flag: str = "--ckpt",
                      require_weights: bool = True) -> dict[str, Any]:
    """``read_checkpoint_meta`` of an elastic checkpoint: kind, budgets and the choice table."""
    meta = read_checkpoint_meta(ckpt, flag, require_weights)
    path = Path(ckpt)
    kind = meta.get("kind")
    if kind != "elastic":
        what = f"a {kind!r} checkpoint" if kind is not None else "a checkpoint without a 'kind'"
        raise ConfigError(f"{flag} {path}: kind={kind!r}, not an elastic checkpoint ({what}); "
                          f"this needs {_ELASTIC_HINT}")
    elastic = meta.get("elastic")
    if (not isinstance(elastic, Mapping) or not isinstance(elastic.get("choices"), Mapping)
            or not elastic["choices"] or not elastic.get("budgets")
            or not isinstance(meta["config"].get("elastic"), Mapping)):
        raise ConfigError(f"{flag} {path}: {CHECKPOINT_META} lacks the elastic config or the "
                          f"choice table (elastic.budgets / elastic.choices); this needs "
                          f"{_ELASTIC_HINT}")
    return meta
