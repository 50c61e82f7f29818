"""The chunked distillation loss vs the unchunked one: peak memory and time, side by side.

One micro-batch of 8K tokens (``[s, b] = [8192, 1]``) of BF16 student and teacher logits over one
TP rank's vocabulary shard. Nano v3's vocabulary is 131,072, so under TP=2 the shard is 65,536
entries; the unchunked loss's FP32 temporaries then need ~10 GiB, more than a shared 24 GiB CPU
machine can spare, so the default shard is scaled by 1/8 (8,192 entries: the memory of every
variant scales linearly in the shard, so the ratio is the same). ``--vocab-shard 65536`` runs
the real size where memory allows.

Measured per variant (``elastic.losses.vocab_parallel_kl``, forward + backward of the summed loss,
the logits allocated outside the measured region): peak bytes allocated above the inputs
(``tests.support.memory.peak_bytes``: the CPU allocator's events, or CUDA's peak counter), the
planner's prediction of that peak (``planning.activations.kd_loss_peak_bytes``), and the
median time of interleaved repetitions. Ratios: ``chunked / unchunked`` peak and time.

Run: ``python bench/bench_kd_loss.py [--quick] [--reps N] [--json PATH]`` or
``python bench/run_all.py --only kd_loss``. ``--quick``: 2,048 tokens, one repetition.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from _timing import interleaved_medians  # noqa: E402

NANO_V3_VOCAB = 131072
SCALED_SHARD = 8192  # NANO_V3_VOCAB / TP2 / 8


def run(
    quick: bool = False,
    reps: int | None = None,
    tokens: int | None = None,
    vocab_shard: int = SCALED_SHARD,
    chunks: tuple[int, ...] = (1024, 256),
) -> list[dict]:
    import torch

    from elastic_plugin.elastic.losses import vocab_parallel_kl
    from elastic_plugin.ops._loader import INFO
    from elastic_plugin.planning.activations import kd_loss_peak_bytes
    from tests.support.memory import peak_bytes

    tokens = tokens or (2048 if quick else 8192)
    reps = reps or (1 if quick else 3)
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    student = (torch.randn(tokens, 1, vocab_shard, generator=gen) * 3).to(torch.bfloat16)
    teacher = (student.float() + torch.randn(student.shape, generator=gen) * 3).to(torch.bfloat16)

    def loss_fn(chunk: int | None):
        def once() -> float:
            s = student.detach().requires_grad_(True)
            loss = vocab_parallel_kl(s, teacher, 1.0, chunk_tokens=chunk).sum()
            loss.backward()
            return float(loss.detach())

        return once

    variants = {"unchunked": None, **{f"chunk {c}": c for c in chunks}}
    fns = {name: loss_fn(c) for name, c in variants.items()}
    peaks, losses = {}, {}
    for name, fn in fns.items():
        peaks[name], losses[name] = peak_bytes(fn, device)
    seconds = interleaved_medians(fns, reps=reps, warmup=0 if quick else 1)
    rows = []
    for name, chunk in variants.items():
        predicted = kd_loss_peak_bytes(tokens, vocab_shard, 2, chunk, INFO.uses_extension)
        rows.append(
            {
                "name": f"kd_loss {name}",
                "tokens": tokens,
                "vocab_shard": vocab_shard,
                "peak_MiB": peaks[name] / 2**20,
                "predicted_MiB": predicted / 2**20,
                "measured/predicted": peaks[name] / predicted,
                "seconds": seconds[name],
                "peak_ratio": peaks[name] / peaks["unchunked"],
                "time_ratio": seconds[name] / seconds["unchunked"],
                "loss_rel_diff": abs(losses[name] - losses["unchunked"]) / losses["unchunked"],
            }
        )
    return rows


def main() -> None:
    from run_all import print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="default 8192 (2048 --quick)")
    parser.add_argument(
        "--vocab-shard",
        type=int,
        default=SCALED_SHARD,
        help=f"vocabulary entries per TP rank (default {SCALED_SHARD}: Nano v3's {NANO_V3_VOCAB} "
        f"at TP2, scaled 1/8; {NANO_V3_VOCAB // 2} is the real shard)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = run(args.quick, args.reps, args.tokens, args.vocab_shard)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
