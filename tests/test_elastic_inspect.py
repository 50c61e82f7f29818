"""``elastic-plugin inspect``: per-budget sizes, parameters and memory of an elastic checkpoint.

The checkpoints here are only ``elastic_meta.json`` files written as ``elastic-train`` writes them
(``train._meta``), so nothing is built. Numbers are checked against ``ElasticCost`` and, where an
independent reference exists, against ``counting.count_parameters`` of the plain model a choice
describes and the memory formulas written out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_plugin.cli import main
from elastic_plugin.elastic.config import ElasticConfig, MemorySpec
from elastic_plugin.elastic.cost import BYTES_PER_PARAM, ElasticCost
from elastic_plugin.models.axes import model_for_choice
from elastic_plugin.models.config import load_config
from elastic_plugin.models.counting import count_parameters
from elastic_plugin.nested.cli import compact_sizes, inspect_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY_ELASTIC = ROOT / "examples" / "configs" / "tiny_elastic.yaml"
PREFIX = "elastic-plugin inspect: error: "

HOMOGENEOUS = {
    "1": {
        "embedding": 128,
        "ffn": 256,
        "shared_ffn": 128,
        "attention_heads": 4,
        "mamba_heads": 8,
        "mamba_head_dim": 16,
        "experts": 8,
    },
    "0.77": {
        "embedding": 96,
        "ffn": 256,
        "shared_ffn": 128,
        "attention_heads": 4,
        "mamba_heads": 8,
        "mamba_head_dim": 12,
        "experts": 8,
    },
    "0.4": {
        "embedding": 64,
        "ffn": 128,
        "shared_ffn": 64,
        "attention_heads": 2,
        "mamba_heads": 6,
        "mamba_head_dim": 8,
        "experts": 4,
    },
}
# tiny: M*E-M*E- -> every per-layer axis has two layers (mamba 1,5; attention 2,6; moe 3,7; mlp 4,8)
HETEROGENEOUS = {
    "1": {
        "embedding": 128,
        "ffn": [256, 256],
        "shared_ffn": [128, 128],
        "attention_heads": [4, 4],
        "mamba_heads": [8, 8],
        "mamba_head_dim": [16, 16],
        "experts": [8, 8],
    },
    "0.77": {
        "embedding": 96,
        "ffn": [256, 192],
        "shared_ffn": [128, 128],
        "attention_heads": [4, 2],
        "mamba_heads": [8, 6],
        "mamba_head_dim": [16, 12],
        "experts": [8, 6],
    },
    "0.4": {
        "embedding": 64,
        "ffn": [128, 192],
        "shared_ffn": [64, 96],
        "attention_heads": [2, 4],
        "mamba_heads": [4, 6],
        "mamba_head_dim": [8, 12],
        "experts": [4, 6],
    },
}
LAYOUT = {"tp": 1, "pp": 1, "ep": 1, "sequence_parallel": False, "distributed_optimizer": False}


def _setup(heterogeneous: bool):
    cfg = load_config(TINY_ELASTIC)
    raw = dict(cfg.elastic, heterogeneous=heterogeneous)
    if heterogeneous:  # the per-layer grid is too large to search by loss: freeze by likelihood
        raw["router"] = dict(raw["router"], freeze_select="likelihood")
    ecfg = ElasticConfig.from_dict(raw)
    return cfg, ecfg, ecfg.resolve(cfg.model)


def write_ckpt(
    path: Path, heterogeneous: bool = False, choices: dict | None = None, **overrides
) -> Path:
    """An elastic checkpoint's metadata, shaped like ``train._meta`` writes it."""
    cfg, ecfg, resolved = _setup(heterogeneous)
    choices = choices or (HETEROGENEOUS if heterogeneous else HOMOGENEOUS)
    meta = {
        "kind": "elastic",
        "iteration": 7,
        "consumed_samples": 112,
        "layout": LAYOUT,
        "config": cfg.to_dict() | {"elastic": ecfg.to_dict()},
        "elastic": {
            "budgets": list(resolved.budgets),
            "metric": ecfg.budget_metric,
            "axes": {
                n: {
                    "full": s.full,
                    "candidates": list(s.candidates),
                    "layers": list(s.layers),
                    "unit": s.unit,
                }
                for n, s in resolved.axes.items()
            },
            "choices": choices,
            "cost_fraction": {},
        },
    } | overrides
    path.mkdir(parents=True, exist_ok=True)
    (path / "elastic_meta.json").write_text(json.dumps(meta))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["inspect", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _expected_row(model, resolved, choice, batch, seq):
    cost = {m: ElasticCost(model, resolved, metric=m) for m in ("total_params", "active_params")}
    mem = {
        p: ElasticCost(model, resolved, metric="memory", memory=MemorySpec(batch, seq, p))
        for p in ("bf16", "fp8", "nvfp4")
    }
    return (
        cost["total_params"].of_choice(choice),
        cost["active_params"].of_choice(choice),
        {p: c.of_choice(choice) for p, c in mem.items()},
    )


@pytest.mark.parametrize("heterogeneous", [False, True])
def test_json_matches_elastic_cost(tmp_path, capsys, heterogeneous):
    ckpt = write_ckpt(tmp_path / "elastic", heterogeneous)
    cfg, _, resolved = _setup(heterogeneous)
    rc, out, err = run(
        capsys, "--ckpt", str(ckpt), "--json", "--batch-size", "3", "--seq-length", "64"
    )
    assert rc == 0, err
    data = json.loads(out)
    assert data["iteration"] == 7 and data["layout"] == LAYOUT
    assert data["metric"] == "total_params"
    assert data["memory"]["batch_size"] == 3 and data["memory"]["seq_length"] == 64
    assert set(data["axes"]) == set(resolved.axes)
    table = HETEROGENEOUS if heterogeneous else HOMOGENEOUS
    rows = data["rows"]
    assert [r["label"] for r in rows] == ["full", *table]
    assert rows[0]["budget"] is None and [r["budget"] for r in rows[1:]] == [1.0, 0.77, 0.4]
    full_count = count_parameters(cfg.model)
    assert (rows[0]["total_params"], rows[0]["active_params"]) == (
        full_count.total,
        full_count.active,
    )
    assert rows[0]["choice"] == resolved.full_choice() and rows[0]["fraction"] == 1.0
    frac_cost = ElasticCost(cfg.model, resolved, metric="total_params")
    for row in rows[1:]:
        choice = table[row["label"]]
        assert row["choice"] == choice
        total, active, mem = _expected_row(cfg.model, resolved, choice, 3, 64)
        assert row["total_params"] == total and row["active_params"] == active
        assert row["memory_bytes"] == pytest.approx(mem, rel=1e-12)
        assert row["fraction"] == pytest.approx(total / frac_cost.full, rel=1e-12)
        assert 0 < row["total_params"] <= full_count.total


def test_params_equal_counting_of_the_plain_models(tmp_path):
    """Independent reference: a homogeneous choice is the plain model ``model_for_choice`` builds;
    a heterogeneous one with two layers per kind is the mean of its two homogeneous halves."""
    cfg, _, _ = _setup(False)
    info = inspect_checkpoint(write_ckpt(tmp_path / "hom", False))
    for row in info.rows[1:]:
        ref = count_parameters(model_for_choice(cfg.model, HOMOGENEOUS[row.label]))
        assert (row.total_params, row.active_params) == (ref.total, ref.active)
    info = inspect_checkpoint(write_ckpt(tmp_path / "het", True))
    for row in info.rows[1:]:
        halves = [
            count_parameters(
                model_for_choice(
                    cfg.model,
                    {a: (v[i] if isinstance(v, list) else v) for a, v in row.choice.items()},
                )
            )
            for i in (0, 1)
        ]
        assert 2 * row.total_params == halves[0].total + halves[1].total
        assert 2 * row.active_params == halves[0].active + halves[1].active
    low = info.rows[-1]
    assert low.total_params < info.rows[0].total_params


def test_memory_formula_and_flags(tmp_path):
    """Full-model memory written out by hand; --batch-size/--seq-length scale only the state."""
    ckpt = write_ckpt(tmp_path / "elastic")
    cfg, _, _ = _setup(False)
    m = cfg.model
    total = count_parameters(m).total
    batch, seq = 2, 64
    d_inner = m.mamba_num_heads * m.mamba_head_dim
    conv_dim = d_inner + 2 * m.mamba_num_groups * m.mamba_state_dim
    state = (
        2 * (2 * m.num_query_groups * m.kv_channels * seq * batch * 2)  # 2 attn layers
        + 2
        * (
            d_inner * m.mamba_state_dim * batch * 4
            + (m.mamba_conv_kernel - 1) * conv_dim * batch * 2
        )
    )  # 2 Mamba layers
    full = inspect_checkpoint(ckpt, batch, seq).rows[0]
    for precision, per_param in (("bf16", 2.0), ("fp8", 1.0), ("nvfp4", 0.5625)):
        assert BYTES_PER_PARAM[precision] == per_param
        assert full.memory_bytes[precision] == pytest.approx(total * per_param + state, rel=1e-12)
    default = inspect_checkpoint(ckpt)
    assert (default.batch_size, default.seq_length) == (1, m.max_sequence_length)
    one = inspect_checkpoint(ckpt, 1, 64).rows
    four = inspect_checkpoint(ckpt, 4, 64).rows
    for a, b in zip(one, four):  # state grows linearly with the batch, weights do not
        weights = a.total_params * 2.0
        assert b.memory_bytes["bf16"] - weights == pytest.approx(
            4 * (a.memory_bytes["bf16"] - weights), rel=1e-12
        )


def test_table(tmp_path, capsys):
    ckpt = write_ckpt(tmp_path / "elastic", True)
    rc, out, err = run(capsys, "--ckpt", str(ckpt))
    assert rc == 0, err
    info = inspect_checkpoint(ckpt)
    assert "iteration 7" in out and "tp=1, pp=1, ep=1" in out
    assert "budget metric: total_params" in out and f"sequence {256}" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "budget 0.77" in line)
    table = lines[header:]
    assert table[0].split()[0] == "full"
    assert len({len(line) for line in table}) == 1, "columns are not aligned"

    def cells(name: str) -> list[str]:
        line = next(line for line in table if line.startswith(name))
        return [c.strip() for c in line[len(table[1].split("  ")[0]) :].split("  ") if c.strip()]

    assert cells("total params") == [f"{r.total_params:,}" for r in info.rows]
    assert cells("active params") == [f"{r.active_params:,}" for r in info.rows]
    assert cells("ffn") == ["256", "256 (x2)", "[256, 192]", "[128, 192]"]
    assert cells("embedding") == ["128", "128", "96", "64"]
    for precision in ("bf16", "fp8", "nvfp4"):
        assert f"memory {precision}" in out
    assert [float(c) for c in cells("total_params fraction")] == pytest.approx(
        [r.fraction for r in info.rows], abs=1e-4
    )


