#!/usr/bin/env bash
# The GPU checks of the csrc ops, as ONE call on a lent H200 (the device tool's `run`):
#
#   run(command="bash scripts/gpu_check.sh", timeout_s=540)
#
# The device image has its own python3 + CUDA torch (no venv, no Megatron, nothing to fetch), so
# this builds the extension in place for sm_90 against that torch, runs the kernel tests (the
# CUDA ones are skipped on CPU machines: ordered_gather / ordered_gather_many CUDA kernels,
# prefix_linear, the FP8 prefix GEMM through torch._scaled_mm vs the emulation), then the
# benchmarks on the GPU: gather vs copy, masked vs dense GEMM, FP8 GEMM of an active block vs
# BF16 (TFLOPS, fraction of peak), quantization. Everything lands in $OUT (logs + bench.json).
# Locally: PY=.venv/bin/python BENCH_DEVICE=cpu OUT=/tmp/gpu_check bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-gpu_check_out}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
status=0

{ date; nvidia-smi 2>&1 | head -15; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda',
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"; } \
  2>&1 | tee "$OUT/env.txt"

echo "==> build (in place)"
SECONDS=0
"$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in ${SECONDS}s"; tail -3 "$OUT/build.log"
"$PY" -c "import elastic_plugin.ops as ops; print(ops.backend_info())" | tee -a "$OUT/env.txt"

echo "==> kernel tests"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py tests/test_kernels_gemm.py \
  tests/test_kernels_quantize.py 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1

echo "==> benchmarks ($BENCH_DEVICE)"
"$PY" bench/run_all.py --device "$BENCH_DEVICE" --only gather --only masked_gemm --only fp8_gemm \
  --only quantize --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
