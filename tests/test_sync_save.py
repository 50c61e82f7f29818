"""compat/sync_save.py: a synchronous save hands its write results over in this process, so no
``multiprocessing`` manager is started (Megatron's default: spawned at a process's first save,
which then waits seconds for it to import torch), and the checkpoint loads back whole."""

from __future__ import annotations

import multiprocessing
from dataclasses import asdict

import torch

from tests.support.inference_cases import TINY_CONFIG, tiny_inference_model


def test_a_save_starts_no_manager_process_and_loads_back(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from elastic_plugin.checkpoint.io import load_checkpoint, save_checkpoint
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import Layout

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process
    model, _ = tiny_inference_model(seed=3)
    children = {p.pid for p in multiprocessing.active_children()}
    meta = {"kind": "extracted", "config": load_config(TINY_CONFIG).to_dict(),
            "layout": asdict(Layout())}  # fmt: skip
    save_checkpoint([model], tmp_path / "ckpt", meta)
    assert filesystem_async._results_queue is None  # Megatron's manager queue was never made
    assert {p.pid for p in multiprocessing.active_children()} == children

    saved = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    other, _ = tiny_inference_model(seed=4)
    load_checkpoint([other], tmp_path / "ckpt")
    loaded = {k: v for k, v in other.state_dict().items() if torch.is_tensor(v)}
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved if "_extra_state" not in k)
