"""``elastic-plugin import --megatron``: a Megatron-LM ``torch_dist`` checkpoint as a teacher.

Users who trained a hybrid (Mamba / attention / MoE) model with Megatron-LM bring its save
directory: ``latest_checkpointed_iteration.txt``, ``iter_NNNNNNN/`` (or ``release/``) with the
dist-checkpoint files, and the run's ``args`` in the common state (``common.pt`` in older
checkpoints, the ``common_state`` object of the torch_dist files in newer ones; Megatron-Core's
``load_common_state_dict`` reads both without touching a weight).

Two model classes are read: Megatron-LM's hybrid model (``pretrain_hybrid.py``, the args carry
``hybrid_layer_pattern``) and its ``GPTModel`` (``pretrain_gpt.py``: no pattern, ``num_layers``
transformer layers, MoE where ``moe_layer_freq`` says, QK layernorm, q/k/v bias, Llama 3.1 RoPE
scaling). A GPT layer i is our pattern's ``*-`` (or ``*E``) pair: its attention half is our
layer 2i, its MLP / MoE half our layer 2i+1, and its ``final_layernorm`` our ``final_norm``
(:func:`gpt_sharded_state`); the tensors are the same Megatron modules, so nothing is converted.

The architecture comes from the saved args alone (:func:`model_config_from_megatron_args`):
every arg that decides what the model computes maps onto our ModelConfig or is checked against
what our Megatron model computes; anything else is refused with a ConfigError naming the arg and
its value, before any weight is read (:func:`plan_megatron_import`). :func:`run_megatron_import`
then builds our model at TP=PP=EP=1, matches each of its sharded tensors to a stored one (its
own key, or the other spec's name of the same norm: Transformer Engine specs fuse the norms into
the following linear, ``...linear_qkv.layer_norm_weight``, Megatron-Core's local specs keep
``input_layernorm.weight``; our local spec stores the TE names), checks every global shape
against the checkpoint's metadata, and loads through ``megatron.core.dist_checkpointing``, which
reshards whatever TP/PP/EP the checkpoint was saved with. The teacher is saved like ``--hf``'s
(:func:`checkpoint.io.save_checkpoint`, staged beside ``--out``, renamed at the end).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elastic_plugin.checkpoint.history import IMPORT_ITERATION
from elastic_plugin.models.config import ConfigError, ExperimentConfig, ModelConfig

__all__ = [
    "MEGATRON_TRACKER",
    "MegatronImportPlan",
    "MegatronSource",
    "check_megatron_source",
    "find_iteration_dir",
    "gpt_sharded_state",
    "import_megatron",
    "model_config_from_megatron_args",
    "norm_aliases",
    "plan_megatron_import",
    "read_megatron_args",
    "run_megatron_import",
]

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_DIST_METADATA = "metadata.json"  # dist_checkpointing's marker of a dist checkpoint directory
_SYMBOLS = set("M*-E|")
# A norm's name in a Transformer Engine spec (fused into the next linear) <-> in a local spec
_NORM_NAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mixer.in_proj.layer_norm_weight", ".norm.weight"),
)
GPT_MODEL = "GPTModel"  # pretrain_gpt.py's model (no hybrid_layer_pattern in the args)
HYBRID_MODEL = "HybridModel"  # pretrain_hybrid.py's model
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclasses.dataclass
class MegatronSource:
    """A checked Megatron-LM save directory: the iteration to import and its saved args."""

    path: Path
    iteration: int | str
    iter_dir: Path
    args: dict[str, Any]
    model: ModelConfig
    notes: list[str]
    #: the Megatron-LM model class that wrote it: GPT_MODEL or HYBRID_MODEL
    model_class: str = HYBRID_MODEL


@dataclasses.dataclass
class MegatronImportPlan:
    source: MegatronSource
    out: Path
    dtype: str


# ------------------------------------------------------------------------------ directory
def find_iteration_dir(megatron_dir: str | Path) -> tuple[int | str, Path]:
    """The iteration ``latest_checkpointed_iteration.txt`` names and its directory."""
    path = Path(megatron_dir)
    if not path.is_dir():
        raise ConfigError(f"--megatron {path}: no such directory")
    tracker = path / MEGATRON_TRACKER
    if not tracker.is_file():
        raise ConfigError(
            f"--megatron {path}: no {MEGATRON_TRACKER} (not a Megatron-LM save directory; give "
            "the directory --save wrote, which holds it and the iter_NNNNNNN/ directories)"
        )
    text = tracker.read_text().strip()
    iteration: int | str
    if text == "release":
        iteration, name = "release", "release"
    else:
        try:
            iteration = int(text)
        except ValueError:
            raise ConfigError(
                f"{tracker}: holds {text[:40]!r}; expected an iteration number or 'release'"
            ) from None
        name = f"iter_{iteration:07d}"
    iter_dir = path / name
    if not iter_dir.is_dir():
        raise ConfigError(
            f"{tracker}: names iteration {iteration}, but {iter_dir} does not exist "
            "(an interrupted or pruned save?)"
        )
    if not (iter_dir / _DIST_METADATA).is_file():
        raise ConfigError(
            f"{iter_dir}: no {_DIST_METADATA}: not a torch_dist checkpoint (save it with "
            "--ckpt-format torch_dist; legacy 'torch' checkpoints are not imported)"
        )
    return iteration, iter_dir


def read_megatron_args(iter_dir: str | Path) -> dict[str, Any]:
    """The saved Megatron-LM ``args`` (as a dict) from a checkpoint's common state. Every
    pickle of the directory is checked first (``checkpoint.safe_pickle``): Megatron-LM's
    common state is a pickle that torch would otherwise load unrestricted."""
    from megatron.core import dist_checkpointing

    from elastic_plugin.checkpoint.safe_pickle import check_checkpoint_pickles

    check_checkpoint_pickles(iter_dir)  # a ConfigError naming the file and the global
    try:
        common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    except Exception as exc:  # a damaged or foreign directory: name it, not a traceback
        raise ConfigError(
            f"{iter_dir}: cannot read the checkpoint's common state ({exc})"
        ) from None
    args = common.get("args") if isinstance(common, Mapping) else None
    if args is None:
        raise ConfigError(
            f"{iter_dir}: the checkpoint holds no saved 'args' (not written by Megatron-LM's "
            "save_checkpoint); the architecture cannot be known"
        )
    return dict(vars(args)) if not isinstance(args, Mapping) else dict(args)


# ------------------------------------------------------------------------------ args
def _refuse(source: str, arg: str, value: Any, allowed: str, why: str) -> ConfigError:
    return ConfigError(f"{source}: {arg}={value!r} is not supported ({why}); allowed: {allowed}")


def _int(a: Mapping[str, Any], arg: str, source: str, default: Any = None) -> int:
    value = a.get(arg)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{source}: {arg}={value!r} must be a positive integer")
    return value


def _is_gpt(a: Mapping[str, Any]) -> bool:
    """Megatron-LM's GPTModel wrote it: neither hybrid pattern arg is set."""
    return not any(a.get(n) for n in ("hybrid_layer_pattern", "hybrid_override_pattern"))


