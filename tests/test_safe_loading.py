"""Loading a file never runs its code (checkpoint/safe_pickle.py, checkpoint/tensor_file.py).

Our own files (importance scores, permutations, partial importance state) are safetensors + JSON;
old ``torch.save`` ones load through the allowlist check and ``torch.load(weights_only=True)``.
The pickles of a dist checkpoint (``.metadata``, the ``.distcp`` byte items, ``common.pt``) are
checked against an allowlist before torch unpickles them. A seeded fuzz sweep over every loader
(truncations, bit flips, wrong types, huge declared sizes, crafted pickles) must give the
project's error naming the file or a valid load: no traceback, nothing written, nothing run (a
canary file every crafted pickle would create must not exist). Runs in-process (no Megatron)."""

from __future__ import annotations

import builtins
import collections
import contextlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elastic_plugin.checkpoint.safe_pickle import (
    UnsafePickleError,
    check_checkpoint_pickles,
    forget_checked,
)
from elastic_plugin.data.indexed import IndexedDatasetError
from elastic_plugin.data.jsonl import JsonlError
from elastic_plugin.importance.collect import CalibrationError
from elastic_plugin.importance.reorder import Permutations
from elastic_plugin.importance.scores import ImportanceScores
from elastic_plugin.models.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SEED = 32
PROJECT_ERRORS = (ConfigError, JsonlError, CalibrationError, IndexedDatasetError)


# ------------------------------------------------------------------------ crafted pickles
class _Reduce:
    """Pickles as ``func(*args)``: what an attacker's file calls on load."""

    def __init__(self, func: Callable, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def crafted_payloads(canary: Path) -> dict[str, object]:
    """Objects whose unpickling would create ``canary``, each another way."""
    touch = f"touch {canary}"
    return {
        "os.system": _Reduce(os.system, touch),
        "builtins.exec": _Reduce(builtins.exec, f"open({str(canary)!r}, 'w').close()"),
        "subprocess": _Reduce(subprocess.call, ["touch", str(canary)]),
        # an allowed container around a call, as deep as a real state dict
        "nested __reduce__": collections.OrderedDict(
            {"model": {"layers": [torch.zeros(2), {"x": _Reduce(os.system, touch)}]}}
        ),
    }


def raw_pickles(canary: Path) -> dict[str, bytes]:
    """Hand-assembled opcodes that name ``os.system`` the ways a scanner can miss."""
    cmd = f"touch {canary}".encode()
    short = bytes([len(cmd)]) + cmd
    return {
        # STACK_GLOBAL with its names from the memo, then a frame-less call
        "stack_global via memo": b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93\x8c"
        + short
        + b"\x85R.",
        # protocol 0 INST: module and name inline
        "INST": b"(S'" + cmd + b"'\nios\nsystem\n.",
        # an extension code (copyreg's registry) instead of a name
        "EXT1": b"\x80\x02\x82\x01)R.",
    }


# ------------------------------------------------------------------------------ fixtures
def _dist_checkpoint(directory: Path) -> Path:
    """A real torch dist checkpoint (tensors and a byte item), written without a process group."""
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.arange(12.0).reshape(3, 4), "extra": {"step": 3, "name": "tiny"}}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (directory / "metadata.json").write_text(json.dumps(backend))  # Megatron's marker
    return directory


def _scores() -> ImportanceScores:
    gen = torch.Generator().manual_seed(SEED)
    return ImportanceScores(
        embedding=torch.rand(8, generator=gen, dtype=torch.float64),
        ffn={1: torch.rand(6, generator=gen)},
        attention_heads={2: torch.rand(4, generator=gen)},
        depth={1: 0.25, 2: 0.5},
        variants={"embedding_in": {0: torch.rand(8, generator=gen)}},
        tokens=64,
        meta={"ckpt": "teacher", "layout": {"tp": 1}},
    )


def _snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")}


