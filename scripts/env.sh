# Sourced by scripts/test.sh and scripts/demo.sh: makes a Python environment
# with torch and fastcomm installed, from nothing if need be.
#   FASTCOMM_PYTHON        use this interpreter as is (no venv), e.g. a system
#                          python that already has torch (the GPU machines)
#   FASTCOMM_TORCH_VERSION torch to install into the venv (default: the pin)
set -euo pipefail
FASTCOMM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$FASTCOMM_ROOT"
TORCH_PIN="${FASTCOMM_TORCH_VERSION:-2.15.0}"

if [[ -n "${FASTCOMM_PYTHON:-}" ]]; then
  PY="$FASTCOMM_PYTHON"
else
  if [[ ! -x .venv/bin/python ]]; then
    echo "[fastcomm] creating .venv"
    python3 -m venv .venv
  fi
  PY="$FASTCOMM_ROOT/.venv/bin/python"
  if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[fastcomm] installing torch==$TORCH_PIN (first run only)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==$TORCH_PIN"
  fi
  "$PY" -m pip install -q pytest numpy ninja setuptools wheel
fi
export PATH="$(dirname "$PY"):$PATH"

# Build and install fastcomm (editable: later builds are incremental).
if [[ "${FASTCOMM_SKIP_BUILD:-0}" != "1" ]]; then
  echo "[fastcomm] building the extension (MAX_JOBS=${MAX_JOBS:=$(nproc)})"
  export MAX_JOBS
  if ! "$PY" -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1; then
    tail -n 60 build.log
    echo "[fastcomm] build failed; full log in build.log" >&2
    exit 1
  fi
fi