def _pattern(a: Mapping[str, Any], source: str) -> str:
    if _is_gpt(a):
        return _gpt_pattern(a, source)
    names = ("hybrid_layer_pattern", "hybrid_override_pattern")
    given = {n: a[n] for n in names if a.get(n)}
    if len(set(given.values())) > 1:
        raise ConfigError(f"{source}: {given} disagree; they must describe the same layers")
    arg, pattern = next(iter(given.items()))
    if not isinstance(pattern, str) or set(pattern) - _SYMBOLS:
        bad = sorted(set(str(pattern)) - _SYMBOLS)
        raise _refuse(
            source,
            arg,
            pattern,
            "M (Mamba-2), * (attention), - (MLP), E (MoE), | (pipeline boundary)",
            f"layer symbol(s) {bad} are not built by our model (e.g. '/' multi-token prediction)",
        )
    layers = len(pattern.replace("|", ""))
    stated = a.get("num_layers")
    if stated is not None and stated != layers:
        raise ConfigError(
            f"{source}: num_layers={stated} contradicts the {layers} layers of {arg}={pattern!r}"
        )
    return pattern


def _gpt_pattern(a: Mapping[str, Any], source: str) -> str:
    """GPTModel's layers as ``*-`` / ``*E`` pairs: with ``num_experts`` set, layer i is MoE where
    ``moe_layer_freq`` says (an int N: every N-th layer from 0; a list: 1 = MoE, 0 = dense), as
    Megatron-Core's ``get_gpt_decoder_block_spec`` builds it; without, every layer is dense."""
    layers = _int(a, "num_layers", source)
    if layers > 10_000:
        raise ConfigError(f"{source}: num_layers={layers} must be at most 10000")
    if not a.get("num_experts"):
        return "*-" * layers
    freq = a.get("moe_layer_freq", 1)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        moe = [i % freq == 0 for i in range(layers)]
    elif (
        isinstance(freq, list | tuple)
        and len(freq) == layers
        and all(v in (0, 1) and not isinstance(v, bool) for v in freq)
    ):
        moe = [v == 1 for v in freq]
    else:
        raise ConfigError(
            f"{source}: moe_layer_freq={freq!r} must be a positive integer or a list of "
            f"num_layers={layers} entries, each 0 (dense) or 1 (MoE)"
        )
    return "".join("*E" if m else "*-" for m in moe)


