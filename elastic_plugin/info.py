"""``elastic-plugin info``: what this installation runs on and which implementations it uses."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


def collect_info() -> dict[str, Any]:
    """Versions, device, Mamba implementation, extension backend and applied CPU patches."""
    import torch

    import elastic_plugin
    from elastic_plugin import ops
    from elastic_plugin.compat.mamba_install import install_mamba_fallbacks
    from elastic_plugin.compat.megatron_training import (
        enable_cpu_megatron_training,
        training_patches,
    )
    from elastic_plugin.models.specs import have_transformer_engine

    # no-ops with CUDA; otherwise what a CPU run would use: Megatron-Core's patches
    # (compat/cpu.py) and Megatron-LM's training loop's (compat/megatron_training.py)
    patches = enable_cpu_megatron_training()
    mamba = install_mamba_fallbacks()
    cuda = torch.cuda.is_available()
    return {
        "elastic_plugin": elastic_plugin.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "megatron_core": _version("megatron-core"),
        "transformer_engine": _version("transformer-engine") if have_transformer_engine() else None,
        "mamba_ssm": _version("mamba-ssm") if _importable("mamba_ssm") else None,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cuda_available": cuda,
        "distributed_backend": "nccl" if cuda else "gloo",
        # per kind of model: the spec it gets here (ELASTIC_PLUGIN_LAYER_SPEC honoured) and why
        "layer_spec": _layer_specs(),
        "mamba_ops": "mamba_ssm"
        if not mamba.get("installed") and mamba.get("mamba_ssm_available")
        else "pytorch (elastic_plugin.compat.mamba_ops)",
        "extension": ops.backend_info(),
        "cpu_patches": len(patches),
        "megatron_training_patches": training_patches(),
    }


def _layer_specs() -> dict[str, str]:
    """The spec an elastic student and a frozen teacher get in this process, and why."""
    from elastic_plugin.models.spec_choice import choose_layer_spec

    specs = {}
    for role in ("student", "teacher"):
        try:
            choice = choose_layer_spec(role)
            specs[role] = f"{choice.backend} ({choice.reason})"
        except Exception as exc:  # ELASTIC_PLUGIN_LAYER_SPEC asks for what cannot run here
            specs[role] = f"error: {exc}"
    return specs


def run_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        print(f"{key:<{width}}  {value}")
    return 0


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="versions, device, Mamba ops and extension backend")
    parser.add_argument("--json", action="store_true", help="print as JSON")
    parser.set_defaults(func=run_info)