# --------------------------------------------------------------------------- round trips
def test_scores_and_permutations_are_safetensors_and_round_trip(tmp_path):
    scores = _scores()
    path = scores.save(tmp_path / "importance.pt")  # the name users pass: content is data
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert json.loads(path.read_bytes()[8 : 8 + header_len])["__metadata__"][
        "elastic_plugin.format"
    ] == ("importance_scores")
    back = ImportanceScores.load(path)
    assert torch.equal(back.embedding, scores.embedding) and back.depth == scores.depth
    assert torch.equal(back.ffn[1], scores.ffn[1]) and back.meta == scores.meta
    assert torch.equal(back.variants["embedding_in"][0], scores.variants["embedding_in"][0])
    perms = Permutations(embedding=torch.randperm(8), ffn={1: torch.randperm(6)})
    perms.save(tmp_path / "p.safetensors")
    again = Permutations.load(tmp_path / "p.safetensors")
    assert torch.equal(again.embedding, perms.embedding) and torch.equal(again.ffn[1], perms.ffn[1])


def test_old_torch_save_files_load_through_the_safe_path(tmp_path):
    scores = _scores()
    torch.save(scores.to_dict(), tmp_path / "old.pt")  # what `importance` wrote before
    back = ImportanceScores.load(tmp_path / "old.pt")
    assert torch.equal(back.attention_heads[2], scores.attention_heads[2])
    perms = Permutations(embedding=torch.randperm(8))
    torch.save(perms.__dict__, tmp_path / "permutations.pt")
    assert torch.equal(Permutations.load(tmp_path / "permutations.pt").embedding, perms.embedding)
    # an old file with a field the format never had: refused, saying how to regenerate
    torch.save({**scores.to_dict(), "bogus": 1}, tmp_path / "odd.pt")
    with pytest.raises(ConfigError, match="odd.pt.*elastic-plugin importance --out"):
        ImportanceScores.load(tmp_path / "odd.pt")


def test_partial_importance_state_is_safetensors(tmp_path):
    from elastic_plugin.importance.collect import _load_partial, _save_partial
    from elastic_plugin.importance.hooks import LocalStats

    stats = LocalStats()
    stats.add("ffn", 1, torch.ones(4))
    stats.expert_tokens[3] = torch.tensor([2.0, 5.0])
    stats.tokens_seen = 40
    path = tmp_path / "partial_rank00000.safetensors"
    _save_partial(path, stats, 2, 5, 4)
    back, counters = _load_partial(path)
    assert counters == {
        "batches_done": 2,
        "num_batches": 5,
        "micro_batch_size": 4,
        "tokens_seen": 40,
    }
    assert torch.equal(back.sums["ffn"][1], stats.sums["ffn"][1])
    assert torch.equal(back.expert_tokens[3], stats.expert_tokens[3]) and back.tokens_seen == 40


# --------------------------------------------------------------------- the pickle check
def test_honest_dist_checkpoint_passes_and_lists_its_globals(tmp_path):
    ckpt = _dist_checkpoint(tmp_path / "ckpt")
    report = check_checkpoint_pickles(ckpt, use_cache=False)
    assert report.files == 1 and report.byte_items == 2  # extra.step, extra.name
    assert "torch.distributed.checkpoint.metadata.Metadata" in report.globals
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.zeros(3, 4), "extra": {"step": 0, "name": ""}}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)  # the real load still works after
    assert state["extra"] == {"step": 3, "name": "tiny"}
    assert torch.equal(state["weight"], torch.arange(12.0).reshape(3, 4))


