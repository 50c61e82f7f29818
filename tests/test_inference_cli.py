"""``elastic-plugin generate``: bad input exits 2 with a message naming the flag (before Megatron
is imported), and on a briefly trained tiny elastic checkpoint the command generates exactly what
the library calls give for the same prompts (the toy's tokenizer puts its <eod> in front): ``generate`` on the nested model of the
budget, ``budget_control_generate`` with the think / answer budgets, ``capped_thinking_generate``,
and the same tokens from the zero-shot extracted checkpoint of the budget."""

from __future__ import annotations

import argparse
import io
import json
import random
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from elastic_plugin.checkpoint.history import resolve_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml")
HERE = "test_inference_cli"
PROMPTS = ["12*3=", "7+5-7="]
SPECIALS = "<pad>, <eod>, <unk>, <think>, </think>"


def _texts() -> list[str]:
    rng = random.Random(0)
    texts = ["abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.?!"]
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        texts.append(f"{a}*{b}=<think>{a}*{b}={a * b}</think>{a * b}")
        texts.append(f"{a}+{b}-7=<think>{a}+{b}={a + b},{a + b}-7={a + b - 7}</think>{a + b - 7}")
    return texts


def _tokenizer(path: Path, **kwargs) -> str:
    """A tokenizer.json with every id of the tiny model's vocabulary (128) in use."""
    from elastic_plugin.data.tokenizer import train_tokenizer

    tok = train_tokenizer(
        kwargs.pop("texts", None) or _texts(), kwargs.pop("vocab_size", 128), **kwargs
    )
    return tok.save(str(path))


