"""Zero-shot extraction: the sliced weights of the elastic tiny model, loaded into a plain smaller
Megatron HybridModel (``model_for_choice``), give the elastic model's logits at that choice;
parameter counts match ``counting``; per-layer choices give per-layer shapes; bad choices fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny.yaml"
SIZES = {
    "embedding": [128, 96, 64],
    "ffn": [256, 128],
    "shared_ffn": [128, 64],
    "attention_heads": [4, 2],
    "mamba_heads": [8, 4],
    "mamba_head_dim": [16, 8],
    "experts": [8, 4],
}
SMALL = {
    "embedding": 64,
    "ffn": 128,
    "shared_ffn": 64,
    "attention_heads": 2,
    "mamba_heads": 4,
    "mamba_head_dim": 8,
    "experts": 4,
}
CHOICES = [
    {"embedding": 96},
    {"embedding": 64},
    {"ffn": 128},
    {"shared_ffn": 64},
    {"attention_heads": 2},
    {"mamba_heads": 4},
    {"mamba_head_dim": 8},
    {"experts": 4},
    SMALL,
    {**SMALL, "embedding": 96, "mamba_head_dim": 12, "experts": 2},
]
TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.config import load_config
    from elastic_plugin.parallel import (
        Layout,
        build_model_chunks,
        init_distributed,
        initialize_layout,
    )
    from tests.support.elastic_model import make_elastic

    enable_cpu_megatron()
    init_distributed()
    initialize_layout(Layout(), seed=7)
    cfg = load_config(CONFIG).model
    model = build_model_chunks(cfg, Layout(), wrap_ddp=False)[0][0]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # no constant tensors (norms = 1, D = 1, bias = 0): a wrong slice shows
        for tensor in [
            *model.parameters(),
            model.decoder.layers[2].mlp.router.expert_bias,
            model.decoder.layers[6].mlp.router.expert_bias,
        ]:
            tensor.add_(0.1 * torch.randn(tensor.shape, generator=gen))
    state, resolved = make_elastic(model, cfg, SIZES)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=gen)
    position = torch.arange(40).expand(2, 40)
    return cfg, model, state, resolved, tokens, position


def _plain(model_cfg):
    from elastic_plugin.parallel import Layout, build_model_chunks

    return build_model_chunks(model_cfg, Layout(), wrap_ddp=False)[0][0]


def _param_count(sliced: dict, module: torch.nn.Module) -> int:
    buffers = {name for name, _ in module.named_buffers()}
    return sum(
        v.numel()
        for k, v in sliced.items()
        if torch.is_tensor(v) and k not in buffers and not k.endswith("_extra_state")
    )


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sliced_plain_model_equals_elastic(setup, choice):
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, state, _, tokens, position = setup
    state.clear()
    with torch.no_grad():
        full = model(tokens, position, None)
        state.set_sizes(choice)
        elastic = model(tokens, position, None)
    state.clear()
    small_cfg = model_for_choice(cfg, choice)
    sliced = sliced_state_dict(model, cfg, choice)
    plain = _plain(small_cfg)
    assert not type(plain.output_layer).__name__.startswith("Elastic")
    assert set(sliced) == set(plain.state_dict())
    plain.load_state_dict(sliced, strict=True)
    with torch.no_grad():
        out = plain(tokens, position, None)
    diff = (out - elastic).abs().max().item()
    print(f"{choice}: max |plain - elastic| = {diff:.2e}")
    assert out.shape == elastic.shape == full.shape
    assert diff <= TOL
    assert (elastic - full).abs().max() > 1e-3  # the choice really changed the model
    assert _param_count(sliced, plain) == count_parameters(small_cfg).total
    assert sum(p.numel() for p in plain.parameters()) == count_parameters(small_cfg).total


def test_full_choice_is_the_original(setup):
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, state, resolved, tokens, position = setup
    full_choice = resolved.full_choice()
    original = model.state_dict()
    sliced = sliced_state_dict(model, cfg, full_choice)
    assert sliced.keys() == original.keys()
    for key, value in original.items():
        if torch.is_tensor(value):
            assert torch.equal(sliced[key], value), key
            assert sliced[key].data_ptr() != value.data_ptr()  # a copy, not a view
    assert sliced_state_dict(model, cfg, {}).keys() == original.keys()
    plain = _plain(model_for_choice(cfg, full_choice))
    plain.load_state_dict(sliced, strict=True)
    state.clear()
    with torch.no_grad():
        reference = model(tokens, position, None)
        out = plain(tokens, position, None)
    assert (out - reference).abs().max().item() <= TOL


def test_wrong_block_is_detected(setup):
    """The comparison is sharp: the same shapes with the *last* query head of every group in
    place of the first (what a slice ignoring the per-group layout would take) change the logits."""
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, state, _, tokens, position = setup
    choice = {"attention_heads": 2}
    sliced = sliced_state_dict(model, cfg, choice)
    d, block = cfg.head_dim, (cfg.num_attention_heads // cfg.query_groups + 2) * cfg.head_dim
    full = model.decoder.layers[1].self_attention.linear_qkv.weight.detach()
    rows = torch.cat(
        [torch.arange(g * block + d, (g + 1) * block) for g in range(cfg.query_groups)]
    )
    sliced["decoder.layers.1.self_attention.linear_qkv.weight"] = full[rows].clone()
    plain = _plain(model_for_choice(cfg, choice))
    plain.load_state_dict(sliced, strict=True)
    state.set_sizes(choice)
    with torch.no_grad():
        elastic = model(tokens, position, None)
        out = plain(tokens, position, None)
    state.clear()
    assert (out - elastic).abs().max() > 1e-3


def test_heterogeneous_shapes(setup):
    """Per-layer sizes: each layer's shapes follow its size, and its tensors are those of the
    homogeneous extraction at that size; the parameter count is the cost model's."""
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, _, resolved, _, _ = setup
    spec = resolved.axes
    assert spec["mamba_heads"].layers == (1, 5) and spec["attention_heads"].layers == (2, 6)
    assert spec["experts"].layers == (3, 7) and spec["ffn"].layers == (4, 8)
    choice = {
        "embedding": 96,
        "mamba_heads": [4, 8],
        "mamba_head_dim": [16, 8],
        "attention_heads": [2, 4],
        "experts": [8, 4],
        "shared_ffn": [64, 128],
        "ffn": [128, 256],
    }
    sliced = sliced_state_dict(model, cfg, choice)
    h, g, n, d = 96, cfg.mamba_num_groups, cfg.mamba_state_dim, cfg.head_dim
    shape = lambda key: tuple(sliced[f"decoder.layers.{key}"].shape)  # noqa: E731
    for i, (nh, p) in enumerate([(4, 16), (8, 8)]):
        layer = (0, 4)[i]
        assert shape(f"{layer}.mixer.in_proj.weight") == (2 * nh * p + 2 * g * n + nh, h)
        assert shape(f"{layer}.mixer.conv1d_weight") == (
            nh * p + 2 * g * n,
            1,
            cfg.mamba_conv_kernel,
        )
        assert shape(f"{layer}.mixer.A_log") == shape(f"{layer}.mixer.dt_bias") == (nh,)
        assert shape(f"{layer}.mixer.norm.weight") == (nh * p,)
        assert shape(f"{layer}.mixer.out_proj.weight") == (h, nh * p)
    for layer, heads in ((1, 2), (5, 4)):
        assert shape(f"{layer}.self_attention.linear_qkv.weight") == ((heads + 2 * 2) * d, h)
        assert shape(f"{layer}.self_attention.linear_proj.weight") == (h, heads * d)
    for layer, experts, shared in ((2, 8, 64), (6, 4, 128)):
        assert shape(f"{layer}.mlp.router.weight") == (experts, h)
        assert shape(f"{layer}.mlp.router.expert_bias") == (experts,)
        experts_prefix = f"decoder.layers.{layer}.mlp.experts."
        names = {k.split(".")[6] for k in sliced if k.startswith(experts_prefix)}
        assert names == {str(j) for j in range(experts)}
        assert shape(f"{layer}.mlp.shared_experts.linear_fc1.weight") == (shared, h)
        assert shape(f"{layer}.mlp.shared_experts.linear_fc2.weight") == (h, shared)
    for layer, ffn in ((3, 128), (7, 256)):
        assert shape(f"{layer}.mlp.linear_fc1.weight") == (ffn, h)
        assert shape(f"{layer}.mlp.linear_fc2.weight") == (h, ffn)

    # each layer = the homogeneous extraction at that layer's sizes
    per_layer = [{k: v[i] if isinstance(v, list) else v for k, v in choice.items()} for i in (0, 1)]
    homogeneous = [sliced_state_dict(model, cfg, c) for c in per_layer]
    layer_index = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    for key, value in sliced.items():
        if not torch.is_tensor(value):
            continue
        index = layer_index[int(key.split(".")[2])] if key.startswith("decoder.layers.") else 0
        assert torch.equal(value, homogeneous[index][key]), key

    cost = ElasticCost(cfg, resolved, metric="total_params")
    count = sum(
        v.numel() for k, v in sliced.items() if torch.is_tensor(v) and not k.endswith("expert_bias")
    )
    assert count == cost.of_choice(choice)


