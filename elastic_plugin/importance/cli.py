"""``elastic-plugin importance`` and ``elastic-plugin reorder`` (single process or torchrun,
any TP/PP/EP layout).

    elastic-plugin importance --ckpt demo_out/checkpoints/teacher --out demo_out/importance.pt
    elastic-plugin reorder --ckpt demo_out/checkpoints/teacher --scores demo_out/importance.pt \
        --out demo_out/checkpoints/reordered
"""

from __future__ import annotations

import argparse
from pathlib import Path

from elastic_plugin.checkpoint.history import DEFAULT_KEEP_LAST, resolve_checkpoint
from elastic_plugin.checkpoint.meta import read_checkpoint_meta
from elastic_plugin.cli_args import (
    add_layout_args,
    check_data_path_args,
    layout_from_args,
    start_ranks,
)
from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.models.axes import IMPORTANCE_AXES
from elastic_plugin.models.config import ConfigError, Layout
from elastic_plugin.models.context_parallel import check_context_parallel


def register_subcommand(subparsers: argparse._SubParsersAction) -> None:
    imp = subparsers.add_parser(
        "importance",
        help="rank every width axis of a checkpoint (scores file)",
        description="Forward passes over calibration data with hooks; writes importance scores.",
    )
    imp.add_argument(
        "--ckpt", required=True, metavar="DIR", help="a checkpoint written by this plugin"
    )
    imp.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="scores file to write (safetensors, whatever its name)",
    )
    imp.add_argument(
        "--num-samples", type=int, default=256, help="calibration samples (per DP rank)"
    )
    imp.add_argument("--seq-length", type=int, default=None, help="default: the checkpoint's")
    imp.add_argument("--micro-batch-size", type=int, default=8)
    imp.add_argument(
        "--axes",
        nargs="+",
        default=None,
        choices=list(IMPORTANCE_AXES) + ["shared_ffn"],
        help="axes that must be present (default: all the model has)",
    )
    imp.add_argument(
        "--data-path",
        default=None,
        metavar="PREFIX",
        help="Megatron indexed dataset (default: the checkpoint's prepared data)",
    )
    imp.add_argument("--tokenizer", default=None, metavar="FILE")
    imp.add_argument(
        "--resume-dir",
        default=None,
        metavar="DIR",
        help="keep partial statistics here; rerun the same command to resume",
    )
    imp.add_argument(
        "--depth",
        action="store_true",
        help="also score layers by the logit change when each is skipped (L+1 forwards/batch)",
    )
    imp.add_argument("--depth-batches", type=int, default=2, help="calibration batches for --depth")
    imp.add_argument(
        "--plot", default=None, metavar="PNG", help="also draw the sorted scores per axis"
    )
    imp.add_argument("--no-progress", action="store_true")
    add_layout_args(imp)
    imp.set_defaults(func=run_importance)

    reo = subparsers.add_parser(
        "reorder", help="write an importance-reordered checkpoint (same function, nested prefixes)"
    )
    reo.add_argument("--ckpt", required=True, metavar="DIR")
    reo.add_argument("--scores", required=True, metavar="FILE")
    reo.add_argument("--out", required=True, metavar="DIR")
    reo.add_argument(
        "--mamba-top-channels",
        type=int,
        default=None,
        help="rank Mamba heads by their norm over this many top channels (default: all)",
    )
    reo.add_argument(
        "--mamba-source",
        default=None,
        choices=["out_proj_input", "x_proj"],
        help="rank Mamba heads and channels by out_proj's input or the x-projection (the "
        "published definition); default: --method's defaults (heads: output_l2, channels: "
        "out_proj_input)",
    )
    reo.add_argument(
        "--method",
        nargs="+",
        default=None,
        metavar="AXIS=STAT",
        help="the statistic that ranks an axis, e.g. embedding=norm_abs experts=reap (the "
        "published ones) or AXIS=random (the baseline); choices in docs/importance.md ('Statistics per axis'); default: the measured best",
    )
    add_layout_args(reo)
    reo.set_defaults(func=run_reorder)


def _start(args: argparse.Namespace):
    """Checks that need no model, then the process group and the layout."""
    import os

    from elastic_plugin.models.config import config_from_dict

    meta = read_checkpoint_meta(args.ckpt)
    cfg = config_from_dict(meta["config"], source=f"--ckpt {args.ckpt}")
    layout = layout_from_args(args, Layout())  # layout from flags; default one rank
    cfg.model.check_parallel(layout.tp, layout.pp, layout.ep)
    seq = getattr(args, "seq_length", None) or cfg.training.seq_length
    check_context_parallel(
        cfg.model, layout.cp, layout.tp, seq if args.func is not run_reorder else None
    )
    layout.check_world(int(os.environ.get("WORLD_SIZE", "1")))
    return meta, cfg, layout


def _calibration(args, meta, cfg, seq_length: int):
    """Dataset for calibration: the user's prefix, or the data the checkpoint was trained on."""
    from elastic_plugin.data.indexed import build_gpt_datasets
    from elastic_plugin.data.jsonl import open_tokenizer
    from elastic_plugin.data.prepare import PreparedData

    if args.data_path:
        check_data_path_args(args)
        tokenizer, prefix = open_tokenizer(args.tokenizer), args.data_path
    else:
        prepared_dir = (meta.get("data") or {}).get("prepared")
        if not prepared_dir or not Path(prepared_dir).is_dir():
            raise ConfigError(
                f"--ckpt {args.ckpt} names no prepared data; pass --data-path and --tokenizer"
            )
        prepared = PreparedData.load(prepared_dir)
        tokenizer, prefix = prepared.load_tokenizer(), prepared.train_prefix
    datasets = build_gpt_datasets(
        tokenizer,
        seq_length,
        train_data_path=prefix,
        num_samples=(None, None, None),
        seed=cfg.training.seed,
    )
    return datasets.train


