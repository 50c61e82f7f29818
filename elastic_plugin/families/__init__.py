"""Hugging Face model families: one folder each, found by the registry (torch-free).

Every model we train is a Megatron-Core ``HybridModel``; what differs between Nemotron-H, Llama,
Qwen or Mixtral is only the Hugging Face side: how ``config.json`` reads, how tensors are named
and laid out on disk, how a budget is cut out of those tensors, and which transformers class
builds the model. Each family is a sub-package here exposing ``FAMILY`` (a
:class:`~elastic_plugin.families.base.Family`); the registry finds them by listing this package,
so adding a family is one new folder (and its tests), nothing else edited.

``family_for_config`` picks the family from ``config.json``'s ``architectures`` / ``model_type``
and names an unsupported architecture first, with the supported list; ``family_for_model`` finds
the one family whose stock class computes a ``ModelConfig`` (exports).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from functools import cache
from typing import Any

from elastic_plugin.families.base import Family
from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "Family",
    "all_families",
    "family_for_config",
    "family_for_model",
    "family_named",
    "model_config_from_hf",
    "supported_architectures",
]


@cache
def all_families() -> tuple[Family, ...]:
    """Every family folder's ``FAMILY``, Nemotron-H first, then by architecture name."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    return tuple(
        sorted(found, key=lambda f: (f.architecture != "NemotronHForCausalLM", f.architecture))
    )


def supported_architectures() -> list[str]:
    """``architectures`` values the registry maps, as the error messages list them."""
    return [f.architecture for f in all_families()]


def _supported_text() -> str:
    return "; ".join(f"{f.architecture} ({f.description})" for f in all_families())


def family_named(architecture: str) -> Family:
    """The family of one ``architectures`` entry (or ``model_type``)."""
    for family in all_families():
        if architecture in (family.architecture, family.model_type):
            return family
    raise ConfigError(
        f"architecture {architecture!r} is not supported; supported: {_supported_text()}"
    )


def family_for_config(config_json: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family ``config.json`` names. Its ``architectures`` (one entry) decides, else its
    ``model_type``; an unsupported one is refused here, before any other field is read."""
    if not isinstance(config_json, Mapping):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    arch = config_json.get("architectures")
    model_type = config_json.get("model_type")
    if arch is not None:
        if not isinstance(arch, list) or len(arch) != 1:
            raise ConfigError(
                f"{source}: unsupported architecture architectures={arch!r} (one entry expected);"
                f" supported: {_supported_text()}"
            )
        matches = [f for f in all_families() if f.architecture == arch[0]]
        if not matches:
            raise ConfigError(
                f"{source}: unsupported architecture architectures={arch!r}; "
                f"supported: {_supported_text()}"
            )
        family = matches[0]
        if model_type is not None and model_type != family.model_type:
            raise ConfigError(
                f"{source}: unsupported architecture model_type={model_type!r} with "
                f"architectures={arch!r} (a {family.architecture} has model_type "
                f"{family.model_type!r}); supported: {_supported_text()}"
            )
        return family
    matches = [f for f in all_families() if f.model_type == model_type]
    if not matches:
        raise ConfigError(
            f"{source}: unsupported architecture model_type={model_type!r} (and no "
            f"architectures); supported: {_supported_text()}"
        )
    return matches[0]


def model_config_from_hf(
    config_json: Mapping[str, Any], source: str = "config.json"
) -> ModelConfig:
    """Our ModelConfig of any supported ``config.json`` (the family's own mapping)."""
    return family_for_config(config_json, source).model_config(config_json, source)


def family_for_model(model: ModelConfig, prefix: str = "--format hf") -> Family:
    """The family whose stock transformers class computes ``model``; a ConfigError listing why
    each family cannot otherwise (naming the ModelConfig field)."""
    reasons = []
    for family in all_families():
        why = family.holds(model)
        if why is None:
            return family
        reasons.append(f"{family.architecture}: {why}")
    raise ConfigError(
        f"{prefix}: no supported Hugging Face architecture computes this model: "
        + "; ".join(reasons)
    )
