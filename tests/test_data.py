"""Reasoning data, tokenizer, Megatron indexed datasets and GPTDataset batches."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from elastic_plugin.data import indexed, prepare, tasks
from elastic_plugin.data.cli import parse_task_args, register_subcommand
from elastic_plugin.data.indexed import (
    MicroBatchSampler,
    batch_iterator,
    build_gpt_datasets,
    read_indexed_documents,
    write_indexed_dataset,
)
from elastic_plugin.data.prepare import PreparedData, prepare_dataset
from elastic_plugin.data.tokenizer import SPECIAL_TOKENS, JsonTokenizer, train_tokenizer
from tests.support.rendezvous import client_env, serve_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 64


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    out = tmp_path_factory.mktemp("prep") / "data"
    return prepare_dataset(out, num_train=2000, num_valid=200, seed=7, progress=False)


@pytest.fixture(scope="module")
def gpt(prepared: PreparedData):
    return prepared.build_datasets(SEQ, seed=3, drop_last_partial_validation_sequence=False)


# --------------------------------------------------------------------------- tasks


def _eval_chain(expr: str) -> int:
    assert re.fullmatch(r"-?\d+([+-]-?\d+)*", expr), expr
    return sum(int(t) for t in re.findall(r"[+-]?\d+", expr))


def test_chain_sum_rendering_and_steps() -> None:
    examples, _ = tasks.generate_examples("chain_sum", 300, seed=11)
    for ex in examples:
        assert ex.text == f"{ex.prompt}<think>{ex.thinking}</think>{ex.answer}"
        assert re.fullmatch(r"\d{1,2}([+-]\d{1,2}){2,4}=", ex.prompt), ex.prompt
        steps = ex.thinking.split(",")
        assert len(steps) == ex.prompt.count("+") + ex.prompt.count("-")
        running = int(re.match(r"\d+", ex.prompt).group())
        for step in steps:
            lhs, rhs = step.split("=")
            assert lhs.startswith(str(running)) and _eval_chain(lhs) == int(rhs)
            running = int(rhs)
        assert ex.answer == str(running) == str(_eval_chain(ex.prompt[:-1])) == ex.entry["answer"]
        assert ex.entry["metadata"]["source_dataset"] == "chain_sum"


def test_products_answer_combines_partial_products() -> None:
    examples, _ = tasks.generate_examples("products", 100, seed=2)
    for ex in examples:
        a, b = map(int, ex.prompt[:-1].split("*"))
        partials = [step.split("=") for step in ex.thinking.split(",")]
        assert len(partials) == len(str(b)) >= 2
        for lhs, rhs in partials:
            x, y = map(int, lhs.split("*"))
            assert x == a and x * y == int(rhs)
        assert int(ex.answer) == a * b == sum(int(r) for _, r in partials)
        if b % 10:  # no zero partial product: the answer is none of the thinking's numbers
            assert ex.answer not in {r for _, r in partials}


def test_splits_disjoint_heldout_unique_and_deterministic() -> None:
    train, heldout, info = tasks.generate_splits("chain_sum", 3000, 300, seed=5)
    assert len(train) == 3000 and len(heldout) == 300
    held = {ex.prompt for ex in heldout}
    assert len(held) == 300
    assert not held & {ex.prompt for ex in train}
    # the 1-digit/3-term space is small (4000 problems), so overlaps must have been removed
    assert info["overlaps_removed"] > 0 and info["heldout_seed"] == 6
    again = tasks.generate_splits("chain_sum", 3000, 300, seed=5)
    assert [e.text for e in again[0]] == [e.text for e in train]
    assert [e.text for e in again[1]] == [e.text for e in heldout]
    other = tasks.generate_splits("chain_sum", 3000, 300, seed=6, heldout_seed=99)
    assert [e.text for e in other[0]] != [e.text for e in train]
    small, _ = tasks.generate_examples("chain_sum", 100, seed=5)
    big, _ = tasks.generate_examples("chain_sum", 5000, seed=5)
    assert [e.text for e in small] == [e.text for e in big[:100]]  # prefix-stable


def test_score_uses_reasoning_gym_scorer() -> None:
    (ex,), _ = tasks.generate_examples("chain_sum", 1, seed=3)
    assert tasks.score(ex, ex.answer) == 1.0
    wrong = str(int(ex.answer) + 1)
    assert tasks.score(ex, wrong) < 1.0
    assert tasks.score(ex, None) == 0.0
    record = json.loads(json.dumps(ex.to_record()))
    assert tasks.score(record, ex.answer) == 1.0 and tasks.score(record, wrong) < 1.0
    assert tasks.parse_completion(f"<think>{ex.thinking}</think>{ex.answer}") == (
        ex.thinking,
        ex.answer,
    )
    assert tasks.parse_completion("12") == (None, "12")


def test_bad_task_inputs() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*chain_sum.*products"):
        tasks.generate_examples("nope", 5)
    with pytest.raises(ValueError, match="num must be > 0"):
        tasks.generate_examples("chain_sum", 0)
    with pytest.raises(ValueError, match="num_train must be > 0"):
        tasks.generate_splits("chain_sum", 0, 10)
    with pytest.raises(ValueError, match=r"unknown task_kwargs \['digits'\].*max_digits"):
        tasks.resolve_task_kwargs("chain_sum", {"digits": 2})
    with pytest.raises(ValueError, match="may not set"):
        tasks.resolve_task_kwargs("chain_sum", {"seed": 1})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        tasks.resolve_task_kwargs("chain_sum", {"max_terms": 1})
    with pytest.raises(ValueError, match="exactly two factors"):
        tasks.resolve_task_kwargs("products", {"max_terms": 3})
    with pytest.raises(ValueError, match="too small"):
        tiny = {"min_terms": 2, "max_terms": 2, "max_digits": 1}  # 200 distinct problems
        tasks.generate_examples("chain_sum", 250, task_kwargs=tiny, unique=True)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_special_tokens(tmp_path) -> None:
    examples, _ = tasks.generate_examples("chain_sum", 500, seed=1)
    texts = [ex.text for ex in examples]
    tok = train_tokenizer(texts)
    chars = set("".join(texts).replace("<think>", "").replace("</think>", ""))
    assert (
        chars == set("0123456789+-=,") and tok.vocab_size == len(SPECIAL_TOKENS) + len(chars) == 19
    )
    assert [tok.vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad, tok.eod, tok.think_open, tok.think_close) == (0, 1, 3, 4)
    for t in SPECIAL_TOKENS:
        assert tok.tokenize(t) == [tok.vocab[t]]
    doc = texts[0] + "<eod>"
    ids = tok.tokenize(doc)
    assert len(ids) == len(texts[0]) - len("<think></think>") + 2 + 1  # one id per character
    assert tok.detokenize(ids) == doc
    assert tok.tokenize("7x") == [tok.vocab["7"], tok.unk]
    assert (
        tok.padded_vocab_size(128) == 128
        and tok.padded_vocab_size(8, tensor_model_parallel_size=2) == 32
    )
    path = tok.save(tmp_path)
    loaded = JsonTokenizer.from_file(path)
    assert loaded.tokenize(doc) == ids and loaded.unique_identifiers == tok.unique_identifiers
    bpe = train_tokenizer(texts, vocab_size=48)
    assert bpe.vocab_size == 48 and bpe.detokenize(bpe.tokenize(doc)) == doc
    assert len(bpe.tokenize(doc)) < len(ids)
    assert bpe.unique_identifiers != tok.unique_identifiers
    with pytest.raises(ValueError, match="vocab_size must be >= 19"):
        train_tokenizer(texts, vocab_size=10)
    with pytest.raises(ValueError, match="eod_token '<end>' is not in the tokenizer vocabulary"):
        JsonTokenizer(tok.backend, eod_token="<end>")


# --------------------------------------------------------------------------- indexed datasets


def test_indexed_dataset_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 19, size=int(n)) for n in rng.integers(1, 40, size=50)]
    stats = write_indexed_dataset(tmp_path / "d", docs, vocab_size=19)
    assert (stats.num_documents, stats.num_tokens, stats.dtype) == (
        50,
        sum(map(len, docs)),
        "uint16",
    )
    back = read_indexed_documents(tmp_path / "d")
    assert len(back) == 50 and all(np.array_equal(a, b) for a, b in zip(back, docs))
    with pytest.raises(ValueError, match=r"ids outside \[0, 19\)"):
        write_indexed_dataset(tmp_path / "e", [[1, 19]], vocab_size=19)
    with pytest.raises(ValueError, match="documents is empty"):
        write_indexed_dataset(tmp_path / "f", [], vocab_size=19)


def test_prepared_files_match_heldout(prepared: PreparedData) -> None:
    tok = prepared.load_tokenizer()
    heldout = prepared.load_heldout()
    valid = read_indexed_documents(prepared.valid_prefix)
    assert len(heldout) == len(valid) == 200 == prepared.meta["counts"]["valid"]
    for ex, doc in zip(heldout, valid):
        assert doc[-1] == tok.eod and tok.detokenize(doc) == ex.text + "<eod>"
    assert len(read_indexed_documents(prepared.train_prefix)) == 2000
    meta = json.load(open(prepared.meta_path))
    assert meta["vocab_size"] == tok.vocab_size and meta["settings"]["task"] == "chain_sum"
    assert meta["tokens"]["train"] == sum(map(len, read_indexed_documents(prepared.train_prefix)))


# --------------------------------------------------------------------------- GPTDataset


def _unshuffled(ds) -> list[dict]:
    order = np.argsort(np.asarray(ds.shuffle_index))
    return [ds[int(i)] for i in order]


def test_gpt_dataset_samples(prepared: PreparedData, gpt) -> None:
    assert gpt.test is None
    docs = read_indexed_documents(prepared.valid_prefix)
    samples = _unshuffled(gpt.valid)
    stream = np.concatenate([docs[i] for i in np.asarray(gpt.valid.document_index)])
    got = np.concatenate([s["tokens"].numpy() for s in samples])
    n_real = len(stream) - 1  # the last token is only ever a label
    assert np.array_equal(got[:n_real], stream[:n_real])
    for s in samples:
        assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == (SEQ,)
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])
        assert s["attention_mask"].shape == (1, SEQ, SEQ)
        assert torch.equal(s["attention_mask"][0], ~torch.ones(SEQ, SEQ).tril().bool())
    last = samples[-1]  # the partial last validation sample is padded with <pad> (id 0)
    pad = last["labels"] == 0
    assert 0 < pad.sum() < SEQ and torch.all(last["loss_mask"][pad] == 0)
    assert torch.all(last["loss_mask"][~pad] == 1)
    assert all(torch.all(s["loss_mask"] == 1) for s in samples[:-1])


def test_batch_iterator_shapes_sharding_and_resume(gpt) -> None:
    b = next(batch_iterator(gpt.train, 4, seed=1))
    assert b["tokens"].shape == b["labels"].shape == b["position_ids"].shape == (4, SEQ)
    assert (
        b["tokens"].dtype == b["labels"].dtype == torch.int64
        and b["loss_mask"].dtype == torch.float32
    )
    assert b["attention_mask"].shape == (4, 1, SEQ, SEQ) and b["attention_mask"].dtype == torch.bool
    assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    full = batch_iterator(gpt.train, 4, seed=1)
    r0 = batch_iterator(gpt.train, 2, seed=1, data_parallel_rank=0, data_parallel_size=2)
    r1 = batch_iterator(gpt.train, 2, seed=1, data_parallel_rank=1, data_parallel_size=2)
    for _ in range(3):
        f, a, c = next(full), next(r0), next(r1)
        assert torch.equal(torch.cat([a["tokens"], c["tokens"]]), f["tokens"])
    fresh = batch_iterator(gpt.train, 4, seed=1)
    for _ in range(2):
        next(fresh)
    resumed = batch_iterator(gpt.train, 4, seed=1, consumed_samples=8)
    assert torch.equal(next(fresh)["tokens"], next(resumed)["tokens"])
    assert not torch.equal(next(batch_iterator(gpt.train, 4, seed=2))["tokens"], b["tokens"])
    sampler = MicroBatchSampler(10, 3, seed=0, infinite=False)
    flat = [i for batch in sampler for i in batch]
    assert (
        len(sampler) == 3 and len(set(flat)) == 9 and flat != sorted(flat)
    )  # shuffled, no repeats
    batches = itertools.islice(MicroBatchSampler(10, 5, shuffle=False, infinite=True), 4)
    assert [i for batch in batches for i in batch] == list(range(10)) * 2  # wraps into epoch 2
    assert batch_iterator(None, 4) is None
    with pytest.raises(ValueError, match="fewer than one global micro batch"):
        MicroBatchSampler(3, 2, data_parallel_size=2)


def test_build_from_data_path_split_and_errors(prepared: PreparedData, tmp_path) -> None:
    tok = prepared.load_tokenizer()
    ds = build_gpt_datasets(
        tok, SEQ, data_path=prepared.train_prefix, split="90,10,0", path_to_cache=tmp_path
    )
    assert ds.train is not None and ds.valid is not None and ds.test is None
    assert len(ds.train) > 5 * len(ds.valid)
    with pytest.raises(ValueError, match=r"no indexed dataset at prefix '.*missing'.*\.bin"):
        build_gpt_datasets(tok, SEQ, data_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="either data_path"):
        build_gpt_datasets(
            tok, SEQ, data_path=prepared.train_prefix, train_data_path=prepared.train_prefix
        )
    with pytest.raises(ValueError, match="no data"):
        build_gpt_datasets(tok, SEQ)


# --------------------------------------------------------------------------- prepare / cache / CLI


def test_prepare_cache_reuse_and_atomicity(tmp_path, monkeypatch) -> None:
    out = tmp_path / "d"
    first = prepare_dataset(out, num_train=300, num_valid=30, seed=1, progress=False)
    assert not first.reused
    stamp = os.stat(first.train_prefix + ".bin").st_mtime_ns
    again = prepare_dataset(out, num_train=300, num_valid=30, seed=1, progress=False)
    assert again.reused and os.stat(again.train_prefix + ".bin").st_mtime_ns == stamp
    assert PreparedData.load(out).meta == first.meta

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(prepare, "write_text_documents", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare_dataset(out, num_train=300, num_valid=40, seed=1, progress=False)
    assert PreparedData.load(out).meta == first.meta  # old result untouched
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare_dataset(tmp_path / "new", num_train=10, num_valid=5, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["d"]  # no partial directory left behind
    monkeypatch.undo()
    changed = prepare_dataset(out, num_train=300, num_valid=40, seed=1, progress=False)
    assert not changed.reused and changed.meta["counts"] == {"train": 300, "valid": 40}


def test_prepare_bad_inputs(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"allowed tasks: \['chain_sum', 'products'\]"):
        prepare_dataset(tmp_path / "a", task="sums")
    with pytest.raises(ValueError, match="num_train must be > 0"):
        prepare_dataset(tmp_path / "a", num_train=0)
    with pytest.raises(ValueError, match="num_valid must be > 0"):
        prepare_dataset(tmp_path / "a", num_valid=-1)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        prepare_dataset(tmp_path / "busy", num_train=10, num_valid=5, progress=False)
    with pytest.raises(ValueError, match="not a complete prepared data directory"):
        PreparedData.load(tmp_path / "busy")


def test_cli_prepare_data(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="elastic-plugin")
    register_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "prepare-data",
            "--out",
            str(tmp_path / "p"),
            "--task",
            "products",
            "--num-train",
            "50",
            "--num-valid",
            "10",
            "--seed",
            "3",
            "--task-arg",
            "max_digits=3",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    assert "wrote" in capsys.readouterr().out
    meta = PreparedData.load(tmp_path / "p").meta
    assert meta["task"] == "products" and meta["settings"]["task_kwargs"]["max_digits"] == 3
    args = parser.parse_args(["prepare-data", "--out", str(tmp_path / "q"), "--num-train", "0"])
    assert args.func(args) == 2 and "num_train must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["prepare-data", "--out", "x", "--task", "nope"])
    assert "choose from" in capsys.readouterr().err
    assert parse_task_args(["a=1", "b=true", "c=x"]) == {"a": 1, "b": True, "c": "x"}


# --------------------------------------------------------------------------- distributed


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from elastic_plugin.data.prepare import prepare_dataset
    from elastic_plugin.data.indexed import batch_iterator
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    p = prepare_dataset(sys.argv[1], num_train=400, num_valid=40, seed=9, progress=False)
    ds = p.build_datasets(32)
    it = batch_iterator(ds.train, 2, seed=4, data_parallel_rank=rank, data_parallel_size=2)
    only0 = p.build_datasets(32, is_built_on_rank=lambda: rank == 0)
    print("RESULT" + json.dumps({"rank": rank, "reused": p.reused, "len": len(ds.train),
          "tokens": next(it)["tokens"].tolist(), "train_none": only0.train is None}))
    dist.destroy_process_group()
    """
)


