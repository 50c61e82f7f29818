"""ElasticConfig: which nested models to train, and how; validated before any model is built.

The ``elastic:`` section of a config file (or the ``--elastic-*`` flags, see ``args.py``) says
which budgets to train (fractions of the full model's parameters or memory), which candidate
sizes each width axis may take, and the router / curriculum / loss settings. ``resolve()`` turns
that into integer candidate sizes for one model and one TP/EP layout and rejects everything the
elastic layers could not run (a width that does not split over TP, fewer experts than top-k, a
budget no candidate combination can reach), so a bad run fails in seconds, not after the build.

The width axes, their units and what a size must be a multiple of are ``models.axes``'s
(``ELASTIC_AXES``, ``model_axes``): one vocabulary for training, extraction and inspection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from elastic_plugin.models.axes import ELASTIC_AXES, model_axes, multiple_name
from elastic_plugin.models.config import ConfigError, ModelConfig

DEFAULT_FRACTIONS: tuple[float, ...] = (1.0, 0.75, 0.5)
BUDGET_METRICS: tuple[str, ...] = ("total_params", "active_params", "memory")
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "nvfp4")
MODES: tuple[str, ...] = ("sliced", "masked")
TEACHERS: tuple[str, ...] = ("frozen", "self")
FREEZE_SELECTS: tuple[str, ...] = ("likelihood", "loss")
FP8_GEMMS: tuple[str, ...] = ("off", "tensor", "row")  # elastic.fp8: off, or the scale granularity
# router.init: "prior" (the output layer solved toward the candidate closest to each budget's
# fraction, router.make_router) or "screened" (toward each budget's lowest zero-shot-loss
# candidate, measured before training: elastic/screening.py)
ROUTER_INITS: tuple[str, ...] = ("prior", "screened")
DEFAULT_SCREEN_TOKENS = 4096
# router keys to_dict writes only when they differ from their default (configs written before
# they existed read back equal)
_OPTIONAL_ROUTER_KEYS: dict[str, Any] = {
    "init": "prior",
    "screen_tokens": DEFAULT_SCREEN_TOKENS,
    "lr": None,
}
_REL_TOL = 1e-9


class ElasticConfigError(ConfigError):
    """A ConfigError that knows its field (``budgets``, ``sizes.ffn``, ``router.temperature``),
    so the flag layer (``args.py``) can say which flag or file the bad value came from."""

    def __init__(self, field_name: str, detail: str, where: str | None = None):
        self.field = field_name
        self.detail = detail
        self.where = where
        text = f"elastic.{field_name}{detail}" if field_name else f"elastic{detail}"
        super().__init__(f"{where}: {text}" if where else text)

    def located(self, where: str | None) -> ElasticConfigError:
        return (
            self if self.where or not where else ElasticConfigError(self.field, self.detail, where)
        )


# ------------------------------------------------------------------------------ value checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ElasticConfigError(name, f"={value!r}; allowed: {', '.join(allowed)}")


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value <= 0:
        extra = " or null" if allow_none else ""
        raise ElasticConfigError(name, f"={value!r}; allowed: a positive integer{extra}")


def _number(name: str, value: Any, low: float, strict: bool) -> float:
    ok = _is_number(value) and math.isfinite(value) and (value > low if strict else value >= low)
    if not ok:
        op = ">" if strict else ">="
        raise ElasticConfigError(name, f"={value!r}; allowed: a number {op} {low:g}")
    return float(value)


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ElasticConfigError(name, f"={value!r}; allowed: true, false")


def _seq(name: str, value: Any) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ElasticConfigError(name, f"={value!r}; allowed: a list of numbers")
    return tuple(value)


def _pair(name: str, value: Any) -> tuple[float, float]:
    items = _seq(name, value)
    if len(items) != 2:
        raise ElasticConfigError(name, f"={value!r}; allowed: [start, end], two numbers > 0")
    return (_number(name, items[0], 0.0, True), _number(name, items[1], 0.0, True))


def _unknown_keys(section: str, raw: Mapping[str, Any], cls: type) -> None:
    allowed = [
        f.name
        for f in fields(cls)
        if f.init and not f.name.startswith("_") and f.name not in ("source", "origins")
    ]
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ElasticConfigError(
            section,
            f": unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(allowed)}",
        )


def _mapping(section: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ElasticConfigError(section, f"={raw!r}; allowed: a mapping")
    return dict(raw)


# ------------------------------------------------------------------------------ sub-sections
@dataclass(frozen=True)
class RouterConfig:
    """Budget router settings (docs/design.md, "Router": Gumbel-Softmax, temperature 1 -> 0.05,
    logit scale 1 -> 10;
    router lr ~1e-2 vs model ~1e-4, hence ``lr_mult`` 100, or ``lr`` as an absolute value).
    ``init``/``screen_tokens``: where the router starts (``ROUTER_INITS``; ``screened`` measures
    every candidate's zero-shot loss on ``screen_tokens`` validation tokens first)."""

    hidden_size: int = 256
    temperature: tuple[float, float] = (1.0, 0.05)  # (start, end)
    logit_scale: tuple[float, float] = (1.0, 10.0)  # (start, end)
    anneal_iters: int | None = None  # None: anneal over the whole run
    freeze_after: int | None = None  # then fix each budget's choice (freeze.py)
    freeze_select: str = "likelihood"  # how: router likelihood, or measured loss
    freeze_candidates: int | None = None  # loss: the router's top-N per budget (None: all)
    hard: bool = True  # straight-through hard masks; False: soft
    lr_mult: float = 100.0  # router lr / model lr
    init: str = "prior"  # ROUTER_INITS
    screen_tokens: int = (
        DEFAULT_SCREEN_TOKENS  # init=screened: validation tokens each candidate is measured on
    )
    lr: float | None = None  # the router's peak LR, absolute; when set, lr_mult is not used

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _pair("router.temperature", self.temperature))
        object.__setattr__(self, "logit_scale", _pair("router.logit_scale", self.logit_scale))
        _positive_int("router.hidden_size", self.hidden_size)
        _positive_int("router.anneal_iters", self.anneal_iters, allow_none=True)
        _positive_int("router.freeze_after", self.freeze_after, allow_none=True)
        _choice("router.freeze_select", self.freeze_select, FREEZE_SELECTS)
        _positive_int("router.freeze_candidates", self.freeze_candidates, allow_none=True)
        _bool("router.hard", self.hard)
        object.__setattr__(self, "lr_mult", _number("router.lr_mult", self.lr_mult, 0.0, True))
        _choice("router.init", self.init, ROUTER_INITS)
        _positive_int("router.screen_tokens", self.screen_tokens)
        if self.lr is not None:
            object.__setattr__(self, "lr", _number("router.lr", self.lr, 0.0, True))

    def lr_multiplier(self, model_lr: float) -> float:
        """Router peak LR / model peak LR: ``lr / model_lr`` when ``lr`` is set, else ``lr_mult``
        (the router's LR follows the model's schedule, warm-up and decay, at this ratio)."""
        if self.lr is None:
            return self.lr_mult
        if not model_lr > 0:
            raise ElasticConfigError(
                "router.lr", f"={self.lr!r} needs a model LR > 0 to scale from, got {model_lr!r}"
            )
        return self.lr / model_lr


