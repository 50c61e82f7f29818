#!/bin/bash
# Submit the whole job as four dependent SLURM jobs (run this on a login node):
#   teacher (train) -> importance -> reorder -> elastic-train
# Each starts only when the previous one succeeded (--dependency=afterok). RUN must be on a
# file system every node sees. DRY_RUN=1 prints the sbatch commands instead of submitting.
#
#   RUN=/lustre/me/run1 CONFIG=examples/configs/tiny_elastic.yaml TP=2 EP=2 \
#       bash examples/slurm/pipeline.sh
#
# Bring your own model: HF=DIR replaces the teacher run by `elastic-plugin import --hf DIR`
# (RUN/checkpoints/teacher); DATA_PATH (and VALID_DATA_PATH) name your indexed datasets
# (`elastic-plugin prepare-data --input ... --tokenizer ...`), read with the imported tokenizer;
# CONFIG then needs the imported model: section (docs/byom.md).
#
#   RUN=/lustre/me/run2 HF=/lustre/Nano-v3 DATA_PATH=/lustre/data/train_text_document \
#       VALID_DATA_PATH=/lustre/data/valid_text_document CONFIG=my_elastic.yaml \
#       bash examples/slurm/pipeline.sh

set -euo pipefail

RUN=${RUN:?set RUN to a shared output folder}
CONFIG=${CONFIG:-examples/configs/tiny_elastic.yaml}
HERE=${HERE:-examples/slurm}               # where run_stage.sbatch / train_elastic.sbatch are
TEACHER_NODES=${TEACHER_NODES:-1}
TEACHER_SAVE_INTERVAL=${TEACHER_SAVE_INTERVAL:-100}  # teacher saves a resubmitted job resumes from
ELASTIC_NODES=${ELASTIC_NODES:-1}
CALIB_SAMPLES=${CALIB_SAMPLES:-1024}       # importance calibration samples (per DP rank)
CALIB_MICRO_BATCH=${CALIB_MICRO_BATCH:-8}
DRY_RUN=${DRY_RUN:-0}
HF=${HF:-}                                 # a Hugging Face NemotronH directory to import
DATA_PATH=${DATA_PATH:-}                   # Megatron indexed dataset prefix (train)
VALID_DATA_PATH=${VALID_DATA_PATH:-}       # (valid; default DATA_PATH)
TOKENIZER=${TOKENIZER:-}                   # default with HF: the imported tokenizer

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

data_args=()
if [[ -n "$HF" ]]; then
    TOKENIZER=${TOKENIZER:-$RUN/checkpoints/teacher/iter_0000000/hf_tokenizer/tokenizer.json}
    [[ -n "$DATA_PATH" ]] || { echo "HF=$HF needs DATA_PATH (prepare-data --input)" >&2; exit 2; }
    # one process, no torchrun (import runs at TP=PP=EP=1; later stages load any layout)
    teacher=$(submit elastic-import 1 "" --wrap "$(printf '%q ' "${PYTHON:-python}" -m \
        elastic_plugin.cli import --hf "$HF" --out "$RUN/checkpoints/teacher" --no-progress)")
else
    teacher=$(submit elastic-teacher "$TEACHER_NODES" "" "$HERE/run_stage.sbatch" \
        train --config "$CONFIG" --out "$RUN" --no-progress --resume \
        --save-interval "$TEACHER_SAVE_INTERVAL")
fi
if [[ -n "$DATA_PATH" ]]; then
    [[ -n "$TOKENIZER" ]] || { echo "DATA_PATH needs TOKENIZER (its tokenizer.json)" >&2; exit 2; }
    data_args=(--data-path "$DATA_PATH" --tokenizer "$TOKENIZER")
fi
importance=$(submit elastic-importance 1 "$teacher" "$HERE/run_stage.sbatch" \
    importance --ckpt "$RUN/checkpoints/teacher" --out "$RUN/importance.pt" \
    --num-samples "$CALIB_SAMPLES" --micro-batch-size "$CALIB_MICRO_BATCH" \
    --plot "$RUN/importance.png" --no-progress ${data_args[@]+"${data_args[@]}"})
reorder=$(submit elastic-reorder 1 "$importance" "$HERE/run_stage.sbatch" \
    reorder --ckpt "$RUN/checkpoints/teacher" --scores "$RUN/importance.pt" \
    --out "$RUN/checkpoints/reordered")
elastic_args=()  # appended to elastic-train's command line by train_elastic.sbatch
if [[ -n "$DATA_PATH" ]]; then
    elastic_args=("${data_args[@]}" --valid-data-path "${VALID_DATA_PATH:-$DATA_PATH}")
fi
elastic=$(submit elastic-train "$ELASTIC_NODES" "$reorder" \
    --export "ALL,CKPT=$RUN/checkpoints/reordered,OUT=$RUN,CONFIG=$CONFIG" \
    "$HERE/train_elastic.sbatch" ${elastic_args[@]+"${elastic_args[@]}"})
echo "submitted: teacher $teacher -> importance $importance -> reorder $reorder -> elastic $elastic"
