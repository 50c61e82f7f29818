"""Depth pruning (``nested.depth``): the pruned model is the parent with those layers skipped,
logits exact; blocks, the pruned pattern and bad input; the written checkpoint loads back."""

from __future__ import annotations

import pytest
import torch

from elastic_plugin.models.config import ConfigError, load_config
from tests.support.inference_cases import TINY_CONFIG, perturb_

pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")

LLAMA = TINY_CONFIG.with_name("tiny_llama.yaml")
DROP_BLOCKS = (1, 2)  # of 4: the pruned model keeps blocks 0 and 3


def _skip(_module, _args, kwargs, output):
    hidden = kwargs["hidden_states"]
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


@pytest.fixture(scope="module")
def parent():
    from elastic_plugin.compat import enable_cpu_megatron

    enable_cpu_megatron()
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_distributed()
    initialize_layout(Layout(), seed=3)
    cfg = load_config(LLAMA)
    model = build_model_chunks(cfg.model, Layout(), wrap_ddp=False)[0][0]
    perturb_(model, seed=3)
    model.eval()
    yield model, cfg
    torch.set_num_threads(threads)


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)


def test_blocks_of_patterns():
    from elastic_plugin.nested.depth import blocks, depth_pruned_config, layers_of_blocks

    cfg = load_config(LLAMA).model
    assert blocks(cfg) == [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert layers_of_blocks(cfg, DROP_BLOCKS) == [3, 4, 5, 6]
    assert depth_pruned_config(cfg, [3, 4, 5, 6]).hybrid_layer_pattern == "*-*-"
    hybrid = load_config(TINY_CONFIG).model  # M*E-M*E-: a leading channel layer is its own block
    assert blocks(hybrid)[0] == (1,) and all(len(b) >= 1 for b in blocks(hybrid))
    assert sum(len(b) for b in blocks(hybrid)) == hybrid.num_layers
    with pytest.raises(ConfigError, match="dropped layers"):
        depth_pruned_config(cfg, [0])
    with pytest.raises(ConfigError, match="leaves no model"):
        depth_pruned_config(cfg, range(1, 9))
    with pytest.raises(ConfigError, match="block 4"):
        layers_of_blocks(cfg, [4])


def test_block_scores_sum_layers_and_need_every_layer():
    from elastic_plugin.nested.depth import block_scores

    cfg = load_config(LLAMA).model
    scores = {n: float(n) for n in range(1, 9)}
    assert block_scores(cfg, scores) == [3.0, 7.0, 11.0, 15.0]
    with pytest.raises(ConfigError, match="importance --depth"):
        block_scores(cfg, {1: 1.0})


def test_pruned_logits_equal_the_parent_with_those_layers_skipped(parent):
    from elastic_plugin.nested.depth import depth_pruned_model, layers_of_blocks

    model, cfg = parent
    drop = layers_of_blocks(cfg.model, DROP_BLOCKS)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    full = _logits(model, tokens)
    handles = [
        model.decoder.layers[n - 1].register_forward_hook(_skip, with_kwargs=True) for n in drop
    ]
    try:
        skipped = _logits(model, tokens)
    finally:
        for h in handles:
            h.remove()
    pruned, small = depth_pruned_model(model, cfg.model, drop)
    pruned.eval()
    assert small.hybrid_layer_pattern == "*-*-"
    assert len(pruned.decoder.layers) == 4
    assert torch.equal(_logits(pruned, tokens), skipped)
    assert not torch.allclose(skipped, full)  # the skipped layers did something


def test_written_checkpoint_loads_back_pruned(parent, tmp_path):
    from dataclasses import asdict

    from elastic_plugin.checkpoint.io import build_from_checkpoint, save_checkpoint
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.nested.depth import depth_pruned_model, write_depth_pruned
    from elastic_plugin.parallel import Layout

    model, cfg = parent
    meta = {"kind": "reordered", "config": cfg.to_dict(), "layout": asdict(Layout())}
    save_checkpoint([model], tmp_path / "parent", meta)
    with pytest.raises(ConfigError, match="dropped layers"):
        write_depth_pruned(tmp_path / "parent", tmp_path / "bad", [9])
    assert not (tmp_path / "bad").exists()
    out = write_depth_pruned(tmp_path / "parent", tmp_path / "pruned", [3, 4])
    written = read_checkpoint_meta(out)
    assert written["kind"] == "depth_pruned" and written["dropped_layers"] == [3, 4]
    assert written["config"]["model"]["hybrid_layer_pattern"] == "*-*-*-"
    loaded = build_from_checkpoint(out, Layout(), wrap_ddp=False)[0][0]
    loaded.eval()
    expected, _ = depth_pruned_model(model, cfg.model, [3, 4])
    expected.eval()
    tokens = torch.randint(
        0, cfg.model.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(_logits(loaded, tokens), _logits(expected, tokens))
    assert write_depth_pruned(tmp_path / "parent", tmp_path / "pruned", [3, 4]) == out  # reused


def test_elastic_train_accepts_a_depth_pruned_student_of_its_teacher():
    """elastic-train's teacher check: the parent may teach a depth-pruned student (only the
    pattern differs, a subsequence of the teacher's); any other difference is refused."""
    import dataclasses

    from elastic_plugin.elastic.inputs import _depth_pruned_of
    from elastic_plugin.nested.depth import depth_pruned_config

    parent = load_config(LLAMA).model
    assert _depth_pruned_of(depth_pruned_config(parent, [3, 4]), parent)
    assert not _depth_pruned_of(dataclasses.replace(parent, hybrid_layer_pattern="*-" * 5), parent)
    wider = dataclasses.replace(depth_pruned_config(parent, [3, 4]), ffn_hidden_size=128)
    assert not _depth_pruned_of(wider, parent)