@dataclass(frozen=True)
class CurriculumStage:
    """One curriculum stage: ``iters`` iterations, or ``tokens`` tokens (the published recipe
    states its stages in tokens), with budgets drawn from ``budget_probs`` (None: uniform),
    optionally at another sequence length (docs/design.md, "Budget sampling and the curriculum":
    stage 2 skews to the big model with longer sequences). Training and the planner share it:
    training counts iterations (``in_iterations``), the planner tokens (``token_count``)."""

    iters: int | None = None
    budget_probs: tuple[float, ...] | None = None
    seq_length: int | None = None
    tokens: float | None = None

    def __post_init__(self) -> None:
        self.check("curriculum[]")

    def check(self, prefix: str, num_budgets: int | None = None) -> None:
        if (self.iters is None) == (self.tokens is None):
            given = "both" if self.iters is not None else "neither"
            raise ElasticConfigError(
                prefix,
                f": sets {given} of iters and tokens; allowed: one of iters (a positive "
                "integer) or tokens (a number > 0)",
            )
        _positive_int(f"{prefix}.iters", self.iters, allow_none=True)
        if self.tokens is not None:
            object.__setattr__(self, "tokens", _number(f"{prefix}.tokens", self.tokens, 0.0, True))
        _positive_int(f"{prefix}.seq_length", self.seq_length, allow_none=True)
        if self.budget_probs is None:
            return
        name = f"{prefix}.budget_probs"
        probs = tuple(_number(name, p, 0.0, False) for p in _seq(name, self.budget_probs))
        object.__setattr__(self, "budget_probs", probs)
        if not probs or abs(sum(probs) - 1.0) > 1e-6:
            raise ElasticConfigError(
                name,
                f"={list(probs)} sums to {sum(probs):g}; allowed: "
                "non-negative probabilities that sum to 1",
            )
        if num_budgets is not None and len(probs) != num_budgets:
            raise ElasticConfigError(
                name,
                f"={list(probs)} has {len(probs)} entries; allowed: one "
                f"per budget ({num_budgets}, as in elastic.budgets)",
            )

    def in_iterations(self, global_batch_size: int, seq_length: int) -> CurriculumStage:
        """This stage counted in iterations: a stage of ``tokens`` lasts
        ceil(tokens / (global_batch_size x its sequence length)) iterations, its sequence length
        being ``seq_length`` (the run's) unless the stage sets one."""
        if self.iters is not None:
            return self
        per_iteration = global_batch_size * (self.seq_length or seq_length)
        iters = max(1, math.ceil(float(self.tokens or 0.0) / per_iteration))
        return replace(self, iters=iters, tokens=None)

    def token_count(self, global_batch_size: int, seq_length: int) -> float:
        """Tokens this stage trains: ``tokens`` as given, or iterations x global batch x its
        sequence length (``seq_length``, the run's, unless the stage sets one)."""
        if self.tokens is not None:
            return self.tokens
        return float(self.iters or 0) * global_batch_size * (self.seq_length or seq_length)


