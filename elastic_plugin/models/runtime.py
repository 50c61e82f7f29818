"""How a model trains, beside what it is: precision and activation recomputation.

``Runtime`` carries the Megatron-LM flags a cluster run sets (``--bf16``,
``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``) from the YAML's
``training:`` section or the command line to ``TransformerConfig``. BF16 is mixed precision as
Megatron does it: parameters and activations in BF16, FP32 main parameters and gradients in the
optimizer (``grad_reduce_in_fp32``), FP32 router and losses. Checking imports no torch, so a
contradictory command line fails before any model is built.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_plugin.models.config import ConfigError, ModelConfig

__all__ = [
    "DTYPE_NAMES",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "Runtime",
    "auto_bf16",
    "is_auto",
    "precision_note",
    "with_saved_precision",
]

RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("full", "selective")
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")

# field -> how the YAML names it (command lines pass their flag names to ``check``)
YAML_NAMES: dict[str, str] = {
    "bf16": "training.bf16",
    "recompute_granularity": "training.recompute_granularity",
    "recompute_method": "training.recompute_method",
    "recompute_num_layers": "training.recompute_num_layers",
}
FLAG_NAMES: dict[str, str] = {
    "bf16": "--bf16",
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
}


def is_auto(bf16: Any) -> bool:
    """``training.bf16`` left to the machine: unset (None) or ``auto``."""
    return bf16 is None or bf16 == "auto"


def auto_bf16() -> tuple[bool, str]:
    """(BF16 for an automatic precision, why): BF16 where matmuls run in BF16 hardware (a
    CUDA device that supports it; a CPU with AMX or AVX-512-BF16, ``compat.host.fast_bf16``),
    else FP32 (BF16 would be emulated, e.g. ~1% of FP32's GEMM speed on an AVX2 CPU)."""
    from elastic_plugin.compat.host import fast_bf16

    torch = sys.modules.get("torch")  # parsing a command line imports no torch: CPU flags then
    if torch is not None and torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return True, "the GPU does BF16 matmuls"
        return False, "the GPU has no BF16 matmuls"
    return fast_bf16()


def with_saved_precision(training: Any, meta: Mapping[str, Any]) -> Any:
    """``training`` to resume a save: an automatic precision continues in the precision the save
    was written in (its optimizer state has FP32 main weights after BF16, none after FP32);
    an explicit one is kept (and ``check_resumable`` refuses a mismatch)."""
    import dataclasses

    saved = meta.get("params_dtype")
    if not is_auto(getattr(training, "bf16", None)) or saved not in DTYPE_NAMES:
        return training
    return dataclasses.replace(training, bf16=saved == "bfloat16")


def precision_note(training: Any) -> str:
    """One log line: the precision a run trains in, and why (the flag, the YAML, or auto)."""
    bf16 = getattr(training, "bf16", None)
    if is_auto(bf16):
        value, why = auto_bf16()
        source = f"auto: {why}"
    else:
        value, source = bool(bf16), "--bf16 / training.bf16"
    return f"precision: {'BF16 mixed precision' if value else 'FP32'} ({source})"


@dataclass(frozen=True)
class Runtime:
    """Precision and recomputation of one training run (defaults: FP32, no recomputation)."""

    bf16: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    @classmethod
    def of(cls, training: Any) -> Runtime:
        """The runtime a ``TrainingConfig`` (or anything with these fields) asks for; an
        automatic precision (``bf16`` None or ``"auto"``) is decided here (``auto_bf16``)."""
        bf16: Any = getattr(training, "bf16", None)
        return cls(
            auto_bf16()[0] if is_auto(bf16) else bf16,
            getattr(training, "recompute_granularity", None),
            getattr(training, "recompute_method", None),
            getattr(training, "recompute_num_layers", None),
        )

    @property
    def dtype_name(self) -> str:
        """The parameters' dtype as checkpoints record it."""
        return "bfloat16" if self.bf16 else "float32"

    @property
    def params_dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def recomputes(self) -> bool:
        return self.recompute_granularity is not None

    @property
    def full_recompute(self) -> bool:
        """Whole layers re-run in the backward pass (a 4th pass in the FLOP count)."""
        return self.recompute_granularity == "full"

    def check_resumable(self, meta: Mapping[str, Any], where: str) -> None:
        """A save continues only in its own precision: its optimizer state has FP32 main
        weights after a BF16 run and none after an FP32 one. ``where`` starts the message."""
        saved = meta.get("params_dtype", "float32")
        if saved != self.dtype_name:
            raise ConfigError(
                f"{where} was trained in {saved} (its optimizer state "
                f"{'has' if saved == 'bfloat16' else 'has no'} FP32 main weights); resume "
                f"{'with' if saved == 'bfloat16' else 'without'} --bf16 (training.bf16)"
            )

    def check(
        self, model: ModelConfig, pp: int = 1, names: Mapping[str, str] | None = None
    ) -> Runtime:
        """Refuse what Megatron would refuse (or silently misread), naming the flag or key."""
        names = {**YAML_NAMES, **(names or {})}
        gran, method, layers = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        if not isinstance(self.bf16, bool):
            raise ConfigError(f"{names['bf16']}={self.bf16!r}; allowed: true, false, auto")
        if gran is not None and gran not in RECOMPUTE_GRANULARITIES:
            raise ConfigError(
                f"{names['recompute_granularity']}={gran!r}; allowed: "
                f"{', '.join(RECOMPUTE_GRANULARITIES)}"
            )
        if method is not None and method not in RECOMPUTE_METHODS:
            raise ConfigError(
                f"{names['recompute_method']}={method!r}; allowed: {', '.join(RECOMPUTE_METHODS)}"
            )
        if layers is not None and (
            not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0
        ):
            raise ConfigError(f"{names['recompute_num_layers']}={layers!r} must be an integer > 0")
        if gran is None and (method is not None or layers is not None):
            given = (
                names["recompute_method"] if method is not None else names["recompute_num_layers"]
            )
            raise ConfigError(
                f"{given} needs {names['recompute_granularity']} full (it says which layers "
                "full recomputation covers)"
            )
        if gran == "selective" and (method is not None or layers is not None):
            given = (
                names["recompute_method"] if method is not None else names["recompute_num_layers"]
            )
            raise ConfigError(
                f"{given} contradicts {names['recompute_granularity']} selective (selective "
                "recomputes core attention in every layer); drop it, or use full"
            )
        if gran == "full":
            if method is None or layers is None:
                raise ConfigError(
                    f"{names['recompute_granularity']} full needs {names['recompute_method']} "
                    f"({'|'.join(RECOMPUTE_METHODS)}) and {names['recompute_num_layers']} N"
                )
            per_stage = model.num_layers // max(pp, 1)
            if layers > per_stage:
                raise ConfigError(
                    f"{names['recompute_num_layers']}={layers} exceeds the {per_stage} layers "
                    f"per pipeline stage ({model.num_layers} layers / PP {pp}); allowed: "
                    f"1..{per_stage}"
                )
        return self

    def transformer_overrides(self) -> dict[str, Any]:
        """``TransformerConfig`` fields for the recomputation (precision is ``params_dtype``)."""
        if not self.recomputes:
            return {}
        return {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "bf16": self.bf16,
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }
