#!/usr/bin/env bash
# GPU checks of the fused matmul ops (torch.ops.fastcomm.matmul / linear).
#
# Run from the repository root on the GPU machine, after the extension has
# been built and installed (import torchext must work). Writes a few compact
# files into "$OUT" (default ./out):
#   ops_pytest.log      tests/test_ops.py, CUDA tests included (+ device info)
#   ops_smoke.log       every kernel variant on odd and multi-tile shapes (no sanitizer, < 1 min)
#   ops_sanitizer.log   compute-sanitizer memcheck (each kernel path / Hopper variant on small
#                       odd shapes, both ops) and racecheck (shared-memory kernels)
#   bench_matmul.log    the benchmark's table, target summary and variant matrix
#   bench_matmul.json   all benchmark numbers, device, torch version, command
#   bench_matmul.png    TFLOP/s per shape and method
#   roofline.png        each kernel under the measured bandwidth / matmul ceilings
#   bench_matmul_{fp16,fp32}.{log,json}  step bench-dtypes: the same comparisons in float16 / float32
#
# Usage: scripts/gpu_ops_check.sh [all|tests|smoke|sanitize|racecheck|bench|bench-quick|bench-dtypes]
#   (each step fits in a few minutes; run them as separate commands if the
#   machine limits the length of one command)
# Env: PYTHON (default python3), OUT, BENCH_VARIANTS (default: the "hopper" set of
#   bench_matmul.py on sm_90, auto elsewhere), BENCH_ARGS (extra benchmark arguments).
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

step_smoke() {
  echo "[gpu_ops_check] every kernel variant, odd shapes -> $OUT/ops_smoke.log"
  "$PY" scripts/matmul_smoke.py > "$OUT/ops_smoke.log" 2>&1
  local rc=$?
  cat "$OUT/ops_smoke.log"
  return $rc
}

step_sanitize() {
  echo "[gpu_ops_check] compute-sanitizer -> $OUT/ops_sanitizer.log"
  local cs
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  local rc=0 variants="simt,simt_wide,mma"
  if is_sm90; then variants="$variants,coop,coop_tma,coop_c2,pingpong,pingpong_c2"; fi
  {
    echo "== $cs"
    "$cs" --version 2>&1 | tail -n 1
    for v in ${variants//,/ }; do
      echo "== memcheck variant $v"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$cs" --tool memcheck --error-exitcode 9 --print-limit 20 \
        "$PY" scripts/matmul_smoke.py --quick --variants "$v" 2>&1 | tail -n 40
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    for v in mma simt_wide; do
      echo "== racecheck variant $v (shared-memory hazards)"
      "$cs" --tool racecheck --error-exitcode 9 --print-limit 20 \
        "$PY" scripts/matmul_smoke.py --quick --variants "$v" 2>&1 | tail -n 20
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    echo "== sanitizer steps exit status: $rc"
  } > "$OUT/ops_sanitizer.log" 2>&1
  grep -E "^== |ERROR SUMMARY|variants OK|RACECHECK SUMMARY" "$OUT/ops_sanitizer.log" | tail -n 30
  return $rc
}

# racecheck on the Hopper kernels, whose pipelines hand shared memory over
# through mbarriers, beside a probe that asks whether the tool models such a
# handover at all (scripts/racecheck_mbarrier_probe.cu: the same handover by
# mbarrier, by bar.arrive / bar.sync, and by __syncthreads as the control).
step_racecheck() {
  echo "[gpu_ops_check] racecheck (mbarrier probe, Hopper variants) -> $OUT/ops_racecheck.log"
  local cs
  cs="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  local rc=0
  {
    "${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}" -std=c++17 -arch=sm_90a \
      -o /tmp/fastcomm_mbar_probe scripts/racecheck_mbarrier_probe.cu || rc=1
    for mode in 0 1 2; do
      echo "== probe mode $mode: plain run, then racecheck"
      /tmp/fastcomm_mbar_probe "$mode" || rc=1
      "$cs" --tool racecheck --print-limit 5 /tmp/fastcomm_mbar_probe "$mode" 2>&1 | tail -n 12
    done
    for v in ${RACECHECK_VARIANTS:-coop_tma pingpong coop_off}; do
      echo "== racecheck variant $v"
      "$cs" --tool racecheck --print-limit 5 "$PY" scripts/matmul_smoke.py --quick --variants "$v" \
        2>&1 | tail -n 14
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
  } > "$OUT/ops_racecheck.log" 2>&1
  grep -E "^== |RACECHECK SUMMARY|OK|WRONG|variants" "$OUT/ops_racecheck.log" | tail -n 30
  return $rc
}

step_bench() {
  local extra="${1:-}"
  local variants="${BENCH_VARIANTS:-}"
  if [ -z "$variants" ]; then
    if is_sm90; then variants="hopper"; else variants="auto"; fi
  fi
  echo "[gpu_ops_check] benchmark (variants $variants) -> $OUT/bench_matmul.{log,json,png}, $OUT/roofline.png"
  "$PY" benchmarks/bench_matmul.py --dtype bf16 --variants "$variants" $extra ${BENCH_ARGS:-} \
    --json "$OUT/bench_matmul.json" --plot "$OUT/bench_matmul.png" --roofline "$OUT/roofline.png" \
    > "$OUT/bench_matmul.log" 2>&1
  local rc=$?
  tail -n 100 "$OUT/bench_matmul.log"
  return $rc
}

# float16 and float32 beside bf16's numbers: auto against cuBLAS, addmm_activation and the
# unfused pair, alternating rounds (no torch.compile baseline: bf16's run has it). float32
# runs the CUDA-core kernel (cuBLAS: SGEMM without TF32, torch's default), so smaller shapes.
step_bench_dtypes() {
  local rc=0 dt sizes llm
  for dt in fp16 fp32; do
    sizes="1024,2048,4096,8192"
    llm="8192x4096x4096,8192x11008x4096,8192x14336x4096"
    if [ "$dt" = fp32 ]; then
      sizes="1024,2048,4096"
      llm="8192x4096x4096"
    fi
    echo "[gpu_ops_check] benchmark $dt -> $OUT/bench_matmul_$dt.{log,json}"
    "$PY" benchmarks/bench_matmul.py --dtype "$dt" --variants auto --sizes "$sizes" --llm "$llm" \
      --rounds 3 --no-compile ${BENCH_ARGS:-} --json "$OUT/bench_matmul_$dt.json" \
      > "$OUT/bench_matmul_$dt.log" 2>&1 || rc=1
    tail -n 40 "$OUT/bench_matmul_$dt.log"
  done
  return $rc
}

case "$STEP" in
  tests) step_tests || status=1 ;;
  smoke) step_smoke || status=1 ;;
  sanitize) step_sanitize || status=1 ;;
  racecheck) step_racecheck || status=1 ;;
  bench) step_bench || status=1 ;;
  bench-quick) step_bench --quick || status=1 ;;
  bench-dtypes) step_bench_dtypes || status=1 ;;
  all)
    step_tests || status=1
    step_smoke || status=1
    step_sanitize || status=1
    step_bench || status=1
    ;;
  *)
    echo "usage: $0 [all|tests|smoke|sanitize|racecheck|bench|bench-quick|bench-dtypes]" >&2
    exit 2
    ;;
esac
echo "[gpu_ops_check] $STEP: exit status $status (files in $OUT)"
exit $status
