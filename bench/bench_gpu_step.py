"""The GPU acceptance benchmark: a plain Megatron-Core training step against our elastic step.

    python bench/bench_gpu_step.py --device cuda --out DIR    # ~1B GPT, seq 2048, bf16 (a GPU)
    BENCH_DEVICE=cpu python bench/bench_gpu_step.py --out DIR # the same rows at tiny sizes

The model is what ``import --hf`` builds from a Llama 3.2 1B-shaped ``config.json`` (vocabulary
32768: 1.04B parameters, 16 ``*-`` blocks, GQA 32/8, SwiGLU, tied embeddings); every step is
BF16 (FP32 main weights in Megatron's optimizer) on synthetic tokens. The rows, each timed after
warm-up as the mean of ``reps`` steps (CUDA-synchronised), with tokens/s, model TFLOP/s
(``models/flops.py``: 3 x forward, plus the teacher's forward in an elastic step) and MFU against
the BF16 peak measured first:

* ``bf16_peak``: an 8192^3 BF16 GEMM (2048^3 on a CPU), the MFU denominator;
* ``megatron_step``: Megatron-Core's own training step of the plain model (DDP, its schedule,
  its optimizer; what ``train`` runs): the baseline;
* ``elastic_b1.0``: our elastic step (``ElasticStep``: frozen-teacher forward, KD loss, router,
  optimizer) with every micro-batch at budget 1.0; goal MFU >= 0.95 x the baseline's;
* ``elastic_mix``: the same at the configured mix (the budgets and last curriculum stage of
  ``--elastic-config``; each smaller budget a fixed nested model of about its parameter
  fraction, as a frozen router gives); goal tokens/s >= 1.0 x the baseline's;
* ``student_full`` / ``sliced_half`` / ``masked_half``: the elastic student's forward + backward
  at full width, sliced at half width (only the active blocks computed) and masked at half width
  (full-width compute times prefix masks); goal: sliced time / full time within 10% of its FLOP
  ratio;
* ``fp8_full`` / ``fp8_sliced_half``: the same with our FP8 GEMM path (E4M3, per-tensor current
  scaling; ``torch._scaled_mm`` on sm_89+, an emulation elsewhere) against BF16.

It writes ``gpu_step.json`` (the rows, the config and the device) and ``gpu_step.md`` (the table)
to ``--out`` (default ``$OUT``). ``scripts/gpu_check.sh`` runs it on a GPU; CI runs the CPU rows
(tests/test_bench_gpu_step.py). ``run()`` (``bench/run_all.py --device cuda``) gives the GPU rows
only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_elastic_step import fraction_for_budget, fraction_sizes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ELASTIC_CONFIG = ROOT / "examples" / "configs" / "tiny_elastic.yaml"
ROWS = (
    "bf16_peak",
    "megatron_step",
    "elastic_b1.0",
    "elastic_mix",
    "student_full",
    "sliced_half",
    "masked_half",
    "fp8_full",
    "fp8_sliced_half",
)
GOAL_B1_MFU = 0.95  # elastic step at budget 1.0: MFU >= 0.95 x the plain step's
GOAL_MIX_TOKENS = 1.0  # at the configured mix: tokens/s >= the plain step's
GOAL_SLICED_FLOPS = 0.10  # sliced time / full time within 10% of the FLOP ratio
HALF = 0.5

# the Llama 3.2 1B shape (vocabulary cut to 32768), and the same family at CPU size
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
}
SIZES: dict[str, dict[str, Any]] = {
    "1b": {
        "config": {
            "vocab_size": 32768,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 4096,
        },
        "seq": 2048,
        "micro_batch": 2,
        "microbatches": 4,
        "peak_n": 8192,
    },
    "tiny": {
        "config": {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 128,
        },
        "seq": 64,
        "micro_batch": 2,
        "microbatches": 2,
        "peak_n": 256,
    },
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One benchmark's model and step shape."""

    size: str
    cfg: Any  # ModelConfig
    seq: int
    micro_batch: int
    microbatches: int
    peak_n: int
    device: torch.device

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.micro_batch * self.microbatches


def setup(device: str, size: str | None = None) -> Setup:
    """``size`` default: ``1b`` on a GPU, ``tiny`` on a CPU."""
    from elastic_plugin.families import model_config_from_hf

    size = size or ("1b" if device == "cuda" else "tiny")
    if size not in SIZES:
        raise SystemExit(f"--size {size!r}: allowed {', '.join(SIZES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (BENCH_DEVICE=cpu runs tiny)")
    spec = SIZES[size]
    cfg = model_config_from_hf({**LLAMA, **spec["config"]})
    return Setup(
        size,
        cfg,
        spec["seq"],
        spec["micro_batch"],
        spec["microbatches"],
        spec["peak_n"],
        torch.device(device),
    )


