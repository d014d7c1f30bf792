// Runtime configuration of fastcomm, read from the environment in one place.
#pragma once

#include <cstdint>
#include <string>

namespace fastcomm {

enum class LogLevel : int { Warn = 0, Info = 1, Debug = 2 };

// Bounds of FASTCOMM_CUDA_WINDOW (the staged pipeline's schedule needs more
// slots than its lag, plans/staged_rail.hpp).
constexpr int64_t kCudaWindowMin = 3;
constexpr int64_t kCudaWindowMax = 32;

struct Config {
  // FASTCOMM_HOST_ID: overrides the host identity (one machine acts as several).
  std::string hostIdOverride;
  // FASTCOMM_TRANSPORT: auto | ib | tcp (inter-node transport).
  std::string transport = "auto";
  // FASTCOMM_WIRE_DTYPE: none | bf16 | fp16 (inter-node compression).
  std::string wireDtype = "none";
  // FASTCOMM_CHUNK_BYTES: pipeline chunk; for shared memory, the bytes each
  // rank owns per pipeline step.
  int64_t chunkBytes = 1 << 20;
  // FASTCOMM_CUDA_HIER=0: CUDA all_reduce across nodes stays on the flat NCCL
  // communicator (NCCL's own socket path) instead of the staged pipeline.
  bool cudaHier = true;
  // FASTCOMM_CUDA_INTER: nccl | host. How CUDA collectives other than
  // all_reduce (and barrier) cross nodes: on the flat NCCL communicator
  // (nccl), or staged through pinned host memory and run by the same
  // hierarchical host plan as CPU tensors (host: shared memory inside a node,
  // fastcomm's transport across nodes). Every rank must set the same value
  // (checked at init). host: tests pass on 4x H200 as 2x2 nodes; opt-in.
  bool cudaInterHost = false;
  // FASTCOMM_CUDA_CHUNK_BYTES: pipeline chunk of that CUDA path, per rank's
  // shard, in bytes on the wire (with a 16-bit wire a chunk holds twice the
  // float32 elements: StagedRail::layoutFor); larger than the host chunk,
  // since every chunk costs a few copies, kernel launches and stream waits.
  int64_t cudaChunkBytes = 4 << 20;
  // FASTCOMM_CUDA_WINDOW: chunks of that path in flight per rank (slots of
  // pinned staging: about 2 x chunk bytes each with 2 nodes), from
  // kCudaWindowMin to kCudaWindowMax. Agreed through the multi-node plan.
  // 6: on 4x H200 as 2 x 2 (TCP loopback) 4, 5, 10, 12 and 16 all ran slower
  // at 256 MiB (16: -39%): more bytes in flight is more host memory touched
  // per chunk, not more overlap (benchmarks/results/
  // 2026-11-22-4xH200-2x2-session10.md).
  int64_t cudaWindow = 6;
  // FASTCOMM_CUDA_LAG: in that path's stream, the all-gather step of chunk k
  // is issued after the reduction of chunk k + lag (from 1 to window - 1):
  // how far the stream runs ahead of the all-gather arrivals. Local to each
  // rank (only the order of its own device steps). 3: ahead of 2 by 3%
  // (float32) and 6% (bf16 wire) at 256 MiB in alternating launches, 1 was
  // 10-20% slower (same results file).
  int64_t cudaLag = 3;
  // FASTCOMM_CUDA_STREAMS: 1 | 3. That path's fused device steps all on the
  // op's stream (1), or on three streams, one per kind of step (3: pack,
  // reduce, gather; plans/staged_rail.hpp, "Streams"), so a step waiting for
  // the network holds back only later steps of its kind. Eager ops only (a
  // captured op keeps one stream). Local to each rank. 3: on 2x H200 as
  // 2 x 1 (TCP loopback) faster in each of 5 alternating launches at 256 MiB
  // (median +13% float32, +13% bf16 wire) and at 4-64 MiB (+8-18%); the
  // proxy saw the staging step of a chunk take 180 us instead of 570 from
  // its slot's release (benchmarks/results/2026-11-22-2xH200-2x1-streams-s11.md).
  int cudaStreams = 3;
  // FASTCOMM_CUDA_SEGMENT_BYTES: 0 (default) runs that path's intra-node
  // reduce-scatter and all-gather on the whole tensor, before and after the
  // rail; N > 0 cuts the tensor into segments of about N bytes whose NCCL
  // steps run on a second stream, under the rail phase of the segment before
  // (reduce-scatter of segment g + 1 and all-gather of segment g - 1 overlap
  // the network of segment g). Agreed through the multi-node plan. Off: on 4x
  // H200 as 2 x 2 it ran slower at every size tried (16M, 64M: each segment
  // pays the rail pipeline's fill and drain; benchmarks/results/
  // 2026-11-22-4xH200-2x2-bf16-wire-chunks.md).
  int64_t cudaSegmentBytes = 0;
  // FASTCOMM_CUDA_HIER_MIN_BYTES: smaller CUDA all_reduces across nodes stay
  // on the flat NCCL communicator (latency, not bandwidth).
  int64_t cudaHierMinBytes = 1 << 20;
  // FASTCOMM_STAGED_KERNELS: fused | copy. How that path's device steps move
  // data between the shard and the staging: one kernel per step reading and
  // writing the staging in place (fused), or copy-engine copies through
  // device scratch around the reduction and wire-cast kernels (copy). Local
  // to each rank (the bytes on the wire are the same), for comparisons.
  bool stagedFused = true;
  // FASTCOMM_STAGED_MEMORY: host | auto. Where that path's staging lives:
  // always mapped pinned host memory (host); or device memory when the
  // rail's transports can move it (ib with GPUDirect RDMA, see
  // FASTCOMM_IB_GDR), else pinned host memory (auto). Local to each rank.
  // Default: auto, except under the ib emulation (FASTCOMM_IB_EMULATE=1),
  // whose software HCA moves device memory with CUDA copies of its own and
  // can deadlock in the driver against the application's blocking copies
  // (benchmarks/results/2026-11-22-4xH200-2x2-emulated-gdr-deadlock.md); a
  // real NIC's DMA takes no CUDA lock.
  bool stagedHostOnly = false;
  bool stagedMemoryExplicit = false;  // FASTCOMM_STAGED_MEMORY was set
  // FASTCOMM_SHM_ONESHOT_BYTES: all-reduces up to this size reduce the whole
  // buffer on every rank after one exchange (one barrier instead of two).
  int64_t oneShotBytes = 32 << 10;
  // FASTCOMM_P2P_BYTES: ring buffer per directed pair for send/recv.
  int64_t p2pBytes = 256 << 10;
  // FASTCOMM_SPIN_US: how long a wait spins before sleeping on a futex.
  int64_t spinMicros = -1;  // -1: chosen from the core count
  // FASTCOMM_CPU_AFFINITY: none | local. local: fastcomm's busy threads
  // (transport progress, the multi-node proxy, the lanes) run on this local
  // rank's share of the host's physical cores (common/affinity.hpp), from the
  // launcher's LOCAL_RANK / LOCAL_WORLD_SIZE. Off by default: measured, it
  // did not steady the multi-node launches (common/affinity.hpp says more).
  std::string cpuAffinity = "none";
  int launcherLocalRank = -1;       // LOCAL_RANK, -1 when unset
  int launcherLocalWorldSize = -1;  // LOCAL_WORLD_SIZE, -1 when unset
  // FASTCOMM_CHECK=1: verify shapes/dtypes agree across ranks per collective.
  bool check = false;
  // FASTCOMM_BLOCKING_WAIT=1: work.wait() on CUDA blocks the host until the
  // collective completes (or fails), like TORCH_NCCL_BLOCKING_WAIT.
  bool blockingWait = false;
  // FASTCOMM_CUDA_TIMING=1 times CUDA collectives for stats() with a pair of
  // timing events each. Off by default, as in ProcessGroupNCCL
  // (TORCH_NCCL_ENABLE_TIMING): on 4x H200 the pair cost 7-9 us of GPU time per
  // collective (benchmarks/results/2026-11-21-4xH200-cuda-timing-events-probe.md).
  bool cudaTiming = false;
  // FASTCOMM_TCP_SOCKETS: sockets per peer connection of the tcp transport
  // (one stream cannot fill a fast link: NCCL_NSOCKS_PERTHREAD likewise).
  // FASTCOMM_TCP_THREADS: progress threads of the tcp transport. 8 x 8 was
  // the fastest setting for the staged 256 MiB CUDA all_reduce on 4x H200 as
  // 2x2 nodes once its device steps were fused kernels: 33.1 GB/s busbw
  // against 29.8 for 8 x 4 and 30.7 for 16 x 4 (each thread then drives one
  // socket of the peer; benchmarks/results/2026-11-22-4xH200-2x2-sweep-fused.md).
  int tcpSocketsPerPeer = 8;
  int tcpThreads = 8;
  // FASTCOMM_TCP_SOCKET_BUFFER: SO_SNDBUF and SO_RCVBUF of every socket of the
  // tcp transport, in bytes (the kernel doubles it, man 7 socket); 0 leaves
  // the kernel's autotuning (tcp_wmem / tcp_rmem). Smaller buffers bound how
  // much data sits in the kernel per socket.
  int64_t tcpSocketBufferBytes = 0;
  // FASTCOMM_SOCKET_IFNAME: interface (or prefix) whose address the tcp
  // transport listens on; empty picks one automatically.
  std::string socketIfname;
  // FASTCOMM_IB_HCA: RDMA devices/ports the ib transport may use
  // ("mlx5_0:1,mlx5_1", "=mlx5_0" exact, "^mlx5_1" excluded); empty: any.
  std::string ibHca;
  // FASTCOMM_IB_GID_INDEX: RoCE GID index; -1 chooses (RoCE v2, IPv4 first).
  int ibGidIndex = -1;
  // FASTCOMM_IB_QPS_PER_PEER: RC queue pairs per connection, data striped
  // over them (one QP's ordering and per-QP engine limits cap a link).
  int ibQpsPerPeer = 2;
  // FASTCOMM_IB_GDR=0: no GPUDirect RDMA even where it is available.
  bool ibGdr = true;
  // FASTCOMM_IB_EMULATE=1: the ib transport runs on the software RC device
  // (fcemu0) instead of libibverbs; every rank then has a usable device.
  bool ibEmulate = false;
  // FASTCOMM_TIMELINE=1: record pipeline phases (torchext.timeline()).
  bool timeline = false;
  // FASTCOMM_CRASH_BACKTRACE=1: print a native backtrace on a segfault.
  bool crashBacktrace = false;
  LogLevel logLevel = LogLevel::Warn;

