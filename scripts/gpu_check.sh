#!/usr/bin/env bash
# The GPU-machine runner: builds fastcomm in place (with the testing module), runs the GPU tests
# and the benchmarks, and leaves logs and JSON in $OUT. Meant for a machine with torch
# preinstalled and no network (python3, or FASTCOMM_PYTHON), from the repository root.
#
#   scripts/gpu_check.sh [STAGE ...]        stages run in the order given; default: build tests
#
#   build        build in place (python3 setup.py build_ext --inplace, FASTCOMM_BUILD_TESTING=1,
#                MAX_JOBS=16 unless set, TORCH_CUDA_ARCH_LIST=9.0a); logs the build time and the .so sizes and
#                leaves the stripped .so files in $OUT as so.part.* (tar.gz, split in 15 MiB pieces)
#   carried      instead of building: unpack $CARRIED_DIR/so.part.* (default: carried-so/, the
#                so.part.* files of an earlier build stage copied there) into the tree
#   tests        the CUDA tests except the matmul ops (pytest -m cuda)        -> tests_cuda.log
#   ops          the matmul ops' tests and every kernel on odd shapes       -> ops.log
#   bench        collectives inside the node, fastcomm vs NCCL, all GPUs     -> bench_<n>gpu.{json,md}
#   sweep        CUDA all_reduce as 2 simulated nodes (2 x n/2) beside NCCL's default and best
#                socket settings                                             -> sweep_2x<k>.{json,md}
#   netbed       the sweep's launches on the shaped-link testbed: 2 nodes as network namespaces
#                joined by a veth pair shaped with tc, 256 KiB..1 GiB, one sweep per link in
#                NETBED_LINKS (default "25gbit"; e.g. "25gbit 100gbit"; a one-way delay:
#                "25gbit,20us", through the testbed's delay line; jumbo
#                frames: "25gbit,mtu9000"); ip and tc from the Debian debs in
#                build/iproute2-debs (carried; unpacked with dpkg -x)
#                                                          -> netbed_2x<k>_<link>.{json,md}
#   netbedcpu    CPU tensors on the same testbed, 2 nodes x NETBED_CPU_RANKS ranks (default 2),
#                fastcomm (float32, bf16 and int8 wires) beside Gloo  -> netbed_cpu_2x<r>_<link>.{json,md}
#   nvlink       the NVLink kernels' tests, then the all_reduce benchmark beside ProcessGroupNCCL
#                and torch symm_mem one-/two-shot, graphs and eager, 4 KiB..16 MiB (NVLINK_ARGS)
#                                             -> nvlink_tests.log, nvlink_ar_<n>gpu.{json,md}
#   nvlinkparts  all_gather and reduce_scatter on the NVLink kernels beside ProcessGroupNCCL
#                                             -> nvlink_{ag,rs}_<n>gpu.{json,md}
#   matmulbench  bf16 matmul / linear+gelu on the main shapes vs cuBLAS     -> matmul.{log,json}
#   matmulgrid   the small-M / mid-size grid (M = 1..2048 x four (N, K), squares 1024-8192)
#                per dtype in MATMUL_DTYPES (default "bf16 fp16"), MATMUL_OPS (default
#                matmul,linear; "train": forward + backward), MATMUL_VARIANTS (default auto)
#                                             -> matmul_grid.log, matmul_grid_<dtype>_{small,mid}.json
#   killed       a peer killed during the staged all_reduce, stacks of hung ranks -> killed.log
#   capture      CUDA-graph capture across simulated nodes (4 GPUs as 2 x 2) -> capture.log
#   hier         the multi-node CUDA tests on simulated nodes (test_cuda_hier.py, test_cuda_inter_host.py:
#                2 x 2 and 2 x 1 layouts) in three parts, each under its own limit -> hier.log
#   hooks        DDP communication hooks and CUDA graphs                     -> hooks.log
#   ddpbench     DDP step time: eager NCCL / eager fastcomm / captured fastcomm -> ddp_<n>gpu.{json,md}
#   suite        PyTorch's DistributedTest on CUDA (SUITE_SHARD=i/n, SUITE_JOBS; expecttest from
#                build/pydeps)                                -> torch_suite_cuda_<i>of<n>.{json,log}
#
# Env: OUT (default ./out), FASTCOMM_PYTHON (default python3), CARRIED_DIR, PLOT=1 (also write
# .png plots), PYTEST_ARGS, BENCH_ARGS, SWEEP_ARGS (e.g. "--rounds 3"), SWEEP_TIMEOUT,
# NETBED_LINKS, NVLINK_ARGS, MATMUL_ARGS (and the matmulgrid settings above). Everything is
# summarised in $OUT/gpu_check.log. At most 8 files come back from
# the lent machines: run stages that write several files in calls of their own.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
# Never use NVLink multicast on the shared machines (every multi-GPU stage).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${FASTCOMM_PYTHON:-python3}"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
CARRIED_DIR="${CARRIED_DIR:-$ROOT/carried-so}"
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(build tests)
status=0