# ------------------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device, reps: int, warmup: int) -> float:
    """Mean seconds of ``fn`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def bf16_peak(s: Setup, reps: int) -> dict[str, Any]:
    """The BF16 GEMM rate this device reaches: the MFU denominator."""
    n = s.peak_n
    gen = torch.Generator(device=s.device).manual_seed(0)
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=gen)
    seconds = timed(lambda: a @ b, s.device, max(reps, 3) * 2, 2)
    return {
        "name": "bf16_peak",
        "gemm": f"{n}^3",
        "ms": seconds * 1e3,
        "tflops": 2 * n**3 / seconds / 1e12,
    }


def _rates(s: Setup, seconds: float, flops: float, tokens: int, peak: float) -> dict[str, float]:
    tflops = flops / seconds / 1e12
    return {
        "ms": seconds * 1e3,
        "tokens_per_s": tokens / seconds,
        "tflops": tflops,
        "mfu": tflops / peak,
    }


def _batches(s: Setup, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seq = torch.randint(0, s.cfg.vocab_size, (s.micro_batch, s.seq + 1), generator=gen)
        out.append(
            {
                "tokens": seq[:, :-1].contiguous(),
                "labels": seq[:, 1:].contiguous(),
                "loss_mask": torch.ones(s.micro_batch, s.seq),
                "position_ids": torch.arange(s.seq).expand(s.micro_batch, s.seq),
            }
        )
    return out


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ the plain step
def megatron_step(s: Setup, reps: int, warmup: int, peak: float) -> dict[str, Any]:
    """Megatron-Core's training step of the plain model: DDP, its schedule, its optimizer."""
    from elastic_plugin.models.flops import training_flops
    from elastic_plugin.parallel import Layout, build_model_chunks, build_optimizer
    from elastic_plugin.training.step import train_step

    chunks, _ = build_model_chunks(s.cfg, Layout(), torch.bfloat16, role="trained")
    optimizer = build_optimizer(chunks, lr=1e-5)
    batches = _batches(s, s.microbatches)

    def step() -> object:
        return train_step(chunks, optimizer, iter(batches), s.microbatches, s.seq, s.micro_batch)

    seconds = timed(step, s.device, reps, warmup)
    flops = s.microbatches * training_flops(s.cfg, s.seq, s.micro_batch).total
    return {"name": "megatron_step", **_rates(s, seconds, flops, s.tokens_per_step, peak)}


