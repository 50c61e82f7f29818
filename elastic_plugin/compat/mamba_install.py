"""Make Megatron-Core's ``MambaMixer`` run without ``mamba_ssm`` / ``causal_conv1d``.

``megatron.core.ssm.mamba_mixer`` imports its kernels once, at import time, into module globals
and reads those globals at call time. When ``mamba_ssm`` is missing it sets
``HAVE_MAMBA_SSM = False`` (``MambaMixer.__init__`` then raises), ``RMSNormGated`` to a
``MagicMock`` (so ``ExtendedRMSNorm`` is a mock too) and the scan functions to ``None``. Replacing
those globals with :mod:`elastic_plugin.compat.mamba_ops` is therefore enough; nothing in
Megatron's source is edited, and :func:`uninstall_mamba_fallbacks` restores the originals.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

MIXER_MODULE = "megatron.core.ssm.mamba_mixer"

# Originals of every global we replaced, and the result of the first install.
_ORIGINALS: dict[str, Any] = {}
_RESULT: dict | None = None


def _sequence_packing_support(for_inference_not_training: bool = True) -> tuple[bool, str | None]:
    """Replacement for Megatron's version check: packed *training* works with the fallbacks
    (``seq_idx`` is honoured by the conv and the scan); dynamic-batching inference does not
    (it needs varlen kernels that only exist in Triton)."""
    if for_inference_not_training:
        return (
            False,
            "dynamic-batching Mamba inference needs mamba_ssm/causal_conv1d (not the CPU fallback)",
        )
    return True, None


def install_mamba_fallbacks(force: bool = False) -> dict:
    """Patch ``megatron.core.ssm.mamba_mixer`` to use the pure-PyTorch ops; idempotent.

    Does nothing when the real ``mamba_ssm`` kernels were imported by Megatron, unless ``force``
    (e.g. ``mamba_ssm`` installed but no GPU). The decode kernels (Megatron's own Triton
    ``causal_conv1d_update`` / ``selective_state_update``) are replaced only when CUDA is not
    available or ``force`` is set, since on a GPU they work and are faster.

    Returns ``{"mamba_ssm_available": bool, "installed": bool, "patched": [names], "reason": str}``
    where names are ``"mamba_mixer.<global>"``.
    """
    global _RESULT
    if _RESULT is not None and _RESULT["installed"]:
        return dict(_RESULT, patched=list(_RESULT["patched"]))

    mixer = importlib.import_module(MIXER_MODULE)
    from elastic_plugin.compat import mamba_ops as ops

    have_real = bool(mixer.HAVE_MAMBA_SSM) and mixer.mamba_chunk_scan_combined is not None
    if have_real and not force:
        _RESULT = {
            "mamba_ssm_available": True,
            "installed": False,
            "patched": [],
            "reason": "mamba_ssm kernels are importable; Megatron uses them",
        }
        return dict(_RESULT)

    replacements: dict[str, Any] = {
        "HAVE_MAMBA_SSM": True,
        # Our scans accept ``state_dtype``; lets ``mamba_training_ssm_states_dtype`` be set.
        "MAMBA_HAS_STATE_DTYPE": True,
        "RMSNormGated": ops.RMSNormGated,
        "ExtendedRMSNorm": ops.ExtendedRMSNormGated,
        "mamba_chunk_scan_combined": ops.mamba_chunk_scan_combined,
        "mamba_split_conv1d_scan_combined": ops.mamba_split_conv1d_scan_combined,
        "causal_conv1d_fn": ops.causal_conv1d_fn,
        "_check_mamba_sequence_packing_support": _sequence_packing_support,
    }
    if force or not torch.cuda.is_available():
        replacements["causal_conv1d_update"] = ops.causal_conv1d_update_ref
        replacements["selective_state_update"] = ops.selective_state_update_ref

    patched = []
    for name, value in replacements.items():
        if name not in _ORIGINALS:
            _ORIGINALS[name] = getattr(mixer, name, None)
        setattr(mixer, name, value)
        patched.append(f"mamba_mixer.{name}")
    _RESULT = {
        "mamba_ssm_available": have_real,
        "installed": True,
        "patched": patched,
        "reason": "forced"
        if have_real
        else "mamba_ssm not importable; pure-PyTorch fallbacks installed",
    }
    return dict(_RESULT, patched=list(patched))


def uninstall_mamba_fallbacks() -> list[str]:
    """Restore Megatron's original globals (for tests); returns the names restored."""
    global _RESULT
    if not _ORIGINALS:
        _RESULT = None
        return []
    mixer = importlib.import_module(MIXER_MODULE)
    restored = []
    for name, value in _ORIGINALS.items():
        setattr(mixer, name, value)
        restored.append(f"mamba_mixer.{name}")
    _ORIGINALS.clear()
    _RESULT = None
    return restored