def test_compact_sizes():
    assert compact_sizes(96) == "96"
    assert compact_sizes([128, 128, 128]) == "128 (x3)"
    assert compact_sizes([192, 192, 128, 192]) == "[192x2, 128, 192]"


def test_bad_input(tmp_path, capsys):
    def error(*argv: str) -> str:
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == ""
        assert err.startswith(PREFIX), err
        return err

    assert "no such checkpoint directory" in error("--ckpt", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no elastic_meta.json" in error("--ckpt", str(empty))
    out_dir = tmp_path / "out"
    write_ckpt(out_dir / "checkpoints" / "elastic")
    assert "did you mean --ckpt" in error("--ckpt", str(out_dir))
    teacher = write_ckpt(tmp_path / "teacher", kind="teacher")
    err = error("--ckpt", str(teacher))
    assert "'teacher' checkpoint" in err and "elastic-train" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "elastic_meta.json").write_text("{not json")
    assert "not readable JSON" in error("--ckpt", str(broken))
    good = write_ckpt(tmp_path / "good")
    assert "--batch-size=0" in error("--ckpt", str(good), "--batch-size", "0")
    assert "--seq-length=-5" in error("--ckpt", str(good), "--seq-length", "-5")
    bad_len = dict(HETEROGENEOUS, **{"0.4": dict(HETEROGENEOUS["0.4"], ffn=[128, 128, 128])})
    err = error("--ckpt", str(write_ckpt(tmp_path / "badlen", True, bad_len)))
    assert "choices['0.4']['ffn']" in err and "one per layer [4, 8]" in err
    bad_axis = dict(HOMOGENEOUS, **{"1": dict(HOMOGENEOUS["1"], heads=3)})
    assert "unknown axis heads" in error(
        "--ckpt", str(write_ckpt(tmp_path / "ax", False, bad_axis))
    )
    too_big = dict(HOMOGENEOUS, **{"1": dict(HOMOGENEOUS["1"], experts=9)})
    assert "integers in [1, 8]" in error(
        "--ckpt", str(write_ckpt(tmp_path / "big", False, too_big))
    )
    no_choices = write_ckpt(tmp_path / "nochoice", elastic={"metric": "total_params"})
    assert "lacks the elastic config or the choice table" in error("--ckpt", str(no_choices))