# ------------------------------------------------------------------------------ elastic
def _mix(elastic_config: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(budgets, probabilities of the last curriculum stage; uniform when it has none)."""
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.models.config import load_config

    section = load_config(str(elastic_config)).elastic
    ecfg = ElasticConfig.from_dict(section)
    budgets = tuple(float(b) for b in ecfg.budgets)
    probs = next(
        (st.budget_probs for st in reversed(ecfg.curriculum or ()) if st.budget_probs), None
    )
    return budgets, tuple(probs) if probs else tuple(1.0 / len(budgets) for _ in budgets)


def _elastic_parts(s: Setup, budgets: tuple[float, ...]):
    """Student (elastified, DDP), frozen teacher, optimizer, resolved config, the fixed choice
    of every budget < 1 and of half width."""
    from elastic_plugin.checkpoint.meta import budget_label
    from elastic_plugin.elastic.config import ElasticConfig
    from elastic_plugin.elastic.model import attach_elastic, router_param_groups
    from elastic_plugin.parallel import Layout, build_model_chunks, build_optimizer, wrap_ddp_chunk

    fractions = {b: fraction_for_budget(s.cfg, b) for b in budgets if b < 1.0}
    choices = {budget_label(b): fraction_sizes(s.cfg, f) for b, f in fractions.items()}
    half = fraction_sizes(s.cfg, HALF)
    full = fraction_sizes(s.cfg, 1.0)
    candidates = {
        axis: sorted({size, half[axis], *(c[axis] for c in choices.values())}, reverse=True)
        for axis, size in full.items()
    }
    resolved = ElasticConfig.from_dict(
        {
            "budgets": list(budgets),
            "sizes": candidates,
            "router": {"hidden_size": 64},
            "mode": "sliced",
            "teacher": "frozen",
        }
    ).resolve(s.cfg)
    (student,), _ = build_model_chunks(
        s.cfg, Layout(), torch.bfloat16, wrap_ddp=False, role="student"
    )
    state = attach_elastic(student, resolved, sequence_parallel=False)
    chunks = [wrap_ddp_chunk(student, Layout())]
    (teacher,), _ = build_model_chunks(
        s.cfg, Layout(), torch.bfloat16, wrap_ddp=False, role="teacher"
    )
    teacher.requires_grad_(False)
    optimizer = build_optimizer(
        chunks, lr=1e-5, config_overrides=router_param_groups(1e-5, 1e-5, 10.0)
    )
    return chunks, teacher, optimizer, state, resolved, choices, half


def elastic_rows(
    s: Setup, reps: int, warmup: int, peak: float, plain: dict[str, Any], elastic_config: Path
) -> list[dict[str, Any]]:
    """``elastic_b1.0``, ``elastic_mix`` and the student-level rows (sliced, masked, FP8)."""
    from elastic_plugin.checkpoint.meta import budget_label
    from elastic_plugin.elastic.config import CurriculumStage
    from elastic_plugin.elastic.cost import ElasticCost
    from elastic_plugin.elastic.layers.fp8 import fp8_gemm
    from elastic_plugin.elastic.layers.state import MASKED
    from elastic_plugin.elastic.router import AnnealSchedule
    from elastic_plugin.elastic.sampling import BudgetSampler
    from elastic_plugin.elastic.step import ElasticStep
    from elastic_plugin.models.flops import training_flops

    budgets, probs = _mix(elastic_config)
    chunks, teacher, optimizer, state, resolved, choices, half = _elastic_parts(s, budgets)
    total = warmup + reps + 1

    def sampler(stage_probs: tuple[float, ...]) -> BudgetSampler:
        return BudgetSampler(
            budgets, [CurriculumStage(iters=total, budget_probs=stage_probs)], 0, total
        )

    step = ElasticStep(
        state=state,
        sampler=sampler(tuple(1.0 if b == 1.0 else 0.0 for b in budgets)),
        cost=ElasticCost(s.cfg, resolved),
        temperature=AnnealSchedule(1.0, 1.0, total),
        logit_scale=AnnealSchedule(1.0, 1.0, total),
        num_microbatches=s.microbatches,
        teacher_chunks=[teacher],
    )
    # a frozen router: every budget < 1 a fixed nested model (budget 1.0 is the parent itself)
    step.freeze(choices | {budget_label(1.0): resolved.full_choice()})
    batches = _batches(s, s.microbatches, seed=1)
    rows = []
    for name, stage_probs in (
        ("elastic_b1.0", tuple(1.0 if b == 1.0 else 0.0 for b in budgets)),
        ("elastic_mix", probs),
    ):
        step.sampler = sampler(stage_probs)
        step.iteration = 1
        step.take_flops()
        counted: list[float] = []

        def one() -> object:
            result = step.train_step(chunks, optimizer, iter(batches), s.seq, s.micro_batch)
            counted.append(step.take_flops())
            step.iteration += 1
            return result

        seconds = timed(one, s.device, reps, warmup)
        flops = sum(counted[warmup:]) / reps
        row = {"name": name, **_rates(s, seconds, flops, s.tokens_per_step, peak)}
        row["vs_plain_tokens"] = row["tokens_per_s"] / plain["tokens_per_s"]
        row["vs_plain_mfu"] = row["mfu"] / plain["mfu"]
        if name == "elastic_b1.0":
            row[f"goal_mfu>={GOAL_B1_MFU:g}x"] = _verdict(row["vs_plain_mfu"] >= GOAL_B1_MFU)
        else:
            row["mix"] = ", ".join(f"{b:g}:{p:g}" for b, p in zip(budgets, probs, strict=True))
            row[f"goal_tokens>={GOAL_MIX_TOKENS:g}x"] = _verdict(
                row["vs_plain_tokens"] >= GOAL_MIX_TOKENS
            )
        rows.append(row)

    # the student alone: forward + backward of one micro-batch at full / half width
    model = chunks[0].module
    batch = {k: v.to(s.device) for k, v in batches[0].items()}
    full_flops = training_flops(s.cfg, s.seq, s.micro_batch).total
    half_flops = training_flops(s.cfg, s.seq, s.micro_batch, half).total
    half_probs = step.choice_probs(half)
    half_probs = {k: v.to(s.device) for k, v in half_probs.items()}

    def student(before: Callable[[], None], fp8: str = "off") -> Callable[[], object]:
        def run() -> object:
            chunks[0].zero_grad_buffer()
            before()
            with fp8_gemm(fp8):
                loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss.float().mean().backward()
            state.clear()
            return None

        return run

    tokens = s.seq * s.micro_batch
    cases = {
        "student_full": (student(state.clear), full_flops),
        "sliced_half": (student(lambda: state.set_sizes(half)), half_flops),
        "masked_half": (student(lambda: state.set_choice(half_probs, MASKED)), full_flops),
        "fp8_full": (student(state.clear, "tensor"), full_flops),
        "fp8_sliced_half": (student(lambda: state.set_sizes(half), "tensor"), half_flops),
    }
    seconds = {name: timed(fn, s.device, reps, warmup) for name, (fn, _) in cases.items()}
    flop_ratio = half_flops / full_flops
    for name, (_, flops) in cases.items():
        row = {"name": name, **_rates(s, seconds[name], flops, tokens, peak)}
        row["vs_full_time"] = seconds[name] / seconds["student_full"]
        if name == "sliced_half":
            row["flop_ratio"] = flop_ratio
            row["time/flops"] = row["vs_full_time"] / flop_ratio
            row[f"goal_within_{GOAL_SLICED_FLOPS:.0%}"] = _verdict(
                abs(row["time/flops"] - 1) <= GOAL_SLICED_FLOPS
            )
        if name == "masked_half":
            row["vs_sliced_time"] = seconds[name] / seconds["sliced_half"]
        if name == "fp8_full":
            row["vs_bf16_time"] = seconds[name] / seconds["student_full"]
        if name == "fp8_sliced_half":
            row["vs_bf16_time"] = seconds[name] / seconds["sliced_half"]
        rows.append(row)
    return rows


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# ------------------------------------------------------------------------------ driver
def measure(
    device: str,
    size: str | None = None,
    reps: int = 5,
    warmup: int = 2,
    elastic_config: Path = ELASTIC_CONFIG,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, description of the run)."""
    if reps < 1 or warmup < 0:
        raise SystemExit(f"reps={reps}, warmup={warmup}: allowed reps >= 1, warmup >= 0")
    s = setup(device, size)
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.counting import count_parameters
    from elastic_plugin.parallel import Layout, init_distributed, initialize_layout

    enable_cpu_megatron()  # a no-op with CUDA
    init_distributed()
    initialize_layout(Layout(), seed=1234)
    peak = bf16_peak(s, reps)
    plain = megatron_step(s, reps, warmup, peak["tflops"])
    _release(s.device)  # the plain model and its optimizer state went with megatron_step's frame
    rows = [peak, plain, *elastic_rows(s, reps, warmup, peak["tflops"], plain, elastic_config)]
    _release(s.device)
    about = {
        "device": torch.cuda.get_device_name()
        if s.device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "size": s.size,
        "params": count_parameters(s.cfg).total,
        "seq": s.seq,
        "micro_batch": s.micro_batch,
        "microbatches": s.microbatches,
        "dtype": "bfloat16",
        "reps": reps,
        "warmup": warmup,
        "elastic_config": str(elastic_config),
    }
    return rows, about


def table(rows: list[dict[str, Any]], about: dict[str, Any]) -> str:
    """A markdown table of the rows (columns: the union, ``name`` first)."""
    columns = ["name"]
    for row in rows:
        columns += [key for key in row if key not in columns]

    def cell(value: object) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    head = ", ".join(f"{k} {v}" for k, v in about.items())
    lines = [f"<!-- {head} -->", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(col)) for col in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write(rows: list[dict[str, Any]], about: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu_step.json", out / "gpu_step.md"
    json_path.write_text(json.dumps({"about": about, "rows": rows}, indent=2))
    md_path.write_text(table(rows, about))
    return json_path, md_path


def run(device: str | None = None, reps: int = 5) -> list[dict[str, Any]]:
    """``bench/run_all.py``: the GPU rows, with a GPU (the CPU rows are this file's dry run)."""
    if device != "cuda" or not torch.cuda.is_available():
        return []
    return measure("cuda", reps=reps)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=os.environ.get("BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"),
        help="default: $BENCH_DEVICE, else cuda where visible",
    )
    parser.add_argument("--size", choices=tuple(SIZES), help="default: 1b on cuda, tiny on cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per row (5; cpu: 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (2; cpu: 1)")
    parser.add_argument("--elastic-config", type=Path, default=ELASTIC_CONFIG)
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out/gpu_step")
    )
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    rows, about = measure(
        args.device,
        args.size,
        reps=args.reps if args.reps is not None else (1 if cpu else 5),
        warmup=args.warmup if args.warmup is not None else (1 if cpu else 2),
        elastic_config=args.elastic_config,
    )
    json_path, md_path = write(rows, about, args.out)
    print(md_path.read_text(), end="")
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
