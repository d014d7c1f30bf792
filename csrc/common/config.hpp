// Runtime configuration of fastcomm, read from the environment in one place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastcomm {

enum class LogLevel : int { Warn = 0, Info = 1, Debug = 2 };

// Bounds of FASTCOMM_CUDA_WINDOW (the staged pipeline's schedule needs more
// slots than its lag, plans/staged_rail.hpp).
constexpr int64_t kCudaWindowMin = 3;
constexpr int64_t kCudaWindowMax = 32;

// FASTCOMM_TCP_SOCKETS=auto: this many sockets per peer for a host's ranks
// together, split evenly among them (at least one each). The ranks of a host
// share its link, so the budget of flows is the host's, not each rank's.
constexpr int kTcpSocketsPerHost = 8;

// The three tiers of settings, as types: Config derives from all three, so
// code reads `cfg.chunkBytes` whatever the tier, and the group's agreement
// works on the AgreedSettings part alone. Every setting is also described,
// once, in settings() (config.cpp): its variable, tier, default and meaning;
// fromEnv(), describe(), the agreement and the README's table come from there.
enum class Tier : int { Agreed, Local, Debug };

// Choices every rank of a group must share (a mismatch would hang or corrupt a
// collective). Decided once, when the group is created: group rank 0's values
// hold for every rank (Config::adoptAgreed); a rank whose environment differs
// is told so in a warning.
struct AgreedSettings {
  std::string transport = "auto";  // auto | ib | tcp; auto is resolved per group (InterPlan)
  std::string wireDtype = "none";  // none | bf16 | fp16 | int8
  int64_t chunkBytes = 1 << 20;    // host pipeline chunk (shared memory: per rank and step)
  int64_t oneShotBytes = 32 << 10;
  int64_t p2pBytes = 256 << 10;
  bool cudaHier = true;
  // Below it NCCL's flat communicator wins on a shaped link: at 1 MiB a lost
  // tail on one of the rail's sockets costs a TCP loss probe (>= 10 ms).
  int64_t cudaHierMinBytes = 2 << 20;
  bool cudaInterHost = false;
  // The staged rail's chunk (bytes on the wire per rank's shard) is larger than
  // the host chunk: every chunk costs kernel launches and stream waits.
  int64_t cudaChunkBytes = 4 << 20;
  // Chunks in flight (kCudaWindowMin..Max). Larger is not faster: more bytes
  // in flight is more host memory touched per chunk, not more overlap.
  int64_t cudaWindow = 6;
  // Sockets per peer; 0 is `auto` (tcpSocketsFor). Several per peer, each
  // driven by its own progress thread (LocalSettings::tcpThreads): one stream
  // cannot fill a link.
  int tcpSocketsPerPeer = 0;
  int ibQpsPerPeer = 2;
  bool check = false;
  // CUDA all_reduces, all_gathers and reduce_scatters inside one node over
  // peer memory where every pair of GPUs has working NVLink peer access
  // (intra/nvlink/); false: NCCL only.
  bool nvlink = true;
};

// Each rank's own tunables: they change how fast, never what a peer sees.
struct LocalSettings {
  std::string hostIdOverride;
  int64_t cudaLag = 3;
  // Staging in pinned host memory, or in device memory where the transport
  // moves it (ib with GPUDirect RDMA). Host by default under the ib
  // emulation, whose software HCA moves device memory with CUDA copies of its
  // own and can deadlock in the driver against the application's blocking
  // copies; a real NIC's DMA takes no CUDA lock.
  bool stagedHostOnly = false;
  bool stagedMemoryExplicit = false;  // FASTCOMM_STAGED_MEMORY was set
  int64_t spinMicros = -1;            // -1: chosen from the core count
  bool blockingWait = false;          // as TORCH_NCCL_BLOCKING_WAIT
  // Off by default, as ProcessGroupNCCL's TORCH_NCCL_ENABLE_TIMING: a pair of
  // timing events costs GPU time on every collective.
  bool cudaTiming = false;
  int tcpThreads = 8;
  int64_t tcpSocketBufferBytes = 0;
  std::string socketIfname;
  std::string ibHca;
  int ibGidIndex = -1;
  bool ibGdr = true;
  // The ib transport on the software RC device: this rank's device choice
  // (FASTCOMM_TRANSPORT=auto takes ib only where every rank has one).
  bool ibEmulate = false;
};

