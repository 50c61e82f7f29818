"""One elastic training step of a Llama-shaped model, sliced at width fraction f, vs a plain
Megatron model of the same reduced size (the GPT-family version of ``bench_elastic_step.py``).

The model is what ``import --hf`` builds from a scaled-down Llama 3.1 ``config.json``
(``families``' Llama mapping: ``*-`` pairs, SwiGLU, GQA, RMSNorm, Llama 3.1 RoPE scaling, tied
embeddings). For each width fraction f (hidden, FFN and query heads within their groups, rounded
as ``ElasticConfig`` rounds), these steps (forward + backward of the token-mean cross-entropy)
run interleaved in one ``interleaved_medians`` call:

* ``plain_full``: a plain Megatron-Core model (never elastified): the baseline;
* ``plain_copy``: a second plain instance with the same weights: the machine's noise floor;
* ``elastic_full``: the same weights elastified, state cleared (the full budget through the
  plugin): ``overhead = elastic_full / plain_full``, target <= 1.05;
* ``sliced``: the elastic model at f (``state.set_sizes``: only the active blocks computed);
* ``sliced_st``: sliced + straight-through masks with router gradients (what training runs);
* ``plain_small``: a plain model of the reduced size holding the nested weights
  (``nested.slicing.nested_state_dict``), so its loss must equal ``sliced``'s (checked first).

Goal (docs/design.md): ``sliced/small`` <= 1.10.

Run: ``python bench/bench_elastic_llama.py [--quick] [--reps N] [--json PATH]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved_medians  # noqa: E402
from bench_elastic_step import (  # noqa: E402
    MAX_OVERHEAD,
    MAX_SLICED_VS_SMALL,
    NOISY,
    BenchModel,
    _build,
    _close,
    _one_hot,
    _setup,
    _stepper,
    _verdict,
    fraction_sizes,
    matmul_flops,
)

FRACTIONS = (0.75, 0.5)
# a Llama 3.1-shaped config.json, scaled down to step in ~0.1-0.3 s on 2 CPU cores
LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rope_theta": 500000.0,
}


def llama_model(batch: int = 4, seq: int = 256) -> BenchModel:
    """The ModelConfig ``import --hf`` maps LLAMA_CONFIG to, with the batch of one step."""
    from elastic_plugin.families import model_config_from_hf

    return BenchModel("llama", model_config_from_hf(LLAMA_CONFIG), batch=batch, seq=seq)


def _batch(bm: BenchModel):
    import torch

    gen = torch.Generator().manual_seed(0)
    b, s, v = bm.batch, bm.seq, bm.cfg.vocab_size
    tokens = torch.randint(0, v, (b, s), generator=gen)
    labels = torch.randint(0, v, (b, s), generator=gen)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
    return tokens, torch.arange(s).expand(b, s), causal, labels


def measure(
    fractions: tuple[float, ...] = FRACTIONS, reps: int = 5, warmup: int = 2, seq: int = 256
) -> list[dict]:
    """One full-budget row (plugin overhead), then one row per width fraction."""
    from elastic_plugin.models.config import ConfigError

    if reps < 1 or warmup < 0:
        raise ConfigError(f"reps={reps}, warmup={warmup}; allowed: reps >= 1, warmup >= 0")
    if not fractions or not all(0 < f < 1 for f in fractions):
        raise ConfigError(
            f"fractions={list(fractions)}; allowed: a non-empty list of width fractions in (0, 1)"
        )
    bm = llama_model(seq=seq)
    cfg = bm.cfg
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.layers.modules import elastify
    from elastic_plugin.elastic.layers.state import SLICED, ElasticState, RankInfo
    from elastic_plugin.models.axes import model_for_choice
    from elastic_plugin.nested.slicing import nested_state_dict

    _setup()
    labels = [f"f{f:g}" for f in fractions]
    choices = {label: fraction_sizes(cfg, f) for label, f in zip(labels, fractions, strict=True)}
    candidates = {
        axis: sorted({full, *(c[axis] for c in choices.values())}, reverse=True)
        for axis, full in fraction_sizes(cfg, 1.0).items()
    }
    resolved = ElasticConfig.from_dict({"budgets": [1.0], "sizes": candidates}).resolve(cfg)
    batch = _batch(bm)
    plain = _build(cfg)
    plain_copy = _build(cfg)
    plain_copy.load_state_dict(plain.state_dict())
    elastic = _build(cfg)
    elastic.load_state_dict(plain.state_dict())
    state = ElasticState(resolved, RankInfo(), groups={"attention_heads": cfg.query_groups})
    elastify(elastic, state)
    steps = {
        "plain_full": _stepper(plain, batch),
        "plain_copy": _stepper(plain_copy, batch),
        "elastic_full": _stepper(elastic, batch, state.clear),
    }
    smalls = {}
    for label in labels:
        sizes = choices[label]
        small_cfg = model_for_choice(cfg, sizes)
        small = _build(small_cfg)
        missing, unexpected = small.load_state_dict(
            nested_state_dict(plain, cfg, sizes), strict=False
        )
        if unexpected or not all(k.endswith("_extra_state") for k in missing):
            raise AssertionError(f"{label}: nested weights do not fit the small model")
        smalls[label] = small_cfg
        probs = _one_hot(resolved, sizes)
        steps[f"sliced {label}"] = _stepper(elastic, batch, lambda s=sizes: state.set_sizes(s))
        steps[f"sliced_st {label}"] = _stepper(
            elastic, batch, lambda p=probs: state.set_choice(p, SLICED, with_masks=True)
        )
        steps[f"plain_small {label}"] = _stepper(small, batch)

    # correctness before timing: the full budget is Megatron's model, a budget its nested model
    losses = {key: fn() for key, fn in steps.items()}
    if not _close(losses["elastic_full"], losses["plain_full"], 1e-5):
        raise AssertionError(f"elastic full {losses['elastic_full']} != {losses['plain_full']}")
    for label in labels:
        for mode in ("sliced_st", "plain_small"):
            if not _close(losses[f"{mode} {label}"], losses[f"sliced {label}"], 1e-4):
                raise AssertionError(
                    f"{label}: {mode} loss {losses[f'{mode} {label}']} != sliced loss "
                    f"{losses[f'sliced {label}']}"
                )

    t = interleaved_medians(steps, reps=reps, warmup=warmup)
    full = t["plain_full"]
    if abs(t["plain_copy"] / full - 1) > NOISY:
        print(
            f"bench_elastic_llama: two identical plain models differ by "
            f"{t['plain_copy'] / full - 1:+.0%}: the machine was busy; rerun with more --reps",
            file=sys.stderr,
        )
    overhead = t["elastic_full"] / full
    rows: list[dict] = [
        {
            "name": f"elastic step llama full budget b{bm.batch}xs{bm.seq} [cpu]",
            "plain_full_ms": full * 1e3,
            "elastic_full_ms": t["elastic_full"] * 1e3,
            "copy/plain": t["plain_copy"] / full,
            "overhead": overhead,
            f"overhead<={MAX_OVERHEAD:g}": _verdict(overhead <= MAX_OVERHEAD),
        }
    ]
    flops_full = matmul_flops(cfg, bm.batch, bm.seq)
    for label, f in zip(labels, fractions, strict=True):
        vs_small = t[f"sliced {label}"] / t[f"plain_small {label}"]
        rows.append(
            {
                "name": f"elastic step llama {label} (f={f:g})",
                "sizes": choices[label],
                "flop_ratio": matmul_flops(smalls[label], bm.batch, bm.seq) / flops_full,
                "sliced_ms": t[f"sliced {label}"] * 1e3,
                "sliced_st_ms": t[f"sliced_st {label}"] * 1e3,
                "plain_small_ms": t[f"plain_small {label}"] * 1e3,
                "sliced/full": t[f"sliced {label}"] / full,
                "small/full": t[f"plain_small {label}"] / full,
                "sliced/small": vs_small,
                "sliced_st/small": t[f"sliced_st {label}"] / t[f"plain_small {label}"],
                f"small<={MAX_SLICED_VS_SMALL:g}": _verdict(vs_small <= MAX_SLICED_VS_SMALL),
            }
        )
    return rows


def run(device: str | None = None, reps: int = 5, quick: bool = False) -> list[dict]:
    """All rows (``quick``: f = 0.5 only, 3 repetitions, sequence 128). CPU only."""
    if device not in (None, "cpu"):
        return []
    if quick:
        return measure((0.5,), reps=min(reps, 3), warmup=1, seq=128)
    return measure(reps=reps)


if __name__ == "__main__":
    import argparse
    import json

    from _timing import keep_freed_memory
    from run_all import print_table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="f=0.5, 3 repetitions, seq 128")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    keep_freed_memory()
    result = run(reps=args.reps, quick=args.quick)
    print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
