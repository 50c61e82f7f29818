"""Calibrated static activation scales for FP8 / NVFP4 exports, and an activation fake quant to
evaluate such an export with its activation quantization applied.

ModelOpt's ``FP8`` and ``NVFP4`` algorithms quantize the *inputs* of every quantized linear as
well as its weight, with a static per-tensor ``X.input_scale`` the serving engine reads from the
checkpoint. Weights can be quantized from the weights alone (:mod:`elastic_plugin.export.quantize`);
input scales need calibration data. :func:`calibrate_input_amax` runs NVIDIA ModelOpt's own
calibration (``mtq.quantize`` with ``FP8_DEFAULT_CFG`` / ``NVFP4_DEFAULT_CFG``, the ``max``
algorithm) and ModelOpt's own pre-export unification, so the numbers are those ModelOpt's
``export_hf_checkpoint`` would write: ``input_scale = amax / 448`` (FP8) and
``amax / (6 * 448)`` (NVFP4, the global scale of its dynamic 16-value blocks), computed in fp32.

Keys are transformers' in-memory module names without ``.weight``
(``model.layers.1.mixer.q_proj``, ``model.layers.0.self_attn.q_proj``); a fused-experts stack
is named by its 3-D parameter (NemotronH's ``….mixer.experts.up_proj`` / ``….experts.down_proj``,
a gated family's ``….mlp.experts.gate_up_proj`` / ``….experts.down_proj``): ModelOpt has one
input quantizer per stack, shared by all experts (and by a gated expert's gate and up), so every
``…experts.{e}.<part>.input_scale`` of a stack is the same number. The dict is what :func:`elastic_plugin.export.quantize.quantize_state_dict`
takes as ``input_amax``.

:func:`activation_fake_quant` puts ModelOpt's input fake quant (``TensorQuantizer`` built from
the same default config, amax fixed, never calibrated) in forward hooks of a plain transformers
model, e.g. one loaded from an export's dequantized weights, and removes them without a trace.

ModelOpt is imported lazily (it is an optional dependency and slow to import); nothing here
imports Megatron.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType, TracebackType
from typing import Any

import torch
from torch import nn

from elastic_plugin.export.quantize import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4_BLOCK,
    check_format,
    input_scale,
)
from elastic_plugin.models.config import ConfigError

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "NVFP4_BLOCK",
    "ActivationFakeQuant",
    "activation_fake_quant",
    "input_fake_quant",
    "calibrate_input_amax",
    "input_scale",
    "nvfp4_fake_quant",
]

# ModelOpt's NVFP4 fake-quant kernel replaces a dequantized block scale below this by 1.0
_NVFP4_MIN_SCALE = 1e-5


# ------------------------------------------------------------------------------ ModelOpt imports
def _modelopt(needed_by: str) -> tuple[ModuleType, ModuleType]:
    """``(mtq, modelopt.torch.export.unified_export_hf)``, or a ConfigError saying who needs it.

    The import prints untested-version and Megatron-plugin warnings that say nothing about
    calibration, so they are silenced."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import modelopt.torch.export.unified_export_hf as unified
            import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise ConfigError(
            f"{needed_by} needs nvidia-modelopt (pip install nvidia-modelopt): {e}"
        ) from e
    return mtq, unified


def _quant_cfg(mtq: ModuleType, fmt: str) -> dict[str, Any]:
    """ModelOpt's default config of ``fmt`` (the one its export recipes use)."""
    return mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG


def _input_quantizer_attrs(mtq: ModuleType, fmt: str) -> dict[str, Any]:
    """The ``*input_quantizer`` attributes of ModelOpt's default config of ``fmt``."""
    for entry in _quant_cfg(mtq, fmt)["quant_cfg"]:
        if entry.get("quantizer_name") == "*input_quantizer" and "cfg" in entry:
            return dict(entry["cfg"])
    raise RuntimeError(f"ModelOpt's {fmt} config has no '*input_quantizer' entry")


# ------------------------------------------------------------------------------ calibration
def _check_batches(batches: Iterable[torch.Tensor], fmt: str) -> list[torch.Tensor]:
    """The batches as a list (the forward loop may be run more than once); a ConfigError
    naming ``--calib-samples`` when there are none or one is not a [b, s] token tensor."""
    out = list(batches)
    if not out:
        raise ConfigError(
            f"--calib-samples: calibration data for --quantize {fmt} is empty; "
            "give at least one token batch"
        )
    for i, b in enumerate(out):
        if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.is_floating_point():
            what = f"shape {tuple(b.shape)}, {b.dtype}" if isinstance(b, torch.Tensor) else type(b)
            raise ConfigError(
                f"--calib-samples: calibration batch {i} must be an integer [batch, seq] "
                f"token tensor; got {what}"
            )
    return out


