#!/usr/bin/env bash
# GPU checks of the fused matmul ops (torch.ops.fastcomm.matmul / linear).
#
# Run from the repository root on the GPU machine, after the extension has
# been built and installed (import torchext must work). Writes a few compact
# files into "$OUT" (default ./out):
#   ops_pytest.log      tests/test_ops.py, CUDA tests included (+ device info)
#   ops_sanitizer.log   compute-sanitizer memcheck (every kernel path, small odd
#                       shapes, both ops) and racecheck (shared-memory kernels)
#   bench_matmul.log    the benchmark's table and target summary
#   bench_matmul.json   all benchmark numbers, device, torch version, command
#   bench_matmul.png    TFLOP/s per shape and method
#   roofline.png        each kernel under the measured bandwidth / matmul ceilings
#
# Usage: scripts/gpu_ops_check.sh [all|tests|sanitize|bench|bench-quick]
#   (each step fits in a few minutes; run them as separate commands if the
#   machine limits the length of one command)
# Env: PYTHON (default python3), OUT, BENCH_VARIANTS (default: mma,wgmma,wgmma_c2
#   on sm_90, auto elsewhere), BENCH_ARGS (extra benchmark arguments).
set -uo pipefail

OUT="${OUT:-$PWD/out}"
PY="${PYTHON:-python3}"
STEP="${1:-all}"
mkdir -p "$OUT"
status=0

is_sm90() {
  "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.get_device_capability()==(9,0) else 1)'
}

step_tests() {
  echo "[gpu_ops_check] pytest tests/test_ops.py -> $OUT/ops_pytest.log"
  {
    echo "== device"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 || true
    "$PY" - <<'EOF'
import torch, torchext  # noqa: F401
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda} | {p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs")
print("ops:", torch.ops.fastcomm.matmul, torch.ops.fastcomm.linear)
if (p.major, p.minor) == (9, 0):
    import os
    os.environ["FASTCOMM_MATMUL_IMPL"] = "wgmma"
    try:
        a = torch.randn(8, 8, device="cuda", dtype=torch.bfloat16)
        torch.ops.fastcomm.matmul(a, a)
        torch.cuda.synchronize()
        print("wgmma kernel: available (extension built for sm_90a)")
    except RuntimeError as e:
        print("wgmma kernel: NOT available -- rebuild with TORCH_CUDA_ARCH_LIST=9.0a:", str(e)[:300])
    os.environ.pop("FASTCOMM_MATMUL_IMPL")
EOF
    echo "== pytest"
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_ops.py 2>&1 | tail -n 200
  } > "$OUT/ops_pytest.log" 2>&1
  local rc=$?
  tail -n 3 "$OUT/ops_pytest.log"
  return $rc
}

step_sanitize() {
  echo "[gpu_ops_check] compute-sanitizer -> $OUT/ops_sanitizer.log"
  local cs
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  local script
  script="$(mktemp /tmp/fastcomm_sanitize_XXXX.py)"
  cat > "$script" <<'EOF'
# Both ops on small odd shapes, every operand layout, every activation, on
# the kernel path named by FASTCOMM_MATMUL_IMPL; checks the results too.
import os, torch, torch.nn.functional as F
import torchext  # noqa: F401
torch.manual_seed(0)
impl = os.environ.get("FASTCOMM_MATMUL_IMPL", "auto")
tol = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 1e-5}
dtypes = [torch.float16, torch.bfloat16] + ([torch.float32] if impl in ("auto", "simt") else [])
worst = 0.0
for dt in dtypes:
    for (m, n, k) in [(1, 1, 1), (7, 13, 5), (33, 65, 17), (129, 200, 72), (130, 257, 136)]:
        for tile in ("large", "small"):
            os.environ["FASTCOMM_MATMUL_TILE"] = tile
            a = torch.randn(m, k, device="cuda", dtype=dt)
            at = torch.randn(k, m, device="cuda", dtype=dt).t()
            b = torch.randn(k, n, device="cuda", dtype=dt)
            bt = torch.randn(n, k, device="cuda", dtype=dt).t()
            for aa in (a, at):
                for bb in (b, bt):
                    out = torch.ops.fastcomm.matmul(aa, bb)
                    ref = aa.double() @ bb.double()
                    e = ((out.double() - ref).norm() / ref.norm()).item()
                    worst = max(worst, e / tol[dt])
            w, bias = bt.t(), torch.randn(n, device="cuda", dtype=dt)
            for act in ("none", "relu", "gelu", "gelu_tanh", "silu"):
                y = torch.ops.fastcomm.linear(a, w, bias, act)
                pre = a.double() @ w.double().t() + bias.double()
                r = {"none": pre, "relu": F.relu(pre), "gelu": F.gelu(pre), "silu": F.silu(pre),
                     "gelu_tanh": F.gelu(pre, approximate="tanh")}[act]
                e = ((y.double() - r).norm() / r.norm()).item()
                worst = max(worst, e / tol[dt])
