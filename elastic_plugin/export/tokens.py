"""Token windows for measuring and calibrating exports: the checkpoint's own data, or the user's.

Evaluation reads the validation split the checkpoint was trained with; calibration of static
activation scales (``--calib-samples``) reads the training split, or the Megatron indexed dataset
prefix given with ``--calib-data``. Windows are the first ``sequences`` runs of ``seq_length + 1``
tokens of the concatenated documents (GPTDataset's packing without shuffling), so every export
of a run is measured or calibrated on the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = [
    "calibration_tokens",
    "check_calibration_source",
    "check_prefix",
    "data_prefix",
    "token_windows",
    "validation_tokens",
]


def data_prefix(meta: dict[str, Any], split: str) -> str | None:
    """The indexed-dataset prefix of ``split`` ("train" / "valid") that ``meta`` (the checkpoint's
    elastic_meta.json) records, or None when it records none."""
    data = meta.get("data") or {}
    if split == "valid" and data.get("valid_data_path"):
        return str(data["valid_data_path"])
    if data.get("data_path"):
        return str(data["data_path"])
    if data.get("prepared"):
        from elastic_plugin.data.prepare import PreparedData

        prepared = PreparedData.load(data["prepared"])
        return prepared.valid_prefix if split == "valid" else prepared.train_prefix
    return None


def check_prefix(prefix: str, flag: str) -> None:
    """One Megatron indexed dataset prefix whose ``.bin`` / ``.idx`` exist, or a ConfigError."""
    if " " in prefix.strip():
        raise ConfigError(
            f"{flag}: {prefix!r} is a blend of several datasets; give one indexed dataset prefix"
        )
    if not (Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()):
        raise ConfigError(
            f"{flag} {prefix}: no {prefix}.bin / {prefix}.idx (a Megatron indexed dataset prefix)"
        )


def token_windows(prefix: str, sequences: int, seq_length: int, flag: str):
    """``[n, seq_length + 1]`` int64 windows (n <= ``sequences``) of an indexed dataset prefix;
    a ConfigError naming ``flag`` when the files are missing or hold less than one window."""
    import numpy as np
    import torch

    from elastic_plugin.data.indexed import read_indexed_documents

    check_prefix(prefix, flag)
    docs = read_indexed_documents(prefix)
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    count = min(sequences, (len(flat) - 1) // seq_length)
    if count < 1:
        raise ConfigError(
            f"{flag} {prefix}: {len(flat)} tokens, too few for one sequence of {seq_length}"
        )
    windows = [flat[i * seq_length : i * seq_length + seq_length + 1] for i in range(count)]
    return torch.as_tensor(np.stack(windows).astype(np.int64))


def validation_tokens(meta: dict[str, Any], sequences: int, seq_length: int):
    """The validation windows every export of a checkpoint is measured on."""
    prefix = data_prefix(meta, "valid")
    if prefix is None:
        raise ConfigError(
            "the checkpoint records no validation data (meta 'data'); pass "
            "--eval-sequences 0 to skip the evaluation"
        )
    return token_windows(prefix, sequences, seq_length, "validation data")


def check_calibration_source(meta: dict[str, Any], calib_data: str | None) -> str:
    """The prefix ``--calib-samples`` will read, checked before anything is loaded."""
    prefix = calib_data or data_prefix(meta, "train")
    if prefix is None:
        raise ConfigError(
            "--calib-samples: the checkpoint records no training data (meta 'data'); pass "
            "--calib-data PREFIX (a Megatron indexed dataset of your calibration text)"
        )
    check_prefix(prefix, "--calib-data" if calib_data else "--calib-samples (training data)")
    return prefix


def calibration_tokens(meta: dict[str, Any], samples: int, seq_length: int, calib_data=None):
    """``samples`` windows of the calibration data (fewer available: a ConfigError naming
    ``--calib-samples``, so a calibration never runs on less than asked)."""
    prefix = check_calibration_source(meta, calib_data)
    tokens = token_windows(prefix, samples, seq_length, "--calib-samples")
    if len(tokens) < samples:
        raise ConfigError(
            f"--calib-samples {samples}: the calibration data {prefix} holds only {len(tokens)} "
            f"sequences of {seq_length} tokens"
        )
    return tokens
