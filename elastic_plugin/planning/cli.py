"""``elastic-plugin plan``: which layouts fit a model on N GPUs, and what they would cost.

Every flag is checked (naming the flag and what is allowed, exit 2) before any layout is
evaluated; the evaluation itself is arithmetic (no model is built, no GPU is needed).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

from elastic_plugin.cli_args import add_runtime_args, runtime_from_args
from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.elastic.config import (
    TEACHERS,
    CurriculumStage,
    ElasticConfig,
    ElasticConfigError,
)
from elastic_plugin.models.config import ConfigError, ModelConfig, TrainingConfig, load_config
from elastic_plugin.models.runtime import Runtime
from elastic_plugin.planning.activations import MAMBA_SCANS
from elastic_plugin.planning.devices import BUILTIN_DEVICES, load_device
from elastic_plugin.planning.plan import PlanInputs

PROG = "elastic-plugin plan"


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank the TP/PP/CP/EP/DP layouts that fit a model on N GPUs (estimates)",
        description="Enumerate every layout elastic-train accepts, with memory per rank, "
        "FLOPs and communication per budget and an estimated step time; a stated model, "
        "not a measurement.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="FILE", help="model YAML (its elastic: section too)")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face NemotronH directory")
    parser.add_argument("--gpus", type=int, required=True, metavar="N")
    parser.add_argument(
        "--gpu",
        default="h100",
        metavar="|".join(BUILTIN_DEVICES) + "|FILE.yaml",
        help="the device table entry, or a YAML file with the same fields (default h100)",
    )
    parser.add_argument("--seq-length", type=int, default=None, metavar="L")
    parser.add_argument("--micro-batch-size", type=int, default=None, metavar="M")
    parser.add_argument("--global-batch-size", type=int, default=None, metavar="G")
    add_runtime_args(parser)
    parser.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only layouts with (or, --no-distributed-optimizer, without) it; default both",
    )
    parser.add_argument(
        "--context-parallel-size",
        type=int,
        nargs="+",
        default=None,
        metavar="CP",
        help="only layouts with these context-parallel sizes (e.g. 1 2 4); default every size "
        "the model and sequence length allow (2 x CP chunks; whole Mamba groups per rank)",
    )
    parser.add_argument("--elastic-budgets", type=float, nargs="+", default=None, metavar="B")
    parser.add_argument("--teacher", default=None, metavar="|".join(TEACHERS))
    parser.add_argument("--kd-chunk-tokens", type=int, default=None, metavar="N",
                        help="the distillation loss's tokens per chunk (elastic.kd_chunk_tokens, "
                        "--elastic-kd-chunk-tokens; default the config's, else 1024)")  # fmt: skip
    parser.add_argument("--mamba-scan", default="fused", choices=MAMBA_SCANS,
                        help="the Mamba scan the run uses: mamba_ssm's fused kernels (default) or "
                        "the plugin's pure-PyTorch scan, which keeps more activations (without "
                        "mamba_ssm, e.g. on CPUs)")  # fmt: skip
    parser.add_argument("--efficiency", type=float, default=0.4, metavar="X",
                        help="fraction of the dense peak the GEMMs reach (default 0.4)")  # fmt: skip
    parser.add_argument("--comm-efficiency", type=float, default=0.7, metavar="X",
                        help="fraction of link bandwidth collectives reach (default 0.7)")  # fmt: skip
    parser.add_argument("--reserve-gb", type=float, default=4.0, metavar="GB",
                        help="per GPU: CUDA context, NCCL buffers, fragmentation (default 4)")  # fmt: skip
    parser.add_argument(
        "--stage",
        action="append",
        default=None,
        metavar="TOKENS:SEQ[:P1/P2/...]",
        help="a curriculum stage (repeat the flag), e.g. 1.1e11:8192 5e10:49152:0.5/0.3/0.2",
    )
    parser.add_argument(
        "--separate-tokens",
        type=float,
        default=None,
        metavar="N",
        help="tokens to train each budget separately on (default: the curriculum's)",
    )
    parser.add_argument("--top", type=int, default=10, metavar="K")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG")
    parser.set_defaults(func=run_plan)
    register_scaling_report(subparsers)


def register_scaling_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scaling-report",
        help="join a layout sweep's runs: throughput and memory, measured vs planned",
        description="Reads every elastic_metrics.jsonl below DIR (and the sweep.json "
        "examples/slurm/sweep.sh writes beside it); writes DIR/scaling_report.{md,json} and plots.",
    )
    parser.add_argument("dir", metavar="DIR")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="logged iterations to drop from each run (default 1)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(func=run_scaling_report)


def run_scaling_report(args: argparse.Namespace) -> int:
    """Table + JSON + plots of a sweep directory; bad input -> exit 2 naming the path."""
    from elastic_plugin.planning.scaling import collect_runs, render_report, scaling_plots

    prog = "elastic-plugin scaling-report"
    try:
        if args.warmup < 0:
            raise ConfigError(f"--warmup={args.warmup}; allowed: an integer >= 0")
        runs = collect_runs(Path(args.dir), args.warmup)
    except (ConfigError, OSError) as exc:
        return report_bad_input(prog, exc)
    root = Path(args.dir)
    table = render_report(runs)
    rows = [r.to_dict() for r in runs]
    for name, text in (("scaling_report.md", table + "\n"),
                       ("scaling_report.json", json.dumps(rows, indent=1))):  # fmt: skip
        tmp = root / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(root / name)
    scaling_plots(runs, root)
    print(json.dumps(rows, indent=1) if args.json else table)
    return 0


def _positive(flag: str, value: float | None, integer: bool = True) -> None:
    if value is None:
        return
    if not (value > 0 and math.isfinite(value)):
        what = "a positive integer" if integer else "a number > 0"
        raise ConfigError(f"{flag}={value!r}; allowed: {what}")


def _fraction(flag: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"{flag}={value!r}; allowed: a number in (0, 1]")


def _stage(text: str, budgets: int) -> CurriculumStage:
    """``--stage TOKENS:SEQ[:P1/P2/...]`` as the training config's stage type; its values are
    checked by that type (the same checks and messages as the config's ``elastic.curriculum``)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        tokens, seq = float(parts[0]), int(parts[1])
        probs = tuple(float(p) for p in parts[2].split("/")) if len(parts) == 3 else None
    except ValueError:
        raise ConfigError(
            f"--stage {text!r}; allowed: TOKENS:SEQ[:P1/P2/...], e.g. 1e11:8192:0.5/0.3/0.2"
        ) from None
    try:
        stage = CurriculumStage(tokens=tokens, seq_length=seq, budget_probs=probs)
        stage.check("stage", budgets)
    except ElasticConfigError as exc:
        raise ConfigError(f"--stage {text!r}: {exc.field.split('.')[-1]}{exc.detail}") from None
    return stage


def _model(args: argparse.Namespace) -> tuple[ModelConfig, TrainingConfig, dict, str]:
    if args.config is not None:
        cfg = load_config(args.config)
        return cfg.model, cfg.training, dict(cfg.elastic), str(args.config)
    from elastic_plugin.families import model_config_from_hf
    from elastic_plugin.models.hf_config import HF_CONFIG_FILE, read_hf_config

    path = Path(args.hf)
    if path.is_file():
        raw, source = read_hf_config(path.parent, path.name), str(path)
    else:
        raw, source = read_hf_config(path), str(path / HF_CONFIG_FILE)
    return model_config_from_hf(raw, source), TrainingConfig(), {}, source


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Every flag checked and combined with the config; raises ConfigError naming the flag."""
    _positive("--gpus", args.gpus)
    for flag in ("seq_length", "micro_batch_size", "global_batch_size", "top"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    _fraction("--efficiency", args.efficiency)
    _fraction("--comm-efficiency", args.comm_efficiency)
    if not args.reserve_gb >= 0:
        raise ConfigError(f"--reserve-gb={args.reserve_gb!r}; allowed: a number >= 0")
    _positive("--separate-tokens", args.separate_tokens, integer=False)
    for cp in args.context_parallel_size or ():
        _positive("--context-parallel-size", cp)
    if args.teacher is not None and args.teacher not in TEACHERS:
        raise ConfigError(f"--teacher {args.teacher!r}; allowed: {', '.join(TEACHERS)}")
    if args.plot is not None and not Path(args.plot).parent.resolve().is_dir():
        raise ConfigError(f"--plot {args.plot}: the directory does not exist")
    device = load_device(args.gpu)
    model, training, elastic_raw, source = _model(args)
    training = runtime_from_args(args, training, model)
    seq = args.seq_length or training.seq_length
    mbs = args.micro_batch_size or training.micro_batch_size
    gbs = args.global_batch_size or training.global_batch_size
    if gbs % mbs:
        raise ConfigError(
            f"--global-batch-size={gbs} is not a multiple of --micro-batch-size={mbs}"
        )
    origins: dict[str, str] = {}
    if args.elastic_budgets is not None:
        elastic_raw["budgets"] = list(args.elastic_budgets)
        origins["budgets"] = "--elastic-budgets"
    if args.teacher is not None:
        elastic_raw["teacher"] = args.teacher
        origins["teacher"] = "--teacher"
    if args.kd_chunk_tokens is not None:
        elastic_raw["kd_chunk_tokens"] = args.kd_chunk_tokens
        origins["kd_chunk_tokens"] = "--kd-chunk-tokens"
    where = str(args.config) if args.config else "<dict>"
    elastic = ElasticConfig.from_dict(elastic_raw, source=where, origins=origins)
    elastic.resolve(model)  # the budgets are reachable with TP = EP = 1
    stages = tuple(_stage(text, len(elastic.budgets)) for text in args.stage or ())
    return PlanInputs(
        model=model,
        source=source,
        gpus=args.gpus,
        device=device,
        seq_length=seq,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        runtime=Runtime.of(training),
        elastic=elastic,
        distributed_optimizer=args.distributed_optimizer,
        efficiency=args.efficiency,
        comm_efficiency=args.comm_efficiency,
        reserve_gb=args.reserve_gb,
        curriculum=stages,
        separate_tokens=args.separate_tokens,
        mamba_scan=args.mamba_scan,
        context_parallel=(
            tuple(args.context_parallel_size) if args.context_parallel_size else None
        ),
    )


def run_plan(args: argparse.Namespace) -> int:
    """Print the ranked plan (or JSON); nothing fits -> exit 2 naming the smallest shortfall."""
    try:
        inputs = inputs_from_args(args)
    except (ConfigError, yaml.YAMLError, OSError) as exc:
        return report_bad_input(PROG, exc)
    from elastic_plugin.planning.plan import make_plan
    from elastic_plugin.planning.report import plan_json, plot_plan, render_table

    plans, rejected = make_plan(inputs)
    if not plans:
        reasons = "; ".join(f"{n} x {r}" for r, n in sorted(rejected.items(), key=lambda i: -i[1]))
        return report_bad_input(
            PROG, ConfigError(f"no valid layout of {inputs.gpus} GPUs for this model: {reasons}")
        )
    if args.plot:
        plot_plan(inputs, plans, args.top, Path(args.plot))
    if args.json:
        print(json.dumps(plan_json(inputs, plans, args.top, rejected), indent=1))
    else:
        print(render_table(inputs, plans, args.top))
    if not plans[0].fits:
        best = plans[0]
        return report_bad_input(
            PROG,
            ConfigError(
                f"no layout fits {inputs.device.name}: the closest, {best.layout.name}, needs "
                f"{best.memory.total / 1e9:.2f} GB per rank of {best.capacity / 1e9:.2f} GB "
                f"usable (short by {-best.headroom / 1e9:.2f} GB)"
            ),
        )
    return 0