torch.cuda.synchronize()
print(f"impl={impl}: worst error / tolerance = {worst:.3f}", "OK" if worst < 1 else "FAIL")
raise SystemExit(0 if worst < 1 else 3)
EOF
  local rc=0
  {
    echo "== $cs"
    "$cs" --version 2>&1 | tail -n 1
    for impl in simt mma; do
      echo "== memcheck FASTCOMM_MATMUL_IMPL=$impl"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 FASTCOMM_MATMUL_IMPL=$impl \
        "$cs" --tool memcheck --error-exitcode 9 --print-limit 20 "$PY" "$script" 2>&1 | tail -n 40
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    if is_sm90; then
      for cl in 1 2; do
        echo "== memcheck FASTCOMM_MATMUL_IMPL=wgmma FASTCOMM_MATMUL_CLUSTER=$cl"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 FASTCOMM_MATMUL_WGMMA=1 FASTCOMM_MATMUL_IMPL=wgmma FASTCOMM_MATMUL_CLUSTER=$cl \
          "$cs" --tool memcheck --error-exitcode 9 --print-limit 20 "$PY" "$script" 2>&1 | tail -n 40
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done
    else
      echo "== wgmma: skipped (not an sm_90 device)"
    fi
    echo "== racecheck FASTCOMM_MATMUL_IMPL=mma (shared-memory hazards)"
    FASTCOMM_MATMUL_IMPL=mma "$cs" --tool racecheck --error-exitcode 9 --print-limit 20 "$PY" "$script" 2>&1 | tail -n 20
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    echo "== sanitizer steps exit status: $rc"
  } > "$OUT/ops_sanitizer.log" 2>&1
  rm -f "$script"
  grep -E "^== |ERROR SUMMARY|worst error|RACECHECK SUMMARY" "$OUT/ops_sanitizer.log" | tail -n 20
  return $rc
}

step_bench() {
  local extra="${1:-}"
  local variants="${BENCH_VARIANTS:-}"
  if [ -z "$variants" ]; then
    # on sm_90 "auto" is "mma" unless FASTCOMM_MATMUL_WGMMA=1
    if is_sm90; then variants="mma,wgmma,wgmma_c2"; else variants="auto"; fi
  fi
  echo "[gpu_ops_check] benchmark (variants $variants) -> $OUT/bench_matmul.{log,json,png}, $OUT/roofline.png"
  "$PY" benchmarks/bench_matmul.py --dtype bf16 --variants "$variants" $extra ${BENCH_ARGS:-} \
    --json "$OUT/bench_matmul.json" --plot "$OUT/bench_matmul.png" --roofline "$OUT/roofline.png" \
    > "$OUT/bench_matmul.log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/bench_matmul.log"
  return $rc
}

case "$STEP" in
  tests) step_tests || status=1 ;;
  sanitize) step_sanitize || status=1 ;;
  bench) step_bench || status=1 ;;
  bench-quick) step_bench --quick || status=1 ;;
  all)
    step_tests || status=1
    step_sanitize || status=1
    step_bench || status=1
    ;;
  *)
    echo "usage: $0 [all|tests|sanitize|bench|bench-quick]" >&2
    exit 2
    ;;
esac
echo "[gpu_ops_check] $STEP: exit status $status (files in $OUT)"
exit $status