say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
plot() { [[ "${PLOT:-0}" == "1" ]] && echo "--plot $1"; }
versions() {
  "$PY" - << 'PY'
import platform
import torch
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", nccl,
      "python", platform.python_version())
for i in range(torch.cuda.device_count()):
    print("gpu", i, torch.cuda.get_device_name(i))
PY
}
so_files() { find torchext -maxdepth 1 -name '*.so' | sort; }
# The testbed needs root and iproute2; the lent machines have no ip / tc, so Debian's iproute2
# and its libraries travel as debs in build/iproute2-debs (benchmarks/README.md), unpacked into
# a new folder whose path this prints; the caller names it to the testbed (NETBED_IPROUTE2)
# where it is not empty.
unpack_iproute2() {
  local dir
  dir=$(mktemp -d)
  if compgen -G "$ROOT/build/iproute2-debs/*.deb" > /dev/null; then
    command -v dpkg > /dev/null || say "no dpkg to unpack build/iproute2-debs" >&2
    for deb in "$ROOT"/build/iproute2-debs/*.deb; do dpkg -x "$deb" "$dir"; done
  fi
  echo "$dir"
}
# all_reduce on the shaped-link testbed, 2 nodes, 256 KiB..1 GiB, fastcomm with every wire beside
# its peer: one sweep per link of NETBED_LINKS -> <prefix>_<link>.{json,md}. Arguments: the file
# prefix, the label, then run_multinode_sweep.py's options for the ranks, device and peer.
testbed_sweeps() {
  local prefix=$1 label=$2 nbdir link name
  shift 2
  nbdir=$(unpack_iproute2)
  [[ -n "$(ls -A "$nbdir")" ]] && export NETBED_IPROUTE2="$nbdir"
  for link in ${NETBED_LINKS:-25gbit}; do
    name="${prefix}_${link//,/_}"
    say "all_reduce on the testbed, $label, link $link"
    timeout "${SWEEP_TIMEOUT:-540}" "$PY" benchmarks/run_multinode_sweep.py "$@" --sim-nodes 2 \
      --ops all_reduce --netbed "$link" --min-bytes 256K --max-bytes 1G --factor 4 --repeats 3 \
      --time-per-size 0.5 --wire-dtype bf16,int8 --out-dir "/tmp/fastcomm_$name" \
      --json "$OUT/$name.json" --md "$OUT/$name.md" $(plot "$OUT/$name.png") \
      --label "$label, link $link, all_reduce" ${SWEEP_ARGS:-} \
      2>&1 | grep -v "^W1" | tail -n 40 | tee -a "$LOG"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
  rm -rf "$nbdir"
}

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      say "build in place with the testing module ($NGPU GPUs)"
      versions 2>&1 | tee -a "$LOG"
      nvidia-smi topo -m >> "$LOG" 2>&1 || true
      start=$(date +%s)
      if ! MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST=9.0a FASTCOMM_BUILD_TESTING=1 \
        "$PY" setup.py build_ext --inplace --build-lib build/inplace > "$OUT/build.log" 2>&1; then
        tail -n 80 "$OUT/build.log" | tee -a "$LOG"
        say "build FAILED"
        exit 1
      fi
      say "build ok in $(($(date +%s) - start)) s"
      so_files | xargs -r ls -l | awk '{printf "%s %.1f MiB\n", $NF, $5 / 1048576}' | tee -a "$LOG"
      # Stripped copies, packed and cut so that each piece fits what comes back from the machine.
      tmp=$(mktemp -d)
      for so in $(so_files); do
        mkdir -p "$tmp/$(dirname "$so")"
        strip --strip-unneeded -o "$tmp/$so" "$so"
      done
      rm -f "$OUT"/so.part.*
      tar -C "$tmp" -czf - torchext | split -b 15M - "$OUT/so.part."
      rm -rf "$tmp"
      ls -l "$OUT"/so.part.* | awk '{printf "%s %.1f MiB\n", $NF, $5 / 1048576}' | tee -a "$LOG"
      ;;
    carried)
      say "carried build from $CARRIED_DIR"
      if ! compgen -G "$CARRIED_DIR/so.part.*" > /dev/null; then
        say "no $CARRIED_DIR/so.part.* to unpack"
        exit 1
      fi
      cat "$CARRIED_DIR"/so.part.* | tar -xzf - -C "$ROOT"
      so_files | xargs -r ls -l | awk '{printf "%s %.1f MiB\n", $NF, $5 / 1048576}' | tee -a "$LOG"
      if ! "$PY" -c 'import torchext, torchext._testing' > "$OUT/carried.log" 2>&1; then
        tail -n 5 "$OUT/carried.log" | tee -a "$LOG"
        say "the carried .so files do not import"
        exit 1
      fi
      ;;
    tests)
      # The matmul ops run in a process of their own (stage ops): a crash there must not hide
      # the collective results.
      say "CUDA tests on $NGPU GPUs"
      "$PY" -m pytest -q -ra -m cuda tests --ignore=tests/test_ops.py ${PYTEST_ARGS:-} \
        > "$OUT/tests_cuda.log" 2>&1 || status=1
      tail -n 40 "$OUT/tests_cuda.log" | tee -a "$LOG"
      ;;
    ops)
      say "matmul ops: tests and every kernel on odd shapes"
      {
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv 2>&1
        "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_ops.py 2>&1 | tail -n 200
        echo "== pytest exit status ${PIPESTATUS[0]}"
        "$PY" benchmarks/tools/matmul_smoke.py 2>&1
        echo "== smoke exit status $?"
      } > "$OUT/ops.log" 2>&1
      grep -E "passed|failed|error|exit status|FAIL" "$OUT/ops.log" | tail -n 20 | tee -a "$LOG"
      grep -q "exit status [1-9]" "$OUT/ops.log" && status=1
      ;;
    bench)
      say "collectives inside the node, $NGPU GPUs, fastcomm vs NCCL"
      "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/bench_collectives.py --device cuda --backends fastcomm,nccl \
        --ops all_reduce,all_gather,reduce_scatter,broadcast --min-bytes 1K --max-bytes 1G \
        --repeats 5 --time-per-size 2 --json "$OUT/bench_${NGPU}gpu.json" \
        --md "$OUT/bench_${NGPU}gpu.md" $(plot "$OUT/bench_${NGPU}gpu.png") \
        --label "${NGPU} GPUs, one node" ${BENCH_ARGS:-} 2>&1 | grep -v "^W1" | tee -a "$LOG"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ;;
    sweep)
      # all_reduce 1 MiB..1 GiB on 2 simulated nodes: fastcomm (float32 and bf16 wire) beside
      # NCCL's socket transport at its default and its best settings; SWEEP_ARGS="--rounds 3"
      # repeats every launch 3 times and reports the median round (~80 s per round on 4 GPUs).
      k=$((NGPU / 2))
      say "CUDA all_reduce sweep, $NGPU GPUs as 2 nodes x $k"
      timeout "${SWEEP_TIMEOUT:-540}" "$PY" benchmarks/run_multinode_sweep.py \
        --nproc-per-node "$NGPU" --sim-nodes 2 --device cuda --ops all_reduce \
        --min-bytes 1M --max-bytes 1G --factor 4 --repeats 3 --time-per-size 0.5 \
        --socket-settings 4x4 --buffsizes default,16777216 --wire-dtype bf16 \
        --launch-timeout 150 --out-dir /tmp/fastcomm_sweep --json "$OUT/sweep_2x$k.json" \
        --md "$OUT/sweep_2x$k.md" $(plot "$OUT/sweep_2x$k.png") \
        --label "${NGPU} GPUs as 2 nodes x $k, TCP loopback, all_reduce" ${SWEEP_ARGS:-} \
        2>&1 | grep -v "^W1" | tail -n 40 | tee -a "$LOG"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ;;
    netbed)
      k=$((NGPU / 2))
      testbed_sweeps "netbed_2x$k" "$NGPU GPUs as 2 nodes x $k" --nproc-per-node "$NGPU" \
        --device cuda --socket-settings 4x4 --buffsizes default,16777216 --launch-timeout 150
      ;;
    netbedcpu)
      # CPU tensors: fastcomm beside Gloo at its default, measured twice (the sweep's one
      # setting; NCCL's socket variables mean nothing to Gloo).
      r="${NETBED_CPU_RANKS:-2}"
      testbed_sweeps "netbed_cpu_2x$r" "CPU, 2 nodes x $r ranks" --nproc-per-node $((2 * r)) \
        --device cpu --peer gloo --socket-settings 1x1 --buffsizes default --launch-timeout 200
      ;;
    nvlink)
      say "NVLink kernels: tests, then the all_reduce benchmark ($NGPU GPUs)"
      timeout 540 "$PY" -m pytest -q -rfE tests/test_nvlink_allreduce.py \
        tests/test_nvlink_gather_scatter.py ${PYTEST_ARGS:-} \
        > "$OUT/nvlink_tests.log" 2>&1 || status=1
      tail -n 8 "$OUT/nvlink_tests.log" | tee -a "$LOG"
      timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/bench_nvlink.py --json "$OUT/nvlink_ar_${NGPU}gpu.json" \
        --md "$OUT/nvlink_ar_${NGPU}gpu.md" $(plot "$OUT/nvlink_ar_${NGPU}gpu.png") \
        ${NVLINK_ARGS:-} 2>&1 | grep -v "^W1" | tail -n 40 | tee -a "$LOG"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ;;
    nvlinkparts)
      for op in all_gather reduce_scatter; do
        name="nvlink_$([[ $op == all_gather ]] && echo ag || echo rs)_${NGPU}gpu"
        say "NVLink $op beside NCCL ($NGPU GPUs)"
        timeout 200 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
          benchmarks/bench_nvlink.py --op "$op" --json "$OUT/$name.json" --md "$OUT/$name.md" \
          ${NVLINK_ARGS:-} 2>&1 | grep -v "^W1" | tail -n 40 | tee -a "$LOG"
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      done
      ;;
    matmulbench)
      say "matmul main shapes vs cuBLAS (bf16, alternating rounds)"
      "$PY" benchmarks/bench_matmul.py --dtype bf16 --variants auto --sizes 4096,8192 \
        --llm 8192x4096x4096,8192x11008x4096,8192x14336x4096 --rounds 5 --reps 30 \
        --warmup-ms 30 --no-compile --ops matmul,linear ${MATMUL_ARGS:-} \
        --json "$OUT/matmul.json" > "$OUT/matmul.log" 2>&1 || status=1
      tail -n 40 "$OUT/matmul.log" | tee -a "$LOG"
      ;;
    matmulgrid)
      # The small-M / mid-size grid: M = 1..2048 x the four (N, K) of the decode / prefill
      # shapes and the squares 1024-8192, per dtype in two runs (M <= 128; the rest).
      say "matmul grid vs cuBLAS / _addmm_activation (${MATMUL_DTYPES:-bf16 fp16})"
      grid() {
        local m nk out=""
        for m in "$@"; do
          for nk in 4096x4096 11008x4096 4096x11008 14336x4096; do out+="${m}x${nk},"; done
        done
        echo "${out%,}"
      }
      for dt in ${MATMUL_DTYPES:-bf16 fp16}; do
        for part in small mid; do
          if [[ $part == small ]]; then
            shapes=(--sizes "" --llm "$(grid 1 8 16 32 64 128)")
          else
            shapes=(--sizes 1024,2048,4096,8192 --llm "$(grid 256 512 1024 2048)")
          fi
          "$PY" benchmarks/bench_matmul.py --dtype "$dt" "${shapes[@]}" --no-compile \
            --reps 25 --warmup-ms 15 --rounds 3 --variants "${MATMUL_VARIANTS:-auto}" \
            --ops "${MATMUL_OPS:-matmul,linear}" ${MATMUL_ARGS:-} \
            --json "$OUT/matmul_grid_${dt}_${part}.json" >> "$OUT/matmul_grid.log" 2>&1 || status=1
        done
      done
      grep -A60 "fastcomm variants" "$OUT/matmul_grid.log" | tail -n 60 | tee -a "$LOG" > /dev/null
      ;;
    killed)
      # The killed-peer test of the staged path. If a survivor is still alive after 60 s
      # (destroy hanging), every thread's stack of the test's ranks goes to killed_stacks.log.
      say "killed peer on the staged path, with stacks of hung ranks"
      FASTCOMM_CRASH_BACKTRACE=1 timeout 200 "$PY" -m pytest -q -x tests/test_cuda_hier.py \
        -k killed > "$OUT/killed.log" 2>&1 &
      tpid=$!
      sleep 60
      for pid in $(pgrep -f "_harness" || true); do
        echo "=== stacks of pid $pid" >> "$OUT/killed_stacks.log"
        if command -v gdb > /dev/null; then
          timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt 25" >> "$OUT/killed_stacks.log" 2>&1
        else
          for t in /proc/"$pid"/task/*; do
            echo "$(cat "$t"/comm) $(cat "$t"/wchan 2> /dev/null)" >> "$OUT/killed_stacks.log"
          done
        fi
      done
      wait "$tpid" || status=1
      tail -n 15 "$OUT/killed.log" | tee -a "$LOG"
      ;;
    hier)
      say "multi-node CUDA tests on simulated nodes ($NGPU GPUs)"
      : > "$OUT/hier.log"
      timeout 300 "$PY" -m pytest -q -rfEs -m cuda tests/test_cuda_hier.py -k "not staging_modes" \
        >> "$OUT/hier.log" 2>&1 || status=1
      timeout 200 "$PY" -m pytest -q -rfEs -m cuda tests/test_cuda_hier.py -k staging_modes \
        >> "$OUT/hier.log" 2>&1 || status=1
      timeout 200 "$PY" -m pytest -q -rfEs -m cuda tests/test_cuda_inter_host.py \
        >> "$OUT/hier.log" 2>&1 || status=1
      grep -E "passed|failed|error|FAILED" "$OUT/hier.log" | tee -a "$LOG"
      ;;
    capture)
      say "CUDA-graph capture across simulated nodes (4 GPUs as 2 x 2)"
      {
        timeout 240 "$PY" -m pytest -q -ra tests/test_cuda_hier.py -k capture
        timeout 330 "$PY" -m pytest -q -ra tests/test_hooks.py -k multinode
      } > "$OUT/capture.log" 2>&1 || status=1
      grep -E "passed|failed|error" "$OUT/capture.log" | tee -a "$LOG"
      ;;
    hooks)
      say "DDP communication hooks and CUDA graphs, $NGPU GPUs"
      timeout 420 "$PY" -m pytest -q -ra tests/test_hooks.py > "$OUT/hooks.log" 2>&1 || status=1
      tail -n 20 "$OUT/hooks.log" | tee -a "$LOG"
      ;;
    suite)
      # PyTorch's DistributedTest suite on CUDA tensors, world 2; it imports expecttest, which
      # a machine without network gets as the unpacked wheel in build/pydeps (carried).
      say "PyTorch's DistributedTest on CUDA, shard ${SUITE_SHARD:-1/1}"
      shard="${SUITE_SHARD:-1/1}"
      shard_name="${shard/\//of}"
      PYTHONPATH="$PYTHONPATH:$ROOT/build/pydeps" timeout "${SUITE_TIMEOUT:-540}" "$PY" \
        tests/torch_suite.py --device cuda --jobs "${SUITE_JOBS:-8}" --timeout 150 \
        --shard "$shard" --json "$OUT/torch_suite_cuda_$shard_name.json" \
        > "$OUT/torch_suite_cuda_$shard_name.log" 2>&1 || status=1
      grep -E "FAILED|on DistributedTest" "$OUT/torch_suite_cuda_$shard_name.log" | tee -a "$LOG"
      ;;
    ddpbench)
      say "DDP step time: eager NCCL, eager fastcomm, captured fastcomm ($NGPU GPUs)"
      timeout 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        benchmarks/bench_ddp_graph.py --json "$OUT/ddp_${NGPU}gpu.json" \
        --md "$OUT/ddp_${NGPU}gpu.md" --label "${NGPU} GPUs, one node" \
        2>&1 | grep -v "^W1" | tail -n 30 | tee -a "$LOG"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ;;
    *)
      echo "unknown stage $stage (build carried tests ops bench sweep netbed netbedcpu nvlink nvlinkparts matmulbench killed capture hier hooks ddpbench suite)" >&2
      exit 2
      ;;
  esac
done
say "done (exit status $status)"
exit $status
