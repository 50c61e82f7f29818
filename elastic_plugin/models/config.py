"""Model configuration files: one YAML schema for every hybrid Mamba-attention-MoE model we build.

A config file has a ``model:`` section (architecture, mapped 1:1 onto Megatron-Core's
``TransformerConfig`` + ``HybridModel`` arguments) and optional ``parallel:`` / ``training:`` /
``data:`` sections used by the main job. Unknown keys are rejected with the list of allowed
ones, because a silently ignored typo (``mamba_num_head``) produces a different model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

LAYER_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
ACTIVATIONS = ("squared_relu", "swiglu", "gelu", "relu", "silu")
ROUTER_SCORES = ("softmax", "sigmoid")
POSITION_EMBEDDINGS = ("none", "rope")
DISPATCHERS = ("alltoall", "allgather")


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and what is allowed."""


@dataclass
class ModelConfig:
    """Architecture of a hybrid model; field names follow Megatron-Core's where one exists."""

    hybrid_layer_pattern: str
    hidden_size: int
    vocab_size: int
    num_attention_heads: int = 0
    num_query_groups: int | None = None
    kv_channels: int | None = None
    ffn_hidden_size: int = 0
    mamba_num_heads: int = 0
    mamba_head_dim: int = 64
    mamba_num_groups: int = 1
    mamba_state_dim: int = 128
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 128
    num_moe_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_enable_expert_bias: bool = False
    # multiplies the (normalised) routing weights of the chosen experts; NemotronH's
    # ``routed_scaling_factor`` (2.5 in Nemotron Nano v3). None: no scaling (Megatron's default)
    moe_router_topk_scaling_factor: float | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    activation: str = "squared_relu"
    normalization: Literal["RMSNorm"] = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    position_embedding_type: Literal["none", "rope"] = "none"
    rotary_base: int = 10000
    # Llama 3.1+ frequency scaling (Megatron's RotaryEmbedding: low/high frequency factors 1 and 4,
    # original context 8192 are fixed there); off: plain RoPE
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    # per-head RMSNorm of queries and keys (Qwen3); its weight is head_dim-sized, not hidden-sized
    qk_layernorm: bool = False
    # biases on the query/key/value projection only (Qwen2), independent of add_bias_linear
    add_qkv_bias: bool = False
    max_sequence_length: int = 4096
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    init_method_std: float = 0.02

    # ----------------------------------------------------------------- derived
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def layer_types(self) -> list[str]:
        """Layer kinds in order ('mamba', 'attention', 'mlp', 'moe'); PP separators removed."""
        return [LAYER_SYMBOLS[c] for c in self.hybrid_layer_pattern if c != "|"]

    def count(self, kind: str) -> int:
        return self.layer_types.count(kind)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        if self.kv_channels:
            return self.kv_channels
        return self.hidden_size // max(self.num_attention_heads, 1)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "swiglu"

    # -------------------------------------------------------------- validation
    def validate(self) -> ModelConfig:
        """Check every field that Megatron would otherwise reject late (or accept wrongly)."""
        bad = set(self.hybrid_layer_pattern) - set(LAYER_SYMBOLS) - {"|"}
        if not self.hybrid_layer_pattern or bad:
            raise ConfigError(
                f"model.hybrid_layer_pattern={self.hybrid_layer_pattern!r}: allowed symbols are "
                "M (Mamba-2), * (attention), - (dense MLP), E (MoE) and | (pipeline boundary)"
            )
        _positive("model.hidden_size", self.hidden_size)
        _positive("model.vocab_size", self.vocab_size)
        _choice("model.activation", self.activation, ACTIVATIONS)
        _choice("model.moe_router_score_function", self.moe_router_score_function, ROUTER_SCORES)
        _choice("model.position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        _choice("model.moe_token_dispatcher_type", self.moe_token_dispatcher_type, DISPATCHERS)
        _choice("model.normalization", self.normalization, ("RMSNorm",))
        if self.count("attention"):
            _positive("model.num_attention_heads", self.num_attention_heads)
            if self.num_attention_heads % self.query_groups:
                raise ConfigError(
                    f"model.num_attention_heads={self.num_attention_heads} must be divisible by "
                    f"model.num_query_groups={self.query_groups}"
                )
            if not self.kv_channels and self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    "model.kv_channels is required when model.hidden_size is not divisible by "
                    "model.num_attention_heads"
                )
        self._validate_gpt_options()
        if self.count("mamba"):
            _positive("model.mamba_num_heads", self.mamba_num_heads)
            _positive("model.mamba_head_dim", self.mamba_head_dim)
            _positive("model.mamba_num_groups", self.mamba_num_groups)
            _positive("model.mamba_state_dim", self.mamba_state_dim)
            if self.mamba_num_heads % self.mamba_num_groups:
                raise ConfigError(
                    f"model.mamba_num_heads={self.mamba_num_heads} must be divisible by "
                    f"model.mamba_num_groups={self.mamba_num_groups}"
                )
        if self.count("mlp"):
            _positive("model.ffn_hidden_size", self.ffn_hidden_size)
        if self.count("moe"):
            _positive("model.num_moe_experts", self.num_moe_experts)
            _positive("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size)
            if self.moe_shared_expert_intermediate_size and self.add_bias_linear:
                raise ConfigError(
                    "model.moe_shared_expert_intermediate_size>0 needs model.add_bias_linear=false "
                    "(Megatron-Core's shared expert has no biases)"
                )
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ConfigError(
                    f"model.moe_router_topk={self.moe_router_topk} must be in "
                    f"[1, model.num_moe_experts={self.num_moe_experts}]"
                )
        return self

    def _validate_gpt_options(self) -> None:
        """The GPT-family options (Llama / Qwen): each needs the part of the model it changes,
        so a config asking for one that would silently do nothing is refused."""
        for name in ("rope_scaling", "qk_layernorm", "add_qkv_bias"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"model.{name}={value!r}; allowed: true, false")
        factor = self.rope_scaling_factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 0
        ):
            raise ConfigError(
                f"model.rope_scaling_factor={factor!r} must be a positive number "
                "(Llama 3.1+: 8.0, Llama 3.2: 32.0)"
            )
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ConfigError(
                "model.rope_scaling=true needs model.position_embedding_type='rope' "
                f"(got {self.position_embedding_type!r}): it rescales RoPE's frequencies"
            )
        for name in ("qk_layernorm", "add_qkv_bias"):
            if getattr(self, name) and not self.count("attention"):
                raise ConfigError(
                    f"model.{name}=true needs attention layers ('*' in "
                    f"model.hybrid_layer_pattern={self.hybrid_layer_pattern!r})"
                )

    def check_parallel(self, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
        """Reject layouts whose sharded dims don't divide, naming the field and the flag."""
        for name, size in (
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("expert_model_parallel_size", ep),
        ):
            if size < 1:
                raise ConfigError(f"parallel.{name}={size} must be >= 1")
        checks: list[tuple[str, int, str, int]] = []
        if self.count("attention"):
            checks += [
                ("model.num_attention_heads", self.num_attention_heads, "tensor", tp),
                ("model.num_query_groups", self.query_groups, "tensor", tp),
            ]
        if self.count("mamba"):
            checks += [
                ("model.mamba_num_heads", self.mamba_num_heads, "tensor", tp),
                ("model.mamba_num_groups", self.mamba_num_groups, "tensor", tp),
            ]
        if self.count("mlp"):
            checks.append(("model.ffn_hidden_size", self.ffn_hidden_size, "tensor", tp))
        if self.count("moe"):
            checks += [
                ("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size, "tensor", tp),
                ("model.num_moe_experts", self.num_moe_experts, "expert", ep),
            ]
            if self.moe_shared_expert_intermediate_size:
                checks.append(
                    (
                        "model.moe_shared_expert_intermediate_size",
                        self.moe_shared_expert_intermediate_size,
                        "tensor",
                        tp,
                    )
                )
        for field_name, value, kind, size in checks:
            if value % size:
                raise ConfigError(
                    f"{field_name}={value} is not divisible by the {kind}-parallel size {size}"
                )
        stages = self.hybrid_layer_pattern.count("|") + 1
        if stages > 1 and stages % pp:
            raise ConfigError(
                f"model.hybrid_layer_pattern has {stages} pipeline segments ('|'), not a multiple "
                f"of pipeline_model_parallel_size={pp}"
            )
        if stages == 1 and self.num_layers % pp:
            raise ConfigError(
                f"model has {self.num_layers} layers, not divisible by "
                f"pipeline_model_parallel_size={pp}; add '|' boundaries to the pattern"
            )


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor, pipeline, expert and context parallel sizes (data parallel is
    the rest). The one layout type: the YAML ``parallel:`` section (Megatron-LM's names,
    :data:`LAYOUT_KEYS`), the command-line flags, the process groups and checkpoint metadata
    (``asdict``: these short names). ``cp`` is last so that positional constructions stay
    valid."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    cp: int = 1

    @classmethod
    def from_section(cls, values: Mapping[str, Any] | None) -> Layout:
        """The layout a config's ``parallel:`` section (Megatron-LM's names) describes."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(LAYOUT_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown key(s) in section 'parallel': {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(LAYOUT_KEYS))}"
            )
        return cls(**{LAYOUT_KEYS[key]: value for key, value in values.items()})

    def to_section(self) -> dict[str, Any]:
        """The ``parallel:`` section (Megatron-LM's names) that describes this layout."""
        return {key: getattr(self, name) for key, name in LAYOUT_KEYS.items()}

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel size: the ranks left after TP x PP x CP (each holds whole
        sequences' rows; a CP group shares its rows)."""
        return world_size // (self.tp * self.pp * self.cp)

    def check_world(self, world_size: int) -> None:
        if self.cp < 1:
            raise ConfigError(f"--context-parallel-size={self.cp} must be >= 1")
        if world_size % (self.tp * self.pp * self.cp):
            raise ConfigError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"({self.tp}) x --pipeline-model-parallel-size ({self.pp}) x "
                f"--context-parallel-size ({self.cp})"
            )
        dp = self.data_parallel(world_size)
        # Megatron carves expert parallelism out of data x context parallelism
        if (dp * self.cp) % self.ep:
            raise ConfigError(
                f"--expert-model-parallel-size={self.ep} must divide the data-parallel x "
                f"context-parallel size {dp * self.cp} (world {world_size} / TP / PP)"
            )


# the YAML ``parallel:`` section's keys (Megatron-LM's argument names) -> ``Layout`` fields
LAYOUT_KEYS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep",
    "sequence_parallel": "sequence_parallel",
    "use_distributed_optimizer": "distributed_optimizer",
    "context_parallel_size": "cp",
}


DEFAULT_KEEP_LAST = 2  # saves a stage keeps (--keep-last); older ones go after a new one verified
DATALOADER_TYPES = ("shuffled", "single")


@dataclass
class TrainingConfig:
    """A training schedule: the teacher's (the config's ``training:`` section) and the elastic
    student's (``elastic.schedule.student_schedule``: the same fields, other defaults)."""

    seq_length: int = 128
    micro_batch_size: int = 8
    global_batch_size: int = 8
    train_iters: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 20
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    eval_interval: int = 50
    eval_iters: int = 5
    log_interval: int = 10
    save_interval: int = 0  # 0: only at the end
    keep_last: int = DEFAULT_KEEP_LAST  # saves kept in the stage's iter_*; 0: keep all
    # "shuffled": each epoch in a seeded random order (our sampler); "single": in the dataset's
    # order, as Megatron-LM's default ``--dataloader-type single`` reads (GPTDataset has already
    # shuffled its samples), so a run here and one in Megatron-LM's loop see the same batches
    dataloader_type: str = "shuffled"
    # precision and activation recomputation (``models.runtime``; Megatron-LM's flags). bf16:
    # None (``auto`` in YAML) = BF16 where the machine does BF16 matmuls in hardware, else FP32
    bf16: bool | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def check(self, what: str = "training") -> None:
        """Sizes, intervals, LR range and data order; ``what`` names the run in the error."""
        for name in (
            "train_iters",
            "global_batch_size",
            "micro_batch_size",
            "seq_length",
            "log_interval",
            "eval_interval",
            "eval_iters",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{what}: {name}={value!r} must be a positive integer")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ConfigError(f"{what}: keep_last={self.keep_last!r} must be an integer >= 0")
        if self.dataloader_type not in DATALOADER_TYPES:
            raise ConfigError(
                f"{what}: dataloader_type={self.dataloader_type!r} must be one of "
                f"{', '.join(DATALOADER_TYPES)} (--dataloader-type)"
            )
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(
                f"{what}: need lr > 0 and 0 <= min_lr <= lr (lr={self.lr}, min_lr={self.min_lr})"
            )


@dataclass
class DataConfig:
    """Where the main job's data comes from: a built-in task, or a user's Megatron data prefix."""

    task: str = "chain_sum"
    num_train: int = 20000
    num_valid: int = 500
    seed: int = 0
    data_path: str | None = None
    tokenizer_path: str | None = None


@dataclass
class ExperimentConfig:
    model: ModelConfig
    parallel: Layout = field(default_factory=Layout)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # the raw `elastic:` section; validated by elastic_plugin.elastic.config.ElasticConfig
    elastic: dict[str, Any] = field(default_factory=dict)
    source: str = "<dict>"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        out["parallel"] = self.parallel.to_section()
        return out


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}; allowed: {', '.join(allowed)}")


def _build(cls: type, section: str, values: Mapping[str, Any] | None) -> Any:
    values = dict(values or {})
    if not isinstance(values, dict):
        raise ConfigError(f"section '{section}' must be a mapping")
    allowed = {f.name for f in fields(cls)} - {"source"}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in section '{section}': {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        required = [
            f.name
            for f in fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        raise ConfigError(
            f"section '{section}' needs the keys {', '.join(required)}: {exc}"
        ) from exc


def _mapping(section: str, values: Any) -> dict[str, Any]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"section '{section}' must be a mapping")
    return dict(values)


def config_from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> ExperimentConfig:
    """Build and validate an ExperimentConfig from already-parsed YAML."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping with a 'model' section")
    sections = {"model", "parallel", "training", "data", "elastic"}
    unknown = sorted(set(raw) - sections)
    if unknown:
        raise ConfigError(
            f"{source}: unknown section(s) {', '.join(unknown)}; allowed: {', '.join(sorted(sections))}"
        )
    if "model" not in raw:
        raise ConfigError(f"{source}: missing the 'model' section")
    cfg = ExperimentConfig(
        model=_build(ModelConfig, "model", raw["model"]).validate(),
        parallel=Layout.from_section(_mapping("parallel", raw.get("parallel"))),
        training=_build(TrainingConfig, "training", raw.get("training")),
        data=_build(DataConfig, "data", raw.get("data")),
        elastic=_mapping("elastic", raw.get("elastic")),
        source=source,
    )
    p = cfg.parallel
    cfg.model.check_parallel(p.tp, p.pp, p.ep)
    from elastic_plugin.models.runtime import Runtime

    try:
        Runtime.of(cfg.training).check(cfg.model, p.pp)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return cfg


def load_config(path: str | Path) -> ExperimentConfig:
    """Read a YAML config file; a missing file or bad key is reported with the path."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    with path.open() as fh:
        raw = yaml.safe_load(fh)
    return config_from_dict(raw, source=str(path))
