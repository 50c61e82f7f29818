"""``examples/pretrain_elastic.py`` end to end: Megatron-LM's own loop (``megatron.training.
pretrain``) under torchrun on CPU + gloo, with ``elastic_plugin.compat.megatron_training``.

Every layout (one rank, TP=2 + SP, EP=2, DP=2 with the distributed optimizer) trains the elastic
student on Megatron's mock data, logs the per-budget losses ``forward_step`` reports, evaluates
every budget and writes Megatron-LM checkpoints; a run stopped at iteration 2 and resumed with
``--load`` logs the same losses for iterations 3-4 as an uninterrupted run; bad input fails
before the model is built, naming the flag. Each launch costs ~20-60 s on 2 cores.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elastic_plugin.elastic.args import axis_flag
from tests.support.elastic_cases import ELASTIC

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny.yaml"
PRETRAIN = ROOT / "examples" / "pretrain_elastic.py"
_VENV_TORCHRUN = Path(sys.executable).with_name("torchrun")
TORCHRUN = (
    [str(_VENV_TORCHRUN)]
    if _VENV_TORCHRUN.exists()
    else [sys.executable, "-m", "torch.distributed.run"]
)
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",  # CPU + gloo even on a GPU machine
    "PYTHONPATH": str(ROOT),
}
TIMEOUT = 900
BUDGETS = ("1", "0.77", "0.4")  # the labels Megatron's log uses for 1.0 0.77 0.4
ITERS = 4
# The tiny model's elastic sizes (elastic_cases.ELASTIC: every axis divides by TP=2 and EP=2).
ELASTIC_FLAGS = [
    "--elastic-budgets",
    "1.0",
    "0.77",
    "0.4",
    "--elastic-router-hidden-size",
    str(ELASTIC["router"]["hidden_size"]),
    *(
        part
        for axis, sizes in ELASTIC["sizes"].items()
        for part in (axis_flag(axis), *map(str, sizes))
    ),
]
# 2 micro-batches of 2 per iteration on one rank (1 under DP=2); --eval-iters 3 evaluates every
# budget at least once per evaluation (forward_step evaluates one budget per micro-batch, in turn)
TRAIN_FLAGS = [
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--distributed-backend",
    "gloo",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--eval-interval",
    "2",
    "--eval-iters",
    "3",
    "--save-interval",
    "2",
]
LAYOUTS = {
    "one-rank": (1, []),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),  # world 2: DP=2 for the dense layers
    # the teacher inside the pipeline schedule (wrapped train_step: both hidden states per p2p)
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    # context parallelism: each rank holds two mirrored chunks of every sequence
    "cp2": (2, ["--context-parallel-size", "2"]),
}
# Layouts that see the same micro-batches and budgets log the same losses (up to reduction
# order): TP and CP split a micro-batch's computation only; EP=2 on 2 ranks has DP=2's data split.
SAME_LOSSES = {"tp2-sp": "one-rank", "ep2": "dp2-distopt", "pp2": "one-rank", "cp2": "one-rank"}


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr of every rank, interleaved
    seconds: float

    def tail(self, n: int = 6000) -> str:
        return self.output[-n:]


def torchrun(nproc: int, *args: str, timeout: int = TIMEOUT, script: Path = PRETRAIN) -> Run:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), str(script), *args]
    began = time.perf_counter()
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=ENV,
    )
    return Run(proc.returncode, proc.stdout, time.perf_counter() - began)


# ------------------------------------------------------------------------------ Megatron's log
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|(.*)$", re.M)
_VALIDATION = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \|(.*)$", re.M)


def _fields(text: str) -> dict[str, float]:
    out = {}
    for part in text.split("|"):
        name, sep, value = part.rpartition(":")
        if sep:
            try:
                out[name.strip()] = float(value)
            except ValueError:
                pass
    return out


def train_log(output: str) -> dict[int, dict[str, float]]:
    """Iteration -> the values Megatron logs for it (``kd loss``, ``budget loss``, ...)."""
    return {int(m.group(1)): _fields(m.group(3)) for m in _ITERATION.finditer(output)}


def per_iteration(log: dict[int, dict[str, float]], key: str) -> dict[int, float]:
    """Each iteration's own ``key`` (``--log-interval 1``). Megatron-LM keeps its loss
    accumulators after the first iteration a run logs (``training_log(is_first_iteration)``), so
    the second line of every run shows the mean of its first two iterations: undone here."""
    its = sorted(log)
    out = {it: log[it][key] for it in its}
    if len(its) > 1:
        out[its[1]] = 2 * log[its[1]][key] - log[its[0]][key]
    return out


def checkpoint_tensors(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Megatron-LM ``torch_dist`` checkpoint directory, by flattened key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, scratch)
    flat: dict[str, torch.Tensor] = {}

    def walk(value, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}/{i}")
        elif torch.is_tensor(value):
            flat[key] = value

    walk(torch.load(scratch, weights_only=False), "")
    scratch.unlink()
    return flat


def model_tensors(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a Megatron-LM checkpoint (no optimizer or RNG state)."""
    return {
        key: value
        for key, value in checkpoint_tensors(path, scratch).items()
        if not key.startswith(("/optimizer", "/rng_state", "/common_state"))
        and "_extra_state" not in key
        and value.is_floating_point()
    }