// Diagnostics and tests.
struct DebugSettings {
  LogLevel logLevel = LogLevel::Warn;
  bool timeline = false;
  bool crashBacktrace = false;
  // The flight recorder (backend/flight_recorder.hpp): entries kept per group
  // (0: off), where dumps go, what triggers them.
  int traceBufferSize = 2000;
  std::string traceFile = "/tmp/fastcomm_trace_rank_";
  bool traceDumpOnTimeout = true;
  int traceSignal = 0;  // 0: none
  bool tracePythonStack = false;
};

struct Config : AgreedSettings, LocalSettings, DebugSettings {
  // Reads every FASTCOMM_* variable of settings(); a bad value throws
  // std::invalid_argument naming the variable.
  static Config fromEnv();
  // "name=value ..." of every setting, as logged at init.
  std::string describe() const;
  // The agreed tier as text, one "VARIABLE=value" per line (what rank 0 sends).
  std::string encodeAgreed() const;
  // Takes group rank 0's agreed tier (encodeAgreed() of rank 0) and returns
  // the variables whose value here differed ("" when none). Local settings
  // bounded by an agreed one are fitted to it (FASTCOMM_CUDA_LAG < window).
  std::string adoptAgreed(const std::string& rankZero);
  // Sockets per peer of a group whose hosts run at most `ranksPerHost` ranks:
  // FASTCOMM_TCP_SOCKETS, or for `auto` kTcpSocketsPerHost split among them.
  int tcpSocketsFor(int ranksPerHost) const;
};

// One setting: its environment variable, tier, default and meaning as the
// README's table shows them.
struct SettingInfo {
  const char* variable;
  Tier tier;
  const char* defaultText;
  const char* meaning;
};
std::vector<SettingInfo> settingsTable();
const char* tierName(Tier tier);

// Kernel choices of the fused matmul ops (torch.ops.fastcomm.matmul / linear
// on CUDA), for debugging: every field's "auto" (the default) leaves the
// choice to the dispatcher's heuristic. Read from the environment once per
// process, at the first matmul (ops/matmul_config.hpp; tests override it
// through torchext._testing.set_matmul_config).
struct MatmulConfig {
  // FASTCOMM_MATMUL_IMPL: auto | skinny | wgmma | mma | simt. Forcing skinny,
  // wgmma or mma raises where that kernel cannot run instead of falling back.
  std::string impl = "auto";
  // FASTCOMM_MATMUL_TILE: auto | large | small | narrow (CUDA cores and
  // mma.sync: 128x128 / 64x64 / 64x64; Hopper: the cooperative 128x256 /
  // 128x128 / 128x64 tile, which implies sched=coop).
  std::string tile = "auto";
  // FASTCOMM_MATMUL_SCHED: auto | coop | pingpong (Hopper consumer schedule).
  std::string sched = "auto";
  // FASTCOMM_MATMUL_EPI: auto | direct | tma | offload (Hopper cooperative
  // epilogue: stores from registers; through shared memory and TMA, with the
  // bias prefetched and lean activations; offload: that math and the stores
  // moved to the producer warpgroup's idle warps, under the next tile's MMAs,
  // 128 x 256 tile only).
  std::string epi = "auto";
  // FASTCOMM_MATMUL_RASTER: auto | m | n (Hopper tile order: row or column groups).
  std::string raster = "auto";
  // FASTCOMM_MATMUL_GROUP: rows (raster m) or columns (raster n) of C per
  // group of the Hopper tile order, 256..65536; 0 = auto (2048).
  int group = 0;
  // FASTCOMM_MATMUL_SPLITS: K split over blocks per output tile of the
  // tensor-core kernels (Hopper wgmma and mma.sync) and of the CUDA-core
  // kernel's wide tiles: 0 = auto (where the tiles do not fill the SMs),
  // 1 = none, 2..16 forced (fewer where K has fewer slices).
  int splits = 0;

  // Every FASTCOMM_MATMUL_* variable that is set, through set().
  static MatmulConfig fromEnv();
  // Sets the field of FASTCOMM_MATMUL_<NAME> (name: "impl", "tile", "sched",
  // "epi", "raster", "group" or "splits", any case) from `value` as that variable would;
  // throws std::invalid_argument naming the variable.
  void set(const std::string& name, const std::string& value);
  std::string describe() const;
};

}  // namespace fastcomm
