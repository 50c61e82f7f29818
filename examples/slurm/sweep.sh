#!/bin/bash
# A layout sweep: the top-K layouts of an `elastic-plugin plan --json` (all for the same number
# of GPUs), each profiled by elastic-train --profile (no evaluation, no checkpoint) with
# --log-interval 1 for ITERS iterations per budget: a curriculum of one stage per budget
# (ITERS:1/0/0,ITERS:0/1/0,...), so every iteration belongs to one budget. Each rank writes its
# own step time, tokens/s, TFLOP/s and peak memory per iteration to OUT/profile/rank_NNNNN.jsonl
# (the run's elastic_metrics.jsonl has the world's figures); `elastic-plugin scaling-report
# SWEEP_DIR` then joins the runs, per layout, per budget and per rank, measured next to planned.
# PER_BUDGET=0: the config's own curriculum.
#
#   elastic-plugin plan --config MODEL.yaml --gpus 16 --seq-length 4096 ... --json > plan.json
#   PLAN=plan.json CKPT=/lustre/run1/checkpoints/reordered SWEEP_DIR=/lustre/sweep TOP=4 \
#       bash examples/slurm/sweep.sh          # one SLURM job array, task i = layout i
#   LOCAL=1 PLAN=plan.json CKPT=... bash examples/slurm/sweep.sh   # torchrun here, one by one
#   DRY_RUN=1 ... bash examples/slurm/sweep.sh                      # print, submit/run nothing
#   elastic-plugin scaling-report /lustre/sweep
#
# Each run goes to SWEEP_DIR/NN_<layout>/ with sweep.json (layout, GPUs, the plan's estimate).
# Layouts run as train_elastic.sbatch runs them: TP, PP, EP and context parallelism
# (--context-parallel-size) as planned, sequence parallel whenever TP > 1 (so plan entries with
# TP > 1 and no sequence parallelism, the same layout less SP, are skipped).

set -euo pipefail

HERE=${SCRIPTS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
PLAN=${PLAN:?set PLAN to the output of elastic-plugin plan --json}
CKPT=${CKPT:?set CKPT to the importance-reordered checkpoint}
SWEEP_DIR=${SWEEP_DIR:-sweep}
TOP=${TOP:-4}                      # how many of the plan's (fitting) layouts
ITERS=${ITERS:-10}                 # iterations per budget (the run's first is a warm-up)
PER_BUDGET=${PER_BUDGET:-1}        # 1: one curriculum stage per budget
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
LOCAL=${LOCAL:-0}                  # 1: run here with torchrun instead of submitting
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}
EXTRA_ARGS=${EXTRA_ARGS:-}         # appended to every elastic-train command

# NN_name tp pp ep distributed_optimizer gpus micro global seq budgets cp, one line per layout; writes
# SWEEP_DIR/NN_name/sweep.json unless DRY_RUN
LAYOUTS=$("$PYTHON" - "$PLAN" "$SWEEP_DIR" "$TOP" "$DRY_RUN" <<'PY'
import json, sys
from pathlib import Path
plan_path, sweep, top, dry = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
plan = json.loads(Path(plan_path).read_text())
chosen = [e for e in plan["layouts"] if e["fits"]
          and e["layout"]["sequence_parallel"] == (e["layout"]["tp"] > 1)][:top]
if not chosen:
    sys.exit(f"sweep.sh: {plan_path} has no fitting layout to run")
for i, entry in enumerate(chosen):
    lay = entry["layout"]
    name = f"{i:02d}_" + lay["name"].replace(" ", "_").lower()
    if not dry:
        (sweep / name).mkdir(parents=True, exist_ok=True)
        planned = {k: entry[k] for k in ("memory", "tokens_per_s", "step_seconds")}
        planned["budgets"] = [{"budget": b["budget"], "tokens_per_s": b["tokens_per_s"]}
                              for b in entry["budgets"]]
        (sweep / name / "sweep.json").write_text(json.dumps(
            {"layout": lay, "gpus": plan["gpus"], "planned": planned, "plan": plan_path}, indent=1))
    print(name, lay["tp"], lay["pp"], lay["ep"], int(lay["distributed_optimizer"]), plan["gpus"],
          plan["micro_batch_size"], plan["global_batch_size"], plan["seq_length"],
          len(entry["budgets"]), lay.get("cp", 1))
PY
)
COUNT=$(wc -l <<< "$LAYOUTS")
read -r _ _ _ _ _ GPUS _ _ _ BUDGETS _ <<< "$(head -n 1 <<< "$LAYOUTS")"
PROFILE_ARGS=(--log-interval 1)
TRAIN_ITERS=$ITERS
if [[ "$PER_BUDGET" == 1 ]]; then  # "ITERS:1/0/0,ITERS:0/1/0,ITERS:0/0/1"
    STAGES=()
    for ((i = 0; i < BUDGETS; i++)); do
        probs=()
        for ((j = 0; j < BUDGETS; j++)); do probs+=("$([[ $i == "$j" ]] && echo 1 || echo 0)"); done
        STAGES+=("$ITERS:$(IFS=/; echo "${probs[*]}")")
    done
    PROFILE_ARGS+=(--elastic-curriculum "$(IFS=,; echo "${STAGES[*]}")")
    TRAIN_ITERS=$((ITERS * BUDGETS))
