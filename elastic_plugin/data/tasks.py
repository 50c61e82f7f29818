"""Reasoning problems from ``reasoning-gym``, rendered as ``PROMPT<think>STEPS</think>ANSWER``.

Why: the demo needs real reasoning data with a checkable answer, generated offline and
deterministically. reasoning-gym provides the problems and the scorer (``score_answer``);
this module adds the step-by-step thinking (reasoning-gym's arithmetic tasks have none),
a compact rendering for a tiny character vocabulary, and a registry so tasks can be added.

Registered tasks:

- ``chain_sum``: ``55-98+93=<think>55-98=-43,-43+93=50</think>50``. The answer copies the
  last partial sum, so the answer phase does no work of its own.
- ``products``: ``47*23=<think>47*3=141,47*20=940</think>1081``. The thinking lists one
  partial product per digit of the second factor; the answer must add them, so the answer
  phase does real work (what a "think small, answer large" experiment needs).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .progress import progress_bar

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# reasoning-gym config fields this module sets itself (never user-supplied).
_RESERVED_FIELDS = ("seed", "size")
# Number of items drawn per reasoning-gym dataset instance; fixed so that a smaller request
# is a prefix of a larger one with the same seed.
_CHUNK = 4096


@dataclass(frozen=True)
class Example:
    """One rendered problem; ``entry`` is reasoning-gym's item, needed by its scorer."""

    task: str
    prompt: str
    thinking: str
    answer: str
    entry: Mapping[str, Any] = field(repr=False)

    @property
    def text(self) -> str:
        """The training document (without the end-of-document token)."""
        return render_text(self.prompt, self.thinking, self.answer)

    def to_record(self) -> dict[str, Any]:
        """JSON-serialisable form (one line of ``heldout.jsonl``)."""
        return {
            "task": self.task,
            "prompt": self.prompt,
            "thinking": self.thinking,
            "answer": self.answer,
            "text": self.text,
            "entry": _jsonable(self.entry),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Example:
        """Inverse of :meth:`to_record`."""
        missing = [k for k in ("task", "prompt", "thinking", "answer", "entry") if k not in record]
        if missing:
            raise ValueError(f"example record is missing field(s) {missing}")
        return cls(
            task=record["task"],
            prompt=record["prompt"],
            thinking=record["thinking"],
            answer=record["answer"],
            entry=record["entry"],
        )


Renderer = Callable[[Mapping[str, Any]], tuple[str, str, str]]


@dataclass(frozen=True)
class TaskSpec:
    """A registered task: which reasoning-gym dataset, its default config, how to render it."""

    name: str
    rg_dataset: str
    defaults: Mapping[str, Any]
    render: Renderer
    description: str
    check_kwargs: Callable[[Mapping[str, Any]], None] | None = None


_TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> None:
    """Add a task to the registry (names are unique)."""
    if spec.name in _TASKS:
        raise ValueError(f"task {spec.name!r} is already registered")
    _TASKS[spec.name] = spec


def available_tasks() -> list[str]:
    """Names accepted by ``task=``."""
    return sorted(_TASKS)


def get_task(name: str) -> TaskSpec:
    """Look a task up by name, naming the allowed ones on failure."""
    if not isinstance(name, str):
        raise TypeError(f"task must be a str, got {type(name).__name__}")
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; allowed tasks: {available_tasks()}") from None


def render_text(prompt: str, thinking: str, answer: str) -> str:
    """``PROMPT<think>THINKING</think>ANSWER``."""
    return f"{prompt}{THINK_OPEN}{thinking}{THINK_CLOSE}{answer}"


def parse_completion(completion: str) -> tuple[str | None, str]:
    """Split a model's continuation of a prompt into (thinking, answer).

    Why: evaluation scores only the text after ``</think>``; a completion without a closed
    thinking block has thinking ``None`` and is scored as a whole.
    """
    body = completion
    if body.startswith(THINK_OPEN):
        body = body[len(THINK_OPEN) :]
    if THINK_CLOSE in body:
        thinking, answer = body.split(THINK_CLOSE, 1)
        return thinking, answer.strip()
    return None, completion.strip()


# --------------------------------------------------------------------------- renderers


def _compact(expression: str) -> str:
    return expression.replace(" ", "")


def _render_chain_sum(entry: Mapping[str, Any]) -> tuple[str, str, str]:
    """Left-to-right partial sums: ``a-b=r1,r1+c=r2,...``; the answer is the last sum."""
    parts = entry["metadata"]["expression"].split(" ")
    if len(parts) % 2 == 0:
        raise RuntimeError(f"unexpected chain_sum expression {entry['metadata']['expression']!r}")
    total = int(parts[0])
    steps: list[str] = []
    for op, term in zip(parts[1::2], parts[2::2]):
        value = int(term)
        new_total = total + value if op == "+" else total - value
        if op not in "+-":
            raise RuntimeError(f"unexpected operator {op!r} in chain_sum expression")
        steps.append(f"{total}{op}{value}={new_total}")
        total = new_total
    answer = str(total)
    _check_answer(entry, answer)
    return _compact(entry["metadata"]["expression"]) + "=", ",".join(steps), answer


def _render_products(entry: Mapping[str, Any]) -> tuple[str, str, str]:
    """One partial product per digit of the second factor (least significant first)."""
    parts = entry["metadata"]["expression"].split(" ")
    if len(parts) != 3 or parts[1] != "*":
        raise RuntimeError(
            f"products renderer needs 'a * b', got {entry['metadata']['expression']!r}"
        )
    a, b = int(parts[0]), int(parts[2])
    if a < 0 or b < 0:
        raise RuntimeError("products renderer needs non-negative factors (allow_negation=False)")
    steps = []
    for place, digit in enumerate(reversed(str(b))):
        multiplier = int(digit) * 10**place
        steps.append(f"{a}*{multiplier}={a * multiplier}")
    answer = str(a * b)
    _check_answer(entry, answer)
    return f"{a}*{b}=", ",".join(steps), answer


def _check_products_kwargs(kwargs: Mapping[str, Any]) -> None:
    if kwargs.get("min_terms") != 2 or kwargs.get("max_terms") != 2:
        raise ValueError("task 'products' supports exactly two factors: min_terms=max_terms=2")
    if kwargs.get("allow_negation"):
        raise ValueError("task 'products' requires allow_negation=False")


def _check_answer(entry: Mapping[str, Any], answer: str) -> None:
    if str(entry["answer"]) != answer:
        raise RuntimeError(
            f"rendered answer {answer!r} disagrees with reasoning-gym's {entry['answer']!r}"
        )


register_task(
    TaskSpec(
        name="chain_sum",
        rg_dataset="chain_sum",
        defaults={
            "min_terms": 3,
            "max_terms": 5,
            "min_digits": 1,
            "max_digits": 2,
            "allow_negation": False,
        },
        render=_render_chain_sum,
        description="add/subtract 3-5 terms of 1-2 digits; thinking = running sums",
    )
)
register_task(
    TaskSpec(
        name="products",
        rg_dataset="products",
        defaults={
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 2,
            "max_digits": 2,
            "allow_negation": False,
        },
        render=_render_products,
        description="a*b (2 digits each); thinking = partial products, answer = their sum",
        check_kwargs=_check_products_kwargs,
    )
)


# --------------------------------------------------------------------------- generation


def resolve_task_kwargs(task: str, task_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The task's reasoning-gym config fields: defaults overridden by ``task_kwargs``.

    Validated here (before any generation) so bad input fails fast with a ValueError.
    """
    spec = get_task(task)
    kwargs = dict(spec.defaults)
    if task_kwargs:
        reserved = sorted(set(task_kwargs) & set(_RESERVED_FIELDS))
        if reserved:
            raise ValueError(f"task_kwargs may not set {reserved}; use num/seed arguments instead")
        kwargs.update(task_kwargs)
    _, config_cls = _rg_classes(spec.rg_dataset)
    allowed = sorted(
        f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED_FIELDS
    )
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"unknown task_kwargs {unknown} for task {task!r}; allowed: {allowed}")
    try:
        config_cls(**kwargs, seed=0, size=1).validate()
    except AssertionError as err:
        raise ValueError(f"invalid task_kwargs for task {task!r}: {err}") from None
    if spec.check_kwargs is not None:
        spec.check_kwargs(kwargs)
    return kwargs


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed from ``seed`` and labels.

    Why: reasoning-gym seeds item ``i`` with ``seed + i``, so seeds ``s`` and ``s+1`` would give
    shifted copies of the same stream; hashing keeps different seeds independent.
    """
    digest = hashlib.sha256(json.dumps([seed, *map(str, labels)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generate_examples(
    task: str = "chain_sum",
    num: int = 1000,
    seed: int = 0,
    *,
    task_kwargs: Mapping[str, Any] | None = None,
    exclude_prompts: Iterable[str] = (),
    unique: bool = False,
    progress: bool = False,
    desc: str | None = None,
) -> tuple[list[Example], int]:
    """Draw ``num`` examples deterministically from ``seed``.

    Problems whose prompt is in ``exclude_prompts`` (and, with ``unique``, repeats) are skipped
    and replaced by further draws. Returns the examples and the number of skipped draws.
    """
    _check_positive_int("num", num)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    spec = get_task(task)
    kwargs = resolve_task_kwargs(task, task_kwargs)
    dataset_cls, config_cls = _rg_classes(spec.rg_dataset)
    excluded = set(exclude_prompts)
    seen: set[str] = set()
    examples: list[Example] = []
    skipped = 0
    max_draws = 20 * num + 10_000
    bar = progress_bar(num, desc or f"generate {task}", progress, unit="ex")
    try:
        chunk_index = 0
        while len(examples) < num:
            dataset = dataset_cls(
                config_cls(**kwargs, seed=derive_seed(seed, chunk_index), size=_CHUNK)
            )
            for i in range(_CHUNK):
                entry = dataset[i]
                prompt, thinking, answer = spec.render(entry)
                if prompt in excluded or (unique and prompt in seen):
                    skipped += 1
                else:
                    seen.add(prompt)
                    examples.append(Example(task, prompt, thinking, answer, _jsonable(entry)))
                    bar.update(1)
                    if len(examples) == num:
                        break
                if len(examples) + skipped >= max_draws:
                    raise ValueError(
                        f"task {task!r} produced only {len(examples)} acceptable problems in "
                        f"{max_draws} draws (num={num}); its problem space is too small for "
                        "this request: lower num or widen task_kwargs"
                    )
            chunk_index += 1
    finally:
        bar.close()
    return examples, skipped


def generate_splits(
    task: str = "chain_sum",
    num_train: int = 50_000,
    num_heldout: int = 500,
    seed: int = 1234,
    heldout_seed: int | None = None,
    *,
    task_kwargs: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> tuple[list[Example], list[Example], dict[str, int]]:
    """Train and held-out sets from different seeds; no held-out problem appears in train.

    Held-out problems are distinct from each other (clean accuracy); train keeps the task's
    natural distribution (repeats allowed) minus the held-out problems.
    Returns (train, heldout, info) with info = seeds used and overlaps removed.
    """
    _check_positive_int("num_train", num_train)
    _check_positive_int("num_heldout", num_heldout)
    heldout_seed = seed + 1 if heldout_seed is None else heldout_seed
    if heldout_seed == seed:
        raise ValueError("heldout_seed must differ from seed (the sets come from different seeds)")
    resolve_task_kwargs(task, task_kwargs)
    heldout, heldout_dups = generate_examples(
        task,
        num_heldout,
        heldout_seed,
        task_kwargs=task_kwargs,
        unique=True,
        progress=progress,
        desc=f"generate {task} held-out",
    )
    train, overlaps = generate_examples(
        task,
        num_train,
        seed,
        task_kwargs=task_kwargs,
        exclude_prompts={ex.prompt for ex in heldout},
        progress=progress,
        desc=f"generate {task} train",
    )
    info = {
        "seed": seed,
        "heldout_seed": heldout_seed,
        "overlaps_removed": overlaps,
        "heldout_duplicates_removed": heldout_dups,
    }
    return train, heldout, info


# --------------------------------------------------------------------------- scoring


def score(example: Example | Mapping[str, Any], predicted_answer: str | None) -> float:
    """reasoning-gym's own ``score_answer`` for this example's task, in [0, 1].

    Note reasoning-gym gives partial credit (e.g. "1400" for "140" scores 0.75): count
    ``score == 1.0`` as correct.
    """
    if isinstance(example, Mapping):
        example = Example.from_record(example)
    if not isinstance(example, Example):
        raise TypeError(
            f"example must be an Example or a record dict, got {type(example).__name__}"
        )
    if predicted_answer is not None and not isinstance(predicted_answer, str):
        raise TypeError(
            f"predicted_answer must be a str or None, got {type(predicted_answer).__name__}"
        )
    scorer = _scorer(get_task(example.task).rg_dataset)
    return float(scorer(predicted_answer, dict(example.entry)))


@functools.cache
def _scorer(rg_dataset: str) -> Callable[[str | None, dict], float]:
    from reasoning_gym.factory import get_score_answer_fn

    return get_score_answer_fn(rg_dataset)


# --------------------------------------------------------------------------- helpers


@functools.cache
def _rg_classes(rg_dataset: str) -> tuple[type, type]:
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    if rg_dataset not in DATASETS:
        raise ValueError(f"reasoning-gym has no dataset {rg_dataset!r}")
    return DATASETS[rg_dataset]


def _jsonable(obj: Any) -> Any:
    """Plain JSON types (tuples become lists) so an entry is the same before and after a file."""
    return json.loads(json.dumps(obj))


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