  static Config fromEnv();
  std::string describe() const;
};

// Kernel choices of the fused matmul ops (torch.ops.fastcomm.matmul / linear
// on CUDA). Read on every call, unlike Config, so that tests and benchmarks can
// switch kernels inside one process; logged (FASTCOMM_LOG=INFO) when it changes.
// Every field's "auto" leaves the choice to the dispatcher's heuristic.
struct MatmulConfig {
  // FASTCOMM_MATMUL_IMPL: auto | wgmma | mma | simt. Forcing wgmma or mma
  // raises where that kernel cannot run instead of falling back.
  std::string impl = "auto";
  // FASTCOMM_MATMUL_TILE: auto | large | small (mma.sync: 128x128 / 64x64;
  // Hopper: the cooperative 128x256 / 128x128 tile, which implies sched=coop
  // unless sched=pingpong is set too: then large = the 64x256 ping-pong tile).
  std::string tile = "auto";
  // FASTCOMM_MATMUL_SCHED: auto | coop | pingpong (Hopper consumer schedule).
  std::string sched = "auto";
  // FASTCOMM_MATMUL_CLUSTER: auto | 1 | 2 (Hopper CTA pairs sharing B via multicast).
  std::string cluster = "auto";
  // FASTCOMM_MATMUL_EPI: auto | direct | tma | tma2 | offload (Hopper cooperative
  // epilogue stores; tma2: the TMA epilogue with bias prefetch and lean
  // activations; offload: tma2's math and stores moved to the producer
  // warpgroup's idle warps, under the next tile's MMAs, 128 x 256 tile only).
  std::string epi = "auto";
  // FASTCOMM_MATMUL_RASTER: auto | m | n (Hopper tile order: row or column groups).
  std::string raster = "auto";
  // FASTCOMM_MATMUL_GROUP: rows (raster m) or columns (raster n) of C per
  // group of the Hopper tile order, 256..65536; 0 = auto (2048).
  int group = 0;
  // FASTCOMM_MATMUL_WGMMA_MN=0: copy M-/N-major operands to K-major before the
  // Hopper kernel instead of loading them transposed.
  bool wgmmaMnMajor = true;

  static MatmulConfig fromEnv();
  std::string describe() const;
};

}  // namespace fastcomm