_ELASTIC = re.compile(r"^ elastic \| iteration\s+(\d+) \|(.*)$", re.M)


def elastic_log(output: str) -> dict[int, dict[str, float]]:
    """Iteration -> the numbers of its ``elastic |`` line (budgets not drawn are absent)."""
    return {int(m.group(1)): _fields(m.group(2)) for m in _ELASTIC.finditer(output)}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two layouts' weights after the same training: equal up to reduction order. Adam turns
    that order's noise in near-zero gradients into steps of up to the learning rate, so a few
    entries differ by up to ~1e-4 (measured: max 8.6e-5, mean 1e-8 after 4 iterations at lr
    1e-3); weights in another order (a layout error) differ in every entry, by about |w|."""
    assert set(a) == set(b) and len(a) > 10
    for key, value in a.items():
        diff = (value - b[key]).abs()
        assert diff.mean().item() < 1e-6 and diff.max().item() < 1e-3, (key, diff.max().item())


def eval_log(output: str) -> list[tuple[int, dict[str, float]]]:
    """(iteration, {budget label: LM loss}) of every evaluation during training."""
    evals = []
    for m in _VALIDATION.finditer(output):
        if m.group(2):  # the final validation / test set evaluations
            continue
        fields = _fields(m.group(3))
        evals.append((int(m.group(1)), {b: fields[f"lm loss {b} value"] for b in BUDGETS}))
    return evals


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pretrain_elastic")


@pytest.fixture(scope="module")
def reordered(rank_pools, workdir) -> Path:
    """A random tiny model saved as importance-reordered (examples/configs/tiny.yaml)."""
    path = workdir / "reordered"
    rank_pools.get(1).run(
        "tests.support.elastic_cases:write_init_checkpoint_at",
        config_path=str(TINY),
        path=str(path),
    )
    return path


@pytest.fixture(scope="module")
def base_args(reordered) -> list[str]:
    """The checkpoint's architecture flags (as a user gets them) + the run's flags."""
    proc = subprocess.run(
        [sys.executable, str(PRETRAIN), "--print-arch-flags", "--elastic-ckpt", str(reordered)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    arch = shlex.split(proc.stdout)
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta

    vocab = read_checkpoint_meta(reordered)["config"]["model"]["vocab_size"]
    return [
        *arch,
        "--elastic-ckpt",
        str(reordered),
        *ELASTIC_FLAGS,
        *TRAIN_FLAGS,
        "--vocab-size",
        str(vocab),
    ]


class Runs:
    """Launches cached for the module: the resume test reuses the one-rank layout run."""

    def __init__(self, workdir: Path, base_args: list[str]) -> None:
        self.workdir, self.base_args, self._done = workdir, base_args, {}

    def layout(self, name: str) -> tuple[Run, Path]:
        if name not in self._done:
            nproc, flags = LAYOUTS[name]
            save = self.workdir / f"save-{name}"
            run = torchrun(
                nproc, *self.base_args, *flags, "--train-iters", str(ITERS), "--save", str(save)
            )
            self._done[name] = (run, save)
        return self._done[name]


@pytest.fixture(scope="module")
def runs(workdir, base_args) -> Runs:
    return Runs(workdir, base_args)


# ------------------------------------------------------------------------------ the tests
@pytest.mark.integration
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrain_elastic_trains_and_checkpoints_in_every_layout(runs, layout):
    run, save = runs.layout(layout)
    print(f"{layout}: {run.seconds:.1f} s")
    assert run.returncode == 0, run.tail()
    assert "pretrain_elastic.py: error" not in run.output
    log = train_log(run.output)
    assert sorted(log) == list(range(1, ITERS + 1)), run.tail()
    for it, fields in log.items():
        for key in ("kd loss", "budget loss", "grad norm"):
            assert math.isfinite(fields[key]), (it, key, fields)
        assert fields["kd loss"] >= 0 and fields["number of nan iterations"] == 0
    # the student starts as the teacher (same checkpoint): KD loss is small but not zero
    # (narrow budgets differ from the full teacher)
    assert 0 <= log[1]["kd loss"] < 1.0
    evals = eval_log(run.output)
    assert [it for it, _ in evals] == [2, 4], run.tail()
    for _, losses in evals:  # every budget evaluated: a finite LM loss near ln(vocab)
        assert all(math.isfinite(v) and 0 < v < 10 for v in losses.values()), losses
    assert (save / f"iter_{ITERS:07d}").is_dir()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    # the elastic line after Megatron's: per-budget losses, choices, throughput, memory
    elastic = elastic_log(run.output)
    assert sorted(elastic) == list(range(1, ITERS + 1)), run.tail()
    print(next(line for line in run.output.splitlines() if line.startswith(" elastic |")))
    kd_all = per_iteration(log, "kd loss")  # Megatron's: every budget drawn, token-weighted
    for it, fields in elastic.items():
        drawn = [fields[f"kd loss {b}"] for b in BUDGETS if f"kd loss {b}" in fields]
        assert drawn and min(drawn) - 1e-6 <= kd_all[it] <= max(drawn) + 1e-6, (it, drawn)
        assert fields["tokens/s"] > 0 and fields["TFLOP/s/rank"] > 0
        assert 0.05 < fields["peak memory/rank (GiB)"] < 64
    assert all(f"choice {b}:" in run.output for b in BUDGETS)
    if layout in SAME_LOSSES:
        other, _ = runs.layout(SAME_LOSSES[layout])
        assert other.returncode == 0, other.tail()
        for key in ("kd loss", "budget loss"):
            got, want = per_iteration(log, key), per_iteration(train_log(other.output), key)
            print(f"{key}: {layout} {got} vs {SAME_LOSSES[layout]} {want}")
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7), key
        assert evals == [
            (it, pytest.approx(losses, rel=1e-4)) for it, losses in eval_log(other.output)
        ]
        # canonical order on disk: the same weights whatever layout wrote them (in memory, TP
        # and EP hold the ranked FFN neurons and experts strided)
        _, other_save = runs.layout(SAME_LOSSES[layout])
        mine, theirs = (
            model_tensors(d / f"iter_{ITERS:07d}", runs.workdir / f"{layout}-{i}.pt")
            for i, d in enumerate((save, other_save))
        )
        assert_same_weights(mine, theirs)


@pytest.mark.integration
def test_resume_from_megatron_checkpoint_matches_an_uninterrupted_run(runs, workdir, base_args):
    """Stop at iteration 2 (``--exit-interval 2``, which saves), resume with ``--load``: the
    losses of iterations 3-4 equal the uninterrupted run's (one rank, same seed)."""
    reference, _ = runs.layout("one-rank")
    assert reference.returncode == 0, reference.tail()
    save = workdir / "save-resume"
    args = [*base_args, "--train-iters", str(ITERS), "--save", str(save)]
    first = torchrun(1, *args, "--exit-interval", "2")
    assert first.returncode == 0, first.tail()
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(train_log(first.output)) == [1, 2]
    second = torchrun(1, *args, "--load", str(save))
    assert second.returncode == 0, second.tail()
    assert "successfully loaded checkpoint" in second.output, second.tail()
    ref, stopped, resumed = (train_log(r.output) for r in (reference, first, second))
    assert sorted(resumed) == [3, 4], second.tail()
    print(f"resume: first {first.seconds:.1f} s, second {second.seconds:.1f} s")
    for it in (3, 4):
        assert resumed[it]["consumed samples"] == ref[it]["consumed samples"]
        assert resumed[it]["learning rate"] == pytest.approx(ref[it]["learning rate"], rel=1e-6)
        assert resumed[it]["grad norm"] == ref[it]["grad norm"]  # printed with 3 decimals
    for key in ("kd loss", "budget loss"):
        want = per_iteration(ref, key)
        assert per_iteration(stopped, key) == pytest.approx({1: want[1], 2: want[2]}, rel=1e-5)
        got = per_iteration(resumed, key)
        for it in (3, 4):
            print(f"iteration {it} {key}: resumed {got[it]!r}, uninterrupted {want[it]!r}")
            assert got[it] == pytest.approx(want[it], rel=1e-5), (it, key)
    # the checkpoints both runs wrote at iteration 4 hold identical tensors: weights, router,
    # expert biases, Adam moments (not the RNG states: this model draws nothing from them)
    _, ref_save = runs.layout("one-rank")
    a = checkpoint_tensors(ref_save / f"iter_{ITERS:07d}", workdir / "a.pt")
    b = checkpoint_tensors(save / f"iter_{ITERS:07d}", workdir / "b.pt")
    assert set(a) == set(b) and len(a) > 100
    differ = [k for k in a if not k.startswith("/rng_state") and not torch.equal(a[k], b[k])]
    assert differ == []