def _calibrated_quantizers(model: nn.Module) -> dict[str, Any]:
    """Module name -> its enabled input ``TensorQuantizer``; a fused-experts module (ModelOpt's
    ``_Quant*FusedExperts``: one input quantizer per 3-D projection) gives one entry per
    projection, named by the 3-D parameter (``…experts.up_proj`` / ``…experts.down_proj``)."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        first = getattr(module, "_first_proj_attr", None)
        if first is not None and hasattr(module, f"{first}_input_quantizer"):
            pairs = [
                (f"{name}.{first}", getattr(module, f"{first}_input_quantizer")),
                (f"{name}.down_proj", getattr(module, "down_proj_input_quantizer", None)),
            ]
        else:
            pairs = [(name, getattr(module, "input_quantizer", None))]
        for key, q in pairs:
            # a SequentialQuantizer (W4A8) has no single amax; the FP8/NVFP4 defaults make none
            if q is not None and getattr(q, "is_enabled", False) and hasattr(q, "export_amax"):
                found[key] = q
    return found


def _force_eager_experts(model: nn.Module) -> None:
    """Every fused-experts module onto transformers' eager ``F.linear`` path, which ModelOpt's
    quantized experts intercept. ModelOpt sets ``_experts_implementation = "eager"`` on the
    model's config only; a block built from its own config copy (a per-layer nested model's
    ``layer_overrides``) would keep ``grouped_mm`` and calibrate nothing."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"


def calibrate_input_amax(
    model: nn.Module, batches: Iterable[torch.Tensor], fmt: str
) -> dict[str, float]:
    """Calibrated activation |x|max per input-quantized module, as ModelOpt exports it.

    ``model`` is a transformers causal LM of any supported family (any ModelOpt quantizes);
    it is left untouched: ModelOpt's ``mtq.quantize`` replaces modules in place, so it runs on
    a deep copy. ``batches`` are LongTensor [b, s] token batches, ``fmt`` is ``"fp8"`` or
    ``"nvfp4"``. After calibration the copy gets the same pre-export passes as ModelOpt's
    ``export_hf_checkpoint`` (``requantize_resmooth_fused_llm_layers``: one max amax for the
    linears that read one tensor; ``sync_tied_input_amax``: one for tied weights), so
    ``input_scale(amax, fmt)`` equals the exported ``X.input_scale`` bit for bit. Modules whose
    quantizer never saw data are left out (ModelOpt's export writes no scale for them either).
    """
    check_format(fmt)
    data = _check_batches(batches, fmt)
    mtq, unified = _modelopt("--calib-samples")
    from modelopt.torch.export.quant_utils import sync_tied_input_amax

    work = copy.deepcopy(model).eval()
    _force_eager_experts(work)
    # ModelOpt's dummy forward reads config.architectures (multimodal check); the copy only
    config: Any = getattr(work, "config", None)
    if config is not None and not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    device = next(work.parameters()).device

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for b in data:
                m(input_ids=b.to(device), use_cache=False)

    # ModelOpt prints one line per registered module kind and a quantizer count
    with contextlib.redirect_stdout(io.StringIO()):
        mtq.quantize(work, _quant_cfg(mtq, fmt), forward_loop)
        unified.requantize_resmooth_fused_llm_layers(work)
        sync_tied_input_amax(work)

    amax: dict[str, float] = {}
    for key, q in _calibrated_quantizers(work).items():
        if q.amax is None:
            continue
        exported = q.export_amax()  # what the export divides: zero/NaN -> maxbound, clamped
        if exported.numel() != 1:
            raise RuntimeError(f"{key}: ModelOpt calibrated a per-channel input amax")
        amax[key] = float(exported.float().reshape(()))
    del work
    return amax


# ------------------------------------------------------------------------------ NVFP4 fake quant
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of each E2M1 code


def _round_e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """|x| / scale rounded to the E2M1 grid with ModelOpt's kernel's decision boundaries
    (``fp4_round_magnitude``: ties to the even code, > 5 saturates to 6). The grid's step is 0.5
    below 2, 1 in [2, 4) and 2 from 4 on, so ``torch.round`` (half to even) of each step's
    multiples is the code (as ``ops.round_e2m1``): three rounding passes instead of seven
    nested ``where``s (1.8x faster), the same values at every boundary (tested)."""
    code = torch.where(
        a < 2, torch.round(a * 2), torch.where(a < 4, torch.round(a) + 2, torch.round(a * 0.5) + 4)
    ).clamp_(max=7)
    return torch.tensor(_E2M1_GRID, device=a.device).take(code.long())