@dataclass(frozen=True)
class MemorySpec:
    """The deployment the ``memory`` budget metric measures: weights at ``precision`` plus the
    KV cache and Mamba state of ``batch_size`` sequences of ``seq_length`` tokens."""

    batch_size: int = 1
    seq_length: int = 4096
    precision: str = "bf16"

    def __post_init__(self) -> None:
        _positive_int("memory.batch_size", self.batch_size)
        _positive_int("memory.seq_length", self.seq_length)
        _choice("memory.precision", self.precision, PRECISIONS)


# Tokens per chunk of the chunked KD loss (elastic/losses.py). Its FP32 temporaries are ~13 bytes x
# chunk x (vocab / TP): 832 MiB at 1024 tokens of Nano v3's 131,072-entry vocabulary under TP=2,
# against 14.5 GiB unchunked for an 8K-token micro-batch (bench/bench_kd_loss.py measures it).
DEFAULT_KD_CHUNK_TOKENS = 1024


# ------------------------------------------------------------------------------ ElasticConfig
@dataclass(frozen=True)
class ElasticConfig:
    """The ``elastic:`` section. ``sizes`` maps an axis to candidate sizes: a float in (0, 1] is a
    fraction of the full size, an int is absolute; an axis not given gets ``DEFAULT_FRACTIONS``.
    ``source``/``origins`` only say where values came from (file, flag) for error messages."""

    budgets: tuple[float, ...] = (1.0, 0.77, 0.4)
    budget_metric: str = "total_params"
    memory: MemorySpec = field(default_factory=MemorySpec)
    sizes: dict[str, tuple[int | float, ...]] = field(default_factory=dict)
    heterogeneous: bool = False
    router: RouterConfig = field(default_factory=RouterConfig)
    curriculum: tuple[CurriculumStage, ...] = ()
    mode: str = "sliced"
    teacher: str = "frozen"
    kd_temperature: float = 1.0
    kd_chunk_tokens: int = DEFAULT_KD_CHUNK_TOKENS  # the KD loss's tokens per chunk (losses.py)
    budget_loss_weight: float = 1.0
    ce_weight_full: float = 0.0
    interpolate: bool = False
    fp8_gemm: str = "off"
    source: str = field(default="<dict>", compare=False, repr=False)
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self._check()
        except ElasticConfigError as exc:
            raise exc.located(self.where(exc.field)) from None

    def where(self, field_name: str) -> str | None:
        """The flag or file a field's value came from."""
        return _where(field_name, self.source, self.origins)

    def _check(self) -> None:
        budgets = _seq("budgets", self.budgets)
        if (
            not budgets
            or not all(_is_number(b) and 0 < b <= 1 for b in budgets)
            or any(a <= b for a, b in zip(budgets, budgets[1:]))
        ):
            raise ElasticConfigError(
                "budgets",
                f"={list(budgets)}; allowed: a non-empty, strictly "
                "descending list of fractions in (0, 1]",
            )
        object.__setattr__(self, "budgets", tuple(float(b) for b in budgets))
        _choice("budget_metric", self.budget_metric, BUDGET_METRICS)
        _choice("mode", self.mode, MODES)
        _choice("teacher", self.teacher, TEACHERS)
        _choice("fp8_gemm", self.fp8_gemm, FP8_GEMMS)
        for name in ("heterogeneous", "interpolate"):
            _bool(name, getattr(self, name))
        if not isinstance(self.memory, MemorySpec):
            raise ElasticConfigError("memory", f"={self.memory!r}; allowed: a MemorySpec")
        if not isinstance(self.router, RouterConfig):
            raise ElasticConfigError("router", f"={self.router!r}; allowed: a RouterConfig")
        if self.router.freeze_select == "loss":
            if self.router.freeze_after is None:
                raise ElasticConfigError(
                    "router.freeze_select",
                    "=loss needs router.freeze_after (the iteration to search at)",
                )
            if self.heterogeneous:
                raise ElasticConfigError(
                    "router.freeze_select",
                    "=loss searches homogeneous "
                    "choices; allowed with "
                    "heterogeneous=true: likelihood",
                )
        object.__setattr__(
            self, "kd_temperature", _number("kd_temperature", self.kd_temperature, 0.0, True)
        )
        _positive_int("kd_chunk_tokens", self.kd_chunk_tokens)
        object.__setattr__(
            self,
            "budget_loss_weight",
            _number("budget_loss_weight", self.budget_loss_weight, 0.0, False),
        )
        object.__setattr__(
            self, "ce_weight_full", _number("ce_weight_full", self.ce_weight_full, 0.0, False)
        )
        object.__setattr__(self, "sizes", _check_sizes(self.sizes))
        stages = tuple(self.curriculum)
        for i, stage in enumerate(stages):
            if not isinstance(stage, CurriculumStage):
                raise ElasticConfigError(
                    f"curriculum[{i}]",
                    f"={stage!r}; allowed: a mapping with iters or tokens, budget_probs, "
                    "seq_length",
                )
            stage.check(f"curriculum[{i}]", len(self.budgets))
        object.__setattr__(self, "curriculum", stages)

    # --------------------------------------------------------------------------- (de)serialize
    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any] | None,
        source: str = "<dict>",
        origins: Mapping[str, str] | None = None,
    ) -> ElasticConfig:
        """Strict parse of the ``elastic:`` section: unknown keys are errors (a typo would
        otherwise silently train a different family of models)."""
        origins = dict(origins or {})
        try:
            values = _mapping("", raw) if raw is not None else {}
            _unknown_keys("", values, cls)
            if "memory" in values:
                mem = _mapping("memory", values["memory"])
                _unknown_keys("memory", mem, MemorySpec)
                values["memory"] = MemorySpec(**mem)
            if "router" in values:
                router = _mapping("router", values["router"])
                _unknown_keys("router", router, RouterConfig)
                values["router"] = RouterConfig(**router)
            if "sizes" in values:
                values["sizes"] = _mapping("sizes", values["sizes"])
            if "curriculum" in values:
                values["curriculum"] = parse_curriculum(values["curriculum"])
        except ElasticConfigError as exc:
            raise exc.located(_where(exc.field, source, origins)) from None
        return cls(**values, source=source, origins=origins)

    def to_dict(self) -> dict[str, Any]:
        """YAML-ready (lists, not tuples); ``from_dict(cfg.to_dict()) == cfg``."""
        return {
            "budgets": list(self.budgets),
            "budget_metric": self.budget_metric,
            "memory": {f.name: getattr(self.memory, f.name) for f in fields(MemorySpec)},
            "sizes": {axis: list(values) for axis, values in self.sizes.items()},
            "heterogeneous": self.heterogeneous,
            "router": {
                f.name: (list(v) if isinstance(v, tuple) else v)
                for f in fields(RouterConfig)
                for v in [getattr(self.router, f.name)]
                if f.name not in _OPTIONAL_ROUTER_KEYS or v != _OPTIONAL_ROUTER_KEYS[f.name]
            },
            "curriculum": [
                {
                    "iters": s.iters,
                    "budget_probs": None if s.budget_probs is None else list(s.budget_probs),
                    "seq_length": s.seq_length,
                    **({"tokens": s.tokens} if s.tokens is not None else {}),
                }
                for s in self.curriculum
            ],
            "mode": self.mode,
            "teacher": self.teacher,
            "kd_temperature": self.kd_temperature,
            "kd_chunk_tokens": self.kd_chunk_tokens,
            "budget_loss_weight": self.budget_loss_weight,
            "ce_weight_full": self.ce_weight_full,
            "interpolate": self.interpolate,
            "fp8_gemm": self.fp8_gemm,
        }

    def curriculum_in_iterations(
        self, global_batch_size: int, seq_length: int
    ) -> tuple[CurriculumStage, ...]:
        """The curriculum counted in iterations of ``global_batch_size`` sequences of
        ``seq_length`` tokens (a stage's own sequence length where it sets one): what the budget
        sampler and the run's coverage check read."""
        return tuple(s.in_iterations(global_batch_size, seq_length) for s in self.curriculum)

    # --------------------------------------------------------------------------------- resolve
    def resolve(self, model: ModelConfig, tp: int = 1, ep: int = 1) -> ResolvedElastic:
        """Integer candidates per axis for ``model`` under TP/EP, and every check that needs the
        model (divisibility, top-k, reachable budgets). Nothing is built."""
        model.validate()
        model.check_parallel(tp=tp, ep=ep)
        try:
            axes = {}
            for name, (full, multiple, minimum, layers, unit) in model_axes(model, tp, ep).items():
                given = self.sizes.get(name)
                candidates = _resolve_candidates(name, given, full, multiple, minimum, model)
                axes[name] = AxisSpec(name, full, candidates, layers, unit, multiple)
            missing = sorted(set(self.sizes) - set(axes))
            if missing:
                raise ElasticConfigError(
                    f"sizes.{missing[0]}",
                    f": this model has no {missing[0]} axis ({_why_absent(missing[0])}); "
                    f"allowed axes for this model: {', '.join(axes)}",
                )
            resolved = ResolvedElastic(
                budgets=self.budgets, axes=axes, config=self, model=model, tp=tp, ep=ep
            )
            _check_full_budget(resolved)
            _check_reachable(resolved)
        except ElasticConfigError as exc:
            raise exc.located(self.where(exc.field)) from None
        return resolved