@pytest.mark.parametrize(
    "choice, axis",
    [
        ({"attention_heads": 3}, "attention_heads"),  # not a multiple of the 2 query groups
        ({"mamba_heads": 5}, "mamba_heads"),  # not a multiple of the 2 Mamba groups
        ({"ffn": 512}, "ffn"),  # bigger than full
        ({"mamba_head_dim": 0}, "mamba_head_dim"),
        ({"experts": 1}, "experts"),  # fewer than top-k
        ({"embedding": 64.0}, "embedding"),  # not an int
        ({"embedding": [64, 64]}, "embedding"),  # the hidden size is global
        ({"ffn": [128, 128, 128]}, "ffn"),  # 2 dense layers
        ({"vision_heads": 2}, "vision_heads"),  # unknown axis
    ],
)
def test_bad_choice_names_the_axis(setup, choice, axis):
    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, _, _, _, _ = setup
    with pytest.raises(ConfigError, match=axis):
        sliced_state_dict(model, cfg, choice)


def test_model_not_matching_config(setup):
    import dataclasses

    from elastic_plugin.models.config import ConfigError
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, _, _, _, _ = setup
    other = dataclasses.replace(cfg, hybrid_layer_pattern="M*E-M*E-M*")
    with pytest.raises(ConfigError, match="does not describe the model"):
        sliced_state_dict(model, other, {})


