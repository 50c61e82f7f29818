"""The demo evaluation: completions scored by reasoning-gym (answer after ``</think>``, token
counts), a setting run on a tiny model against plain generation, and bad input for
``elastic-plugin evaluate`` (the end-to-end report runs in tests/test_elastic_cli.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")


@pytest.fixture(scope="module")
def problems():
    from elastic_plugin.data.tasks import generate_examples
    from elastic_plugin.data.tokenizer import train_tokenizer
    from elastic_plugin.evaluation.problems import Problems

    examples, _ = generate_examples("products", num=6, seed=3)
    tokenizer = train_tokenizer([e.text for e in examples] + ["0123456789*=,"])
    prompts = [[tokenizer.eod, *tokenizer.tokenize(e.prompt)] for e in examples]
    return Problems(examples, prompts, tokenizer.eod, tokenizer.think_close, tokenizer)


def test_completions_are_scored_on_the_answer_with_token_counts(problems):
    from elastic_plugin.evaluation.problems import score_completions

    tok = problems.tokenizer
    e0, e1, e2 = problems.examples[:3]
    right = (
        tok.tokenize(f"<think>{e0.thinking}</think>{e0.answer}") + [tok.eod] + tok.tokenize("99")
    )
    wrong = tok.tokenize(f"<think>{e1.thinking}</think>{int(e1.answer) + 1}")
    unclosed = tok.tokenize(f"<think>{e2.thinking},{e2.answer}")
    scored = score_completions(problems.slice(0, 3), [right, wrong, unclosed])
    assert scored.correct == [True, False, False]
    think0 = len(tok.tokenize(f"<think>{e0.thinking}</think>"))
    assert scored.think_tokens[0] == think0
    assert scored.answer_tokens[0] == len(tok.tokenize(e0.answer))  # stops at <eod>
    assert scored.think_tokens[2] == len(unclosed) and scored.answer_tokens[2] == 0
    assert scored.answers[0] == e0.answer and scored.accuracy == pytest.approx(1 / 3)


def test_a_setting_runs_what_generate_runs(problems):
    """On a tiny random model (its vocabulary holds the tokenizer's ids): the single-model
    setting scores exactly plain greedy generation; capped thinking never thinks longer than
    the cap + the forced </think>; latency fields are measured."""
    from elastic_plugin.evaluation.problems import score_completions
    from elastic_plugin.evaluation.settings import (
        MAX_ANSWER_TOKENS,
        MAX_THINK_TOKENS,
        Setting,
        run_setting,
    )
    from elastic_plugin.inference import generate
    from tests.support.inference_cases import tiny_inference_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = tiny_inference_model(seed=2)
        models = {(1.0, "fp32"): model}
        single = run_setting(
            Setting("full", 1.0, 1.0), models, problems, batch_size=4, latency_problems=2
        )
        plain = generate(
            model,
            problems.prompts,
            MAX_THINK_TOKENS + MAX_ANSWER_TOKENS,
            stop_tokens=[problems.eod],
        )
        assert single["accuracy"] == score_completions(problems, plain.tokens).accuracy
        assert single["kind"] == "single" and single["problems"] == 6
        assert single["latency_ms_batch1"] > 0 and single["latency_ms_batched"] > 0
        lengths = [len(p) for p in problems.prompts]
        assert single["prompt_tokens_mean"] == pytest.approx(sum(lengths) / len(lengths))
        capped = run_setting(Setting("capped", 1.0, 1.0, cap=3), models, problems, 4, 0)
        assert capped["kind"] == "capped" and capped["think_tokens_mean"] <= 4
        assert capped["latency_ms_batch1"] is None
        # interleaved batch-1 latency: every setting times the same problems, in rotating order
        calls = []
        import elastic_plugin.evaluation.settings as settings_module

        original = settings_module._completions

        def recording(setting, models_, problems_):
            calls.append((setting.name, len(problems_)))
            return original(setting, models_, problems_)

        settings_module._completions = recording
        try:
            latency = settings_module.interleaved_latencies(
                [Setting("full", 1.0, 1.0), Setting("capped", 1.0, 1.0, cap=3)], models, problems, 3
            )
        finally:
            settings_module._completions = original
        assert set(latency) == {"full", "capped"}
        assert all(
            v["latency_ms_batch1"] > 0 and v["latency_ms_batch1_mean"] > 0 for v in latency.values()
        )
        timed = calls[2:]  # after one warm-up call per setting
        assert len(timed) == 6 and all(n == 1 for _, n in timed)
        assert [name for name, _ in timed] == ["full", "capped", "capped", "full", "full", "capped"]
    finally:
        torch.set_num_threads(threads)


def test_budget_control_target_counts_the_switch_arithmetic():
    """The targets' ``arithmetic_ratio``: the small model reads prompt + thinking, the answering
    model re-reads both and answers; the reference reads prompt, thinks and answers once. With
    the demo's counts and a 0.25 active ratio the control does 22% more arithmetic (why it can
    only win where a decode step is bound by reading weights)."""
    from elastic_plugin.evaluation.report import _targets

    def budget(b: float, active: int) -> dict:
        return {"budget": b, "params": {"active": active}, "accuracy": {"fp32": 0.5}}

    def setting(name, kind, think, answer, think_tokens, ms):
        return {
            "name": name,
            "kind": kind,
            "think": think,
            "answer": answer,
            "accuracy": 0.5,
            "think_tokens_mean": think_tokens,
            "answer_tokens_mean": 4.0,
            "prompt_tokens_mean": 8.0,
            "latency_ms_batch1": ms,
            "latency_ms_batched": ms / 10,
        }

    rows = [budget(1.0, 400), budget(0.4, 100)]
    control = [
        setting("full", "single", 1.0, 1.0, 20.0, 30.0),
        setting("0.4->1", "elastic", 0.4, 1.0, 20.0, 20.0),
    ]
    target = _targets(rows, control)["budget_control"]
    assert target["arithmetic_ratio"] == pytest.approx((28 * 1.25 + 4) / 32)
    assert target["speedup_if_step_time_tracked_active_params"] == pytest.approx(24 / 9)
    assert target["speedup_batch1"] == pytest.approx(1.5) and target["met"]
    control[1]["think_tokens_mean"] = 10.0  # thinking less: less to re-read
    assert _targets(rows, control)["budget_control"]["arithmetic_ratio"] == pytest.approx(
        (18 * 1.25 + 4) / 32
    )


def test_evaluate_rejects_bad_input_before_loading(tmp_path, monkeypatch, capsys):
    import elastic_plugin.evaluation.models as models
    from elastic_plugin.cli import main
    from tests.test_elastic_extract import _fake_ckpt

    def refuse(*_args, **_kwargs):
        raise AssertionError("bad input reached the work")

    monkeypatch.setattr(models, "load_budget_models", refuse)
    no_data = _fake_ckpt(tmp_path / "no_data")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "heldout.jsonl").write_text("")
    good = _fake_ckpt(tmp_path / "good", data={"prepared": str(tmp_path / "data")})
    (tmp_path / "exports").mkdir()
    out = tmp_path / "out"
    for argv, message in (
        (["--ckpt", str(tmp_path / "nope")], "no such checkpoint directory"),
        (["--ckpt", str(no_data)], "is not a prepared task directory"),
        (["--ckpt", str(good), "--num-problems", "0"], "--num-problems=0: must be an int >= 1"),
        (["--ckpt", str(good), "--batch-size", "-2"], "--batch-size=-2"),
        (["--ckpt", str(good), "--exports", str(tmp_path / "exports")], "no exports.json"),
    ):
        assert main(["evaluate", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("elastic-plugin evaluate: error:") and message in err, err
    assert not out.exists()
