#!/usr/bin/env bash
# The GPU acceptance run, in ONE call of at most 8 minutes on a GPU machine (docs/benchmarks.md):
#
#   make gpu-wheels                                   # here: .whl/ (wheels + the tiny model's data)
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)   # the device tool
#   bash scripts/gpu_check.sh                         # or on any GPU node with .whl/ beside it
#
# The machine has python3 with a CUDA torch and nvcc, no Megatron-Core, no ModelOpt, no network:
#   0. install .whl/*.whl into /tmp/site (PYTHONPATH), build the extension in place for sm_90 and
#      assert it (scripts/check_extension.py: backend cpp+cuda, an sm_90 cubin, the CUDA kernels);
#   a. the kernel tests (tests/test_kernels*.py: their CUDA cases run here);
#   b. every test with a CUDA variant (named test_cuda_*), and the FP8 GEMM tests;
#   c. the tiny model end to end on the GPU, one rank (NCCL), BF16 training: train (--quick),
#      importance, reorder, elastic-train (--quick), export (BF16/FP8/NVFP4, nested, calibrated),
#      generate at a nested budget;
#   d. bench/bench_gpu_step.py: a plain Megatron-Core step vs our elastic step (budget 1.0, the
#      configured mix) on a ~1B GPT at seq 2048 in BF16, MFU against the measured BF16 peak; FP8
#      vs BF16; sliced vs masked at half width.
# A section that fails is recorded and the next one runs; each has a time cap, so the whole run
# ends inside 8 minutes (GPU_CHECK_BUDGET_S, default 470). $OUT (at most 8 files come back):
# summary.json (each section's status and seconds, the build facts), env.txt, build.log,
# tests.log, e2e.log, bench.log, gpu_step.json, gpu_step.md.
# GPU_CHECK_SECTIONS=e2e,bench runs only those (wheels, build, kernel_tests, cuda_variant_tests,
# e2e, bench). On a CPU (a dry run of the script itself; slower, so the caps are scaled):
#   PY=.venv/bin/python BENCH_DEVICE=cpu NO_WHEELS=1 NO_BUILD=1 E2E_PRECISION=--no-bf16 \
#   GPU_CHECK_BUDGET_S=3000 GPU_CHECK_CAP_SCALE=5 OUT=/tmp/gpu_check bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu_check_out}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
E2E_PRECISION=${E2E_PRECISION:---bf16} # --no-bf16 on a CPU, whose BF16 matmuls may be emulated
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PY WORK E2E_PRECISION
STATUS="$WORK/status.jsonl"
: > "$STATUS"
failed=0

# section NAME CAP_S LOG CMD...: run CMD under a time cap (what is left of the budget, at most
# CAP_S), appending to LOG; record status and seconds
section() {
  local name=$1 cap=$(($2 * ${GPU_CHECK_CAP_SCALE:-1})) log=$3
  shift 3
  if [ -n "${GPU_CHECK_SECTIONS:-}" ] && [[ ",$GPU_CHECK_SECTIONS," != *",$name,"* ]]; then
    return 0 # not asked for (GPU_CHECK_SECTIONS=e2e,bench reruns those alone)
  fi
  local left=$((BUDGET - SECONDS))
  ((cap > left)) && cap=$left
  if ((cap < 15)); then
    echo "==> $name: SKIPPED (${left}s of the ${BUDGET}s budget left)" | tee -a "$OUT/$log"
    printf '{"section": "%s", "status": "skipped", "seconds": 0}\n' "$name" >> "$STATUS"
    failed=1
    return 1
  fi
  echo "==> $name (cap ${cap}s)" | tee -a "$OUT/$log"
  local start=$SECONDS rc
  # a child bash (it sees the exported functions); timeout ends its whole process group
  timeout --kill-after=10 "$cap" bash -c '"$@"' _ "$@" >> "$OUT/$log" 2>&1
  rc=$?
  local status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  ((rc != 0)) && failed=1
  printf '{"section": "%s", "status": "%s", "rc": %d, "seconds": %d}\n' \
    "$name" "$status" "$rc" $((SECONDS - start)) >> "$STATUS"
  echo "    $name: $status (rc $rc, $((SECONDS - start))s)" | tee -a "$OUT/$log"
  tail -4 "$OUT/$log" | sed 's/^/    | /'
  return $rc
}