def run_importance(args: argparse.Namespace) -> int:
    try:
        meta, cfg, layout = _start(args)
        if args.num_samples <= 0 or args.micro_batch_size <= 0:
            raise ConfigError("--num-samples and --micro-batch-size must be > 0")
    except (ConfigError, FileNotFoundError) as exc:
        return report_bad_input("elastic-plugin importance", exc)
    start_ranks(layout, seed=cfg.training.seed)
    import torch.distributed as dist

    from elastic_plugin.checkpoint.io import build_from_checkpoint
    from elastic_plugin.data.indexed import batch_iterator
    from elastic_plugin.importance import CalibrationError, check_calibration, collect_importance

    seq_length = args.seq_length or cfg.training.seq_length
    try:
        dataset = _calibration(args, meta, cfg, seq_length)
        dp = layout.data_parallel(dist.get_world_size())
        check_calibration(
            len(dataset) // dp if dataset is not None else None,
            args.num_samples,
            args.micro_batch_size,
        )
    except (ConfigError, CalibrationError) as exc:
        return report_bad_input("elastic-plugin importance", exc)
    try:  # a damaged checkpoint (integrity check) is bad input, not a traceback
        chunks, cfg, _ = build_from_checkpoint(args.ckpt, layout)
    except ConfigError as exc:
        return report_bad_input("elastic-plugin importance", exc)
    iterator = batch_iterator(
        dataset, args.micro_batch_size, seed=cfg.training.seed, shuffle=False, infinite=False
    )
    try:  # a damaged or foreign partial state in --resume-dir is bad input too
        scores = collect_importance(
            chunks,
            iterator,
            args.num_samples,
            seq_length,
            args.micro_batch_size,
            axes=args.axes,
            resume_dir=args.resume_dir,
            progress=not args.no_progress,
            num_available=None,
            meta={"ckpt": str(args.ckpt), "layout": layout.__dict__},
        )
    except (ConfigError, CalibrationError) as exc:
        return report_bad_input("elastic-plugin importance", exc)
    if args.depth:
        from elastic_plugin.importance.depth import depth_scores

        again = batch_iterator(
            dataset, args.micro_batch_size, seed=cfg.training.seed, shuffle=False, infinite=False
        )
        batches = [] if again is None else [b for _, b in zip(range(args.depth_batches), again)]
        scores.depth = depth_scores(
            chunks, batches, seq_length, args.micro_batch_size, progress=not args.no_progress
        )
    if dist.get_rank() == 0:
        scores.save(args.out)
        if args.plot:
            from elastic_plugin.importance.scores import plot_scores

            plot_scores(scores, args.plot)
        print(
            f"importance scores ({', '.join(scores.axes())}) over {scores.tokens} tokens -> {args.out}"
        )
    dist.destroy_process_group()
    return 0


def run_reorder(args: argparse.Namespace) -> int:
    try:
        meta, cfg, layout = _start(args)
        if not Path(args.scores).is_file():
            raise ConfigError(f"--scores {args.scores}: no such file")
        source = resolve_checkpoint(args.ckpt)  # a stage's newest save, or the path itself
        stages = {Path(args.ckpt).resolve(), source.resolve()}
        if source != Path(args.ckpt):
            stages.add(source.parent.resolve())
        if Path(args.out).resolve() in stages:
            raise ConfigError(
                f"--out {args.out} must differ from --ckpt {args.ckpt} and its stage directory "
                "(the original is kept)"
            )
        if meta.get("reordered"):
            raise ConfigError(f"--ckpt {args.ckpt} is already reordered")
        from elastic_plugin.importance.methods import parse_methods

        methods = parse_methods(args.method)
        from elastic_plugin.importance.scores import ImportanceScores

        # safetensors (or an old torch.save file, allowlist-checked): read before any rank starts
        scores = ImportanceScores.load(args.scores, "--scores")
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        return report_bad_input("elastic-plugin reorder", exc)
    start_ranks(layout, seed=cfg.training.seed)
    import torch.distributed as dist

    from elastic_plugin.checkpoint.io import build_from_checkpoint, save_checkpoint
    from elastic_plugin.importance.reorder import (
        PERMUTATIONS_FILE,
        Permutations,
        apply_permutations,
    )

    try:  # a damaged checkpoint (integrity check) is bad input, not a traceback
        chunks, cfg, meta = build_from_checkpoint(args.ckpt, layout)
    except ConfigError as exc:
        return report_bad_input("elastic-plugin reorder", exc)
    perms = Permutations.from_scores(
        scores,
        cfg.model.query_groups,
        cfg.model.mamba_num_groups,
        args.mamba_top_channels,
        args.mamba_source,
        methods,
    )
    apply_permutations(chunks[0], perms)
    saved = save_checkpoint(  # the teacher's iteration: the same weights, reordered
        chunks,
        Path(args.out),
        {**meta, "kind": "reordered", "scores": str(args.scores), "source_ckpt": str(args.ckpt)},
        iteration=int(meta.get("iteration", 0)),
        keep_last=DEFAULT_KEEP_LAST,
        extra_files=lambda ckpt: perms.save(ckpt / PERMUTATIONS_FILE),
    )
    if dist.get_rank() == 0:
        print(f"reordered checkpoint -> {saved}")
    dist.destroy_process_group()
    return 0