def parse_curriculum(raw: Any) -> tuple[CurriculumStage, ...]:
    """A list of ``{iters, budget_probs, seq_length}`` mappings, or the flag form
    ``"ITERS[:P1/P2/...[:SEQ]],..."`` (e.g. ``"200,100:0.5/0.3/0.2:256"``; ``"100::256"`` keeps
    uniform sampling at sequence length 256)."""
    if raw is None:
        return ()
    if isinstance(raw, str):
        return tuple(_stage_from_text(i, part) for i, part in enumerate(raw.split(",")))
    if isinstance(raw, Mapping) or not isinstance(raw, Sequence):
        raise ElasticConfigError(
            "curriculum",
            f"={raw!r}; allowed: a list of mappings with iters or tokens, budget_probs, seq_length",
        )
    stages = []
    for i, item in enumerate(raw):
        if isinstance(item, CurriculumStage):
            stages.append(item)
            continue
        values = _mapping(f"curriculum[{i}]", item)
        _unknown_keys(f"curriculum[{i}]", values, CurriculumStage)
        if "iters" not in values and "tokens" not in values:
            raise ElasticConfigError(
                f"curriculum[{i}].iters",
                ": missing; allowed: a positive integer (or tokens: a number > 0)",
            )
        try:
            stages.append(CurriculumStage(**values))
        except ElasticConfigError as exc:
            raise ElasticConfigError(
                exc.field.replace("curriculum[]", f"curriculum[{i}]"), exc.detail
            ) from None
    return tuple(stages)


