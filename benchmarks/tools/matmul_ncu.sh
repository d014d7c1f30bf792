#!/usr/bin/env bash
# Nsight Compute counters of one call of each matmul method (benchmarks/tools/matmul_ncu.py), on the
# GPU machine after the build: instructions per pipe, shared-memory wavefronts, L2 and DRAM
# bytes. Clocks are left alone (--clock-control none). Metrics this ncu does not know are
# dropped (listed in the log) instead of failing the run.
#   OUT=... bash benchmarks/tools/matmul_ncu.sh [matmul_ncu.py arguments]
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${FASTCOMM_PYTHON:-python3}"
NCU="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"
wanted=(
  gpu__time_duration.sum
  sm__cycles_elapsed.avg
  sm__cycles_elapsed.avg.per_second
  smsp__inst_executed.sum
  smsp__inst_executed_pipe_fma.sum
  smsp__inst_executed_pipe_fmaheavy.sum
  smsp__inst_executed_pipe_alu.sum
  smsp__inst_executed_pipe_xu.sum
  smsp__inst_executed_pipe_lsu.sum
  smsp__inst_executed_pipe_adu.sum
  smsp__inst_executed_pipe_uniform.sum
  smsp__inst_executed_pipe_cbu.sum
  sm__inst_executed_pipe_tensor_op_gmma.sum
  sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  smsp__thread_inst_executed.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
  l1tex__data_bank_reads.sum
  l1tex__data_bank_writes.sum
  l1tex__m_xbar2l1tex_read_bytes.sum
  l1tex__m_l1tex2xbar_write_bytes.sum
  lts__t_bytes.sum
  lts__t_sectors_op_read.sum
  lts__t_sectors_op_write.sum
  dram__bytes_read.sum
  dram__bytes_write.sum
  lts__throughput.avg.pct_of_peak_sustained_elapsed
  dram__throughput.avg.pct_of_peak_sustained_elapsed
  smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio
  smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
  smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
  smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
  smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
)
"$NCU" --query-metrics --chip gh100 > "$OUT/ncu_query.txt" 2>&1 || true
metrics=()
for m in "${wanted[@]}"; do
  base="${m%%.*}"
  if grep -q "^${base} " "$OUT/ncu_query.txt"; then metrics+=("$m"); else echo "ncu: no metric $base"; fi
done
list=$(IFS=,; echo "${metrics[*]}")
echo "ncu metrics: $list"
"$NCU" --clock-control none --profile-from-start off --metrics "$list" --csv --page raw \
  "$PY" benchmarks/tools/matmul_ncu.py "$@" > "$OUT/ncu_raw.csv" 2> "$OUT/ncu_err.log"
rc=$?
grep "^# kernel" "$OUT/ncu_raw.csv"
grep -c '^"' "$OUT/ncu_raw.csv" || true
tail -n 5 "$OUT/ncu_err.log"
exit $rc