def _parser() -> argparse.ArgumentParser:
    from elastic_plugin.inference.cli import register_subcommand

    parser = argparse.ArgumentParser(prog="elastic-plugin")
    register_subcommand(parser.add_subparsers(dest="command"))
    return parser


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(["generate", *argv])
    return args.func(args)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = _main(argv)
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------ rank case
def generate_case(workdir: str) -> dict:
    """1 rank: train a tiny elastic checkpoint, run the command in every mode, and the library
    calls it should equal."""
    from elastic_plugin.data.tokenizer import JsonTokenizer
    from elastic_plugin.export.extract import extract_nested
    from elastic_plugin.inference import budget_control_generate, capped_thinking_generate, generate
    from elastic_plugin.nested.model import load_nested_models
    from tests.support.export_cases import train_checkpoint

    work = Path(workdir)
    ckpt = train_checkpoint(CONFIG, work)  # budgets 1, 0.77 (per-layer), 0.4 (homogeneous)
    tok_path = _tokenizer(work / "tokenizer.json")
    meta_path = resolve_checkpoint(ckpt) / "elastic_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"] = tok_path
    meta_path.write_text(json.dumps(meta))
    tok = JsonTokenizer.from_file(tok_path)

    base = ["--ckpt", str(ckpt), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--json"]
    runs = {
        "plain": ["--budget", "0.4", "--max-new-tokens", "8"],
        "sampled": [
            "--budget",
            "0.4",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--seed",
            "3",
        ],
        "control": [
            "--think-budget",
            "0.4",
            "--answer-budget",
            "1",
            "--max-think-tokens",
            "5",
            "--max-new-tokens",
            "6",
        ],
        "capped": ["--budget", "1", "--max-think-tokens", "4", "--max-new-tokens", "5"],
    }
    out: dict = {"tokenizer": tok_path, "eod": tok.eod, "think_close": tok.think_close}
    for name, extra in runs.items():
        rc, stdout, stderr = _cli(base + extra)
        assert rc == 0, (name, stderr)
        out[name] = json.loads(stdout)
    # a stop token the greedy run emits: the run stops right after its first occurrence
    stop_id = out["plain"]["results"][0]["tokens"][2]
    out["stop_token"] = tok.backend.id_to_token(stop_id)
    rc, stdout, stderr = _cli(base + runs["plain"] + ["--stop", "<eod>", out["stop_token"]])
    assert rc == 0, stderr
    out["stopped"] = json.loads(stdout)
    rc, stdout, _ = _cli(base[:-1] + runs["control"])  # readable lines
    out["text"] = stdout
    extracted = extract_nested(ckpt, 0.4, work / "small")["out"]
    rc, stdout, stderr = _cli(["--ckpt", extracted, *base[2:], "--max-new-tokens", "8"])
    assert rc == 0, stderr
    out["extracted"] = json.loads(stdout)

    (small, _), (full, _) = load_nested_models(ckpt, [0.4, 1.0])
    prompts = [[tok.eod, *tok.tokenize(p)] for p in PROMPTS]
    control = budget_control_generate(
        small, full, prompts, tok.think_close, 5, 6, answer_stop_tokens=[tok.eod]
    )
    small_answer = budget_control_generate(
        small, small, prompts, tok.think_close, 5, 6, answer_stop_tokens=[tok.eod]
    )
    out["ref"] = {
        "prompts": prompts,
        "plain": generate(small, prompts, 8, stop_tokens=[tok.eod]).tokens,
        "sampled": generate(
            small,
            prompts,
            8,
            greedy=False,
            temperature=0.8,
            top_k=20,
            seed=3,
            stop_tokens=[tok.eod],
        ).tokens,
        "control": [t + a for t, a in zip(control.thinking, control.answers)],
        "control_thinking": control.thinking,
        "control_forced": control.think_forced,
        "small_answer": [t + a for t, a in zip(small_answer.thinking, small_answer.answers)],
        "capped": capped_thinking_generate(
            full, prompts, tok.think_close, 4, 5, answer_stop_tokens=[tok.eod]
        ).tokens,
        "params": {
            "0.4": sum(p.numel() for p in small.parameters()),
            "1": sum(p.numel() for p in full.parameters()),
        },
    }
    return out


@pytest.fixture(scope="module")
def generated(rank_pools, tmp_path_factory):
    work = tmp_path_factory.mktemp("generate")
    (result,) = rank_pools.get(1).run(f"{HERE}:generate_case", workdir=str(work))
    return result


def _check_records(
    summary: dict, expected: list[list[int]], tokenizer, eod: int, think_close: int
) -> None:
    """Tokens as expected; every derived field consistent with them."""
    from elastic_plugin.data.tasks import parse_completion

    assert [r["tokens"] for r in summary["results"]] == expected
    for record, prompt in zip(summary["results"], PROMPTS):
        tokens = record["tokens"]
        assert record["prompt"] == prompt
        assert record["prompt_tokens"] == 1 + len(tokenizer.tokenize(prompt))  # eod prefix
        assert record["generated_tokens"] == len(tokens)
        stopped = record["stop_reason"] == "stop_token"
        body = tokens[:-1] if stopped else tokens
        assert record["completion"] == tokenizer.detokenize(body)
        assert (record["thinking"], record["answer"]) == parse_completion(record["completion"])
        closed = think_close in body
        assert record["think_closed"] == closed
        assert record["think_tokens"] == (body.index(think_close) + 1 if closed else 0)
        assert record["think_tokens"] + record["answer_tokens"] == len(body)
        if stopped:
            assert tokenizer.backend.token_to_id(record["stop_token"]) == tokens[-1]
        assert record["stop_reason"] in ("stop_token", "max_new_tokens", "max_length")
    timings = summary["timings"]
    # budget control appends a forced </think> itself; the model generated the rest
    forced = (
        sum(bool(r["think_forced"]) for r in summary["results"])
        if summary["mode"] == "budget_control"
        else 0
    )
    assert timings["generated_tokens"] == sum(len(r["tokens"]) for r in summary["results"]) - forced
    assert timings["prefill_s"] > 0 and timings["decode_s"] > 0 and timings["load_s"] > 0
    assert timings["tokens_per_s"] == pytest.approx(
        timings["generated_tokens"] / (timings["prefill_s"] + timings["decode_s"])
    )


@pytest.mark.integration
def test_generate_equals_the_library_calls(generated):
    from elastic_plugin.data.tokenizer import JsonTokenizer

    r = generated
    ref = r["ref"]
    tok = JsonTokenizer.from_file(r["tokenizer"])
    eod, close = r["eod"], r["think_close"]
    assert ref["prompts"] == [[eod, *tok.tokenize(p)] for p in PROMPTS]

    plain = r["plain"]
    _check_records(plain, ref["plain"], tok, eod, close)
    assert plain["mode"] == "generate" and plain["kind"] == "elastic"
    assert plain["budgets"] == {"generate": 0.4}
    assert plain["models"]["generate"]["params"] == ref["params"]["0.4"]
    assert plain["settings"]["greedy"] is True and plain["settings"]["stop"] == ["<eod>"]
    assert all(len(t) == 8 or t[-1] == eod for t in ref["plain"])

    sampled = r["sampled"]
    _check_records(sampled, ref["sampled"], tok, eod, close)
    assert {k: sampled["settings"][k] for k in ("greedy", "temperature", "top_k", "seed")} == {
        "greedy": False,
        "temperature": 0.8,
        "top_k": 20,
        "seed": 3,
    }
    assert ref["sampled"] != ref["plain"]  # sampling really sampled

    # a stop token: the greedy tokens up to its first occurrence (or an earlier <eod>)
    stop_id = tok.backend.token_to_id(r["stop_token"])
    expected = []
    for tokens in ref["plain"]:
        cut = next((i for i, t in enumerate(tokens) if t in (stop_id, eod)), len(tokens) - 1)
        expected.append(tokens[: cut + 1])
    _check_records(r["stopped"], expected, tok, eod, close)
    assert r["stopped"]["results"][0]["stop_reason"] == "stop_token"
    assert r["stopped"]["settings"]["stop"] == ["<eod>", r["stop_token"]]

    # the extracted checkpoint of budget 0.4 (its meta carries the tokenizer): same tokens
    extracted = r["extracted"]
    assert extracted["kind"] == "extracted" and extracted["budgets"] == {"generate": None}
    _check_records(extracted, ref["plain"], tok, eod, close)
    assert extracted["models"]["generate"]["params"] == ref["params"]["0.4"]


@pytest.mark.integration
def test_budget_control_thinks_small_and_answers_with_the_answer_budget(generated):
    from elastic_plugin.data.tokenizer import JsonTokenizer

    r = generated
    ref = r["ref"]
    tok = JsonTokenizer.from_file(r["tokenizer"])
    control = r["control"]
    _check_records(control, ref["control"], tok, r["eod"], r["think_close"])
    assert control["mode"] == "budget_control"
    assert control["budgets"] == {"think": 0.4, "answer": 1.0}
    assert control["models"]["think"]["params"] == ref["params"]["0.4"]
    assert control["models"]["answer"]["params"] == ref["params"]["1"]
    assert ref["params"]["0.4"] < 0.5 * ref["params"]["1"]
    for record, thinking, forced in zip(
        control["results"], ref["control_thinking"], ref["control_forced"]
    ):
        assert record["think_tokens"] == len(thinking) <= 6 and record["think_closed"]
        assert record["think_forced"] == forced
        assert record["answer_tokens"] <= 6
    # the answer budget matters: answering with the think model gives other tokens
    assert ref["small_answer"] != ref["control"]
    phases = control["timings"]["phases"]
    assert set(phases) == {"think", "answer"} and phases["answer"]["prefill_s"] > 0
    assert (
        control["timings"]["generated_tokens"]
        == phases["think"]["generated_tokens"] + phases["answer"]["generated_tokens"]
    )

    capped = r["capped"]
    _check_records(capped, ref["capped"], tok, r["eod"], r["think_close"])
    assert capped["mode"] == "capped_thinking" and capped["budgets"] == {"generate": 1.0}
    for record in capped["results"]:
        assert record["think_tokens"] <= 5 and record["answer_tokens"] <= 5
        assert record["think_forced"] == (
            record["tokens"].index(r["think_close"]) == 4 if record["think_closed"] else False
        )
    text = r["text"]
    assert "mode budget_control" in text and "think: budget 0.4" in text
    assert "answer: budget 1" in text and "tokens/s" in text
    for record in control["results"]:
        assert f"[{control['results'].index(record) + 1}] {record['prompt']}" in text
        assert repr(record["completion"]) in text


# ------------------------------------------------------------------------------ bad input
def _fake_ckpt(path: Path, tokenizer: str | None, **meta_changes) -> Path:
    """A checkpoint's metadata only: every input check happens before loading."""
    from elastic_plugin.models.config import load_config
    from tests.support.elastic_cases import ELASTIC

    path.mkdir(parents=True)
    small = {
        "embedding": 64,
        "ffn": 128,
        "shared_ffn": 64,
        "attention_heads": 2,
        "mamba_heads": 4,
        "mamba_head_dim": 8,
        "experts": 4,
    }
    meta = {
        "kind": "elastic",
        "layout": {"tp": 1, "pp": 1, "ep": 1},
        "config": load_config(CONFIG).to_dict() | {"elastic": ELASTIC},
        "elastic": {
            "budgets": [1.0, 0.77, 0.4],
            "choices": {"1": {**small, "embedding": 128}, "0.77": small, "0.4": small},
        },
    }
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    meta.update(meta_changes)
    (path / "elastic_meta.json").write_text(json.dumps(meta))
    (path / "metadata.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    root = tmp_path_factory.mktemp("fakes")
    tok = _tokenizer(root / "tokenizer.json")
    no_think = _tokenizer(
        root / "no_think.json", vocab_size=None, special_tokens=("<pad>", "<eod>", "<unk>")
    )
    too_big = _tokenizer(
        root / "big.json", vocab_size=None, texts=["".join(chr(0x100 + i) for i in range(150))]
    )
    incomplete = root / "incomplete"
    incomplete.mkdir()
    (incomplete / "metadata.json").write_text("{}")
    (root / "blank.txt").write_text("\n  \n")
    (root / "prompts.txt").write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    return {
        "root": root,
        "tokenizer": tok,
        "no_think": no_think,
        "too_big": too_big,
        "good": _fake_ckpt(root / "good", tok),
        "extracted": _fake_ckpt(root / "extracted", tok, kind="extracted"),
        "hetero": _fake_ckpt(
            root / "hetero",
            tok,
            elastic={
                "budgets": [1.0, 0.5],
                "choices": {"1": {"ffn": [256, 256]}, "0.5": {"ffn": [256, 128]}},
            },
        ),
        "untokenized": _fake_ckpt(root / "untokenized", None),
        "lost_tokenizer": _fake_ckpt(root / "lost", str(root / "gone" / "tokenizer.json")),
        "incomplete": incomplete,
    }


@pytest.fixture
def no_loading(monkeypatch):
    import elastic_plugin.inference.command as command

    def refuse(*_args, **_kwargs):
        raise AssertionError("bad input reached the model loading")

    monkeypatch.setattr(command, "run_plan", refuse)


def test_bad_input_exits_2_with_clear_messages(fakes, no_loading, capsys):
    f = fakes
    good, root = str(f["good"]), f["root"]
    cases = [
        (["--ckpt", str(root / "nope")], (), "no such checkpoint directory"),
        (["--ckpt", str(f["incomplete"])], (), "not a complete checkpoint"),
        (
            [],
            ("--budget",),
            f"{good} is an elastic checkpoint: choose a trained budget with --budget B "
            "(or --think-budget B1 --answer-budget B2); trained budgets: 1, 0.77, 0.4",
        ),
        (["--budget", "0.6"], (), "--budget 0.6 was not trained; trained budgets: 1, 0.77, 0.4"),
        (["--budget", "nan"], (), "--budget nan: not a number"),
        (
            ["--think-budget", "0.5", "--answer-budget", "1"],
            (),
            "--think-budget 0.5 was not trained; trained budgets: 1, 0.77, 0.4",
        ),
        (
            ["--think-budget", "0.4", "--answer-budget", "0.3"],
            (),
            "--answer-budget 0.3 was not trained",
        ),
        (["--think-budget", "0.4"], (), "--think-budget needs --answer-budget"),
        (["--answer-budget", "1"], (), "--answer-budget needs --think-budget"),
        (
            ["--budget", "0.4", "--think-budget", "0.4", "--answer-budget", "1"],
            (),
            "--budget and --think-budget/--answer-budget exclude each other",
        ),
        (
            ["--ckpt", str(f["extracted"]), "--budget", "0.4"],
            (),
            "--budget 0.4: --ckpt " + str(f["extracted"]) + " is a 'extracted' checkpoint holding "
            "one model; budget flags (--budget, --think-budget, --answer-budget) need an elastic",
        ),
        (
            ["--ckpt", str(f["extracted"]), "--think-budget", "0.4", "--answer-budget", "1"],
            "--ckpt",
            "--think-budget 0.4: --ckpt",
        ),
        (
            ["--ckpt", str(f["hetero"]), "--budget", "0.5"],
            (),
            "--budget 0.5: the nested model has per-layer sizes (ffn=[256, 128])",
        ),
        (["--ckpt", str(f["untokenized"])], (), "records no tokenizer; pass --tokenizer PATH"),
        (
            ["--ckpt", str(f["lost_tokenizer"])],
            (),
            "which is not readable here; pass --tokenizer PATH",
        ),
        (
            ["--tokenizer", str(root / "nope.json")],
            (),
            f"--tokenizer {root / 'nope.json'}: no such file",
        ),
        (["--tokenizer", f["too_big"]], (), "more than the model's vocabulary (128)"),
        (
            ["--tokenizer", f["no_think"], "--max-think-tokens", "4"],
            (),
            "--max-think-tokens: budget control needs a </think> token",
        ),
        (
            ["--stop", "<nope>"],
            (),
            f"--stop '<nope>': not a token of the tokenizer "
            f"{f['tokenizer']}; its special tokens: {SPECIALS}",
        ),
        (["--prompt", ""], (), "--prompt 1 is empty"),
        (
            ["--prompt", "1+1=\u00e9\u00e9\u4e00"],
            (),
            f"--prompt 1 has characters the tokenizer {f['tokenizer']} cannot represent: "
            "'\u00e9', '\u4e00' (they would become its unknown token or vanish); rephrase the "
            "prompt, or pass --allow-unknown-chars",
        ),
        (["--prompt", "1+1=", "--prompt", "  "], (), "--prompt 2 is empty"),
        (
            ["--prompts-file", str(root / "missing.txt")],
            (),
            f"--prompts-file {root / 'missing.txt'}: no such file",
        ),
        (["--prompts-file", str(root / "blank.txt")], (), "has no prompts"),
        (
            ["--prompt", "1" * 300],
            (),
            "--prompt 1 has 301 tokens with the tokenizer's special tokens; "
            "the model's max_sequence_length is 256, so a prompt may have at most 255 tokens",
        ),
        (
            ["--prompt", "1" * 254, "--think-budget", "0.4", "--answer-budget", "1"],
            (),
            "--prompt 1 has 255 tokens with the tokenizer's special tokens; the model's "
            "max_sequence_length is "
            "256, so a prompt may have at most 253 tokens (budget control keeps 2 positions",
        ),
        (["--max-new-tokens", "0"], (), "--max-new-tokens 0: must be >= 1"),
        (["--max-think-tokens", "0"], (), "--max-think-tokens 0: must be >= 1"),
        (
            ["--temperature", "0"],
            (),
            "--temperature 0.0: must be a number > 0 (for greedy decoding pass --greedy",
        ),
        (["--temperature", "-1"], (), "--temperature -1.0: must be a number > 0"),
        (["--greedy", "--temperature", "0.5"], (), "--greedy and --temperature exclude each other"),
        (["--seed", "3"], (), "--seed 3: goes with sampling"),
        (["--top-k", "0"], (), "--top-k 0: must be in [1, 128]"),
        (["--top-p", "1.5"], (), "--top-p 1.5: must be in (0, 1]"),
    ]
    budget_flags = {"--budget", "--think-budget", "--answer-budget"}
    for extra, drop, message in cases:
        defaults = {"--ckpt": good, "--budget": "0.4", "--prompt": PROMPTS[0]}
        argv = list(extra)
        for flag, value in defaults.items():
            if flag in drop or flag in extra or (flag == "--budget" and budget_flags & set(extra)):
                continue
            if flag == "--prompt" and "--prompts-file" in extra:
                continue
            argv += [flag, value]
        assert _main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("elastic-plugin generate: error: ") and message in err, (argv, err)


def test_flags_resolve_to_a_plan(fakes):
    """The accepted inputs: modes, budgets (matched to the trained ones), eod-prefixed prompt ids
    equal to the tokenizer's, stop ids, sampling settings."""
    from elastic_plugin.data.tokenizer import JsonTokenizer
    from elastic_plugin.inference.request import plan_generation

    f = fakes
    tok = JsonTokenizer.from_file(f["tokenizer"])

    def plan(*argv):
        return plan_generation(_parser().parse_args(["generate", *argv]))

    p = plan(
        "--ckpt", str(f["good"]), "--budget", "0.4", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]
    )
    assert (p.mode, p.budgets, p.kind) == ("generate", [0.4], "elastic")
    assert p.prompt_ids == [[tok.eod, *tok.tokenize(t)] for t in PROMPTS]
    assert p.stop_tokens == ["<eod>"] and p.stop_ids == [tok.eod] and p.eos == tok.eod
    assert p.sampling == {"greedy": True, "temperature": 1.0, "top_k": None, "top_p": None}
    assert p.max_new_tokens == 64 and p.max_think_tokens is None and p.max_sequence_length == 256

    p = plan(
        "--ckpt",
        str(f["good"]),
        "--budget",
        "0.7700000000001",
        "--think-cap",
        "7",
        "--prompts-file",
        str(f["root"] / "prompts.txt"),
        "--stop",
        "</think>",
        "=",
        "--stop",
        "<eod>",
        "--top-p",
        "0.9",
        "--seed",
        "5",
    )
    assert (p.mode, p.budgets, p.max_think_tokens) == ("capped_thinking", [0.77], 7)
    assert p.prompts == PROMPTS  # the blank line is skipped
    assert p.stop_ids == [tok.think_close, tok.backend.token_to_id("="), tok.eod]
    assert p.sampling == {"greedy": False, "temperature": 1.0, "top_k": None, "top_p": 0.9}
    assert p.seed == 5

    p = plan(
        "--ckpt",
        str(f["good"]),
        "--think-budget",
        "0.4",
        "--answer-budget",
        "1",
        "--prompt",
        "1" * 252,
        "--tokenizer",
        f["tokenizer"],
    )
    assert (p.mode, p.budgets, p.think_close) == ("budget_control", [0.4, 1.0], tok.think_close)
    assert len(p.prompt_ids[0]) == 253  # the longest prompt budget control takes

    p = plan(
        "--ckpt", str(f["good"]), "--budget", "1", "--prompt", "1+\u00e9", "--allow-unknown-chars"
    )
    unk = tok.backend.token_to_id("<unk>")
    assert p.prompt_ids == [[tok.eod, *tok.tokenize("1+"), unk]]  # kept as asked, as <unk>

    p = plan("--ckpt", str(f["extracted"]), "--prompt", "1" * 254)
    assert (p.mode, p.budgets, p.kind) == ("generate", [None], "extracted")
    assert len(p.prompt_ids[0]) == 255  # the longest prompt plain generation takes

    with pytest.raises(SystemExit):  # argparse: exactly one prompt source
        _parser().parse_args(["generate", "--ckpt", "x", "--prompt", "a", "--prompts-file", "y"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["generate", "--ckpt", "x"])


@pytest.mark.integration
def test_bad_input_in_a_fresh_process_imports_no_megatron(fakes):
    import subprocess
    import sys

    good = str(fakes["good"])
    code = (
        "import argparse, sys\n"
        "from elastic_plugin.inference.cli import register_subcommand\n"
        "p = argparse.ArgumentParser(); register_subcommand(p.add_subparsers())\n"
        "for extra in (['--budget', '0.5'], ['--budget', '0.4', '--stop', 'zz'],\n"
        "              ['--budget', '0.4', '--prompt', '1' * 300]):\n"
        f"    a = p.parse_args(['generate', '--ckpt', {good!r}, '--prompt', '1+1=', *extra])\n"
        "    print(a.func(a))\n"
        "print('megatron' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "2", "2", "False"], proc
    assert "--budget 0.5 was not trained" in proc.stderr
    assert "--stop 'zz': not a token" in proc.stderr
    assert "--prompt 2 has 301 tokens" in proc.stderr