def _stage_from_text(i: int, text: str) -> CurriculumStage:
    parts = text.strip().split(":")
    try:
        if len(parts) > 3:
            raise ValueError(text)
        iters = int(parts[0])
        probs = (
            tuple(float(p) for p in parts[1].split("/")) if len(parts) > 1 and parts[1] else None
        )
        seq = int(parts[2]) if len(parts) > 2 and parts[2] else None
    except ValueError:
        raise ElasticConfigError(
            f"curriculum[{i}]",
            f"={text!r}; allowed: ITERS[:P1/P2/...[:SEQ]] (e.g. 100:0.5/0.3/0.2:256)",
        ) from None
    try:
        return CurriculumStage(iters=iters, budget_probs=probs, seq_length=seq)
    except ElasticConfigError as exc:
        raise ElasticConfigError(
            exc.field.replace("curriculum[]", f"curriculum[{i}]"), exc.detail
        ) from None


def _where(field_name: str, source: str, origins: Mapping[str, str]) -> str | None:
    """Longest prefix of ``field_name`` (``sizes.ffn`` -> ``sizes``) found in ``origins``, else the
    source file (None for an anonymous dict)."""
    parts = field_name.replace("[", ".[").split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n]).replace(".[", "[")
        if key in origins:
            return origins[key]
    return None if source == "<dict>" else source