def test_slicing_and_reorder_run_on_the_csrc_gather_ops(setup, monkeypatch):
    """Extraction slices every tensor with ``ops.ordered_gather`` (the importance-ordered
    slicing kernel) and reordering moves a whole residual stream / Mamba block with one
    ``ops.ordered_gather_many`` call; results are those of plain ``index_select``: a reordered
    copy of the model computes the same logits, and undoing the permutation restores every
    weight bit for bit."""
    import elastic_plugin.ops as ops
    from elastic_plugin.importance.reorder import Permutations, apply_permutations, within_groups
    from elastic_plugin.nested.slicing import sliced_state_dict

    cfg, model, state, _, tokens, position = setup
    calls = {"ordered_gather": 0, "ordered_gather_many": []}
    gather, gather_many = ops.ordered_gather, ops.ordered_gather_many

    def counting_gather(*args, **kwargs):
        calls["ordered_gather"] += 1
        return gather(*args, **kwargs)

    def counting_many(tensors, *args, **kwargs):
        calls["ordered_gather_many"].append(len(tensors))
        return gather_many(tensors, *args, **kwargs)

    monkeypatch.setattr(ops, "ordered_gather", counting_gather)
    monkeypatch.setattr(ops, "ordered_gather_many", counting_many)
    sliced = sliced_state_dict(model, cfg, SMALL)
    assert (
        calls["ordered_gather"]
        >= len(
            [k for k, v in sliced.items() if torch.is_tensor(v) and not k.endswith("_extra_state")]
        )
        // 2
    )

    state.clear()
    plain = _plain(cfg)
    plain.load_state_dict({k: v for k, v in model.state_dict().items()}, strict=True)
    original = {k: v.clone() for k, v in plain.state_dict().items() if torch.is_tensor(v)}
    gen = torch.Generator().manual_seed(4)
    perms = Permutations(embedding=torch.randperm(cfg.hidden_size, generator=gen))
    for number, layer in enumerate(plain.decoder.layers, start=1):
        if type(layer).__name__ == "MambaLayer":
            perms.mamba_channels[number] = torch.randperm(cfg.mamba_head_dim, generator=gen)
            perms.mamba_heads[number] = within_groups(
                torch.rand(cfg.mamba_num_heads, generator=gen), cfg.mamba_num_groups
            )
        if type(layer).__name__ == "MLPLayer":
            perms.ffn[number] = torch.randperm(cfg.ffn_hidden_size, generator=gen)
    with torch.no_grad():
        before = plain(tokens, position, None)
        apply_permutations(plain, perms)
        after = plain(tokens, position, None)
    assert (after - before).abs().max().item() <= TOL
    residual_tensors = max(calls["ordered_gather_many"])
    assert residual_tensors >= 20  # every norm, linear input/output and embedding in one call
    moved = [
        k
        for k, v in plain.state_dict().items()
        if torch.is_tensor(v)
        and k in original
        and v.shape == original[k].shape
        and not torch.equal(v, original[k])
    ]
    assert len(moved) >= residual_tensors