def _splice_byte_item(ckpt: Path, payload: bytes) -> None:
    """Point the checkpoint's byte item at ``payload`` (appended to its .distcp), rewriting
    .metadata as torch would (the test trusts its own file)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    fqn = next(
        k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    )
    info = meta.storage_data[MetadataIndex(fqn)]
    target = ckpt / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(payload)
    info.offset, info.length = offset, len(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))


def test_crafted_pickles_anywhere_in_a_checkpoint_are_refused_naming_file_and_global(tmp_path):
    canary = tmp_path / "canary"
    honest = _dist_checkpoint(tmp_path / "honest")
    for name, payload in crafted_payloads(canary).items():
        # as .metadata (plain pickle.load in torch)
        ckpt = tmp_path / f"meta_{name.replace(' ', '_')}"
        _dist_checkpoint(ckpt)
        (ckpt / ".metadata").write_bytes(pickle.dumps(payload, protocol=4))
        with pytest.raises(UnsafePickleError) as info:
            check_checkpoint_pickles(ckpt)
        assert ".metadata" in str(info.value) and info.value.global_name in str(info.value)
        # as a byte item (torch.load(weights_only=False) in torch's planner)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        item = tmp_path / f"item_{name.replace(' ', '_')}"
        _dist_checkpoint(item)
        _splice_byte_item(item, buffer.getvalue())
        with pytest.raises(UnsafePickleError, match=r"__0_0\.distcp \(item extra"):
            check_checkpoint_pickles(item)
        # as Megatron-LM's common.pt
        common = tmp_path / f"common_{name.replace(' ', '_')}"
        _dist_checkpoint(common)
        torch.save({"args": payload}, common / "common.pt")
        with pytest.raises(UnsafePickleError, match="common.pt"):
            check_checkpoint_pickles(common)
    assert check_checkpoint_pickles(honest).byte_items == 2
    assert not canary.exists()


def test_a_byte_item_cannot_hide_by_renaming_its_metadata_class(tmp_path):
    """A BUILD state that sets ``_name`` on the byte item's metadata (the field the check's
    placeholders carry) changes nothing: the check reads the class the pickle named."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    canary = tmp_path / "canary"
    ckpt = _dist_checkpoint(tmp_path / "ckpt")
    buffer = io.BytesIO()
    torch.save(crafted_payloads(canary)["os.system"], buffer)
    _splice_byte_item(ckpt, buffer.getvalue())
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    for entry in meta.state_dict_metadata.values():
        if isinstance(entry, BytesStorageMetadata):
            entry._name = "torch.distributed.checkpoint.metadata.TensorStorageMetadata"
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))
    with pytest.raises(UnsafePickleError, match="posix.system"):
        check_checkpoint_pickles(ckpt)
    assert not canary.exists()


def test_verify_reports_the_check_and_exits_2_naming_the_global(tmp_path):
    from elastic_plugin.checkpoint.integrity import FILES_KEY, file_digests
    from elastic_plugin.checkpoint.meta import CHECKPOINT_META
    from elastic_plugin.cli import main

    canary = tmp_path / "canary"
    ckpt = _dist_checkpoint(tmp_path / "ckpt")

    def publish() -> None:  # digests that match: anyone who can write a file can write these
        meta = {"kind": "teacher", "config": {}, FILES_KEY: file_digests(ckpt)}
        (ckpt / CHECKPOINT_META).write_text(json.dumps(meta))

    def verify(*extra: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["verify", str(ckpt), *extra])
        return rc, out.getvalue(), err.getvalue()

    publish()
    rc, out, err = verify("--json")
    assert (rc, err) == (0, "") and json.loads(out)["pickles"] == 3  # .metadata + 2 byte items
    (ckpt / ".metadata").write_bytes(pickle.dumps(crafted_payloads(canary)["os.system"]))
    publish()
    rc, out, err = verify()
    assert rc == 2 and out == ""
    assert err.startswith("elastic-plugin verify: error: ") and ".metadata" in err
    assert "posix.system" in err and "Traceback" not in err
    assert not canary.exists()


