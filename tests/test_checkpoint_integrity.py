"""Checkpoint integrity: every file's size and SHA-256 are recorded in ``elastic_meta.json`` at
save and checked before any load uses a byte. A block of flipped bytes, a truncated or a missing
file is a ConfigError naming the file with what was expected and found (exit 2 from the
commands, nothing written), not silently wrong weights or ``EOFError`` from ``torch.load``;
``elastic-plugin verify`` checks a checkpoint without loading a model. Checkpoints saved before
digests were recorded load as before. Under PP=2 every rank's files are recorded and a file
damaged on one rank's share fails the load on all ranks alike."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from elastic_plugin.checkpoint.integrity import (
    FILES_KEY,
    balanced_share,
    digest_names,
    file_digest,
    recorded_digests,
    verify_digests,
)
from elastic_plugin.checkpoint.meta import CHECKPOINT_META
from elastic_plugin.models.config import ConfigError
from tests.support.integrity_cases import flip_middle

CASES = "tests.support.integrity_cases"


@pytest.fixture(scope="module")
def saved(rank_pools, tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("integrity")
    (paths,) = rank_pools.get(1).run(f"{CASES}:make_checkpoints", workdir=str(work))
    return {kind: Path(p) for kind, p in paths.items()}


def _meta(ckpt: Path) -> dict:
    return json.loads((ckpt / CHECKPOINT_META).read_text())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _largest_distcp(ckpt: Path) -> str:
    return max((p for p in ckpt.glob("*.distcp")), key=lambda p: p.stat().st_size).name


def _verify(*argv: str) -> tuple[int, str, str]:
    from elastic_plugin.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", *argv])
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------ pure helpers
def test_balanced_share_splits_every_file_once_largest_first():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 5, "e": 1}
    shares = [balanced_share(sizes, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(sizes)
    assert shares == [["a", "d", "e"], ["b", "c"]]  # loads 106 and 110
    assert balanced_share(sizes, 0, 1) == sorted(sizes)
    assert balanced_share({}, 1, 3) == []


def test_malformed_digests_are_refused(tmp_path):
    assert recorded_digests({"config": {}}, tmp_path) is None
    for bad in ({"x": {"bytes": 3}}, {"x": {"sha256": "00"}}, ["x"], {"x": {"bytes": "3"}}):
        with pytest.raises(ConfigError, match="'files' is malformed"):
            recorded_digests({FILES_KEY: bad}, tmp_path)


# ------------------------------------------------------------------------------ real checkpoints
@pytest.mark.parametrize("kind", ["teacher", "elastic"])
def test_every_file_is_recorded_and_verify_passes(saved, kind):
    ckpt = saved[kind]
    meta = _meta(ckpt)
    assert meta["kind"] == kind
    files = meta[FILES_KEY]
    names = digest_names(ckpt)
    # Megatron's shards and its indexes: everything but the metadata itself
    assert sorted(files) == names and CHECKPOINT_META not in files
    assert {"metadata.json", ".metadata"} <= set(names) and _largest_distcp(ckpt) in names
    for name in names:
        assert files[name] == file_digest(ckpt / name), name
    rc, out, err = _verify(str(ckpt))
    assert (rc, err) == (0, ""), err
    total = sum(e["bytes"] for e in files.values())
    assert out.startswith(f"OK {ckpt} ({kind}): {len(names)} files, {total / 1e6:.1f} MB")
    rc, out, _ = _verify(str(ckpt), "--json")
    report = json.loads(out)
    assert rc == 0 and report["verified"] and report["files"] == len(names)
    assert report["bytes"] == total and report["kind"] == kind


@pytest.fixture(scope="module")
def damaged(saved, tmp_path_factory) -> dict[str, tuple[Path, str, dict]]:
    """Copies of the teacher checkpoint: flipped, truncated, missing; and one saved before
    digests were recorded. ``name -> (ckpt, damaged file, its recorded entry)``."""
    work = tmp_path_factory.mktemp("damaged")
    src = saved["teacher"]
    name = _largest_distcp(src)
    entry = _meta(src)[FILES_KEY][name]
    out = {}
    flipped = _copy(src, work / "flipped")
    flip_middle(flipped / name)
    out["flipped"] = (flipped, name, entry)
    truncated = _copy(src, work / "truncated")
    with open(truncated / name, "r+b") as f:
        f.truncate(entry["bytes"] // 2)
    out["truncated"] = (truncated, name, entry)
    missing = _copy(src, work / "missing")
    (missing / ".metadata").unlink()  # torch.distributed.checkpoint's index
    out["missing"] = (missing, ".metadata", _meta(src)[FILES_KEY][".metadata"])
    old = _copy(src, work / "old")
    meta = _meta(old)
    del meta[FILES_KEY]
    (old / CHECKPOINT_META).write_text(json.dumps(meta))
    out["old"] = (old, "", {})
    return out


def _expected_message(case: str, ckpt: Path, name: str, entry: dict) -> list[str]:
    """The parts the message of ``case`` must contain."""
    if case == "flipped":
        found = file_digest(ckpt / name)["sha256"]
        assert found != entry["sha256"]
        return [
            f"checkpoint {ckpt}: file {name} differs from what was saved",
            f"expected sha256 {entry['sha256']} ({entry['bytes']} bytes)",
            f"found sha256 {found} ({entry['bytes']} bytes)",
        ]
    if case == "truncated":
        return [
            f"checkpoint {ckpt}: file {name} is truncated",
            f"expected {entry['bytes']} bytes as saved, found {entry['bytes'] // 2} bytes",
        ]
    return [
        f"checkpoint {ckpt}: file {name} is missing",
        f"expected {entry['bytes']} bytes (sha256 {entry['sha256']})",
    ]


@pytest.mark.parametrize("case", ["flipped", "truncated", "missing"])
def test_verify_names_the_damaged_file_and_exits_2(damaged, case):
    ckpt, name, entry = damaged[case]
    rc, out, err = _verify(str(ckpt))
    assert rc == 2 and out == ""
    assert err.startswith("elastic-plugin verify: error: ") and err.count("\n") == 1
    for part in _expected_message(case, ckpt, name, entry):
        assert part in err, (part, err)
    with pytest.raises(ConfigError, match="damaged"):
        verify_digests(ckpt, _meta(ckpt)[FILES_KEY])


def test_loads_check_digests_first(rank_pools, saved, damaged):
    """Loading (``build_from_checkpoint``, what every command uses): the intact and the old
    checkpoint load to the same weights; each damaged one is a ConfigError naming the file."""
    paths = [str(saved["teacher"])] + [str(damaged[c][0]) for c in damaged]
    (loaded,) = rank_pools.get(1).run(f"{CASES}:load_each", paths=paths)
    intact = loaded[str(saved["teacher"])]
    assert intact.startswith("ok ")
    assert loaded[str(damaged["old"][0])] == intact  # no digests: loads unchecked, as before
    for case in ("flipped", "truncated", "missing"):
        ckpt, name, entry = damaged[case]
        message = loaded[str(ckpt)]
        assert message.startswith("ConfigError: "), message
        for part in _expected_message(case, ckpt, name, entry):
            assert part in message, (part, message)


def test_verify_of_an_old_checkpoint_says_no_digests(damaged):
    ckpt = damaged["old"][0]
    rc, out, err = _verify(str(ckpt))
    assert (rc, err) == (0, "")
    rc, js, _ = _verify(str(ckpt), "--json")
    report = json.loads(js)
    assert rc == 0 and report["verified"] is False
    # no digests, but its pickles (.metadata and the .distcp byte items) are still checked
    assert report["pickles"] > 1
    assert out.strip() == (
        f"{ckpt}: no digests recorded (saved before checkpoints recorded them); nothing verified"
        f"; {report['pickles']} pickles hold only allowed globals"
    )


def test_verify_refuses_what_is_not_a_checkpoint(tmp_path):
    rc, _, err = _verify(str(tmp_path / "nope"))
    assert rc == 2 and "no such checkpoint directory" in err
    rc, _, err = _verify(str(tmp_path))
    assert rc == 2 and f"no {CHECKPOINT_META}" in err


def test_extract_of_a_damaged_elastic_checkpoint_exits_2_and_writes_nothing(
    rank_pools, saved, tmp_path
):
    """Before: flipped bytes loaded silently; a truncated shard died with ``EOFError``."""
    src = saved["elastic"]
    name = _largest_distcp(src)
    flipped, truncated = _copy(src, tmp_path / "flipped"), _copy(src, tmp_path / "truncated")
    flip_middle(flipped / name)
    with open(truncated / name, "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    pool = rank_pools.get(1)
    for ckpt, what in ((flipped, "differs from what was saved"), (truncated, "is truncated")):
        out = tmp_path / f"out_{ckpt.name}"
        argv = ["extract", "--ckpt", str(ckpt), "--budget", "1", "--out", str(out)]
        (result,) = pool.run(f"{CASES}:run_cli", argv=argv)
        assert result["rc"] == 2 and result["stdout"] == "", result
        err = result["stderr"]
        assert err.startswith("elastic-plugin extract: error: ") and "Traceback" not in err
        assert f"file {name} {what}" in err, err
        assert not out.exists() and not out.with_name(out.name + ".tmp").exists()


@pytest.mark.integration
def test_pipeline_parallel_save_records_every_ranks_files_and_verifies(rank_pools, tmp_path):
    results = rank_pools.get(2).run(f"{CASES}:pipeline_case", workdir=str(tmp_path))
    first, second = results
    assert first["files"] == second["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json"} <= set(first["files"])
    for r in results:
        assert r["intact"] and r["same_pp2"] and r["same_dp2"] and r["params"] > 0, r
    assert first["whole"] == second["whole"]  # resharded to DP=2: the same whole model
    assert first["damaged"] == second["damaged"]
    # rank 1 hashed the damaged file; both ranks report it, with the same message
    assert first["error"] == second["error"] != ""
    assert f"file {first['damaged']} differs from what was saved" in first["error"]
