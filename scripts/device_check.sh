#!/usr/bin/env bash
# Runs on a lent GPU machine (torch preinstalled, no network), from the repo
# root: builds the extension, runs the GPU tests and the benchmarks, and
# leaves logs and JSON in $OUT (at most 8 files come back).
#   scripts/device_check.sh build tests bench cpubench cpubench2x2 multinode sweep spread stagedsweep
#     stagedmodes stagedtests segments ibdevice killed capture hooks ddpbench ops
#   (any subset, in order)
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/device.log"
# Never use NVLink multicast on the shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
export FASTCOMM_PYTHON="${FASTCOMM_PYTHON:-python3}"
PY="$FASTCOMM_PYTHON"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(build tests bench)

say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
versions() {
  "$PY" - <<'PY'
import torch, platform
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
for i in range(torch.cuda.device_count()):
    print("gpu", i, torch.cuda.get_device_name(i))
print("python", platform.python_version())
PY
}

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      say "build"
      versions 2>&1 | tee -a "$LOG"
      nvidia-smi topo -m >> "$LOG" 2>&1 || true
      start=$(date +%s)
      if ! "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1; then
        tail -n 80 "$OUT/build.log" | tee -a "$LOG"
        say "build FAILED"
        exit 1
      fi
      say "build ok in $(( $(date +%s) - start )) s"
      ;;
    tests)
      # The matmul ops run in their own process (stage ops): a crash there must
      # not hide the collective results. Full log comes back as a file.
      say "GPU collective tests on $NGPU GPUs"
      "$PY" -m pytest -q -ra -m cuda tests --ignore=tests/test_ops.py ${PYTEST_ARGS:-} \
        > "$OUT/tests_cuda.log" 2>&1
      tail -n 40 "$OUT/tests_cuda.log" | tee -a "$LOG"
      ;;
    bench)
      say "collectives benchmark, $NGPU GPUs, fastcomm vs nccl"
      "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/bench_collectives.py --device cuda --backends fastcomm,nccl \
        --ops all_reduce,all_gather,reduce_scatter,broadcast --min-bytes 1K --max-bytes 1G \
        --repeats 5 --time-per-size 2 \
        --json "$OUT/bench_cuda_${NGPU}gpu.json" --plot "$OUT/bench_cuda_${NGPU}gpu.png" \
        --md "$OUT/bench_cuda_${NGPU}gpu.md" \
        --label "device_check bench" ${BENCH_ARGS:-} 2>&1 | grep -v "^W1" | tee -a "$LOG"
      ;;
    cpubench)
      say "collectives benchmark, 4 CPU ranks, fastcomm vs gloo"
      OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 \
        benchmarks/bench_collectives.py --device cpu --backends fastcomm,gloo \
        --ops all_reduce --min-bytes 1K --max-bytes 256M \
        --json "$OUT/bench_cpu_4rank.json" --plot "$OUT/bench_cpu_4rank.png" \
        --label "device_check cpubench" 2>&1 | grep -v "^W1" | tee -a "$LOG"
      ;;
    cpubench2x2)
      say "collectives benchmark, 4 CPU ranks as 2 simulated nodes x 2 (tcp on loopback), fastcomm vs gloo"
      OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 \
        benchmarks/bench_collectives.py --device cpu --backends fastcomm,gloo --sim-nodes 2 \
        --ops all_reduce --min-bytes 1K --max-bytes 256M --repeats 3 \
        --json "$OUT/bench_cpu_2x2.json" --plot "$OUT/bench_cpu_2x2.png" --md "$OUT/bench_cpu_2x2.md" \
        --label "device_check cpubench2x2" 2>&1 | grep -v "^W1" | tee -a "$LOG"
      ;;
    multinode)
      # 4 GPUs as 2 simulated nodes x 2: the staged CUDA all_reduce across nodes
      # (tests/test_cuda_hier.py) and the multi-node suite's CUDA cases.
      say "CUDA multi-node tests (4 GPUs as 2x2 nodes)"
      timeout "${MULTINODE_TIMEOUT:-420}" "$PY" -m pytest -q -ra tests/test_cuda_hier.py tests/test_multinode.py -m cuda \
        > "$OUT/tests_multinode_cuda.log" 2>&1
      tail -n 25 "$OUT/tests_multinode_cuda.log" | tee -a "$LOG"
      ;;
    sweep)
      # all_reduce 1 MiB..1 GiB on 2 simulated nodes (2 x NGPU/2): fastcomm (fp32 and bf16
      # wire) beside NCCL's socket transport at its default and best settings
      # (SWEEP_ARGS="--rounds 3": every launch 3 times, the median round; ~80 s
      # of wall time per round on 4x H200).
      say "multi-node all_reduce sweep, $NGPU GPUs as 2 nodes"
      timeout "${SWEEP_TIMEOUT:-480}" "$PY" benchmarks/run_multinode_sweep.py --nproc-per-node "$NGPU" --sim-nodes 2 \
        --device cuda --ops all_reduce --min-bytes 1M --max-bytes 1G --factor 4 --repeats 3 \
        --time-per-size 0.5 \
        --socket-settings 4x4 --buffsizes default,16777216 --wire-dtype bf16 --launch-timeout 150 \
        --out-dir /tmp/fastcomm_sweep --json "$OUT/sweep_2x$((NGPU / 2)).json" \
        --plot "$OUT/sweep_2x$((NGPU / 2)).png" --md "$OUT/sweep_2x$((NGPU / 2)).md" \
        --label "${NGPU}x GPU as 2 nodes x $((NGPU / 2)), TCP loopback, all_reduce" ${SWEEP_ARGS:-} \
        2>&1 | grep -v "^W1" | tail -n 40 | tee -a "$LOG"
      ;;
    spread)
      # Launch-to-launch spread of the multi-node all_reduce (256 MiB float32,
      # 2 simulated nodes, fastcomm alone, the sweep's timing loop):
      # SPREAD_LAUNCHES rounds of the SPREAD_MODES launches, one after the other:
      #   free     the CUDA all_reduce as the sweep runs it
      #   pinned   every rank's whole process pinned to its own slice of the
      #            physical cores (scripts/pin_local_rank.py)
      #   threads  only fastcomm's threads pinned (FASTCOMM_CPU_AFFINITY=local)
      #   cpu      the same all_reduce of CPU tensors (bound by its
      #            single-threaded reductions, ~3.4 GB/s: no network probe)
      #   membw    the host's copy bandwidth (scripts/host_membw.py)
      # Session 9 ran free / pinned / threads: a slow round was slow in all
      # three; session 10 free / cpu / membw: membw did not move with free
      # (benchmarks/results/2026-11-22-4xH200-2x2-session{9,10}.md).
      say "launch spread (${SPREAD_MODES:-free membw}), $NGPU GPUs as 2 nodes"
      lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|NUMA node|Model name|L3)' | tee -a "$LOG"
      rm -f /tmp/spread_*
      bench=(benchmarks/bench_collectives.py --backends fastcomm --ops all_reduce
        --sim-nodes 2 --min-bytes 256M --max-bytes 256M --repeats 3 --time-per-size 0.5)
      for i in $(seq 1 "${SPREAD_LAUNCHES:-3}"); do
        for mode in ${SPREAD_MODES:-free membw}; do
          json="/tmp/spread_${i}_${mode}.json"
          affinity=none
          case $mode in
            free) cmd=(-m torch.distributed.run --standalone --nproc_per_node="$NGPU" "${bench[@]}" --device cuda) ;;
            pinned) cmd=(-m torch.distributed.run --standalone --nproc_per_node="$NGPU"
              scripts/pin_local_rank.py "$PY" "${bench[@]}" --device cuda) ;;
            threads) affinity=local
              cmd=(-m torch.distributed.run --standalone --nproc_per_node="$NGPU" "${bench[@]}" --device cuda) ;;
            cpu) cmd=(-m torch.distributed.run --standalone --nproc_per_node="$NGPU" "${bench[@]}" --device cpu) ;;
            membw) cmd=(scripts/host_membw.py --mib 1024 --threads 16) ;;
            *) echo "spread: unknown mode $mode" | tee -a "$LOG"; continue ;;
          esac
          FASTCOMM_CPU_AFFINITY=$affinity OMP_NUM_THREADS=1 timeout 120 "$PY" "${cmd[@]}" --json "$json" \
            > "/tmp/spread_${i}_${mode}.log" 2>&1
          "$PY" - "$json" "$mode" "$i" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
    bw = [r["busbw_gbps"] for r in rows if r.get("backend") in ("fastcomm", "host-copy")]
    print(f"launch {sys.argv[3]} {sys.argv[2]:7s} {' '.join(f'{b:.2f}' for b in bw)} GB/s")
