"""``elastic-train``'s run, from checked inputs (``elastic.inputs``) to the summary rank 0 prints.

The heavy part: the process group, the data feed, ``elastic.train.train_elastic`` and the
failures a run can meet after start-up (a full disk, a peer that never joined a collective), each
reported as the command's exit code and message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from elastic_plugin.checkpoint.meta import ELASTIC_SUBDIR
from elastic_plugin.cli_args import exit_signal_from_args, start_ranks
from elastic_plugin.cli_errors import report_bad_input
from elastic_plugin.elastic.inputs import PROG, DataSource, ElasticInputs
from elastic_plugin.models.config import ConfigError, TrainingConfig
from elastic_plugin.training.recovery import save_failed_message, stuck_rank_message

__all__ = ["finished_summary", "summary", "train"]


def finished_summary(inputs: ElasticInputs) -> dict[str, Any]:
    """``--resume`` of a run that already reached --train-iters: report it, train nothing
    (a requeued job that had finished must not fail)."""
    meta = inputs.finished or {}
    metrics = inputs.out / "elastic_metrics.jsonl"
    valid: dict[str, float] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            valid = record.get("valid_loss") or valid
    plots = [
        str(p)
        for p in (inputs.out / "elastic_loss.png", inputs.out / "elastic_router.png")
        if p.is_file()
    ]
    return {
        "checkpoint": str(inputs.out.joinpath(*ELASTIC_SUBDIR)),
        "iterations": int(meta.get("iteration", 0)),
        "already_finished": True,
        "valid_loss": valid,
        "teacher_valid_loss": meta.get("teacher_valid_loss"),
        "choices": (meta.get("elastic") or {}).get("choices"),
        "plots": plots,
        "seconds": 0.0,
    }


def _data_feed(inputs: ElasticInputs, layout, progress: bool):
    """The teacher run's data feed (``training.data_feed``) sized for this schedule."""
    from elastic_plugin.data.prepare import PreparedData
    from elastic_plugin.training.data_feed import build_data_feed

    s = inputs.schedule
    training = dataclasses.replace(
        inputs.cfg.training,
        seq_length=s["seq_length"],
        micro_batch_size=s["micro_batch_size"],
        global_batch_size=s["global_batch_size"],
        train_iters=s["train_iters"],
        eval_iters=s["eval_iters"],
        seed=s["seed"],
    )
    cfg = dataclasses.replace(inputs.cfg, training=training)
    src = inputs.data
    if src.prepared:
        try:
            prepared = PreparedData.load(src.prepared)
            src = DataSource(prepared.train_prefix, prepared.valid_prefix, prepared.tokenizer_path)
        except ValueError:  # incomplete: prepare the built-in task again from the config
            src = DataSource()
    return build_data_feed(
        cfg,
        inputs.out,
        layout,
        data_path=src.data_path,
        valid_data_path=src.valid_data_path,
        tokenizer_path=src.tokenizer,
        progress=progress,
    )


def summary(run, train_iters: int) -> dict[str, Any]:
    """What rank 0 prints: where the checkpoint is and how every budget did."""
    last_train: dict[str, float] = next(  # budget -> loss of the last logged iteration
        (h["train_loss"] for h in reversed(run.history) if h.get("train_loss")), {}
    )
    out = {
        "checkpoint": run.checkpoint_dir or None,
        "iterations": run.iterations,
        "train_loss": last_train,
        "valid_loss": run.final_valid,
        "teacher_valid_loss": run.teacher_valid,
        "choices": run.choices,
        "params": run.params,
        "plots": run.plots,
        "seconds": round(run.seconds, 1),
    }
    if not run.checkpoint_dir:  # --profile: measured, nothing saved
        out["profile"] = f"{run.iterations} iterations, per rank in OUT/profile/rank_*.jsonl"
    elif run.iterations < train_iters:
        out["stopped_at"] = f"{run.iterations}/{train_iters}: rerun with --resume to continue"
    if run.preempted_by:
        out["preempted_by"] = run.preempted_by
    return out


def train(inputs: ElasticInputs, args: argparse.Namespace) -> int:
    """The heavy part: process group, data, model, training (every rank)."""
    start_ranks(timeout_minutes=args.distributed_timeout_minutes)
    import torch.distributed as dist

    from elastic_plugin.data.indexed import batch_iterator
    from elastic_plugin.elastic.train import train_elastic

    layout = inputs.layout
    sched = TrainingConfig(**inputs.schedule)
    progress = not args.no_progress
    try:
        sched.check("elastic training")
        feed = _data_feed(inputs, layout, progress)
        if feed.vocab_size > inputs.cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {feed.vocab_size} tokens but the checkpoint's "
                f"model.vocab_size={inputs.cfg.model.vocab_size}"
            )

        def train_iterator(consumed_samples: int):
            return batch_iterator(
                feed.train_dataset,
                sched.micro_batch_size,
                seed=sched.seed,
                shuffle=sched.dataloader_type == "shuffled",
                consumed_samples=consumed_samples,
            )

        run = train_elastic(
            inputs.cfg,
            inputs.ecfg,
            layout,
            inputs.student,
            inputs.out,
            train_iterator,
            feed.valid_iterator,
            sched,
            teacher_ckpt=inputs.teacher,
            resume=args.resume,
            progress=progress,
            stop_after=args.stop_after,
            exit_signal=exit_signal_from_args(args),
            profile=args.profile,
            extra_meta={"data": feed.describe(), "tokenizer": feed.tokenizer_path},
            save_optimizer=not args.no_save_optim,
        )
    except ConfigError as exc:  # found after start-up; every rank finds it alike
        dist.destroy_process_group()
        return report_bad_input(PROG, exc)
    except OSError as exc:  # a full disk or a lost filesystem while saving
        stage = inputs.out.joinpath(*ELASTIC_SUBDIR)
        print(save_failed_message(PROG, inputs.out, stage, exc), file=sys.stderr, flush=True)
        return 1
    except RuntimeError as exc:  # a peer never joined a collective: name the stuck rank
        report = stuck_rank_message(PROG, inputs.out, exc)
        if report is None:
            raise
        print(report, file=sys.stderr, flush=True)
        return 1
    if dist.get_rank() == 0:
        print(json.dumps(summary(run, sched.train_iters), indent=2))
        print(run.table(), file=sys.stderr)
    dist.destroy_process_group()
    return 0