def _check_sizes(sizes: Any) -> dict[str, tuple[int | float, ...]]:
    sizes = _mapping("sizes", sizes)
    out: dict[str, tuple[int | float, ...]] = {}
    for axis, values in sizes.items():
        if axis not in ELASTIC_AXES:
            raise ElasticConfigError(
                f"sizes.{axis}", f": unknown axis; allowed: {', '.join(ELASTIC_AXES)}"
            )
        items = _seq(f"sizes.{axis}", values)
        ok = bool(items) and all(
            (_is_int(v) and v > 0) or (isinstance(v, float) and 0.0 < v <= 1.0) for v in items
        )
        if not ok:
            raise ElasticConfigError(
                f"sizes.{axis}",
                f"={list(items)}; allowed: a non-empty list of fractions in (0, 1] "
                "(floats, e.g. 0.5) or absolute sizes (positive integers, e.g. 64)",
            )
        out[axis] = items
    return out


# ------------------------------------------------------------------------------ resolved form
@dataclass(frozen=True)
class AxisSpec:
    """One width axis for one model/layout: ``candidates`` descending, unique; ``layers`` are
    Megatron's global 1-based ``layer_number``s it applies to (``()`` for the embedding);
    candidates are multiples of ``multiple`` (TP, query groups, Mamba groups or EP)."""

    name: str
    full: int
    candidates: tuple[int, ...]
    layers: tuple[int, ...]
    unit: str
    multiple: int = 1


@dataclass(frozen=True)
class ResolvedElastic:
    """An ElasticConfig resolved for one model and TP/EP layout (see ``ElasticConfig.resolve``)."""

    budgets: tuple[float, ...]
    axes: dict[str, AxisSpec]
    config: ElasticConfig
    model: ModelConfig
    tp: int = 1
    ep: int = 1

    def num_choices(self, axis: str) -> int:
        return len(self._axis(axis).candidates)

    def per_layer(self, axis: str) -> bool:
        """True when the router picks this axis' size per layer (heterogeneous, not embedding)."""
        self._axis(axis)
        return self.config.heterogeneous and axis != "embedding"

    def full_choice(self) -> dict[str, int]:
        return {name: spec.full for name, spec in self.axes.items()}

    def largest_choice(self) -> dict[str, int]:
        return {name: spec.candidates[0] for name, spec in self.axes.items()}

    def smallest_choice(self) -> dict[str, int]:
        return {name: spec.candidates[-1] for name, spec in self.axes.items()}

    def _axis(self, axis: str) -> AxisSpec:
        if axis not in self.axes:
            raise KeyError(
                f"axis {axis!r} is not elastic in this model; axes: {', '.join(self.axes)}"
            )
        return self.axes[axis]