{
  date
  nvidia-smi 2>&1 | head -15
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 0. wheels, build, assertion -------------------------------------------------------------------
install_wheels() { # into /tmp/site, as the device's notes say
  ls .whl/*.whl > /dev/null || { echo "no .whl/*.whl: run make gpu-wheels and carry .whl"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
}
build() {
  "$PY" setup.py build_ext --inplace && "$PY" scripts/check_extension.py --cuda-archs "$TORCH_CUDA_ARCH_LIST"
}
export -f install_wheels build
if [ -z "${NO_WHEELS:-}" ]; then
  # /tmp/site after the repository, before the image's site-packages (transformers 5.24 over 5.17)
  section wheels 60 build.log install_wheels && export PYTHONPATH="$PWD:/tmp/site"
fi
if [ -z "${NO_BUILD:-}" ]; then
  section build 180 build.log build
fi
"$PY" -c "import elastic_plugin.ops as o, json; print(json.dumps(o.backend_info()))" \
  > "$WORK/backend.json" 2>> "$OUT/build.log" || echo '{}' > "$WORK/backend.json"
tee -a "$OUT/env.txt" < "$WORK/backend.json"

# a + b. tests -----------------------------------------------------------------------------------
# (the kernel files' integration cases check the PyTorch fallback in fresh CPU processes)
section kernel_tests 120 tests.log "$PY" -m pytest -q -p no:cacheprovider -rs -m "not integration" \
  tests/test_kernels.py tests/test_kernels_gemm.py tests/test_kernels_quantize.py
# a test's CUDA variant is named test_cuda_*: every file that has one, and the FP8 _scaled_mm path
mapfile -t cuda_files < <(grep -l "def test_cuda_" tests/test_*.py | grep -v "tests/test_kernels")
section cuda_variant_tests 120 tests.log "$PY" -m pytest -q -p no:cacheprovider -rs \
  -m "not integration" -k "cuda or scaled_mm" tests/test_elastic_fp8.py "${cuda_files[@]}"

# c. the tiny model end to end on the GPU -------------------------------------------------------
cli() { "$PY" -m elastic_plugin.cli "$@"; }
e2e() {
  local d=$WORK/e2e data=.whl/data
  set -e
  cli train --config examples/configs/tiny.yaml --out "$d" --quick "$E2E_PRECISION" --no-progress \
    --data-path "$data/train_text_document" --valid-data-path "$data/valid_text_document" \
    --tokenizer "$data/tokenizer.json"
  cli importance --ckpt "$d/checkpoints/teacher" --out "$d/importance.pt" --num-samples 64 \
    --micro-batch-size 16 --no-progress --data-path "$data/train_text_document" \
    --tokenizer "$data/tokenizer.json"
  cli reorder --ckpt "$d/checkpoints/teacher" --scores "$d/importance.pt" \
    --out "$d/checkpoints/reordered"
  cli elastic-train --ckpt "$d/checkpoints/reordered" --config examples/configs/tiny_elastic.yaml \
    --out "$d" --quick "$E2E_PRECISION" --no-progress
  cli export --ckpt "$d/checkpoints/elastic" --out "$d/exports" --eval-sequences 16 --nested \
    --calib-samples 16 --nvfp4-unaligned high-precision --no-progress
  cli generate --ckpt "$d/checkpoints/elastic" --budget 0.4 --prompt "47*23=" --max-new-tokens 24
  echo "e2e: every stage ran"
}
export -f cli e2e
section e2e 200 e2e.log e2e

# d. the benchmark ------------------------------------------------------------------------------
section bench 170 bench.log "$PY" bench/bench_gpu_step.py --device "$BENCH_DEVICE" --out "$OUT"

# summary ---------------------------------------------------------------------------------------
"$PY" - "$STATUS" "$WORK/backend.json" "$OUT/summary.json" "$SECONDS" "$failed" <<'PY'
import json, sys
status, backend, out, seconds, failed = sys.argv[1:6]
sections = [json.loads(line) for line in open(status) if line.strip()]
try:
    info = json.load(open(backend))
except ValueError:
    info = {}
summary = {"ok": failed == "0", "seconds": int(seconds), "sections": sections, "extension": info}
open(out, "w").write(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
exit $failed