def nvfp4_fake_quant(x: torch.Tensor, amax: float | torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quant of an activation with global amax ``amax``: a PyTorch port of ModelOpt's
    Triton kernel (``fp4_fake_quant_block``), because ModelOpt's own NVFP4 fake quant runs
    on CUDA only.

    Per 16 consecutive values along the last dim (zero-padded): block scale
    ``e4m3(min(block_amax / (6 * g), 448)) * g`` with ``g = amax / (6 * 448)`` (a scale below
    1e-5 becomes 1), values rounded to E2M1 times that scale; computed in fp32, returned in
    ``x.dtype``."""
    shape, dtype = x.shape, x.dtype
    flat = x.float().reshape(-1, shape[-1])
    pad = -flat.shape[-1] % NVFP4_BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(flat.shape[0], -1, NVFP4_BLOCK)
    g = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(()) / (
        E2M1_MAX * E4M3_MAX
    )
    g = torch.where(g > 0, g, torch.full_like(g, 1e-12))
    mag = blocks.abs()
    block_scale = (mag.amax(dim=-1, keepdim=True) / (E2M1_MAX * g)).clamp(max=E4M3_MAX)
    scale = block_scale.to(torch.float8_e4m3fn).float() * g
    scale = torch.where(scale >= _NVFP4_MIN_SCALE, scale, torch.ones_like(scale))
    q = _round_e2m1_magnitude(mag / scale) * scale
    q = torch.where(blocks >= 0, q, -q)
    out = q.view(flat.shape)[:, : shape[-1]]
    return out.reshape(shape).to(dtype)


# ------------------------------------------------------------------------------ activation fake quant
class _InputQuant:
    """One module input's fake quant: ModelOpt's ``TensorQuantizer`` (amax fixed, not attached
    to the model, so the model's modules and state dict do not change)."""

    def __init__(self, quantizer: Any, amax: float, fmt: str) -> None:
        self.quantizer, self.amax, self.fmt = quantizer, amax, fmt

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to
            return x
        if self.fmt == "nvfp4" and not x.is_cuda:
            return nvfp4_fake_quant(x, self.amax)  # ModelOpt's kernels need CUDA
        return self.quantizer(x)


class ActivationFakeQuant:
    """Forward hooks that fake-quantize the inputs of the modules in ``input_amax``.

    Use as a context manager or call :meth:`remove`; removing the hooks leaves the model as it
    was (nothing else is changed). ``calls`` counts, per key, how often an input was
    quantized, so a caller can check that every hook fired (a fused kernel that bypasses a
    module's forward would silently skip it)."""

    def __init__(self, handles: list[torch.utils.hooks.RemovableHandle], keys: list[str]) -> None:
        self._handles = handles
        self.calls: dict[str, int] = dict.fromkeys(keys, 0)

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> ActivationFakeQuant:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def _resolve(model: nn.Module, key: str) -> tuple[str, nn.Module]:
    """``("linear", module)`` for a Linear, ``("experts_up" | "experts_down", experts)`` for a
    fused-experts stack named by its 3-D parameter (its first projection, ``up_proj`` or a gated
    ``gate_up_proj``, or its ``down_proj``); else a ConfigError."""
    head, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(key)
    except AttributeError:
        module = None
    if isinstance(module, nn.Linear):
        return "linear", module
    try:
        parent = model.get_submodule(head) if head else model
    except AttributeError:
        parent = None
    param = getattr(parent, attr, None) if parent is not None else None
    first = "gate_up_proj" if getattr(parent, "has_gate", False) else "up_proj"
    if isinstance(param, nn.Parameter) and param.dim() == 3 and attr in (first, "down_proj"):
        assert parent is not None
        if (
            attr == "down_proj"
            and first == "up_proj"
            and not isinstance(getattr(parent, "act_fn", None), nn.Module)
        ):
            raise ConfigError(
                f"input_amax names {key!r}: non-gated fused experts need an act_fn module"
            )
        return ("experts_up" if attr == first else "experts_down"), parent
    raise ConfigError(
        f"input_amax names {key!r}, which is neither an nn.Linear of the model nor a fused "
        "experts stack (up_proj / gate_up_proj / down_proj)"
    )


class _DownInputs(torch.overrides.TorchFunctionMode):
    """Quantizes the input of every ``F.linear`` whose weight is a view of one 3-D parameter:
    a gated expert's ``down_proj`` reads ``act(gate) * up``, which no module returns, so the
    call transformers' eager experts make (and ModelOpt intercepts the same way) is caught."""

    def __init__(self, param: torch.Tensor, quant: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.storage = param.untyped_storage().data_ptr()
        self.quant = quant

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear and len(args) >= 2:
            weight = args[1]
            if isinstance(weight, torch.Tensor) and (
                weight.untyped_storage().data_ptr() == self.storage
            ):
                args = (self.quant(args[0]), *args[1:])
        return func(*args, **kwargs)


class _Restore:
    """A handle that puts back the ``_experts_implementation`` :func:`_eager_experts` changed."""

    def __init__(self, saved: dict[int, tuple[Any, Any]]) -> None:
        self.saved = saved

    def remove(self) -> None:
        for config, value in self.saved.values():
            config._experts_implementation = value
        self.saved.clear()


def _eager_experts(module: nn.Module, saved: dict[int, tuple[Any, Any]]) -> None:
    """Run a fused-experts module on transformers' eager path (one ``F.linear`` per expert and
    projection) while the hooks are on; the old setting is saved for :class:`_Restore`."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_experts_implementation"):
        saved.setdefault(id(config), (config, config._experts_implementation))
        config._experts_implementation = "eager"


def input_fake_quant(amax: float, fmt: str, key: str = "input") -> _InputQuant:
    """ModelOpt's static input fake quant of ``fmt`` with a fixed ``amax``: a callable on one
    activation tensor (a ``TensorQuantizer`` from the default config's ``*input_quantizer``,
    never calibrated; NVFP4 on a CPU through :func:`nvfp4_fake_quant`)."""
    check_format(fmt)
    value = float(amax)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"input_amax[{key!r}] must be a finite amax >= 0; got {value}")
    mtq, _ = _modelopt("activation fake quantization")
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    quantizer = TensorQuantizer(QuantizerAttributeConfig(**_input_quantizer_attrs(mtq, fmt)))
    quantizer.amax = torch.tensor(value, dtype=torch.float32)
    quantizer.eval()
    return _InputQuant(quantizer, value, fmt)


def activation_fake_quant(
    model: nn.Module, input_amax: Mapping[str, float], fmt: str
) -> ActivationFakeQuant:
    """Make ``model`` fake-quantize the inputs of the modules in ``input_amax`` (keys as
    :func:`calibrate_input_amax` gives them) with those static amaxes; weights are untouched.

    FP8: E4M3 per tensor, scale ``amax / 448``. NVFP4: dynamic 16-value blocks with E4M3 block
    scales under the global scale ``amax / (6 * 448)``. The quantizers are ModelOpt's
    ``TensorQuantizer`` built from its default ``*input_quantizer`` config (NVFP4 on CPU uses
    :func:`nvfp4_fake_quant`, a port of ModelOpt's CUDA kernel). A Linear gets a forward
    pre-hook; a fused-experts stack gets a pre-hook on the experts module (the first
    projection's input is its ``hidden_states``; a per-tensor / per-row-block quant of all
    tokens equals ModelOpt's per-expert one) and, for ``down_proj``, a forward hook on a
    non-gated stack's ``act_fn`` (whose output is ``down_proj``'s input) or, gated, a torch
    function mode during the experts' forward catching the ``F.linear`` on ``down_proj``
    (``act(gate) * up`` is no module's output; such experts run on transformers' eager path
    while hooked). Returns the hooks' handle: a context manager, or call ``remove()``.
    """
    check_format(fmt)
    _modelopt("activation fake quantization")  # refused up front, even for an empty plan
    plan: list[tuple[str, str, nn.Module, _InputQuant]] = []
    for key in sorted(input_amax):
        kind, module = _resolve(model, key)
        plan.append((key, kind, module, input_fake_quant(input_amax[key], fmt, key)))

    handles: list[Any] = []
    restore: dict[int, tuple[Any, Any]] = {}
    handles.append(_Restore(restore))
    fake = ActivationFakeQuant(handles, [p[0] for p in plan])

    def pre_hook(key: str, fq: _InputQuant) -> Callable[..., Any]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            fake.calls[key] += 1
            if args:
                return (fq(args[0]), *args[1:]), kwargs
            name = "input" if "input" in kwargs else "hidden_states"
            return args, {**kwargs, name: fq(kwargs[name])}

        return hook

    def out_hook(key: str, fq: _InputQuant) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            fake.calls[key] += 1
            return fq(output)

        return hook

    def mode_hooks(key: str, module: nn.Module, fq: _InputQuant) -> list[Any]:
        active: list[_DownInputs] = []

        def enter(_module: nn.Module, _args: tuple[Any, ...]) -> None:
            fake.calls[key] += 1
            down = module.get_parameter("down_proj")
            mode = _DownInputs(down, fq)
            mode.__enter__()
            active.append(mode)

        def leave(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
            active.pop().__exit__(None, None, None)

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    try:
        for key, kind, module, fq in plan:
            if kind == "experts_down" and getattr(module, "has_gate", False):
                _eager_experts(module, restore)  # F.linear per expert, as ModelOpt quantizes
                handles.extend(mode_hooks(key, module, fq))
            elif kind == "experts_down":
                act = module.get_submodule("act_fn")
                handles.append(act.register_forward_hook(out_hook(key, fq)))
            else:
                handles.append(
                    module.register_forward_pre_hook(pre_hook(key, fq), with_kwargs=True)
                )
    except BaseException:
        fake.remove()
        raise
    return fake