fi
PROFILE_ARGS+=(--profile "$TRAIN_ITERS")

run_env() {  # the environment train_elastic.sbatch reads, for one layouts line
    local name tp pp ep dopt gpus mbs gbs seq budgets cp
    read -r name tp pp ep dopt gpus mbs gbs seq budgets cp <<< "$1"
    echo "OUT=$SWEEP_DIR/$name TP=$tp PP=$pp EP=$ep CP=$cp DISTRIBUTED_OPTIMIZER=$dopt" \
         "TRAIN_ITERS=$TRAIN_ITERS MICRO_BATCH_SIZE=$mbs GLOBAL_BATCH_SIZE=$gbs SEQ_LENGTH=$seq"
}

if [[ "$LOCAL" == 1 ]]; then
    while read -r line; do
        # train_elastic.sbatch's own command line (its DRY_RUN), run here instead of by srun
        cmd=$(env $(run_env "$line") CKPT="$CKPT" DRY_RUN=1 SLURM_NNODES=1 \
              GPUS_PER_NODE="$GPUS" TORCHRUN="$TORCHRUN" EXTRA_ARGS="$EXTRA_ARGS" \
              bash "$HERE/train_elastic.sbatch" "${PROFILE_ARGS[@]}")
        if [[ "$DRY_RUN" == 1 ]]; then
            echo "$cmd"
        else
            eval "$cmd"
        fi
    done <<< "$LAYOUTS"
    exit 0
fi

if (( GPUS % GPUS_PER_NODE )); then
    echo "sweep.sh: the plan's $GPUS GPUs are not whole nodes of GPUS_PER_NODE=$GPUS_PER_NODE" >&2
    exit 2
fi
SUBMIT=(sbatch --array "0-$((COUNT - 1))" --nodes "$((GPUS / GPUS_PER_NODE))"
        --gpus-per-node "$GPUS_PER_NODE" --job-name elastic-sweep
        --export "ALL,SCRIPTS_DIR=$HERE,SWEEP_DIR=$SWEEP_DIR,CKPT=$CKPT,ITERS=$ITERS"
        "$HERE/sweep.sh")
if [[ -n "${SLURM_ARRAY_TASK_ID:-}" ]]; then  # inside the array: run this task's layout
    line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" <<< "$LAYOUTS")
    exec env $(run_env "$line") EXTRA_ARGS="$EXTRA_ARGS" \
        bash "$HERE/train_elastic.sbatch" "${PROFILE_ARGS[@]}"
fi
if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${SUBMIT[@]}"
    echo
    while read -r line; do  # what each task will run
        env $(run_env "$line") CKPT="$CKPT" DRY_RUN=1 SLURM_NNODES="$((GPUS / GPUS_PER_NODE))" \
            EXTRA_ARGS="$EXTRA_ARGS" bash "$HERE/train_elastic.sbatch" "${PROFILE_ARGS[@]}"
    done <<< "$LAYOUTS"
    exit 0
fi
"${SUBMIT[@]}"