except Exception as e:  # a failed launch: say so, keep going
    print(f"launch {sys.argv[3]} {sys.argv[2]:7s} FAILED ({e})")
PY
        done
      done
      "$PY" - "$OUT/spread.json" /tmp/spread_*.json <<'PY'
import json, sys
json.dump({p: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)
PY
      ;;
    stagedsweep)
      # The staged CUDA all_reduce across 2 simulated nodes under transport
      # settings SOCKETSxTHREADS:CHUNK[:WINDOW[:LAG[:STREAMS]]] (FASTCOMM_TCP_SOCKETS,
      # FASTCOMM_TCP_THREADS, FASTCOMM_CUDA_CHUNK_BYTES, FASTCOMM_CUDA_WINDOW,
      # FASTCOMM_CUDA_LAG, FASTCOMM_CUDA_STREAMS; left out or empty: fastcomm's
      # defaults): wall time and the proxy's phases per setting (STAGED_CONFIGS
      # overrides).
      say "staged all_reduce settings sweep, $NGPU GPUs as 2 nodes"
      for cfg in ${STAGED_CONFIGS:-4x2:4M 8x4:4M 16x4:4M 8x4:8M 8x4:16M 16x8:8M}; do
        IFS=: read -r st chunk window lag streams <<< "$cfg"
        socks=${st%%x*}; threads=${st#*x}
        sched=(); label=w${window:-default}_lag${lag:-default}${streams:+_s$streams}
        [[ -n $window ]] && sched+=(FASTCOMM_CUDA_WINDOW="$window")
        [[ -n $lag ]] && sched+=(FASTCOMM_CUDA_LAG="$lag")
        [[ -n $streams ]] && sched+=(FASTCOMM_CUDA_STREAMS="$streams")
        wire=$(echo "${STAGED_ARGS:-}" | grep -o 'bf16\|fp16' || echo f32)
        echo "--- sockets $socks threads $threads chunk $chunk $label ($wire)" | tee -a "$LOG"
        base="$OUT/staged_${socks}x${threads}_${chunk}_${label}_${wire}"
        json="$base.json"; n=1
        while [[ -e $json ]]; do n=$((n + 1)); json="${base}_$n.json"; done  # a repeated setting
        env "${sched[@]}" FASTCOMM_TCP_SOCKETS=$socks FASTCOMM_TCP_THREADS=$threads \
          FASTCOMM_CUDA_CHUNK_BYTES=$chunk timeout 120 "$PY" -m torch.distributed.run --standalone \
          --nproc_per_node="$NGPU" benchmarks/trace_staged_allreduce.py --sim-nodes 2 --sizes 16M,256M \
          --iters 7 ${STAGED_ARGS:-} \
          --json "$json" 2>&1 \
          | grep "B  median" | tee -a "$LOG"
      done
      ;;
    segments)
      # The staged all_reduce with the node's NCCL steps whole (0) or in
      # segments on a second stream (FASTCOMM_CUDA_SEGMENT_BYTES), float32 and
      # bf16 wire, 256 MiB and 1 GiB; then its correctness test.
      say "staged all_reduce in segments, $NGPU GPUs as 2 nodes"
      for seg in ${SEGMENT_SIZES:-0 16M 32M 64M}; do
        for wire in none bf16; do
          echo "--- segment bytes $seg wire $wire" | tee -a "$LOG"
          FASTCOMM_CUDA_SEGMENT_BYTES=$seg timeout 120 "$PY" -m torch.distributed.run --standalone \
            --nproc_per_node="$NGPU" benchmarks/trace_staged_allreduce.py --sim-nodes 2 \
            --sizes 256M,1G --iters 7 --wire "$wire" --json "$OUT/segments_${seg}_${wire}.json" 2>&1 \
            | grep "B  median" | tee -a "$LOG"
        done
      done
      timeout 200 "$PY" -m pytest -q -ra tests/test_cuda_hier.py -k segments > "$OUT/segments_test.log" 2>&1
      tail -n 4 "$OUT/segments_test.log" | tee -a "$LOG"
      ;;
    ibdevice)
      # Device staging under the ib emulation (GPUDirect emulated by the rank's
      # own CUDA copies; 2x2 gated in the suite, see EMULATED_GDR_2X2 in
      # tests/test_cuda_hier.py): 2x1 on 2 GPUs, 2x2 too on 4. Hang stacks of
      # the ranks land in $OUT/hung.
      say "ib emulation with device staging, $NGPU GPUs"
      FASTCOMM_TEST_EMULATED_GDR=1 FASTCOMM_CRASH_BACKTRACE=1 FASTCOMM_TEST_TIMEOUT_CAP=150 \
        FASTCOMM_TEST_HANG_DIR="$OUT/hung" timeout 420 "$PY" -m pytest -q -ra tests/test_cuda_hier.py \
        -k "ib-device" > "$OUT/ib_device.log" 2>&1
      tail -n 8 "$OUT/ib_device.log" | tee -a "$LOG"
      pkill -9 -x python 2> /dev/null; pkill -9 -x python3 2> /dev/null
      ;;
    killed)
      # The killed-peer test of the staged path; if a survivor is still alive
      # after 60 s (destroy hanging), dump every thread's stack of the ranks
      # (kernel view here; the harness adds native stacks via SIGUSR2 into
      # $OUT/hung when its own timeout fires).
      say "killed peer on the staged path, with stack dumps of hung ranks"
      FASTCOMM_CRASH_BACKTRACE=1 FASTCOMM_TEST_HANG_DIR="$OUT/hung" \
        timeout 200 "$PY" -m pytest -q -x tests/test_cuda_hier.py -k killed > "$OUT/killed.log" 2>&1 &
      tpid=$!
      sleep 60
      for pid in $(pgrep -f "_harness" || true); do
        [[ "$pid" == "$$" ]] && continue
        echo "=== stacks of pid $pid" >> "$OUT/stacks.log"
        if command -v gdb > /dev/null; then
          timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt 25" >> "$OUT/stacks.log" 2>&1
        elif command -v py-spy > /dev/null; then
          timeout 60 py-spy dump --native --pid "$pid" >> "$OUT/stacks.log" 2>&1
        else
          for t in /proc/"$pid"/task/*; do
            echo "$(cat "$t"/comm) $(cat "$t"/wchan 2> /dev/null) $(cat "$t"/syscall 2> /dev/null)" >> "$OUT/stacks.log"
          done
        fi
      done
      wait "$tpid"
      tail -n 15 "$OUT/killed.log" | tee -a "$LOG"
      ;;
    capture)
      # CUDA-graph capture of the multi-node path (4 GPUs as 2x2 nodes): the
      # staged all_reduce captured and replayed, and whole DDP steps.
      say "capture across simulated nodes (4 GPUs as 2x2)"
      timeout 240 "$PY" -m pytest -q -ra tests/test_cuda_hier.py -k capture > "$OUT/capture.log" 2>&1
      tail -n 5 "$OUT/capture.log" | tee -a "$LOG"
      timeout 330 "$PY" -m pytest -q -ra tests/test_hooks.py -k multinode -s > "$OUT/hooks_multinode.log" 2>&1
      tail -n 5 "$OUT/hooks_multinode.log" | tee -a "$LOG"
      ;;
    stagedmodes)
      # The staged all_reduce's device steps as fused kernels on mapped staging
      # vs copy-engine copies (FASTCOMM_STAGED_KERNELS), float32 and bf16 wire;
      # then the ib emulation with device staging vs host staging.
      say "staged all_reduce: fused kernels vs copies, $NGPU GPUs as 2 nodes"
      for wire in none bf16; do
        echo "--- wire $wire" | tee -a "$LOG"
        timeout 150 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
          benchmarks/trace_staged_allreduce.py --sim-nodes 2 --sizes 16M,256M,1G --iters 7 \
          --kernels fused,copy --wire "$wire" --json "$OUT/staged_modes_${wire}.json" 2>&1 \
          | grep -E "B  median|^-- " | tee -a "$LOG"
      done
      ;;
    stagedtests)
      say "staged kernels (1 GPU) and staging modes (4 GPUs as 2x2)"
      timeout 120 "$PY" -m pytest -q -ra tests/test_staged_kernels.py > "$OUT/staged_tests.log" 2>&1
      tail -n 4 "$OUT/staged_tests.log" | tee -a "$LOG"
      timeout 200 "$PY" -m pytest -q -ra tests/test_cuda_hier.py -k "staging_modes or capture" \
        >> "$OUT/staged_tests.log" 2>&1
      tail -n 4 "$OUT/staged_tests.log" | tee -a "$LOG"
      ;;
    hooks)
      say "DDP comm hooks and CUDA graph capture, $NGPU GPUs"
      timeout 420 "$PY" -m pytest -q -ra tests/test_hooks.py > "$OUT/tests_hooks.log" 2>&1
      tail -n 20 "$OUT/tests_hooks.log" | tee -a "$LOG"
      ;;
    ddpbench)
      say "DDP step time: eager NCCL, eager fastcomm, captured fastcomm ($NGPU GPUs)"
      timeout 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/bench_ddp_graph.py --json "$OUT/ddp_graph_${NGPU}gpu.json" \
        --md "$OUT/ddp_graph_${NGPU}gpu.md" --label "${NGPU}x H200, one node" \
        2>&1 | grep -v "^W1" | tail -n 30 | tee -a "$LOG"
      ;;
    ops)
      say "matmul ops"
      bash scripts/gpu_ops_check.sh 2>&1 | tail -n 80 | tee -a "$LOG"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
say "done"
