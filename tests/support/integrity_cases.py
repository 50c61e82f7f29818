"""Rank-pool cases of the checkpoint integrity tests (``tests/test_checkpoint_integrity.py``).

``make_checkpoints`` (1 rank) writes a teacher-like checkpoint of the tiny model and a briefly
trained elastic one; ``load_each`` loads checkpoints as the commands do and reports what
happened; ``run_cli`` runs an ``elastic-plugin`` command in the rank (its Megatron state is
already up); ``pipeline_case`` (2 ranks) saves under PP=2, where the ranks write different
files, and loads back: clean, resharded to DP=2, and after one rank's file is damaged.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.inference_cases import TINY_CONFIG

__all__ = ["flip_middle", "load_each", "make_checkpoints", "pipeline_case", "run_cli"]


def flip_middle(path: str | Path, nbytes: int = 4096) -> None:
    """Invert ``nbytes`` in the middle of a file (its size stays the same)."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - nbytes // 2)
    data[start : start + nbytes] = bytes(b ^ 0xFF for b in data[start : start + nbytes])
    path.write_bytes(bytes(data))


def _teacher_meta(cfg, layout) -> dict[str, Any]:
    """What ``train_teacher`` records (without the losses it measured)."""
    return {"kind": "teacher", "iteration": 0, "layout": asdict(layout), "config": cfg.to_dict()}


def make_checkpoints(workdir: str) -> dict[str, str]:
    """A tiny teacher checkpoint (random weights) and a 1-iteration elastic checkpoint."""
    from elastic_plugin.checkpoint.io import save_checkpoint
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout
    from tests.support import elastic_cases as ec

    work = Path(workdir)
    cfg = load_config(TINY_CONFIG)
    initialize_layout(Layout(), seed=3)
    chunks, _ = build_model_chunks(cfg.model, Layout(), wrap_ddp=False)
    teacher = save_checkpoint(chunks, work / "teacher", _teacher_meta(cfg, Layout()))
    elastic = ec.train_tiny_elastic(
        ec._experiment(str(TINY_CONFIG), None), work / "elastic_run", iters=1, batch=2, lr=1e-3
    )
    return {"teacher": str(teacher), "elastic": str(elastic)}


def _checksum(chunks) -> float:
    model = getattr(chunks[0], "module", chunks[0])
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def load_each(paths: list[str]) -> dict[str, str]:
    """``build_from_checkpoint`` of each path at TP=PP=EP=1: ``"ok <checksum>"`` or the
    ConfigError's message (anything else propagates: a raw traceback is a failure)."""
    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.parallel import Layout, initialize_layout

    out = {}
    for path in paths:
        initialize_layout(Layout())
        try:
            chunks, _, _ = build_from_checkpoint(path, Layout(), wrap_ddp=False)
            out[path] = f"ok {_checksum(chunks):.6f}"
        except ConfigError as exc:
            out[path] = f"ConfigError: {exc}"
    return out


def run_cli(argv: list[str]) -> dict[str, Any]:
    """``elastic-plugin ARGV`` in this rank: exit code, stdout, stderr."""
    from elastic_plugin.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    return {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def _params(chunks) -> dict[str, torch.Tensor]:
    model = getattr(chunks[0], "module", chunks[0])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def pipeline_case(workdir: str) -> dict[str, Any]:
    """2 ranks: save under PP=2 (each rank writes its own shard file), load back under PP=2 and
    resharded to DP=2; then rank 0 damages the file rank 1 hashes, and both ranks' loads fail
    with the same message."""
    from elastic_plugin.checkpoint.integrity import balanced_share, file_digest
    from elastic_plugin.checkpoint.io import load_checkpoint, save_checkpoint
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.models.config import ConfigError, load_config
    from elastic_plugin.parallel import Layout, build_model_chunks, initialize_layout

    rank = dist.get_rank()
    ckpt = Path(workdir) / "pp2"
    cfg = load_config(TINY_CONFIG)
    pp2 = Layout(pp=2)
    initialize_layout(pp2, seed=11)
    chunks, _ = build_model_chunks(cfg.model, pp2, wrap_ddp=False)
    saved = _params(chunks)
    save_checkpoint(chunks, ckpt, _teacher_meta(cfg, pp2))
    recorded = read_checkpoint_meta(ckpt)["files"]
    intact = all(file_digest(ckpt / name) == entry for name, entry in recorded.items())

    initialize_layout(pp2, seed=12)  # other random weights, replaced by the load
    fresh, _ = build_model_chunks(cfg.model, pp2, wrap_ddp=False)
    load_checkpoint(fresh, ckpt)
    same_pp2 = all(torch.equal(saved[n], p) for n, p in _params(fresh).items())

    initialize_layout(Layout(), seed=13)  # DP=2: every rank reads every stage's file
    whole, _ = build_model_chunks(cfg.model, Layout(), wrap_ddp=False)
    load_checkpoint(whole, ckpt)
    whole_params = _params(whole)
    # stage 0's names are the whole model's (stage 1 numbers its layers from 0 again)
    same_dp2 = rank != 0 or all(torch.equal(whole_params[n], p) for n, p in saved.items())

    sizes = {name: int(entry["bytes"]) for name, entry in recorded.items()}
    (damaged,) = [n for n in balanced_share(sizes, 1, 2) if n.endswith(".distcp")][:1]
    dist.barrier()  # every rank has read the checkpoint before one of its files is damaged
    if rank == 0:
        flip_middle(ckpt / damaged)
    dist.barrier()
    initialize_layout(pp2, seed=14)
    again, _ = build_model_chunks(cfg.model, pp2, wrap_ddp=False)
    try:
        load_checkpoint(again, ckpt)
        error = ""
    except ConfigError as exc:
        error = str(exc)
    return {
        "rank": rank,
        "files": sorted(recorded),
        "intact": intact,
        "same_pp2": same_pp2,
        "same_dp2": same_dp2,
        "whole": _checksum(whole),
        "params": len(saved),
        "damaged": damaged,
        "error": error,
    }
