"""Reading a Hugging Face ``config.json`` (torch-free).

What the fields mean is each model family's business (``elastic_plugin/families/``); this is only
the file: present, JSON, an object, with errors that name the directory or file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = ["HF_CONFIG_FILE", "read_hf_config"]

HF_CONFIG_FILE = "config.json"


def read_hf_config(hf_dir: str | Path, name: str = HF_CONFIG_FILE) -> dict[str, Any]:
    """``config.json`` of a Hugging Face directory, or a ConfigError naming the file."""
    path = Path(hf_dir)
    if not path.is_dir():
        raise ConfigError(f"--hf {path}: no such directory")
    file = path / name
    if not file.is_file():
        raise ConfigError(f"--hf {path}: no {HF_CONFIG_FILE} (not a Hugging Face model directory)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: the top level must be a JSON object")
    return raw