def _activation(a: Mapping[str, Any], source: str) -> str:
    for arg in ("quick_geglu", "openai_gelu", "onnx_safe", "use_te_activation_func"):
        if a.get(arg):
            raise _refuse(source, arg, a[arg], "false", "our MLPs use torch's activations")
    if a.get("swiglu") and a.get("squared_relu"):
        raise ConfigError(f"{source}: swiglu=True and squared_relu=True contradict each other")
    if a.get("swiglu"):
        return "swiglu"
    if a.get("squared_relu"):
        return "squared_relu"
    return "gelu"  # Megatron-LM's default activation


# (arg, the value our model computes with (absent args take it), why another one is refused)
_MUST: tuple[tuple[str, Any, str], ...] = (
    ("multi_latent_attention", False, "multi-latent attention is not built"),
    ("mtp_num_layers", None, "multi-token prediction layers are not built"),
    ("qk_l2_norm", False, "no q/k L2 norms"),
    ("apply_layernorm_1p", False, "zero-centred norm weights are not built"),
    ("layernorm_zero_centered_gamma", False, "zero-centred norm weights are not built"),
    ("apply_residual_connection_post_layernorm", False, "pre-norm residuals only"),
    ("rotary_interleaved", False, "rotary embeddings are not interleaved"),
    ("mrope_section", None, "no multimodal rotary embedding"),
    ("no_rope_freq", None, "rotary embeddings in every attention layer"),
    ("rotary_seq_len_interpolation_factor", None, "no rotary position interpolation"),
    ("softmax_type", "vanilla", "attention sinks (off-by-one or learnable softmax) are not built"),
    ("window_size", None, "attention is global (no sliding window)"),
    ("softmax_scale", None, "attention uses 1/sqrt(kv_channels)"),
    ("heterogeneous_layers_config_path", None, "every layer of a kind has the same shape"),
    ("heterogeneous_layers_config_encoded_json", None, "every layer of a kind has the same shape"),
    ("experimental_attention_variant", None, "plain softmax attention only"),
    ("attention_output_gate", False, "no gated attention output"),
    ("moe_router_pre_softmax", False, "our router takes top-k of the scores, then normalises"),
    ("moe_router_num_groups", None, "group-limited routing is not supported"),
    ("moe_router_group_topk", None, "group-limited routing is not supported"),
    ("moe_shared_expert_gate", False, "the shared expert is not gated"),
    ("moe_latent_size", None, "no latent MoE"),
    ("moe_use_upcycling", False, "upcycling is a training-time conversion"),
    ("moe_expert_capacity_factor", None, "no token is dropped (no expert capacity)"),
)
# What GPTModel builds from these and the local hybrid spec does not: refused for hybrid models,
# mapped for GPT models (model_config_from_megatron_args)
_HYBRID_MUST: tuple[tuple[str, Any, str], ...] = (
    ("qk_layernorm", False, "no q/k layer norms in Megatron-LM's hybrid model"),
    ("use_rope_scaling", False, "Megatron-LM's hybrid model builder does not scale RoPE"),
)


def _check_must(a: Mapping[str, Any], kinds: set[str], source: str) -> None:
    for arg, wanted, why in _MUST + (() if _is_gpt(a) else _HYBRID_MUST):
        if arg.startswith("moe_") and "moe" not in kinds:
            continue
        value = a.get(arg, wanted)
        off = value in (None, False, 0) and wanted in (None, False)
        if value != wanted and not off:
            raise _refuse(source, arg, value, repr(wanted), why)
    percent = a.get("rotary_percent", 1.0)
    if a.get("position_embedding_type") == "rope" and percent != 1.0:
        raise _refuse(source, "rotary_percent", percent, "1.0", "rotary embeddings span the head")


