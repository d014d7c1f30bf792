# Sourced by scripts/test.sh and scripts/demo.sh: makes a Python environment with torch and
# fastcomm, from nothing if need be, and builds what changed since the last run.
#   FASTCOMM_PYTHON        use this interpreter as is (no venv), e.g. a system python that
#                          already has torch (the GPU machines)
#   FASTCOMM_TORCH_VERSION torch to install into the venv (default: the pin)
#   FASTCOMM_TORCH_INDEX   an extra package index to take torch from (e.g. one with CPU wheels)
#   FASTCOMM_BUILD_CUDA    1: build the CUDA parts even without a GPU; 0: CPU only
#                          (default: CUDA where torch has it, nvcc is found and a GPU is present)
#   FASTCOMM_BUILD_TESTING 1: also build torchext._testing (scripts/test.sh sets it)
#   FASTCOMM_SKIP_BUILD    1: use the extension as it is
#   MAX_JOBS               parallel compile jobs (default: all cores)
# The extension is built in place (torchext/*.so); ninja keeps its objects in build/, so a
# rebuild compiles only what changed, and nothing runs when no input changed (a stamp over the
# sources, setup.py, torch and the build settings). The full log goes to build.log.
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
    # PyPI has a single Linux x86_64 torch build, with CUDA: it pulls the CUDA libraries
    # (several GB) even where no GPU exists. CPU-only wheels come only from PyTorch's own
    # index; FASTCOMM_TORCH_INDEX names it (or a mirror) to install from there.
    echo "[fastcomm] installing torch==$TORCH_PIN (first run only)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q ${FASTCOMM_TORCH_INDEX:+--extra-index-url "$FASTCOMM_TORCH_INDEX"} \
      "torch==$TORCH_PIN"
  fi
  # expecttest: torch.testing's own test utilities import it (tests/torch_suite.py runs
  # PyTorch's distributed test suite)
  if ! "$PY" -c "import pytest, numpy, ninja, setuptools, wheel, expecttest" 2>/dev/null; then
    "$PY" -m pip install -q pytest numpy ninja setuptools wheel expecttest
  fi
fi
export PATH="$(dirname "$PY"):$PATH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

# Runs `setup.py ARGS...` with its full output in LOG, showing on the terminal only what is
# built (ninja's "[k/n] file" lines), our warnings and errors, and the time it took.
fastcomm_setup() {
  local log="$1"
  shift
  local start=$SECONDS rc=0
  mkdir -p "$(dirname "$log")"
  "$PY" setup.py "$@" 2>&1 | tee "$log" | awk -v root="$FASTCOMM_ROOT/" '
    /^\[fastcomm setup\] / { sub(/^\[fastcomm setup\]/, "[fastcomm]"); print; fflush(); next }
    /^\[[0-9]+\/[0-9]+\] / {
      src = ""
      for (i = 2; i <= NF; i++) if ($i ~ /\.(cpp|cu)$/) src = $i
      if (src == "") next
      if (index(src, root) == 1) src = substr(src, length(root) + 1)
      print "  " $1 " " src; fflush(); next
    }
    /(warning|error): / && (index($0, root) == 1 || /^(csrc|kernels)\//) { print; fflush() }
    /^(error|Error|RuntimeError|subprocess\.CalledProcessError)/ { print; fflush() }
  ' || rc=$?
  local took=$((SECONDS - start))
  if [[ $rc -ne 0 ]]; then
    tail -n 60 "$log"
    echo "[fastcomm] build failed after $((took / 60)) min $((took % 60)) s; full log in $log" >&2
    return 1
  fi
  echo "[fastcomm] built in $((took / 60)) min $((took % 60)) s (log: $log)"
}

# Everything the build depends on besides the tree ninja tracks itself: when this hash is
# the one of the last successful build, nothing is rebuilt.
fastcomm_build_key() {
  {
    find csrc kernels setup.py pyproject.toml -type f -print0 | LC_ALL=C sort -z | xargs -0 sha1sum
    "$PY" - <<'PY'
import importlib.util, os, sys
print(os.path.realpath(sys.executable), sys.version)
spec = importlib.util.find_spec("torch")
if spec is not None and spec.origin:
    with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
        print(f.read())
PY
    for v in FASTCOMM_BUILD_CUDA FASTCOMM_CPU_ONLY FASTCOMM_CUDA_PTX_ONLY TORCH_CUDA_ARCH_LIST \
      CUDA_HOME NCCL_HOME NCCL_ROOT RDMA_CORE_HOME CC CXX CFLAGS CXXFLAGS LDFLAGS; do
      echo "$v=${!v:-}"
    done
    command -v nvcc || true
    if command -v nvidia-smi > /dev/null; then nvidia-smi -L 2> /dev/null || true; fi
  } | sha1sum | cut -d' ' -f1
}

# The package and its entry points (init_process_group(backend="fastcomm") without an import),
# installed editable without building anything: the extension files built in place are the
# ones Python loads. Redone when torch or the packaging changes (the entry point depends on it).
fastcomm_install_metadata() {
  local key
  key=$({
    sha1sum setup.py pyproject.toml
    "$PY" -c 'import importlib.metadata as m, sys; print(sys.prefix, m.version("torch"))'
  } | sha1sum | cut -d' ' -f1)
  if "$PY" - "$FASTCOMM_ROOT" <<'PY' && [[ "$(cat build/stamps/install 2> /dev/null)" == "$key" ]]; then
import importlib.metadata as md, json, pathlib, sys
try:
    dist = md.distribution("fastcomm")
except md.PackageNotFoundError:
    sys.exit(1)
url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
ok = url == pathlib.Path(sys.argv[1]).as_uri() and any(e.name == "fastcomm" for e in dist.entry_points)
sys.exit(0 if ok else 1)
PY
    return 0
  fi
  echo "[fastcomm] installing the package (editable, entry points)"
  if ! FASTCOMM_NO_EXTENSION=1 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
    -e . > build/install.log 2>&1; then
    cat build/install.log
    echo "[fastcomm] install failed; log in build/install.log" >&2
    return 1
  fi
  echo "$key" > build/stamps/install
}

if [[ "${FASTCOMM_SKIP_BUILD:-0}" != "1" ]]; then
  mkdir -p build/stamps
  fastcomm_install_metadata
  key=$(fastcomm_build_key)
  # _testing links against _C: once built, it is rebuilt with _C so the two never disagree.
  testing="${FASTCOMM_BUILD_TESTING:-0}"
  [[ -e build/stamps/_testing ]] && testing=1
  current=1
  [[ "$(cat build/stamps/_C 2> /dev/null)" == "$key" ]] && compgen -G "torchext/_C*.so" > /dev/null \
    || current=0
  if [[ $testing == 1 ]]; then
    [[ "$(cat build/stamps/_testing 2> /dev/null)" == "$key" ]] \
      && compgen -G "torchext/_testing*.so" > /dev/null || current=0
  fi
  if [[ $current == 1 ]]; then
    echo "[fastcomm] extension up to date (no input changed since the last build)"
  else
    rm -f build/stamps/_C build/stamps/_testing
    # build/inplace, not setuptools' default build/lib.*: a later `pip install .` packs what
    # is under build/lib.*, which must not hold this build's torchext._testing.
    FASTCOMM_BUILD_TESTING=$testing fastcomm_setup build.log build_ext --inplace --force \
      --build-lib build/inplace
    echo "$key" > build/stamps/_C
    if [[ $testing == 1 ]]; then echo "$key" > build/stamps/_testing; fi
  fi
fi
