"""Bring your own model: a Hugging Face NemotronH (random, scaled-down Nano v3) with its own
byte-level BPE tokenizer (EOS ``</s>``, named by tokenizer_config.json) goes through
``import --hf`` -> ``prepare-data --input`` (JSONL) -> ``importance`` -> ``reorder`` ->
``elastic-train`` -> ``generate``, every command a subprocess that exits 0; bad JSONL input is
refused (exit 2) before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_plugin.checkpoint.meta import read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[1]
NANO_CONFIG = ROOT / "tests" / "fixtures" / "nemotron_nano_v3_config.json"
CLI = [sys.executable, "-m", "elastic_plugin.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600
    )


def _json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def test_prepare_data_input_writes_indexed_datasets_with_the_tokenizers_eos(tmp_path):
    from elastic_plugin.cli import main
    from elastic_plugin.data.indexed import read_indexed_documents
    from elastic_plugin.data.jsonl import open_tokenizer
    from tests.support.byom_cases import EOS, corpus, write_bpe_tokenizer, write_jsonl

    texts = corpus(40)
    tok_file = write_bpe_tokenizer(tmp_path / "tok", texts)
    jsonl = write_jsonl(tmp_path / "c.jsonl", texts, key="body")
    out = tmp_path / "data"
    args = ["prepare-data", "--input", str(jsonl), "--text-key", "body", "--tokenizer"]
    assert main([*args, str(tok_file), "--out", str(out), "--valid-fraction", "0.1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eos"]["token"] == EOS and meta["eos"]["source"].startswith("tokenizer_config")
    assert meta["counts"] == {"train": 36, "valid": 4}
    tok = open_tokenizer(tok_file)
    assert tok.eod == meta["eos"]["id"] and tok.pad == tok.backend.token_to_id("<pad>")
    docs = read_indexed_documents(out / "train_text_document")
    assert all(d[-1] == tok.eod for d in docs)
    decoded = {tok.detokenize(d[:-1].tolist()) for d in docs}
    valid = {
        tok.detokenize(d[:-1].tolist()) for d in read_indexed_documents(meta["valid_data_path"])
    }
    assert decoded | valid == set(texts) and not decoded & valid
    # again without --force: refused, nothing changed
    assert main([*args, str(tok_file), "--out", str(out)]) == 2


@pytest.mark.parametrize(
    "case, lines, needle",
    [
        ("not_json", ['{"text": "a b"}', "{oops"], ":2: not a JSON line"),
        ("missing_key", ['{"text": "a b"}', '{"body": "c"}'], ":2: no key 'text'"),
        ("not_a_string", ['{"text": 3}'], ":1: key 'text' is a int"),
        ("all_empty", ['{"text": ""}', '{"text": ""}'], "no non-empty 'text'"),
        ("missing_file", None, "c.jsonl: no such file"),
        ("bad_tokenizer", ['{"text": "a b"}', '{"text": "c d"}'], "not a readable tokenizer"),
    ],
)
def test_prepare_data_input_refuses_bad_input_before_writing(tmp_path, capsys, case, lines, needle):
    from elastic_plugin.cli import main
    from tests.support.byom_cases import corpus, write_bpe_tokenizer

    tok_file = write_bpe_tokenizer(tmp_path / "tok", corpus(8))
    if case == "bad_tokenizer":
        tok_file = tmp_path / "tokenizer.json"
        tok_file.write_text("{}")
    jsonl = tmp_path / "c.jsonl"
    if lines is not None:
        jsonl.write_text("\n".join(lines) + "\n")
    out = tmp_path / "data"
    rc = main(
        ["prepare-data", "--input", str(jsonl), "--tokenizer", str(tok_file), "--out", str(out)]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and (str(tok_file) if case == "bad_tokenizer" else str(jsonl)) in err
    assert not out.exists()


@pytest.mark.integration
def test_imported_model_runs_every_stage(tmp_path):
    from tests.support.byom_cases import (
        corpus,
        write_elastic_config,
        write_hf_model,
        write_jsonl,
    )

    times: dict[str, float] = {}

    def step(name: str, *args) -> subprocess.CompletedProcess:
        start = time.time()
        proc = _cli(*args)
        times[name] = round(time.time() - start, 1)
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
        return proc

    hf = write_hf_model(tmp_path / "hf", NANO_CONFIG)
    teacher = tmp_path / "teacher"
    step("import", "import", "--hf", hf, "--out", teacher, "--no-progress")
    meta = json.loads((teacher / "iter_0000000" / "elastic_meta.json").read_text())
    tokenizer = Path(meta["tokenizer"])
    assert (
        meta["kind"] == "teacher"
        and tokenizer == teacher.resolve() / "iter_0000000" / "hf_tokenizer" / "tokenizer.json"
    )

    jsonl = write_jsonl(tmp_path / "corpus.jsonl", corpus(64))
    data = tmp_path / "data"
    prep = _json(
        step(
            "prepare-data",
            "prepare-data",
            "--input",
            jsonl,
            "--tokenizer",
            tokenizer,
            "--out",
            data,
        )
    )
    assert prep["eos"]["token"] == "</s>"
    train, valid = prep["data_path"], prep["valid_data_path"]

    scores = tmp_path / "scores.pt"
    step(
        "importance", "importance", "--ckpt", teacher, "--out", scores, "--data-path", train,
        "--tokenizer", tokenizer, "--num-samples", "8", "--micro-batch-size", "4", "--no-progress",
    )  # fmt: skip
    reordered = tmp_path / "reordered"
    step("reorder", "reorder", "--ckpt", teacher, "--scores", scores, "--out", reordered)
    config = write_elastic_config(tmp_path / "elastic.yaml", meta)
    run = tmp_path / "run"
    trained = _json(
        step(
            "elastic-train",
            "elastic-train",
            "--ckpt",
            reordered,
            "--config",
            config,
            "--out",
            run,
            "--data-path",
            f"0.3 {train} 0.7 {train}",  # a Megatron blend (weights, prefixes)
            "--valid-data-path",
            valid,
            "--tokenizer",
            tokenizer,
            "--train-iters",
            "2",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--log-interval",
            "1",
            "--no-progress",
        )  # fmt: skip
    )
    assert trained["iterations"] == 2
    elastic = run / "checkpoints" / "elastic"
    exports = tmp_path / "exports"
    step(
        "export", "export", "--ckpt", elastic, "--out", exports, "--precisions", "bf16",
        "--no-megatron", "--nested", "--eval-sequences", "2", "--no-progress",
    )  # fmt: skip
    evaluated = tmp_path / "eval"
    step(
        "evaluate", "evaluate", "--ckpt", elastic, "--exports", exports, "--out", evaluated,
        "--data-path", valid, "--tokenizer", tokenizer, "--num-sequences", "4",
        "--seq-length", "32", "--no-progress",
    )  # fmt: skip
    report = json.loads((evaluated / "lm_report.json").read_text())
    budgets = read_checkpoint_meta(elastic)["elastic"]["budgets"]
    assert [r["budget"] for r in report["budgets"]] == sorted(budgets, reverse=True)
    # up to 4 windows of 32 tokens, as many as the small valid split holds
    assert 1 <= report["sequences"] <= 4 and report["tokens"] == report["sequences"] * 32
    for row in report["budgets"]:
        fp32, bf16 = row["loss"]["fp32"], row["loss"]["bf16"]
        # the BF16 export computes what the fp32 nested model does, within BF16 rounding
        assert 0 < fp32 < 20 and bf16 == pytest.approx(fp32, rel=0.02), row
        # the budget sliced from the one nested directory is that export, bit for bit
        assert row["sliced_from_nested"]["bf16"] == bf16, row
    params = [r["params"]["active"] for r in report["budgets"]]
    assert params == sorted(params, reverse=True) and params[0] > params[-1]
    assert (evaluated / "loss_vs_params.png").stat().st_size > 0
    assert "sliced from nested" in (evaluated / "lm_report.md").read_text()
    _evaluate_refuses_bad_input(elastic, valid, tokenizer, tmp_path)
    generated = _json(
        step(
            "generate",
            "generate",
            "--ckpt",
            teacher,
            "--prompt",
            "the model reads",
            "--max-new-tokens",
            "4",
            "--greedy",
            "--json",
        )  # fmt: skip
    )
    assert generated, "generate printed no JSON"
    print("stage seconds:", times, json.dumps(generated)[:300])


def _evaluate_refuses_bad_input(elastic: Path, valid: str, tokenizer: Path, tmp: Path) -> None:
    """evaluate --data-path: each bad input exits 2 naming its flag; no report is started."""
    import contextlib
    import io

    from elastic_plugin.cli import main
    from elastic_plugin.data.indexed import write_indexed_dataset

    vocab = read_checkpoint_meta(elastic)["config"]["model"]
    foreign = tmp / "foreign_text_document"
    write_indexed_dataset(foreign, [list(range(vocab["vocab_size"], vocab["vocab_size"] + 80))],
                          vocab_size=2 * vocab["vocab_size"])  # fmt: skip
    out = tmp / "never"
    cases = [
        (["--tokenizer", tokenizer], "--tokenizer is given without --data-path"),
        (["--data-path", tmp / "nothing", "--tokenizer", tokenizer], "--data-path"),
        (["--data-path", valid], "--tokenizer None"),
        (["--data-path", valid, "--tokenizer", tokenizer, "--num-sequences", "0"],
         "--num-sequences=0"),
        (["--data-path", foreign, "--tokenizer", tokenizer, "--seq-length", "32"],
         "the model's vocabulary"),
        (["--data-path", valid, "--tokenizer", tokenizer, "--exports", tmp], "no exports.json"),
    ]  # fmt: skip
    for extra, needle in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(["evaluate", "--ckpt", str(elastic), "--out", str(out), *map(str, extra)])
        assert rc == 2 and needle in err.getvalue(), (extra, err.getvalue())
        assert not out.exists()


def test_data_path_blends_are_checked_prefix_by_prefix(tmp_path):
    """--data-path takes what Megatron's --data-path takes: one prefix, several, or weighted
    pairs; each prefix must exist, and a missing one is named."""
    import argparse

    from elastic_plugin.cli_args import blend_prefixes, check_data_path_args
    from elastic_plugin.models.config import ConfigError

    assert blend_prefixes("data/a") == ["data/a"]
    assert blend_prefixes("0.3 data/a 0.7 data/b") == ["data/a", "data/b"]
    assert blend_prefixes("data/a data/b") == ["data/a", "data/b"]  # equal weights
    assert blend_prefixes("data/a 1 data/b") == ["data/a", "1", "data/b"]
    for name in ("a", "b"):
        (tmp_path / f"{name}.idx").write_bytes(b"")
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    a, b = tmp_path / "a", tmp_path / "b"

    def check(data_path: str) -> None:
        check_data_path_args(argparse.Namespace(data_path=data_path, tokenizer=str(tok)))

    check(f"0.3 {a} 0.7 {b}")
    check(f"{a} {b}")
    with pytest.raises(ConfigError, match=rf"--data-path {tmp_path}/c: no .*\(in the blend"):
        check(f"0.3 {a} 0.7 {tmp_path / 'c'}")


def test_demo_tokenizers_keep_eod_and_pad(tmp_path):
    """The demo's tokenizers open as before: <eod> ends, <pad> pads, as their own
    tokenizer_config.json says."""
    from elastic_plugin.data.jsonl import open_tokenizer, tokenizer_spec
    from elastic_plugin.data.tokenizer import JsonTokenizer, train_tokenizer

    path = train_tokenizer(["12+3=15", "4*5=20"]).save(tmp_path)
    before, after = JsonTokenizer.from_file(path), open_tokenizer(path)
    assert (after.eod, after.pad) == (before.eod, before.pad)
    assert tokenizer_spec(path).eos_source == "tokenizer_config.json eos_token"