def elastic_train_per_budget(out: Path) -> dict[str, dict[int, dict[str, float]]]:
    """``elastic-train``'s per-budget KD and budget loss per iteration (elastic_metrics.jsonl)."""
    import json

    rows = [json.loads(line) for line in (out / "elastic_metrics.jsonl").read_text().splitlines()]
    out_: dict[str, dict[int, dict[str, float]]] = {"kd loss": {}, "budget loss": {}}
    for row in rows:
        if "train_loss" in row:
            out_["kd loss"][row["iteration"]] = row["train_loss"]
            out_["budget loss"][row["iteration"]] = row["budget_loss"]
    return out_


def megatron_per_budget(output: str) -> dict[str, dict[int, dict[str, float]]]:
    """The same from the ``elastic |`` lines of a ``--log-interval 1`` run."""
    out: dict[str, dict[int, dict[str, float]]] = {"kd loss": {}, "budget loss": {}}
    for it, fields in elastic_log(output).items():
        for key in out:
            out[key][it] = {b: fields[f"{key} {b}"] for b in BUDGETS if f"{key} {b}" in fields}
    return out


@pytest.mark.integration
def test_megatron_lm_loop_and_elastic_train_train_the_same_run(workdir, reordered):
    """The two entry points on the same indexed data, seed, schedule and layout (one rank):
    ``elastic-train --dataloader-type single`` and ``pretrain_elastic.py`` (Megatron-LM's
    default loader) read the same batches, draw the same budgets and log the same per-budget
    KD and budget losses every iteration."""
    from elastic_plugin.data.prepare import prepare_dataset

    data = prepare_dataset(workdir / "data", num_train=400, num_valid=40, seed=3, progress=False)
    iters, common = 6, ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"]
    schedule = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2"]
    schedule += ["--train-iters", str(iters), "--log-interval", "1", "--eval-interval", str(iters)]
    schedule += ["--eval-iters", "2"]
    out = workdir / "elastic-train"
    ours = run_cli(
        "elastic-train", "--ckpt", str(reordered), "--out", str(out), "--no-progress",
        "--data-path", data.train_prefix, "--valid-data-path", data.valid_prefix,
        "--tokenizer", str(data.tokenizer_path), "--dataloader-type", "single",
        *common, *schedule, *ELASTIC_FLAGS,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    arch = subprocess.run(
        [sys.executable, str(PRETRAIN), "--print-arch-flags", "--elastic-ckpt", str(reordered)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV,
    )  # fmt: skip
    megatron = torchrun(
        1, *shlex.split(arch.stdout), "--elastic-ckpt", str(reordered), *ELASTIC_FLAGS,
        "--train-data-path", data.train_prefix, "--valid-data-path", data.valid_prefix,
        "--test-data-path", data.valid_prefix, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--distributed-backend", "gloo", *common, *schedule,
        # elastic-train's optimizer and schedule in Megatron-LM's flags
        "--lr-decay-style", "cosine", "--weight-decay", "0.0", "--clip-grad", "1.0",
        "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--seed", "1234",
        "--dataloader-type", "single",
    )  # fmt: skip
    assert megatron.returncode == 0, megatron.tail()
    want, got = elastic_train_per_budget(out), megatron_per_budget(megatron.output)
    assert sorted(got["kd loss"]) == list(range(1, iters + 1)), megatron.tail()
    for key in ("kd loss", "budget loss"):
        for it in range(1, iters + 1):
            print(f"iteration {it} {key}: Megatron-LM {got[key][it]} elastic-train {want[key][it]}")
            assert set(got[key][it]) == set(want[key][it]), (it, key)  # the same budgets drawn
            assert got[key][it] == pytest.approx(want[key][it], rel=1e-4, abs=1e-7), (it, key)


def readme_elastic_lines() -> str:
    """The README's "Inside your Megatron-LM pipeline" code block, as a user copies it."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- elastic-lines:begin -->", 1)[1].split("<!-- elastic-lines:end -->")[0]
    code = block.strip().removeprefix("```python").removesuffix("```")
    assert "elastic.wrap_model_provider(model_provider)" in code
    return code.strip("\n")


def with_elastic_lines(script: str, lines: str) -> str:
    """``script`` with ``lines`` at its ``# <elastic lines>`` marker, at the marker's indent."""
    marker = "# <elastic lines>"
    (row,) = [row for row in script.splitlines() if row.strip() == marker]
    indent = row[: len(row) - len(row.lstrip())]
    body = "\n".join(indent + line if line.strip() else "" for line in lines.splitlines())
    return script.replace(row, body, 1)


@pytest.mark.integration
def test_readme_lines_make_a_users_megatron_lm_script_train_the_same_run(runs, workdir, base_args):
    """README's lines inserted into a minimal ``pretrain_mamba.py``-style script (its own model
    provider from Megatron's flags, its own ``get_batch``) train the run ``pretrain_elastic.py``
    trains: the same per-iteration losses, and a ``--save`` our tools verify."""
    source = (ROOT / "tests" / "fixtures" / "megatron_lm_user_script.py").read_text()
    script = workdir / "user_pretrain_mamba.py"
    script.write_text(with_elastic_lines(source, readme_elastic_lines()))
    save = workdir / "save-user-script"
    # Megatron-LM's own default needs APEX's CUDA extension (the example's provider turns it off)
    plain = [*base_args, "--no-gradient-accumulation-fusion"]
    run = torchrun(1, *plain, "--train-iters", str(ITERS), "--save", str(save), script=script)
    print(f"user script: {run.seconds:.1f} s")
    assert run.returncode == 0, run.tail()
    log, reference = train_log(run.output), runs.layout("one-rank")[0]
    assert sorted(log) == list(range(1, ITERS + 1)), run.tail()
    assert reference.returncode == 0, reference.tail()
    for key in ("kd loss", "budget loss"):
        got, want = per_iteration(log, key), per_iteration(train_log(reference.output), key)
        print(f"{key}: user script {got} vs pretrain_elastic.py {want}")
        assert got == pytest.approx(want, rel=1e-5, abs=1e-8), key
    assert [it for it, _ in eval_log(run.output)] == [2, 4]
    assert sorted(elastic_log(run.output)) == list(range(1, ITERS + 1))
    verify = run_cli("verify", str(save))
    assert verify.returncode == 0, verify.stderr[-3000:]
    # a flag the checkpoint contradicts stops every rank before the model is built
    bad = [*plain, "--train-iters", "2", "--elastic-budgets", "1.0", "0.01"]
    refused = torchrun(1, *bad, script=script, timeout=300)
    assert refused.returncode != 0
    errors = [ln for ln in refused.output.splitlines() if f"{script.name}: error:" in ln]
    assert errors and "--elastic-budgets" in errors[0], refused.tail()
    assert "number of parameters" not in refused.output


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_plugin.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=ENV,
    )


@pytest.mark.integration
def test_a_megatron_lm_save_loads_in_another_layout_and_our_tools_read_it(runs, base_args):
    """A ``--save`` written at TP2+SP: Megatron-LM's ``--load`` reads it at TP1 (weights only:
    iteration 3's loss, computed before any update, is the TP2 run's); loading its optimizer
    state in another layout is refused, naming the flag; ``verify``, ``inspect``, ``extract``
    and ``generate`` read the directory, and the nested model extracted from it is the one
    extracted from the one-rank run's save."""
    tp2, save = runs.layout("tp2-sp")
    one, one_save = runs.layout("one-rank")
    assert tp2.returncode == 0 and one.returncode == 0, (tp2.tail(), one.tail())
    args = [*base_args, "--train-iters", str(ITERS), "--load", str(save), "--ckpt-step", "2"]
    weights = torchrun(1, *args, "--no-load-optim", "--no-load-rng", "--exit-interval", "3")
    assert weights.returncode == 0, weights.tail()
    assert "successfully loaded checkpoint" in weights.output, weights.tail()
    first = train_log(weights.output)[3]  # the first line a run logs is its own iteration's
    for key in ("kd loss", "budget loss"):
        want = per_iteration(train_log(tp2.output), key)[3]
        print(f"iteration 3 {key}: TP1 from the TP2 save {first[key]!r}, TP2 {want!r}")
        assert first[key] == pytest.approx(want, rel=1e-4), key
    refused = torchrun(1, *args, "--exit-interval", "3", timeout=300)
    assert refused.returncode != 0
    errors = [ln for ln in refused.output.splitlines() if "pretrain_elastic.py: error:" in ln]
    assert errors and "written at TP2 EP1" in errors[0] and "--no-load-optim" in errors[0]

    verify = run_cli("verify", str(save))
    assert verify.returncode == 0, verify.stderr[-3000:]
    inspect = run_cli("inspect", "--ckpt", str(save), "--json")
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    assert "0.4" in inspect.stdout
    extracted = {}
    for name, directory in (("tp2", save), ("one", one_save)):
        out = runs.workdir / f"extract-{name}"
        proc = run_cli("extract", "--ckpt", str(directory), "--budget", "0.4", "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        extracted[name] = model_tensors(
            out / f"iter_{ITERS:07d}", runs.workdir / f"extract-{name}.pt"
        )
    assert_same_weights(extracted["tp2"], extracted["one"])
    tokenizer = runs.workdir / "tokenizer.json"
    _write_tokenizer(tokenizer)
    generate = run_cli(
        "generate", "--ckpt", str(save), "--budget", "0.4", "--tokenizer", str(tokenizer),
        "--prompt", "12*3=", "--max-new-tokens", "4", "--allow-unknown-chars", "--json",
    )  # fmt: skip
    assert generate.returncode == 0, generate.stderr[-3000:]


def _write_tokenizer(path: Path) -> None:
    """A tokenizer.json the tiny model's vocabulary (128) covers."""
    from elastic_plugin.data.tokenizer import train_tokenizer

    texts = [f"{a}*{b}={a * b}" for a in range(40) for b in range(12)]
    train_tokenizer(texts, 128).save(str(path))


@pytest.mark.integration
@pytest.mark.parametrize(
    "nproc,flags,needle",
    [
        (2, ["--elastic-teacher", "self"], "uses a frozen teacher (--elastic-teacher frozen)"),
        (
            1,
            ["--elastic-budgets", "1.0", "0.01"],
            "--elastic-budgets: elastic.budgets: budget 0.01",
        ),
    ],
    ids=["self-teacher", "unreachable-budget"],
)
def test_bad_input_fails_before_the_model_is_built_naming_the_flag(base_args, nproc, flags, needle):
    run = torchrun(nproc, *base_args, "--train-iters", "2", *flags, timeout=300)
    print(f"{flags[0]}: {run.seconds:.1f} s")
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if "pretrain_elastic.py: error:" in line]
    assert errors and all(needle in line for line in errors), run.tail()
    # every rank stops on its own (none waits in a collective); torchrun may stop a slower rank
    # once the first has exited, before that one has printed its own line
    assert 1 <= len(errors) <= nproc
    assert "number of parameters" not in run.output  # Megatron never built the model


