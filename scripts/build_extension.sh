#!/usr/bin/env bash
# Build elastic_plugin._C into the venv (make install) and assert what was built.
#
#   bash scripts/build_extension.sh .venv/bin/python "8.0;9.0;10.0"
#
# The CUDA ops are compiled for every architecture asked, with the machine's CUDA toolkit when its
# major version is torch's, else with the registry's compiler (requirements-cuda.txt, installed
# into the venv by scripts/cuda_toolkit.py); a CUDA part that does not compile fails the build.
# scripts/check_extension.py then asserts from the loaded library (backend, fatbin, the CUDA
# kernels' registrations) and prints what it found. ELASTIC_PLUGIN_SKIP_CUDA=1 builds the C++
# part only and says so loudly; ELASTIC_PLUGIN_NO_EXT=1 builds nothing (pure-PyTorch ops).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$1
archs=$2
truthy() { case "${1,,}" in 1 | true | yes | on) return 0 ;; *) return 1 ;; esac; }
banner() { printf '\n%s\n!!! %s\n%s\n\n' "$(printf '!%.0s' {1..78})" "$1" "$(printf '!%.0s' {1..78})"; }
export MAX_JOBS=${MAX_JOBS:-2}

if truthy "${ELASTIC_PLUGIN_NO_EXT:-}"; then
  banner "ELASTIC_PLUGIN_NO_EXT=1: no compiled extension; every op runs its PyTorch fallback"
  "$py" -m pip install --no-build-isolation --no-deps -q -e .
  exit 0
fi
if truthy "${ELASTIC_PLUGIN_SKIP_CUDA:-}"; then
  banner "ELASTIC_PLUGIN_SKIP_CUDA=1: the CUDA ops are NOT compiled; on a GPU the ops run their PyTorch fallbacks"
  "$py" -m pip install --no-build-isolation --no-deps -q -e .
  exec "$py" scripts/check_extension.py --no-cuda
fi

SECONDS=0
cuda_home=$("$py" scripts/cuda_toolkit.py)
toolkit_s=$SECONDS
echo "==> CUDA toolkit: $cuda_home (${toolkit_s}s); compiling for $archs"
CUDA_HOME=$cuda_home TORCH_CUDA_ARCH_LIST=$archs ELASTIC_PLUGIN_REQUIRE_CUDA=1 \
  "$py" -m pip install --no-build-isolation --no-deps -q -e .
echo "==> built in $((SECONDS - toolkit_s))s"
"$py" scripts/check_extension.py --cuda-archs "$archs"