def _reorder_case(tmp_path: Path) -> tuple[list[str], Path]:
    """``reorder`` argv with a plugin-like teacher and a crafted ``--scores``, and the canary."""
    from elastic_plugin.checkpoint.meta import CHECKPOINT_META
    from elastic_plugin.models.config import load_config

    canary = tmp_path / "canary"
    ckpt = _dist_checkpoint(tmp_path / "teacher")
    config = load_config(ROOT / "examples" / "configs" / "tiny.yaml").to_dict()
    (ckpt / CHECKPOINT_META).write_text(json.dumps({"kind": "teacher", "config": config}))
    evil = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "x": crafted_payloads(canary)["os.system"]}, evil)
    argv = ["reorder", "--ckpt", str(ckpt), "--scores", str(evil), "--out", str(tmp_path / "o")]
    return argv, canary


def test_reorder_refuses_a_crafted_scores_file_before_starting(tmp_path):
    """The issue's attack: exit 2 naming the flag, the file and the global; nothing runs."""
    from elastic_plugin.cli import main

    argv, canary = _reorder_case(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    assert err.getvalue().startswith("elastic-plugin reorder: error: --scores")
    assert "evil.pt" in err.getvalue() and "posix.system" in err.getvalue()
    assert not canary.exists() and not (tmp_path / "o").exists()


@pytest.mark.integration
def test_the_real_command_line_refuses_it_too(tmp_path):
    argv, canary = _reorder_case(tmp_path)
    cli = Path(sys.executable).parent / "elastic-plugin"
    proc = subprocess.run([str(cli), *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("elastic-plugin reorder: error: --scores")
    assert "posix.system" in proc.stderr
    assert not canary.exists() and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ the fuzz
def _mutations(data: bytes, rng: random.Random, flips: int = 6) -> list[tuple[str, bytes]]:
    """Truncations and single-bit flips, at seeded positions."""
    n = len(data)
    cuts = sorted({0, 1, n // 3, n // 2, max(n - 1, 0)})
    out = [(f"truncated to {c} bytes", data[:c]) for c in cuts]
    for _ in range(flips):
        pos = rng.randrange(n)
        bit = 1 << rng.randrange(8)
        out.append(
            (f"bit {bit} flipped at {pos}", data[:pos] + bytes([data[pos] ^ bit]) + data[pos + 1 :])
        )
    return out


def _json_mutations(text: str) -> list[tuple[str, bytes]]:
    """The whole document and its first top-level values of the wrong type."""
    out = [(f"top level {v!r}", v.encode()) for v in ("[]", "3", '"x"', "null", "{")]
    doc = json.loads(text)
    for key in list(doc)[:4]:
        for wrong in ([], "x", 7, None, {"a": []}):
            out.append((f"{key}={wrong!r}", json.dumps({**doc, key: wrong}).encode()))
    return out


def _huge_sizes() -> dict[str, bytes]:
    return {
        "safetensors header of 2**62 bytes": struct.pack("<Q", 1 << 62) + b"{}",
        "safetensors tensor past the end": _safetensors_claiming(1 << 40),
        "pickle BINBYTES8 of 2**62 bytes": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"x.",
        "pickle BYTEARRAY8 of 2**40 bytes": b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b".",
    }


def _safetensors_claiming(end: int) -> bytes:
    header = json.dumps(
        {"embedding": {"dtype": "F64", "shape": [end // 8], "data_offsets": [0, end]}}
    )
    return struct.pack("<Q", len(header)) + header.encode()


def test_fuzz_every_loader_refuses_cleanly(tmp_path, capsys):
    from safetensors.torch import save_file

    from elastic_plugin.checkpoint.hub import read_hub_tensors
    from elastic_plugin.checkpoint.meta import CHECKPOINT_META, read_checkpoint_meta
    from elastic_plugin.export.nested_hf import read_nested_config
    from elastic_plugin.importance.collect import _load_partial, _save_partial
    from elastic_plugin.importance.hooks import LocalStats

    rng = random.Random(SEED)
    canary = tmp_path / "canary"
    base = tmp_path / "base"
    base.mkdir()
    forget_checked()

    # one honest file of every kind; each loader reads one path (file or directory)
    _dist_checkpoint(base / "dist")
    torch.save({"args": {"hidden_size": 8}, "iteration": 3}, base / "dist" / "common.pt")
    _scores().save(base / "importance.pt")
    Permutations(embedding=torch.randperm(8), ffn={1: torch.randperm(4)}).save(base / "perm.st")
    stats = LocalStats()
    stats.add("ffn", 1, torch.ones(4))
    _save_partial(base / "partial.st", stats, 1, 2, 4)
    hub = base / "hub"
    hub.mkdir()
    save_file({"a.weight": torch.ones(2, 2)}, str(hub / "model-00001-of-00001.safetensors"))
    index = {
        "metadata": {"total_size": 16},
        "weight_map": {"a.weight": "model-00001-of-00001.safetensors"},
    }
    (hub / "model.safetensors.index.json").write_text(json.dumps(index))
    nested = base / "nested"
    nested.mkdir()
    (nested / "nested_config.json").write_text(
        json.dumps({"format": "elastic_plugin.nested/1", "budgets": []})
    )
    meta_dir = base / "meta"
    meta_dir.mkdir()
    (meta_dir / CHECKPOINT_META).write_text(
        json.dumps({"kind": "teacher", "config": {"model": {}}})
    )
    (meta_dir / ".metadata").write_bytes((base / "dist" / ".metadata").read_bytes())

    from tokenizers import Tokenizer, models

    from elastic_plugin.checkpoint.integrity import FILES_KEY, file_digests
    from elastic_plugin.data.jsonl import tokenizer_spec
    from elastic_plugin.models.hf_config import read_hf_config

    vocab = {"<unk>": 0, "<eod>": 1, "a": 2, "b": 3}
    (base / "tok").mkdir()
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(base / "tok" / "tokenizer.json"))
    (base / "hf").mkdir()
    fixture = ROOT / "tests" / "fixtures" / "nemotron_nano_v3_config.json"
    (base / "hf" / "config.json").write_text(fixture.read_text())
    export = base / "export"
    export.mkdir()
    save_file({"w": torch.ones(3)}, str(export / "model.safetensors"))
    export_meta = {"kind": "export", FILES_KEY: file_digests(export)}
    (export / "export_meta.json").write_text(json.dumps(export_meta))

    from elastic_plugin.data.indexed import read_indexed_documents, write_indexed_dataset

    (base / "ds").mkdir()
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    write_indexed_dataset(str(base / "ds" / "data"), iter(docs), vocab_size=100, progress=False)

    def scores_loader(p: Path) -> object:
        return ImportanceScores.load(p)

    def verify_export(d: Path) -> None:
        """``elastic-plugin verify`` of an export, in-process: exit 2 becomes its message."""
        from elastic_plugin.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["verify", str(d / "export")])
        if rc == 2 and err.getvalue().startswith("elastic-plugin verify: error: "):
            raise ConfigError(err.getvalue())
        if rc != 0 or err.getvalue():
            raise RuntimeError(f"verify exited {rc}: {err.getvalue()[-300:]}")

    # kind -> (file to damage, relative to its case directory; loader of the case directory)
    loaders: dict[str, tuple[str, Callable[[Path], object]]] = {
        ".metadata": ("dist/.metadata", lambda d: check_checkpoint_pickles(d / "dist")),
        "common.pt": ("dist/common.pt", lambda d: check_checkpoint_pickles(d / "dist")),
        ".distcp byte item": ("dist/__0_0.distcp", lambda d: check_checkpoint_pickles(d / "dist")),
        "importance scores": ("importance.pt", lambda d: scores_loader(d / "importance.pt")),
        "permutations": ("perm.st", lambda d: Permutations.load(d / "perm.st")),
        "partial state": ("partial.st", lambda d: _load_partial(d / "partial.st")),
        "safetensors shard": (
            "hub/model-00001-of-00001.safetensors",
            lambda d: read_hub_tensors(d / "hub"),
        ),
        "model.safetensors.index.json": (
            "hub/model.safetensors.index.json",
            lambda d: read_hub_tensors(d / "hub"),
        ),
        "nested_config.json": (
            "nested/nested_config.json",
            lambda d: read_nested_config(d / "nested"),
        ),
        "elastic_meta.json": (
            f"meta/{CHECKPOINT_META}",
            lambda d: read_checkpoint_meta(d / "meta"),
        ),
        "tokenizer.json": ("tok/tokenizer.json", lambda d: tokenizer_spec(d / "tok")),
        "config.json": ("hf/config.json", lambda d: read_hf_config(d / "hf")),
        "export_meta.json": ("export/export_meta.json", verify_export),
        "indexed dataset .idx": (
            "ds/data.idx",
            lambda d: read_indexed_documents(d / "ds" / "data"),
        ),
        "indexed dataset .bin": (
            "ds/data.bin",
            lambda d: read_indexed_documents(d / "ds" / "data"),
        ),
    }
    honest = {k: (base / rel).read_bytes() for k, (rel, _) in loaders.items()}
    payloads = crafted_payloads(canary)

    def cases(kind: str) -> list[tuple[str, bytes, bool]]:
        """(description, bytes, must be refused)."""
        data = honest[kind]
        out = [(d, b, False) for d, b in _mutations(data, rng)]
        if kind.endswith(".json"):
            out += [(d, b, False) for d, b in _json_mutations(data.decode())]
        if kind in ("importance scores", "permutations", "partial state", "safetensors shard"):
            out += [(d, b, True) for d, b in _huge_sizes().items() if d.startswith("safetensors")]
        if kind in (".metadata", "common.pt", "importance scores", "permutations"):
            for name, payload in payloads.items():
                buffer = io.BytesIO()
                torch.save({"format_version": 1, "x": payload}, buffer)
                as_pickle = pickle.dumps(payload, protocol=4)
                out.append(
                    (
                        f"crafted {name}",
                        as_pickle if kind == ".metadata" else buffer.getvalue(),
                        True,
                    )
                )
        if kind == "indexed dataset .idx":  # 2**40 sequences declared in a 100-byte index
            out.append(
                ("huge sequence count", data[:18] + struct.pack("<Q", 1 << 40) + data[26:], True)
            )
        if kind == ".metadata":
            out += [(f"crafted {n}", b, True) for n, b in raw_pickles(canary).items()]
            out += [(d, b, True) for d, b in _huge_sizes().items() if d.startswith("pickle")]
        return out

    counts = collections.Counter()
    problems = []
    for kind, (rel, load) in loaders.items():
        for number, (description, data, must_refuse) in enumerate(cases(kind)):
            case = tmp_path / "cases" / f"{kind.replace(' ', '_')}_{number}"
            top = Path(rel).parts[0]  # copy only what this loader reads
            case.mkdir(parents=True)
            if (base / top).is_dir():
                shutil.copytree(base / top, case / top)
            (case / rel).write_bytes(data)
            before = _snapshot(case)
            counts["tried"] += 1
            try:
                load(case)
                outcome = "accepted"
            except PROJECT_ERRORS as exc:
                named = Path(rel).name in str(exc) or str(case / Path(rel).parent) in str(exc)
                outcome = "refused" if named else f"refused without naming the file: {exc}"
            except Exception as exc:  # a traceback a user would see
                outcome = f"traceback {type(exc).__name__}: {str(exc)[:200]}"
            counts[outcome if outcome in ("accepted", "refused") else "bad"] += 1
            if outcome.startswith("traceback"):
                counts["tracebacks"] += 1
            if outcome != "refused" and (must_refuse or outcome != "accepted"):
                problems.append((kind, description, outcome))
            if _snapshot(case) != before:
                problems.append((kind, description, "wrote files"))
            shutil.rmtree(case)
    executed = int(canary.exists())
    with capsys.disabled():
        print(
            f"\nsafe-loading fuzz (seed {SEED}): {counts['tried']} cases, {counts['refused']} "
            f"refused, {counts['accepted']} still valid, tracebacks {counts['tracebacks']}, "
            f"commands executed {executed}"
        )
    assert executed == 0
    assert not problems, "\n".join(map(str, problems))
    assert counts["tracebacks"] == 0 and counts["refused"] > counts["tried"] // 2


@pytest.mark.integration
def test_generate_refuses_a_crafted_metadata_whose_digest_matches(tmp_path):
    """The issue's second attack: ``.metadata`` replaced by a crafted pickle and its digest in
    ``elastic_meta.json`` updated to match. ``generate --ckpt`` exits 2 naming it; nothing runs."""
    from tokenizers import Tokenizer, models

    from elastic_plugin.checkpoint.integrity import FILES_KEY, file_digests
    from elastic_plugin.checkpoint.meta import CHECKPOINT_META
    from elastic_plugin.models.config import load_config

    canary = tmp_path / "canary"
    ckpt = _dist_checkpoint(tmp_path / "teacher")
    (ckpt / ".metadata").write_bytes(pickle.dumps(crafted_payloads(canary)["os.system"]))
    config = load_config(ROOT / "examples" / "configs" / "tiny.yaml").to_dict()
    meta = {"kind": "teacher", "config": config, FILES_KEY: file_digests(ckpt)}
    (ckpt / CHECKPOINT_META).write_text(json.dumps(meta))
    tokenizer = tmp_path / "tokenizer.json"
    vocab = {"<unk>": 0, "<eod>": 1, "a": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<eod>"])  # the token rule's end of document
    tok.save(str(tokenizer))
    cli = Path(sys.executable).parent / "elastic-plugin"
    argv = ["generate", "--ckpt", str(ckpt), "--tokenizer", str(tokenizer), "--prompt", "a"]
    proc = subprocess.run([str(cli), *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "elastic-plugin generate: error: " in proc.stderr
    assert ".metadata" in proc.stderr and "posix.system" in proc.stderr
    assert not canary.exists()


def test_every_familys_config_json_mapping_refuses_wrong_values_cleanly():
    """Each supported family's ``config.json`` mapping (the released configs in tests/fixtures),
    every top-level field set to a wrong type, a sign error, zero, a huge or a non-finite size:
    accepted or a ConfigError naming the file, never a traceback, and a declared depth of 2**63
    is refused before a layer pattern is built (it hung the mapping before)."""
    from elastic_plugin.families import model_config_from_hf

    fixtures = ROOT / "tests" / "fixtures"
    wrongs = ([], "x", 7, None, {"a": []}, -1, 0, 1e30, float("inf"), True, 2**63)
    counts = collections.Counter()
    problems = []
    for name in (
        "llama_3_1_8b_config.json",
        "qwen3_8b_config.json",
        "qwen3_30b_a3b_config.json",
        "mixtral_8x7b_config.json",
        "nemotron_nano_v3_config.json",
    ):
        doc = json.loads((fixtures / name).read_text())
        model_config_from_hf(doc, name)  # the honest file maps
        for key in doc:
            for wrong in wrongs:
                counts["tried"] += 1
                try:
                    model_config_from_hf({**doc, key: wrong}, name)
                    counts["accepted"] += 1
                except ConfigError as exc:
                    counts["refused"] += 1
                    if name not in str(exc):
                        problems.append((name, key, wrong, f"not named: {exc}"))
                except Exception as exc:  # a traceback a user would see
                    problems.append((name, key, wrong, f"{type(exc).__name__}: {exc}"))
    print(f"\nfamily config.json fuzz: {dict(counts)}")
    assert not problems, "\n".join(map(str, problems[:20]))
    assert counts["refused"] > counts["tried"] // 3
