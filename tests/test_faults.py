"""Fault injection (``compat.faults``): ranks killed with SIGKILL at seeded random points of a
training step or of a checkpoint save, under torchrun with TP=2 x EP=2 (4 ranks) and PP=2, and
a full disk during a save. After each, nothing published is half-written (every save under
``checkpoints/elastic/iter_*`` verifies, the pointer names a save) and ``--resume`` reproduces
the uninterrupted run's loss trace exactly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from tests.support.fault_cases import (
    TRAIN_ITERS,
    loss_trace,
    pick_faults,
    published_state,
    write_config,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
LAYOUTS = {
    "tp2_ep2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                    "--expert-model-parallel-size", "2", "--global-batch-size", "8"]),  # DP=2
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}  # fmt: skip
# PP=2: a kill of one rank at a training step; TP=2 x EP=2 (4 ranks on the 2-core machine, the
# costliest launches): a kill of every rank inside a save. (PP=2 also killed inside a save until
# the suite had to fit its time: each fault is two more launches, and a save under TP2 x EP2
# already writes and verifies shards from several ranks.)
FAULTS_PER_LAYOUT = {"tp2_ep2": (1, "save"), "pp2": (1, "step")}
JOB_ENV = "ELASTIC_PLUGIN_TEST_JOB"
ORPHANS: list[int] = []  # processes left behind per finished job (killed by _end_job)


@pytest.fixture(scope="module")
def start(rank_pools, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    config = write_config(work / "small_elastic.yaml")
    (ckpt,) = rank_pools.get(1).run(
        "tests.support.fault_cases:init_checkpoint",
        config_path=str(config),
        out=str(work / "reordered"),
    )
    return config, Path(ckpt)


def _elastic_train(start, out: Path, nproc: int, flags: list[str], *extra: str, fault=None):
    config, ckpt = start
    args = ["elastic-train", "--ckpt", str(ckpt), "--config", str(config), "--out", str(out),
            "--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-interval",
            str(TRAIN_ITERS), "--eval-iters", "1", "--lr-warmup-iters", "1",
            "--save-interval", "2", "--keep-last", "2", "--no-progress", *flags, *extra]  # fmt: skip
    launcher = [sys.executable, "-m", "elastic_plugin.cli"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--standalone", "-m", "elastic_plugin.cli"]  # fmt: skip
    job = uuid.uuid4().hex  # every process of this job inherits it: how leftovers are found
    env = {**ENV, JOB_ENV: job, **({"ELASTIC_PLUGIN_FAULT": fault} if fault else {})}
    # output to files, not pipes: a leftover process must not keep the launcher's pipes open
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(
            [*launcher, *args], stdout=out_file, stderr=err_file, text=True, cwd=ROOT, env=env
        )
        try:
            proc.wait(timeout=900)
        finally:
            ORPHANS.append(_end_job(job))
            proc.kill()
            proc.wait()
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read(), err_file.read()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _end_job(job: str) -> int:
    """Kill what is left of a finished job, as a batch scheduler ends a job's processes, and
    count it. A rank killed with SIGKILL leaves the multiprocessing Manager that Megatron's
    checkpoint writer starts (``get_write_results_queue``) running, reparented to init."""
    left = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(JOB_ENV) == job:
                left.append(process)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(left, timeout=10)
    return len(left)


def _same_trace(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want) == list(range(1, TRAIN_ITERS + 1))
    for iteration, losses in want.items():
        assert set(got[iteration]) == set(losses)
        for budget, value in losses.items():
            assert got[iteration][budget] == pytest.approx(value, rel=1e-6), (iteration, budget)


def _check_left_intact(state: dict) -> None:
    """Nothing published is half-written: every save verifies, the pointer names one."""
    assert all(v == "verified" for v in state["saves"].values()), state
    if state["latest"] is not None:
        assert f"iter_{int(state['latest']):07d}" in state["saves"], state
    assert state["bytes_lost"] == 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_killed_ranks_resume_to_the_uninterrupted_trace(start, layout, tmp_path):
    nproc, flags = LAYOUTS[layout]
    reference = _elastic_train(start, tmp_path / "reference", nproc, flags)
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = loss_trace(tmp_path / "reference")
    counts = {"faults injected": 0, "runs recovered": 0, "bytes lost": 0}
    orphans_before = len(ORPHANS)
    count, first = FAULTS_PER_LAYOUT[layout]
    for i, fault in enumerate(pick_faults(f"faults-{layout}", nproc, count, first)):
        out = tmp_path / f"run{i}"
        killed = _elastic_train(start, out, nproc, flags, fault=fault)
        assert killed.returncode != 0 and "[fault]" in killed.stdout, (fault, killed.stderr[-2000:])
        counts["faults injected"] += 1
        state = published_state(out)
        print(f"{layout} {fault}: left {state}")
        _check_left_intact(state)
        counts["bytes lost"] += state["bytes_lost"]
        resumed = _elastic_train(start, out, nproc, flags, "--resume")
        assert resumed.returncode == 0, (fault, resumed.stderr[-3000:])
        _same_trace(loss_trace(out), want)
        _check_left_intact(published_state(out))
        counts["runs recovered"] += 1
    counts["processes left behind"] = sum(ORPHANS[orphans_before:])
    print(f"fault injection ({layout}): {counts}")
    assert counts["runs recovered"] == counts["faults injected"] > 0 and counts["bytes lost"] == 0


def test_a_full_disk_during_a_save_leaves_the_previous_save_usable(start, tmp_path):
    """ENOSPC while the second save is written: the run stops with a message naming the last
    complete save; that save verifies; --resume finishes with the uninterrupted trace."""
    reference = _elastic_train(start, tmp_path / "reference", 1, [])
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "full_disk"
    failed = _elastic_train(start, out, 1, [], fault="save.written@2:action=enospc")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "No space left on device" in failed.stderr
    assert "the last complete save is iteration 2" in failed.stderr, failed.stderr[-2000:]
    state = published_state(out)
    assert state["saves"] == {"iter_0000002": "verified"} and state["latest"] == "2", state
    assert state["leftovers"] == ["iter_0000004.tmp"]  # the unfinished save, never published
    resumed = _elastic_train(start, out, 1, [], "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_trace(loss_trace(out), loss_trace(tmp_path / "reference"))
    print(
        "fault injection (full disk): {'faults injected': 1, 'runs recovered': 1, 'bytes lost': 0}"
    )


def test_a_hung_rank_is_named_when_the_collective_times_out(start, tmp_path):
    """Rank 1 hangs before iteration 3: rank 0's next collective times out after 30 s, and the
    run fails naming rank 1 and where it stopped (its heartbeat: iteration 2 done), not just
    "timed out"."""
    result = _elastic_train(
        start, tmp_path / "hung", 2, ["--distributed-timeout-minutes", "0.5", "--global-batch-size", "8"],
        fault="train.step@3:rank=1:action=hang",
    )  # fmt: skip
    assert result.returncode != 0
    assert "[fault] rank 1: hang at train.step" in result.stdout + result.stderr
    assert "a collective timed out after 30 s on rank 0 at iteration 3 (train)" in result.stderr
    assert "rank 1 (" in result.stderr, result.stderr[-3000:]
    assert "is stuck: its last heartbeat" in result.stderr
    assert "was iteration 2 done" in result.stderr
    assert "Traceback" not in result.stderr.split("a collective timed out")[0][-2000:]


def test_fault_specs_are_checked():
    from elastic_plugin.compat.faults import FaultSpec, parse_faults

    assert parse_faults("save.pointer@3:rank=0, train.step@2:action=enospc") == [
        FaultSpec("save.pointer", 3, 0, "kill"),
        FaultSpec("train.step", 2, None, "enospc"),
    ]
    assert parse_faults("") == []
    for bad in ("save.typo@1", "train.step@0", "train.step", "train.step@1:rank=x",
                "train.step@1:action=explode"):  # fmt: skip
        with pytest.raises(ValueError, match="ELASTIC_PLUGIN_FAULT"):
            parse_faults(bad)
    specs = pick_faults("faults-tp2_ep2", 4, 4)
    assert specs == pick_faults("faults-tp2_ep2", 4, 4)  # seeded
    assert [s.split("@")[0].split(".")[0] for s in specs] == ["train", "save", "train", "save"]
    assert all(len(parse_faults(s)) == 1 for s in specs)
