"""Which layer spec a model is built with: chosen by what can run here and what must be sliced.

Two backends build a hybrid stack (``SPEC_BACKENDS``): the local spec (Megatron-Core's plain
parallel layers, ``models/specs.py``; runs anywhere) and Transformer Engine's (Megatron-Core's
own TE spec; needs TE *and* a CUDA device: TE imports on a machine without a GPU, but its
modules refuse to be built there). A model whose layers our code slices, hooks or permutes (the
elastic student, importance, reordering, extraction, import and export) needs a backend whose
layers that code handles; a model that only runs (the frozen teacher, ``train``'s model) may use
either (``MODEL_ROLES``). ``choose_layer_spec`` decides per model and says why; the request is ``auto`` unless
the user asked otherwise (``--layer-spec`` of ``train`` / ``elastic-train``, or
``ELASTIC_PLUGIN_LAYER_SPEC`` for any command and for Megatron-LM scripts):

- ``auto``: TE's spec for a model that only runs where TE can run, else the local one;
- ``local``: the local spec for every model;
- ``te``: TE's spec for every model that can take it (a sliced model keeps the local spec, and
  the log says so); where TE cannot run, an error.

Elastic widths on TE's own linears are not written (no machine we run on runs TE). Adding them is
their elastic forward (``elastic/layers``) plus one change here: the ``te`` entry's
``not_elastic`` becomes None, and every choice, check and log follows from the entry.

Importing this module imports no torch (command lines check the request before ranks start).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic_plugin.models.config import ConfigError

__all__ = [
    "LAYER_SPECS",
    "LAYER_SPEC_ENV",
    "MODEL_ROLES",
    "SPEC_BACKENDS",
    "SpecBackend",
    "SpecChoice",
    "check_layer_spec_request",
    "choose_layer_spec",
    "requested_layer_spec",
    "transformer_engine_missing",
]

LAYER_SPEC_ENV = "ELASTIC_PLUGIN_LAYER_SPEC"
LAYER_SPECS: tuple[str, ...] = ("auto", "local", "te")
_ASKED = f"--layer-spec / {LAYER_SPEC_ENV}"

MODEL_ROLES: dict[str, tuple[bool, str]] = {
    # role -> (our code slices, hooks or permutes its layers; how the log names the model)
    "sliced": (True, "a model whose layers are sliced"),  # the default of every builder
    "student": (True, "the elastic student"),
    "teacher": (False, "the frozen teacher"),
    "trained": (False, "the trained model"),
}
"""What a model is built for. ``sliced`` (the default: importance, reordering, extraction,
import, export, generation build their models so) and ``student`` need layers our code handles;
``teacher`` and ``trained`` (``train``'s model) only run."""


def transformer_engine_missing() -> str | None:
    """Why Transformer Engine's layers cannot run in this process (None: they can)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "transformer_engine":
            return "Transformer Engine is not installed"
        return f"Transformer Engine does not import ({exc})"
    except Exception as exc:  # a broken CUDA install: TE's libraries fail to load
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"Transformer Engine does not import ({type(exc).__name__}: {first})"
    import torch

    if not torch.cuda.is_available():
        return "Transformer Engine imports, but no CUDA device is visible (its modules need one)"
    return None


def _local_stack_spec(core_attention: str | None) -> Any:
    from elastic_plugin.models.specs import local_hybrid_stack_spec

    return local_hybrid_stack_spec(core_attention or "sdpa")


def _te_stack_spec(core_attention: str | None) -> Any:
    if core_attention is not None:
        raise ConfigError(
            f"core_attention={core_attention!r} selects the local (non-TE) spec's attention; "
            "the Transformer Engine spec uses TEDotProductAttention (use the local spec)"
        )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return hybrid_stack_spec


@dataclass(frozen=True)
class SpecBackend:
    """One way to build the hybrid stack's layers.

    ``missing()``: why its layers cannot run here (None: they can). ``stack_spec(core_attention)``:
    the ``HybridStack`` spec. ``not_elastic``: why our elastic layers, importance hooks and
    reordering cannot handle its layers (None: they can, so sliced models may use it)."""

    name: str
    title: str
    missing: Callable[[], str | None]
    stack_spec: Callable[[str | None], Any]
    not_elastic: str | None


SPEC_BACKENDS: dict[str, SpecBackend] = {
    "local": SpecBackend(
        name="local",
        title="the local spec (Megatron-Core's parallel layers)",
        missing=lambda: None,
        stack_spec=_local_stack_spec,
        not_elastic=None,
    ),
    "te": SpecBackend(
        name="te",
        title="Transformer Engine's spec",
        missing=transformer_engine_missing,
        stack_spec=_te_stack_spec,
        not_elastic="Transformer Engine's linears are not elastic yet",
    ),
}


@dataclass(frozen=True)
class SpecChoice:
    """The backend one model is built with, and why."""

    backend: str  # a key of SPEC_BACKENDS
    reason: str

    @property
    def use_te(self) -> bool:
        return self.backend == "te"

    role: str = "sliced"  # a key of MODEL_ROLES

    def describe(self) -> str:
        """The log line: ``layer spec of the elastic student: local (why)``."""
        return f"layer spec of {MODEL_ROLES[self.role][1]}: {self.backend} ({self.reason})"


def _check_value(value: str, where: str) -> str:
    value = value.strip().lower()
    if value not in LAYER_SPECS:
        raise ConfigError(f"{where}={value!r}: allowed values are {', '.join(LAYER_SPECS)}")
    return value


def requested_layer_spec(environ: Mapping[str, str] | None = None) -> str:
    """The user's request: ``ELASTIC_PLUGIN_LAYER_SPEC`` (``--layer-spec`` sets it), else auto."""
    value = (os.environ if environ is None else environ).get(LAYER_SPEC_ENV, "") or "auto"
    return _check_value(value, LAYER_SPEC_ENV)


def _role(role: str) -> bool:
    if role not in MODEL_ROLES:
        raise ValueError(f"model role {role!r}: one of {', '.join(MODEL_ROLES)}")
    return MODEL_ROLES[role][0]


def choose_layer_spec(role: str = "sliced", requested: str | None = None) -> SpecChoice:
    """The spec of one model built for ``role`` (``MODEL_ROLES``). ``requested``: auto / local /
    te (default: :func:`requested_layer_spec`)."""
    sliced = _role(role)
    asked = requested_layer_spec() if requested is None else _check_value(requested, _ASKED)
    if asked == "local":
        return SpecChoice("local", f"{_ASKED} asks for local", role)
    te = SPEC_BACKENDS["te"]
    missing = te.missing()
    sliced_why = None
    if sliced and te.not_elastic is not None:
        sliced_why = (
            "its layers are sliced (elastic widths, importance, reordering, extraction), and "
            f"{te.not_elastic}"
        )
    if asked == "te":
        if missing is not None:
            raise ConfigError(f"{_ASKED} asks for te, but {missing}; allowed here: auto, local")
        if sliced_why is not None:
            return SpecChoice("local", f"te asked for, but {sliced_why}", role)
        return SpecChoice("te", f"{_ASKED} asks for te", role)
    if missing is not None:
        return SpecChoice("local", missing, role)
    if sliced_why is not None:
        return SpecChoice("local", sliced_why, role)
    return SpecChoice("te", "Transformer Engine imports and a CUDA device is visible", role)


def check_layer_spec_request(requested: str, roles: list[str], where: str) -> None:
    """Before any rank starts: ``requested`` can be honoured by a command that builds models of
    ``roles``, or a ConfigError names ``where`` (the flag) and the allowed values."""
    asked = _check_value(requested, where)
    if asked != "te":
        return
    te = SPEC_BACKENDS["te"]
    if te.not_elastic is not None and all(_role(role) for role in roles):
        names = ", ".join(MODEL_ROLES[role][1] for role in roles)
        raise ConfigError(
            f"{where}=te: this command's models have their layers sliced ({names}), and "
            f"{te.not_elastic}; allowed here: auto, local"
        )
    missing = te.missing()
    if missing is not None:
        raise ConfigError(f"{where}=te: {missing}; allowed here: auto, local")