def model_config_from_megatron_args(args: Mapping[str, Any], source: str = "args") -> ModelConfig:
    """Our ModelConfig of a Megatron-LM run's saved args (see the module docstring)."""
    a = dict(args)
    pattern = _pattern(a, source)
    kinds = {c for c in pattern if c != "|"}
    named = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    kinds = {named[c] for c in kinds}
    _check_must(a, kinds, source)
    normalization = a.get("normalization", "LayerNorm")
    if normalization != "RMSNorm":
        raise _refuse(source, "normalization", normalization, "'RMSNorm'", "RMSNorm models only")
    position = a.get("position_embedding_type", "learned_absolute")
    if position not in ("none", "rope"):
        raise _refuse(
            source, "position_embedding_type", position, "'none', 'rope'", "no learned positions"
        )
    vocab = a.get("padded_vocab_size")
    if vocab is None:
        raise ConfigError(
            f"{source}: padded_vocab_size is not set (Megatron-LM sets it when it builds the "
            "tokenizer); the embedding's size cannot be known"
        )
    hidden = _int(a, "hidden_size", source)
    max_seq = a.get("max_position_embeddings") or a.get("seq_length") or 4096
    model = ModelConfig(
        hybrid_layer_pattern=pattern,
        hidden_size=hidden,
        vocab_size=_int({"padded_vocab_size": vocab}, "padded_vocab_size", source),
        activation=_activation(a, source),
        normalization="RMSNorm",
        # --norm-epsilon's dest is layernorm_epsilon (TransformerConfig's field name)
        layernorm_epsilon=float(a.get("layernorm_epsilon", a.get("norm_epsilon", 1e-5))),
        position_embedding_type=position,
        rotary_base=int(a.get("rotary_base", 10000)),
        max_sequence_length=int(max_seq),
        untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights")),
        add_bias_linear=bool(a.get("add_bias_linear", True)),
        init_method_std=float(a.get("init_method_std", 0.02)),
    )
    _map_attention_options(model, a, source)
    if "attention" in kinds:
        heads = _int(a, "num_attention_heads", source)
        model.num_attention_heads = heads
        if a.get("group_query_attention"):
            model.num_query_groups = _int(a, "num_query_groups", source)
        model.kv_channels = _int(a, "kv_channels", source, hidden // heads or None)
    if "mlp" in kinds or ("moe" in kinds and not a.get("moe_ffn_hidden_size")):
        model.ffn_hidden_size = _int(a, "ffn_hidden_size", source)
    if "mamba" in kinds:
        head_dim = _int(a, "mamba_head_dim", source, 64)
        mamba_heads = a.get("mamba_num_heads")
        if mamba_heads is None:  # MambaMixer: d_inner = 2 * hidden_size, in heads of head_dim
            if (2 * hidden) % head_dim:
                raise ConfigError(
                    f"{source}: mamba_num_heads=None and 2*hidden_size={2 * hidden} is not a "
                    f"multiple of mamba_head_dim={head_dim}"
                )
            mamba_heads = 2 * hidden // head_dim
        model.mamba_num_heads = _int({"mamba_num_heads": mamba_heads}, "mamba_num_heads", source)
        model.mamba_head_dim = head_dim
        model.mamba_num_groups = _int(a, "mamba_num_groups", source, 8)
        model.mamba_state_dim = _int(a, "mamba_state_dim", source, 128)
    if "moe" in kinds:
        _map_moe(model, a, source)
    try:
        return model.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _map_attention_options(model: ModelConfig, a: Mapping[str, Any], source: str) -> None:
    """QK layernorm, q/k/v bias and Llama 3.1 RoPE scaling, as GPTModel builds them (the hybrid
    model refuses the first and ignores the last: ``_HYBRID_MUST``). Megatron-LM sets
    ``add_qkv_bias`` whenever ``add_bias_linear`` is set; then every linear has its bias."""
    model.add_qkv_bias = bool(a.get("add_qkv_bias")) and not model.add_bias_linear
    if not _is_gpt(a):
        if model.add_qkv_bias:
            raise _refuse(
                source, "add_qkv_bias", True, "False", "no q/k/v-only bias in the hybrid model"
            )
        return
    model.qk_layernorm = bool(a.get("qk_layernorm"))
    if a.get("use_rope_scaling") and model.position_embedding_type == "rope":
        factor = a.get("rope_scaling_factor", 8.0)
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor > 0:
            raise ConfigError(f"{source}: rope_scaling_factor={factor!r} must be a number > 0")
        model.rope_scaling, model.rope_scaling_factor = True, float(factor)


def _map_moe(model: ModelConfig, a: Mapping[str, Any], source: str) -> None:
    if not a.get("num_experts"):
        raise ConfigError(
            f"{source}: num_experts={a.get('num_experts')!r} but the layer pattern has MoE "
            "layers (E); needs a positive number of experts"
        )
    model.num_moe_experts = _int(a, "num_experts", source)
    model.moe_router_topk = _int(a, "moe_router_topk", source, 2)
    model.moe_ffn_hidden_size = _int(
        a, "moe_ffn_hidden_size", source, a.get("moe_ffn_hidden_size") or model.ffn_hidden_size
    )
    shared = a.get("moe_shared_expert_intermediate_size") or 0
    if shared:
        model.moe_shared_expert_intermediate_size = _int(
            a, "moe_shared_expert_intermediate_size", source
        )
    score = a.get("moe_router_score_function", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise _refuse(
            source, "moe_router_score_function", score, "'softmax', 'sigmoid'", "our router scores"
        )
    model.moe_router_score_function = score
    model.moe_router_enable_expert_bias = bool(a.get("moe_router_enable_expert_bias"))
    scale = a.get("moe_router_topk_scaling_factor")
    if scale is not None and (not isinstance(scale, int | float) or not scale > 0):
        raise ConfigError(f"{source}: moe_router_topk_scaling_factor={scale!r} must be > 0")
    model.moe_router_topk_scaling_factor = None if scale is None else float(scale)


def _notes(a: Mapping[str, Any]) -> list[str]:
    notes = []
    if a.get("moe_router_dtype") not in (None, "fp32"):
        notes.append(f"moe_router_dtype={a['moe_router_dtype']!r}: our router computes in fp32")
    if a.get("fp8"):
        notes.append(f"fp8={a['fp8']!r}: the weights are imported in high precision, no FP8 recipe")
    return notes


# ------------------------------------------------------------------------------ plan
def check_megatron_source(megatron_dir: str | Path) -> MegatronSource:
    """Read and check a Megatron-LM save directory without reading any weight."""
    path = Path(megatron_dir)
    iteration, iter_dir = find_iteration_dir(path)
    args = read_megatron_args(iter_dir)
    source = f"{iter_dir} (saved args)"
    model = model_config_from_megatron_args(args, source)
    model_class = GPT_MODEL if _is_gpt(args) else HYBRID_MODEL
    return MegatronSource(path, iteration, iter_dir, args, model, _notes(args), model_class)


def check_megatron_out(out: str | Path, megatron_dir: str | Path) -> Path:
    """``--out``: absent, or an empty directory; never the input or inside it."""
    from elastic_plugin.export.hf_import import check_import_out

    try:
        return check_import_out(out, megatron_dir)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--hf", "--megatron")) from None


def plan_megatron_import(
    megatron_dir: str | Path, out_dir: str | Path, dtype: str = "fp32"
) -> MegatronImportPlan:
    """Every check of an import that needs no weight: --dtype, --out, the tracker, the saved
    args."""
    from elastic_plugin.export.hf_import import IMPORT_DTYPES

    if dtype not in IMPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: allowed: {', '.join(IMPORT_DTYPES)}")
    out = check_megatron_out(out_dir, megatron_dir)
    return MegatronImportPlan(check_megatron_source(megatron_dir), out, dtype)


# ------------------------------------------------------------------------------ weights
def norm_aliases(key: str) -> list[str]:
    """``key`` and the other spec's name of the same norm (TE fused <-> local separate)."""
    names = [key]
    for fused, local in _NORM_NAMES:
        if key.endswith(fused):
            names.append(key[: -len(fused)] + local)
        elif key.endswith(local):
            names.append(key[: -len(local)] + fused)
    return names


def gpt_sharded_state(model, stacked: bool) -> dict[str, Any]:
    """Our model's sharded state dict under the keys GPTModel stores: our layers 2i (attention)
    and 2i+1 (MLP / MoE) are its layer i, built by each layer's own ``sharded_state_dict`` as
    Megatron-Core's ``TransformerBlock`` does it: ``decoder.layers.{i}.*`` (non-homogeneous
    layers: MoE mixed with dense, or newer saves) or, ``stacked``, one ``decoder.layers.*``
    tensor per name with the layer as a leading axis; our ``final_norm`` is its
    ``final_layernorm``. The dict keys stay ours, so the loaded state loads into our model."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    full = model.sharded_state_dict()
    base = next(k for k in full if "decoder.layers." in k).split("decoder.layers.")[0]
    out: dict[str, Any] = {}
    for name, item in full.items():
        if name.startswith(base + "decoder.layers."):
            continue
        if getattr(item, "key", None) == "decoder.final_norm.weight":
            item = dataclasses.replace(item, key="decoder.final_layernorm.weight")
        out[name] = item
    layers = model_layers(model)  # Float16Module and the like wrap it
    count = len(layers) // 2
    for j, layer in enumerate(layers):
        ours = f"{base}decoder.layers.{j}."
        offsets = [(0, j // 2, count)] if stacked else []
        part = layer.sharded_state_dict(ours, offsets, None)
        replace_prefix_for_sharding(
            part, ours, "decoder.layers." if stacked else f"decoder.layers.{j // 2}."
        )
        out.update(part)
    return out


def model_layers(model) -> Any:
    """The decoder layers of our (possibly wrapped) model."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner.decoder.layers


def _stacked(stored: Mapping[str, Any]) -> bool:
    """Whether GPTModel stored its layers stacked (``decoder.layers.<name>``, layer axis first)."""
    return any(re.match(r"decoder\.layers\.\D", key) for key in stored)


def _global_shapes(item) -> dict[str, tuple[int, ...]]:
    """The global shape of each tensor ``item`` stores, by key: a ShardedTensor's own, or what a
    factory builds (SwiGLU's fc1 builds its gate and up halves as one key; the expert axis and
    a stacked layer axis are in the built shapes)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(item, ShardedTensor):
        return {item.key: tuple(item.global_shape)}
    built = item.build()
    shapes: dict[str, tuple[int, ...]] = {}
    for tensor in nested_values(built) if isinstance(built, dict | list) else [built]:
        if isinstance(tensor, ShardedTensor):
            shapes.setdefault(tensor.key, tuple(tensor.global_shape))
    return shapes


def _stored_numel(stored: Mapping[str, Any], key: str) -> int:
    """Elements stored under ``key`` or its factory's sub-keys (``in_proj.weight.z`` ...)."""
    if key in stored:
        return math.prod(stored[key].global_shape)
    parts = [v for k, v in stored.items() if k.startswith(key + ".")]
    return sum(math.prod(p.global_shape) for p in parts)


def _matched_state(
    model, iter_dir: Path, model_class: str = HYBRID_MODEL
) -> tuple[dict[str, Any], dict[str, int]]:
    """Our model's sharded state dict with each tensor's key set to the stored one it loads
    from (GPTModel's layer numbering for a GPT checkpoint); every tensor must have one of the
    same global shape. Returns it and the count of tensors by key form (own / renamed norm)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    stored = dist_checkpointing.load_tensors_metadata(str(iter_dir))
    gpt = model_class == GPT_MODEL
    stacked = gpt and _stacked(stored)
    sharded = gpt_sharded_state(model, stacked) if gpt else model.sharded_state_dict()
    matched: dict[str, Any] = {}
    forms = {"same_key": 0, "renamed_norm": 0}
    for name, item in sharded.items():
        if isinstance(item, ShardedObject):  # _extra_state (TE/FP8 metadata): nothing to import
            continue
        key = item.key
        found = next((k for k in norm_aliases(key) if _stored_numel(stored, k)), None)
        if found is None:
            read_as = (
                " (its args set no hybrid_layer_pattern, so it is read as a GPTModel checkpoint)"
                if model_class == GPT_MODEL
                else ""
            )
            raise ConfigError(
                f"{iter_dir}: holds no tensor {key!r} (nor {norm_aliases(key)[1:]}), which the "
                f"saved args' model has; the checkpoint's layers differ from its args{read_as}"
            )
        for part, shape in _global_shapes(item).items():
            stored_key = found + part[len(key) :]
            want: Any = shape
            have: Any = tuple(stored[stored_key].global_shape) if stored_key in stored else None
            if have is None and part == key:  # stored as sub-keys (in_proj.weight.z ...)
                have, want = _stored_numel(stored, stored_key), math.prod(shape)
            if have != want:
                stored_as = "is not stored" if have is None else f"is stored with {have}"
                raise ConfigError(
                    f"{iter_dir}: {stored_key!r} {stored_as}, but the saved args imply {want}"
                )
        forms["same_key" if found == key else "renamed_norm"] += 1
        matched[name] = dataclasses.replace(item, key=found) if found != key else item
    return matched, forms


def _load_weights(model, iter_dir: Path, model_class: str = HYBRID_MODEL) -> dict[str, int]:
    """Load every tensor of ``model`` from the checkpoint (any saved layout)."""
    from megatron.core import dist_checkpointing

    from elastic_plugin.checkpoint.safe_pickle import check_checkpoint_pickles

    check_checkpoint_pickles(iter_dir)  # checked when the args were read: cached unless changed
    matched, forms = _matched_state(model, iter_dir, model_class)
    loaded = dist_checkpointing.load(matched, str(iter_dir))
    wanted = {
        k for k in model.state_dict() if not k.endswith(("_extra_state", "local_tokens_per_expert"))
    }
    missing = sorted(wanted - set(loaded))
    if missing:
        raise RuntimeError(f"the checkpoint load did not set {missing[:5]}")
    model.load_state_dict(loaded, strict=False)
    return forms


def _import_meta(plan: MegatronImportPlan) -> dict[str, Any]:
    from elastic_plugin.parallel import Layout

    src = plan.source
    a = src.args
    saved_layout = {
        k: a.get(k)
        for k in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "transformer_impl",
        )
    }
    return {
        "kind": "teacher",
        "imported_from": {
            "megatron": str(src.path.resolve()),
            "iteration": src.iteration,
            "iter_dir": src.iter_dir.name,
            "model_class": src.model_class,
            "saved_layout": saved_layout,
            "tokenizer": {k: a.get(k) for k in ("tokenizer_type", "tokenizer_model")},
            "dtype": plan.dtype,
            "notes": src.notes,
        },
        "iteration": IMPORT_ITERATION,
        "layout": dataclasses.asdict(Layout()),
        "config": ExperimentConfig(model=src.model).to_dict(),
        "tokenizer": None,
    }


def run_megatron_import(
    plan: MegatronImportPlan, progress: bool = True, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Build the model at TP=PP=EP=1, load the checkpoint into it, save the teacher."""
    import torch

    from elastic_plugin.checkpoint.io import save_new_stage
    from elastic_plugin.cli_args import start_ranks
    from elastic_plugin.parallel import Layout, build_model_chunks

    del progress  # dist_checkpointing loads in one call: there is nothing to count
    start = time.perf_counter()
    src = plan.source
    final = plan.out.resolve()
    start_ranks(Layout(), one_process="import runs as one process")
    dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
    chunks, _ = build_model_chunks(
        src.model, Layout(), params_dtype=dtype, wrap_ddp=False, perform_initialization=False
    )
    model = chunks[0]
    forms = _load_weights(model, src.iter_dir, src.model_class)
    if log is not None:
        log(f"loaded {sum(forms.values())} tensors from {src.iter_dir}")
    save_new_stage([model], final, _import_meta(plan), iteration=IMPORT_ITERATION)  # checked empty
    return {
        "out": str(final),
        "kind": "teacher",
        "imported_from": str(src.iter_dir),
        "model_class": src.model_class,
        "hybrid_layer_pattern": src.model.hybrid_layer_pattern,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": forms,
        "dtype": plan.dtype,
        "notes": src.notes,
        "seconds": round(time.perf_counter() - start, 3),
    }


def import_megatron(
    megatron_dir: str | Path, out_dir: str | Path, dtype: str = "fp32", progress: bool = True
) -> dict[str, Any]:
    """Import a Megatron-LM torch_dist checkpoint as a teacher checkpoint at ``out_dir``."""
    return run_megatron_import(plan_megatron_import(megatron_dir, out_dir, dtype), progress)
