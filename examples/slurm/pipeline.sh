#!/bin/bash
# Submit the whole job as four dependent SLURM jobs (run this on a login node):
#   teacher (train) -> importance -> reorder -> elastic-train
# Each starts only when the previous one succeeded (--dependency=afterok). RUN must be on a
# file system every node sees. DRY_RUN=1 prints the sbatch commands instead of submitting.
#
#   RUN=/lustre/me/run1 CONFIG=examples/configs/tiny_elastic.yaml TP=2 EP=2 \
#       bash examples/slurm/pipeline.sh

set -euo pipefail

RUN=${RUN:?set RUN to a shared output folder}
CONFIG=${CONFIG:-examples/configs/tiny_elastic.yaml}
HERE=${HERE:-examples/slurm}               # where run_stage.sbatch / train_elastic.sbatch are
TEACHER_NODES=${TEACHER_NODES:-1}
ELASTIC_NODES=${ELASTIC_NODES:-1}
CALIB_SAMPLES=${CALIB_SAMPLES:-1024}       # importance calibration samples (per DP rank)
CALIB_MICRO_BATCH=${CALIB_MICRO_BATCH:-8}
DRY_RUN=${DRY_RUN:-0}

# submit NAME NODES DEPENDENCY SCRIPT [ARGS...] -> prints the job id
submit() {
    local name=$1 nodes=$2 dependency=$3
    shift 3
    local cmd=(sbatch --parsable --job-name "$name" --nodes "$nodes")
    [[ -n "$dependency" ]] && cmd+=(--dependency "afterok:$dependency")
    cmd+=("$@")
    if [[ "$DRY_RUN" == 1 ]]; then
        printf '%q ' "${cmd[@]}" >&2
        echo >&2
        echo "<$name>"
    else
        "${cmd[@]}"
    fi
}

teacher=$(submit elastic-teacher "$TEACHER_NODES" "" "$HERE/run_stage.sbatch" \
    train --config "$CONFIG" --out "$RUN" --no-progress)
importance=$(submit elastic-importance 1 "$teacher" "$HERE/run_stage.sbatch" \
    importance --ckpt "$RUN/checkpoints/teacher" --out "$RUN/importance.pt" \
    --num-samples "$CALIB_SAMPLES" --micro-batch-size "$CALIB_MICRO_BATCH" \
    --plot "$RUN/importance.png" --no-progress)
reorder=$(submit elastic-reorder 1 "$importance" "$HERE/run_stage.sbatch" \
    reorder --ckpt "$RUN/checkpoints/teacher" --scores "$RUN/importance.pt" \
    --out "$RUN/checkpoints/reordered")
elastic=$(submit elastic-train "$ELASTIC_NODES" "$reorder" \
    --export "ALL,CKPT=$RUN/checkpoints/reordered,OUT=$RUN,CONFIG=$CONFIG" \
    "$HERE/train_elastic.sbatch")
echo "submitted: teacher $teacher -> importance $importance -> reorder $reorder -> elastic $elastic"