def _why_absent(axis: str) -> str:
    return {
        "ffn": "no '-' (dense MLP) layers",
        "shared_ffn": "no MoE layers with a shared expert",
        "attention_heads": "no '*' (attention) layers",
        "mamba_heads": "no 'M' (Mamba) layers",
        "mamba_head_dim": "no 'M' (Mamba) layers",
        "experts": "no 'E' (MoE) layers",
    }.get(axis, "")


def _resolve_candidates(
    axis: str,
    given: tuple[int | float, ...] | None,
    full: int,
    multiple: int,
    minimum: int,
    model: ModelConfig,
) -> tuple[int, ...]:
    """Fractions round to the nearest allowed multiple (never 0); ints must already be allowed.
    Defaults clamp to the smallest allowed size and drop duplicates; explicit sizes must be
    distinct after rounding (two fractions that give the same width train one model twice)."""
    name = f"sizes.{axis}"
    allowed = (
        f"allowed: multiples of {multiple} ({multiple_name(axis, model)}) in [{minimum}, {full}]"
    )
    if axis == "experts" and minimum > multiple:
        allowed += f" (at least model.moe_router_topk={model.moe_router_topk})"
    values = DEFAULT_FRACTIONS if given is None else given
    out: list[int] = []
    for value in values:
        if isinstance(value, float):
            size = max(1, math.floor(value * full / multiple + 0.5)) * multiple
            if given is None:
                size = max(size, minimum)
        else:
            size = value
        if size % multiple or size > full or size < minimum:
            what = f"{value!r} (-> {size})" if isinstance(value, float) else f"{value!r}"
            reason = (
                "more experts dropped than top-k allows; "
                if axis == "experts" and size < model.moe_router_topk
                else ""
            )
            raise ElasticConfigError(
                name, f"={list(values)}: {what} is not allowed; {reason}{allowed}"
            )
        out.append(size)
    if given is None:
        return tuple(sorted(set(out), reverse=True))
    if len(set(out)) != len(out):
        raise ElasticConfigError(
            name,
            f"={list(values)} resolves to {out} (full {full}); sizes must be distinct; {allowed}",
        )
    return tuple(sorted(out, reverse=True))


def _check_full_budget(resolved: ResolvedElastic) -> None:
    """Budget 1.0 is the parent itself, so every axis must offer its full size."""
    from elastic_plugin.checkpoint.meta import is_full_budget

    if not any(is_full_budget(b) for b in resolved.budgets):
        return
    for name, spec in resolved.axes.items():
        if spec.candidates[0] != spec.full:
            raise ElasticConfigError(
                f"sizes.{name}",
                f"={list(spec.candidates)}: budget 1.0 is the full parent model, so the sizes "
                f"must include the full size {spec.full} (1.0); add it, or drop budget 1.0",
            )


def _check_reachable(resolved: ResolvedElastic) -> None:
    """Every budget must lie between the cost of the smallest and of the largest candidates."""
    from elastic_plugin.elastic.cost import ElasticCost

    cfg = resolved.config
    cost = ElasticCost(resolved.model, resolved, cfg.budget_metric, cfg.memory)
    low = cost.of_choice(resolved.smallest_choice()) / cost.full
    high = cost.of_choice(resolved.largest_choice()) / cost.full
    for b in resolved.budgets:
        if b < low * (1 - _REL_TOL):
            raise ElasticConfigError(
                "budgets",
                f": budget {b:g} is not reachable with budget_metric={cfg.budget_metric}: "
                f"the smallest candidates give {low:.4f} of the full model; allowed: "
                f"budgets >= {low:.4f}, or add smaller sizes (elastic.sizes.*)",
            )
        if b > high * (1 + _REL_TOL):
            raise ElasticConfigError(
                "budgets",
                f": budget {b:g} is not reachable with budget_metric={cfg.budget_metric}: "
                f"the largest candidates give {high:.4f} of the full model; allowed: "
                f"budgets <= {high:.4f}, or add larger sizes (elastic.sizes.*)",
            )