@pytest.mark.integration
def test_two_ranks_rank0_builds_others_wait(tmp_path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    store = serve_store()  # both ranks join it as clients: no port picked, then raced for
    out = tmp_path / "shared"
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            **client_env(store, rank, 2),
            PYTHONPATH=REPO,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.split("RESULT", 1)[1]))
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    assert (r0["reused"], r1["reused"]) == (False, True)
    assert r0["len"] == r1["len"] and r0["tokens"] != r1["tokens"]
    assert (r0["train_none"], r1["train_none"]) == (False, True)
    single = PreparedData.load(out).build_datasets(32)  # loads the cache rank 0 wrote
    assert len(single.train) == r0["len"]
    full = next(batch_iterator(single.train, 4, seed=4))["tokens"].tolist()
    assert full == r0["tokens"] + r1["tokens"]
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


@pytest.mark.integration
def test_helpers_compiled_when_missing(tmp_path, monkeypatch) -> None:
    """The wheel ships helpers_cpp but not the Makefile compile_helpers() needs: our fallback."""
    import megatron.core.datasets as mds
    from megatron.core.datasets import helpers_cpp as shipped

    monkeypatch.setattr(mds, "helpers_cpp", shipped)  # restored after the test
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)  # import fails
    built = indexed.ensure_dataset_helpers(tmp_path)
    assert built is not shipped and built.__file__.startswith(str(tmp_path))
    assert sys.modules["megatron.core.datasets.helpers_cpp"] is built and mds.helpers_cpp is built
    sizes = np.random.default_rng(0).integers(1, 50, size=500).astype(np.int32)
    docs = np.random.default_rng(1).permutation(500).astype(np.int32)
    args = (sizes, docs, 64, 1, int(sizes.sum()), True, 1)
    assert np.array_equal(
        built.build_sample_idx_int32(*args), shipped.build_sample_idx_int32(*args)
    )