@pytest.mark.integration
def test_cpu_training_patches_are_recorded_idempotent_and_off_with_cuda():
    code = """
        import json, torch
        import megatron.training.training as training
        from elastic_plugin.compat import applied_patches
        from elastic_plugin.compat.megatron_training import (
            LABELS, enable_cpu_megatron_training, training_patches)
        from elastic_plugin.info import collect_info
        patches = enable_cpu_megatron_training()
        again = enable_cpu_megatron_training()
        info = collect_info()
        print(json.dumps({
            "same": again == patches == applied_patches(), "labels": list(LABELS),
            "ours": training_patches(), "total": len(patches),
            "wrapped": hasattr(training.initialize_megatron, "__wrapped__"),
            "info_total": info["cpu_patches"], "info_ours": info["megatron_training_patches"],
        }))
    """
    out = _python(code)
    assert out["same"] and out["ours"] == out["labels"] and len(out["labels"]) == 8
    assert out["total"] > 10 + len(out["labels"]) and out["wrapped"]
    assert out["info_total"] == out["total"] and out["info_ours"] == out["labels"]
    with_cuda = """
        import json, torch
        import megatron.training.training as training
        orig = training.initialize_megatron
        torch.cuda.is_available = lambda: True
        from elastic_plugin.compat import applied_patches
        from elastic_plugin.compat.megatron_training import enable_cpu_megatron_training
        print(json.dumps({"patches": enable_cpu_megatron_training(), "all": applied_patches(),
                          "same": training.initialize_megatron is orig}))
    """
    assert _python(with_cuda) == {"patches": [], "all": [], "same": True}


