"""What one Hugging Face model family supplies (torch-free; torch parts load lazily).

A family is one folder under ``families/`` (``families/README`` in the package docstring of
``families/__init__.py``): its ``config.json`` mapping onto our ``ModelConfig``, its Hub key
layout both ways (Megatron state dict <-> transformers' names <-> the names on disk), the
HF-side slicing of a budget and its transformers model builder / ``config.json`` writer. Every
stage that touches Hugging Face files (import, export, slice, nested directories, serve-check,
evaluation) asks the registry for the family and calls these methods, so a new family is one
new folder.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from elastic_plugin.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch

__all__ = ["Cut", "Family", "ImportLayout", "QuantLayout", "Target", "refuse"]

# (dim, prefix length or index set) per cut dimension of one tensor
Cut = tuple[tuple[int, "int | torch.Tensor"], ...]


class Target(NamedTuple):
    """Where one stored tensor goes: a Megatron state key, the shape ``config.json`` implies, the
    config fields that shape comes from, and which part of a fused Megatron tensor it fills:
    ``q`` / ``k`` / ``v`` of ``linear_qkv`` (rows interleaved per query group), ``gate`` / ``up``
    of a gated ``linear_fc1`` (gate rows first), or None for the whole tensor."""

    megatron: str
    shape: tuple[int, ...]
    fields: str
    part: str | None = None


@dataclasses.dataclass
class ImportLayout:
    """What an import of one directory fills: the model, stored key -> Target, Megatron keys no
    stored tensor sets (zero-filled), and notes recorded with the checkpoint."""

    model: ModelConfig
    table: dict[str, Target]
    zero_filled: list[str]
    notes: list[str]


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """How a family's in-memory tensors become ModelOpt's quantized HF layout (the shared
    ``export/quantize.py`` asks, so it names no family).

    ``expert_stacks``: an in-memory 3-D fused-experts leaf (``…experts.<leaf>``, [E, out, in])
    -> the per-expert projections it is written as, its rows split evenly in that order
    (NemotronH ``up_proj`` -> ``up_proj``; a gated ``gate_up_proj`` -> ``gate_proj``,
    ``up_proj``). The parts of one expert share its weight scale(s): ModelOpt quantizes the
    fused parameter per expert. ``fused``: sibling projections a runtime runs as one GEMM, so
    NVFP4 gives them one global weight scale (ModelOpt's ``preprocess_linear_fusion``)."""

    expert_stacks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    fused: tuple[tuple[str, ...], ...] = ()

    def merged(self, other: QuantLayout) -> QuantLayout:
        """Both layouts' rules (leaf names of different families do not collide)."""
        return QuantLayout({**self.expert_stacks, **other.expert_stacks}, self.fused + other.fused)


def refuse(source: str, field: str, value: Any, allowed: str, why: str) -> ConfigError:
    """The one wording of an unsupported ``config.json`` value: field, value, why, allowed."""
    return ConfigError(f"{source}: {field}={value!r} is not supported ({why}); allowed: {allowed}")


class Family(abc.ABC):
    """One Hugging Face architecture. Subclasses live in ``families/<name>/__init__.py`` as
    ``FAMILY``; methods that need torch or transformers import them lazily, so the registry
    and the config mapping stay importable without torch (``params --hf``)."""

    #: the ``architectures`` entry of config.json (and the transformers class name)
    architecture: str
    #: config.json's ``model_type``
    model_type: str
    #: one line for the supported list and the README table
    description: str

    # ------------------------------------------------------------------ config.json
    @abc.abstractmethod
    def model_config(self, config_json: Mapping[str, Any], source: str) -> ModelConfig:
        """Our ModelConfig of a ``config.json`` dict: every field that changes the function is
        mapped or refused naming the field and its value."""

    def notes(self, config_json: Mapping[str, Any]) -> list[str]:
        """Accepted differences worth recording with an import."""
        return []

    @abc.abstractmethod
    def holds(self, model: ModelConfig) -> str | None:
        """None when this family's stock transformers class computes ``model``; else why not
        (naming the ModelConfig field and value)."""

    # ------------------------------------------------------------------ key layout
    @abc.abstractmethod
    def import_layout(
        self,
        config_json: Mapping[str, Any],
        model: ModelConfig,
        stored: Mapping[str, tuple[int, ...]],
        source: str,
    ) -> ImportLayout:
        """Every tensor a directory of ``model`` stores (disk names) -> its Target."""

    @abc.abstractmethod
    def megatron_to_hf(self, state: Mapping[str, Any], model: ModelConfig) -> dict[str, Any]:
        """A TP=1 Megatron state dict (plain or sliced) in transformers' in-memory names;
        anything left over is an error."""

    @abc.abstractmethod
    def hf_to_megatron(self, hf: Mapping[str, Any], model: ModelConfig) -> dict[str, Any]:
        """The inverse of :meth:`megatron_to_hf`."""

    @abc.abstractmethod
    def to_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """transformers' in-memory names -> the names on disk (``save_pretrained``'s)."""

    @abc.abstractmethod
    def from_hub(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The names on disk -> transformers' in-memory ones."""

    def hub_name(self, name: str) -> str:
        """A module or tensor name as stored on disk (quantization excludes)."""
        return name

    def memory_name(self, name: str) -> str:
        """A module or tensor name as transformers holds it."""
        return name

    #: the quantized layout (:class:`QuantLayout`) of this family's tensors
    quant_layout: QuantLayout = QuantLayout()

    def megatron_input(self, module: str) -> tuple[int, str] | None:
        """``(Megatron layer index, role)`` of the Megatron module that reads what the in-memory
        HF linear ``module`` reads, for activation quantization of a Megatron model with an
        export's ``input_scale`` (``evaluation/models.py``). Roles: ``qkv``, ``proj`` (attention
        output), ``fc1`` / ``fc2`` (dense MLP), ``shared_fc1`` / ``shared_fc2``, ``experts_fc1`` /
        ``experts_fc2`` (every local expert), ``mamba_in`` / ``mamba_out``; None: not a linear
        this family quantizes."""
        return None

    def keep_fp32(self, name: str) -> bool:
        """Tensors stored in float32 whatever the export dtype (quantization scales always)."""
        return name.endswith(("weight_scale", "weight_scale_2", "input_scale"))

    # ------------------------------------------------------------------ slicing
    @abc.abstractmethod
    def tensor_cuts(
        self, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
    ) -> dict[str, Cut]:
        """The cut of every in-memory tensor of the nested model of ``choice``."""

    @abc.abstractmethod
    def slice_hub_files(
        self, path: Path, model: ModelConfig, choice: Mapping[str, int | Sequence[int]]
    ) -> dict[str, Any]:
        """The nested model of ``choice`` read from a directory's files (in-memory names),
        reading only what the budget keeps where the layout allows."""

    # ------------------------------------------------------------------ transformers
    @abc.abstractmethod
    def hf_config(
        self,
        tensors: Mapping[str, Any],
        model: ModelConfig,
        torch_dtype: str,
        token_ids: Mapping[str, int],
    ) -> dict[str, Any]:
        """``config.json`` for the converted tensors (sizes read from the tensors)."""

    def gguf_tensors(self, config_json: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
        """llama.cpp's architecture and this family's tensors in its names and layouts
        (``export --gguf``; numpy arrays in transformers' in-memory names); a family llama.cpp
        is not given here refuses, naming its architecture."""
        raise ConfigError(
            f"--gguf: {self.architecture} is not written as GGUF here (llama.cpp's "
            "architectures: the GPT families Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral)"
        )

    @abc.abstractmethod
    def build_hf_model(
        self, config_json: Mapping[str, Any], state: Mapping[str, Any], dtype: Any, source: str
    ) -> Any:
        """The transformers model of ``config_json`` holding ``state`` (in-memory names)."""
