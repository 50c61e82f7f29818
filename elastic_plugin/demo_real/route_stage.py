"""``make demo-real``'s method comparison: the three routes at equal total cost, run and costed.

After the elastic run and its export, in this order (each needs the one before):

1. ``elastic`` (``routes.elastic_route``): the elastic run's cost recomputed from its logged steps
   (importance, training, the freeze's validation, the zero-shot screening's candidate passes
   from ``OUT/screening.json``), its budgets linked to the BF16 exports ``export`` wrote;
2. ``alone`` (``alone.distil_alone``): each smaller size distilled alone on the elastic run's
   architecture, for an equal share of the elastic route's FLOPs (less its importance pass);
3. ``minitron`` (``minitron.run_minitron``): per size four candidate architectures distilled
   briefly, the best distilled further, the whole route at the elastic route's FLOPs.

Every route writes ``OUT/routes/<route>/route.json`` (``total_flops``, ``total_tokens``) and one
BF16 HF directory per budget. Why FLOPs and not tokens: the routes train different architectures
(Minitron's depth candidates are cheaper per token), so equal tokens would not be equal cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROUTES_DIR = "routes"


def _screening_cost(out: Path) -> list[Any]:
    """The zero-shot screening's candidate passes (they pick each budget's starting
    architecture: search); its ablation rows and depth scores decide nothing (measurement)."""
    from elastic_plugin.demo_real.routes import Cost
    from elastic_plugin.elastic.screening import SCREENING_JSON

    path = out / SCREENING_JSON
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    passes = int(record["passes"]["candidates"])
    return [
        Cost(
            "zero-shot screening",
            "search",
            passes * int(record["tokens_per_candidate"]),
            float(record["flops"]["candidates"]),
            {"candidates": passes, "tokens_per_candidate": record["tokens_per_candidate"]},
        )
    ]


def _bf16_exports(exports_dir: Path) -> dict[str, Path]:
    from elastic_plugin.checkpoint.meta import budget_label

    rows = json.loads((exports_dir / "exports.json").read_text())["exports"]
    return {budget_label(r["budget"]): Path(r["path"]) for r in rows if r["precision"] == "bf16"}


def run_routes(
    stages: Any,
    out: Path,
    parent: Path,
    hf_dir: Path,
    data: Mapping[str, str],
    batch: Mapping[str, int],
    importance: Mapping[str, int],
    schedule_flags: tuple[str, ...],
    peak_gflops: float,
    quick: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run and cost the three routes (module docstring) as stages of ``stages``
    (``pipeline.Stages``); ``data``: the ``train`` / ``valid`` prefixes and ``tokenizer``;
    ``batch``: the elastic run's ``seq_length`` / ``micro_batch_size`` / ``global_batch_size``
    / ``eval_iters``; ``importance``: the importance stage's ``samples``, ``seq_length``,
    ``depth_batches``, ``micro_batch_size``; ``quick``: a run of a few tokens, where Minitron's
    depth importance alone outweighs the elastic run (its runs then train one iteration each,
    over equal cost), and Minitron searches two mixes for the smallest size only. Returns each
    route's ``route.json``."""
    from elastic_plugin.checkpoint.meta import (
        read_checkpoint_meta,
        read_elastic_meta,
        trained_budgets,
    )
    from elastic_plugin.demo_real.alone import distil_alone
    from elastic_plugin.demo_real.minitron import MIXES, QUICK_MIXES, run_minitron
    from elastic_plugin.demo_real.routes import alone_route, elastic_route, importance_cost
    from elastic_plugin.models.config import config_from_dict

    ckpts, routes = out / "checkpoints", out / ROUTES_DIR
    # each route run's checkpoint only seeds an export or the next run: no optimizer state (a
    # third of the bytes: 0.5 instead of 1.6 GB a run for SmolLM2-135M)
    run_flags = (*schedule_flags, "--no-save-optim")
    parent_model = config_from_dict(read_checkpoint_meta(parent)["config"]).model
    imp = importance_cost(parent_model, int(importance["samples"]), int(importance["seq_length"]))
    wall, cpu = time.time(), stages.cpu_seconds()
    elastic = elastic_route(
        routes / "elastic", ckpts / "elastic", out / "elastic_metrics.jsonl", batch, imp,
        extra=_screening_cost(out), parent_hf=hf_dir, exported=_bf16_exports(out / "exports"),
    )  # fmt: skip
    stages.record("route elastic (cost)", time.time() - wall, stages.cpu_seconds() - cpu)

    smaller = [b for b in trained_budgets(read_elastic_meta(ckpts / "elastic")) if b < 1.0]
    wall, cpu = time.time(), stages.cpu_seconds()
    alone = distil_alone(
        ckpts / "elastic", ckpts / "reordered", data["train"], data["valid"], data["tokenizer"],
        out / "alone", dict(batch), run_flags,
        size_flops=(elastic["total_flops"] - imp.flops) / max(len(smaller), 1),
    )  # fmt: skip
    alone_record = alone_route(routes / "alone", alone, ckpts / "elastic", batch, imp, hf_dir)
    stages.record(
        "distil alone (equal cost)", time.time() - wall, stages.cpu_seconds() - cpu,
        tokens={label: r["tokens"] for label, r in alone["sizes"].items()},
    )  # fmt: skip
    runs = alone["sizes"].values()
    if runs and all(r.get("tflop") is not None for r in runs):
        stages.add_use(
            "distil alone (equal cost)", sum(r["tokens"] for r in runs),
            sum(r["tflop"] for r in runs) * 1e12, sum(r["seconds"] for r in runs), peak_gflops,
        )  # fmt: skip

    wall, cpu = time.time(), stages.cpu_seconds()
    minitron = run_minitron(
        ckpts / "reordered", ckpts / "elastic", out / "importance.pt", data["train"],
        data["valid"], data["tokenizer"], routes / "minitron", dict(batch),
        elastic["total_flops"], importance, run_flags, parent_hf=hf_dir, over_budget=quick,
        mixes=QUICK_MIXES if quick else MIXES, only_smallest=quick,
    )  # fmt: skip
    stages.record(
        "minitron (search + final)", time.time() - wall, stages.cpu_seconds() - cpu,
        tokens=minitron["total_tokens"],
    )  # fmt: skip
    return {"elastic": elastic, "alone": alone_record, "minitron": minitron}