def _python(code: str) -> dict:
    import json
    import textwrap

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class _Writer:
    """Megatron's TensorBoard writer, as far as the elastic log uses it."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag] = (value, step)


def test_elastic_log_reports_each_budget_its_choice_throughput_and_memory():
    """The accumulator behind the ``elastic |`` line, one process: per-budget means over the
    interval, a budget not drawn shown as ``-`` (not 0/0), choices as size / full size."""
    from elastic_plugin.elastic.megatron_lm_log import ElasticLog

    table = {"1": {"ffn": 256, "experts": 8}, "0.5": {"ffn": 128, "experts": [4, 2]}}
    log = ElasticLog([1.0, 0.5, 0.25], {"ffn": 256, "experts": 8}, lambda: table, lambda: 2e9)
    writer = _Writer()
    log.iteration_started()
    for kd_sum, tokens, b_loss, index in ((3.0, 10, 0.0, 0), (1.0, 10, 0.2, 1), (2.0, 10, 0.4, 1)):
        log.add(torch.tensor([kd_sum, tokens, b_loss, 0.0, index]))
    assert log.end_iteration(1, 64, log_interval=2) is None  # not a log iteration
    log.iteration_started()
    line = log.end_iteration(2, 64, log_interval=2, writer=writer)
    fields = _fields(line.split("| iteration", 1)[1])
    assert fields["kd loss 1"] == pytest.approx(0.3) and fields["kd loss 0.5"] == pytest.approx(
        0.15
    )
    assert fields["budget loss 0.5"] == pytest.approx(0.3)
    assert "kd loss 0.25: -" in line and "choice 0.5: ffn=128 experts=3(mean)" in line
    assert fields["tokens/s"] > 0 and fields["peak memory/rank (GiB)"] > 0
    assert writer.scalars["elastic/kd loss 0.5"] == (pytest.approx(0.15), 2)
    assert writer.scalars["elastic/choice 0.5/experts"][0] == pytest.approx(3 / 8)
    assert "elastic/kd loss 0.25" not in writer.scalars
    assert {"elastic/tokens per second", "elastic/peak memory per rank GiB"} <= set(writer.scalars)
    assert log.window.abs().sum() == 0  # the interval was reset


def test_a_setup_note_prints_once_however_often_the_setup_runs(capsys):
    """A Megatron-LM launch runs ``elastic_setup`` up to three times (the router's LR group,
    the early check, the model provider): its notes reach stderr once."""
    from elastic_plugin.elastic import megatron_lm_args

    message = "elastic: note: a test note printed once"
    megatron_lm_args._NOTED.discard(message)
    for _ in range(3):
        megatron_lm_args._note_once(message)
    assert capsys.readouterr().err.count(message) == 1
