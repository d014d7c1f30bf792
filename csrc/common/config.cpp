#include "common/config.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace fastcomm {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Accepts plain integers and K/M/G suffixes (powers of two).
int64_t parseBytes(const char* name, const char* text) {
  std::string s(text);
  int64_t mult = 1;
  if (!s.empty()) {
    char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
    if (last == 'K' || last == 'M' || last == 'G') {
      mult = last == 'K' ? (1 << 10) : last == 'M' ? (1 << 20) : (1 << 30);
      s.pop_back();
    }
  }
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || *end != '\0' || v < 0) {
    throw std::invalid_argument(std::string("fastcomm: ") + name + "=" + text +
                                " is not a byte count");
  }
  return static_cast<int64_t>(v) * mult;
}

std::string oneOf(const char* name, const char* text, std::initializer_list<const char*> allowed) {
  std::string v = lower(text);
  for (const char* a : allowed) {
    if (v == a) return v;
  }
  std::string msg = std::string("fastcomm: ") + name + "=" + text + " is not one of";
  for (const char* a : allowed) msg += std::string(" ") + a;
  throw std::invalid_argument(msg);
}

bool flag(const char* name, bool dflt) {
  const char* v = env(name);
  if (v == nullptr) return dflt;
  std::string s = lower(v);
  return !(s == "0" || s == "false" || s == "off" || s == "no");
}

// The launcher's LOCAL_RANK / LOCAL_WORLD_SIZE: torch's own variables, so a
// value that is no non-negative integer is not ours to reject: -1 (unset).
int launcherInt(const char* text) {
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  return (end != text && *end == '\0' && v >= 0 && v < (1 << 20)) ? static_cast<int>(v) : -1;
}

}  // namespace

Config Config::fromEnv() {
  Config c;
  if (const char* v = env("FASTCOMM_HOST_ID")) c.hostIdOverride = v;
  if (const char* v = env("FASTCOMM_TRANSPORT"))
    c.transport = oneOf("FASTCOMM_TRANSPORT", v, {"auto", "ib", "tcp"});
  if (const char* v = env("FASTCOMM_WIRE_DTYPE"))
    c.wireDtype = oneOf("FASTCOMM_WIRE_DTYPE", v, {"none", "bf16", "fp16"});
  if (const char* v = env("FASTCOMM_CHUNK_BYTES"))
    c.chunkBytes = parseBytes("FASTCOMM_CHUNK_BYTES", v);
  if (const char* v = env("FASTCOMM_CUDA_CHUNK_BYTES"))
    c.cudaChunkBytes = parseBytes("FASTCOMM_CUDA_CHUNK_BYTES", v);
  if (const char* v = env("FASTCOMM_CUDA_WINDOW")) {
    const int64_t w = parseBytes("FASTCOMM_CUDA_WINDOW", v);
    if (w < kCudaWindowMin || w > kCudaWindowMax) {
      throw std::invalid_argument(std::string("fastcomm: FASTCOMM_CUDA_WINDOW=") + v +
                                  " is not a chunk count from " + std::to_string(kCudaWindowMin) +
                                  " to " + std::to_string(kCudaWindowMax));
    }
    c.cudaWindow = w;
  }
  if (const char* v = env("FASTCOMM_CUDA_LAG")) {
    const int64_t lag = parseBytes("FASTCOMM_CUDA_LAG", v);
    if (lag < 1 || lag >= c.cudaWindow) {
      throw std::invalid_argument(std::string("fastcomm: FASTCOMM_CUDA_LAG=") + v +
                                  " is not from 1 to FASTCOMM_CUDA_WINDOW - 1 (" +
                                  std::to_string(c.cudaWindow - 1) + ")");
    }
    c.cudaLag = lag;
  }
  if (const char* v = env("FASTCOMM_CUDA_STREAMS"))
    c.cudaStreams = std::stoi(oneOf("FASTCOMM_CUDA_STREAMS", v, {"1", "3"}));
  if (const char* v = env("FASTCOMM_CUDA_SEGMENT_BYTES"))
    c.cudaSegmentBytes = parseBytes("FASTCOMM_CUDA_SEGMENT_BYTES", v);
  if (const char* v = env("FASTCOMM_CUDA_HIER_MIN_BYTES"))
    c.cudaHierMinBytes = parseBytes("FASTCOMM_CUDA_HIER_MIN_BYTES", v);
  c.cudaHier = flag("FASTCOMM_CUDA_HIER", true);
  if (const char* v = env("FASTCOMM_CUDA_INTER"))
    c.cudaInterHost = oneOf("FASTCOMM_CUDA_INTER", v, {"nccl", "host"}) == "host";
  if (const char* v = env("FASTCOMM_STAGED_KERNELS"))
    c.stagedFused = oneOf("FASTCOMM_STAGED_KERNELS", v, {"fused", "copy"}) == "fused";
  if (const char* v = env("FASTCOMM_STAGED_MEMORY")) {
    c.stagedHostOnly = oneOf("FASTCOMM_STAGED_MEMORY", v, {"host", "auto"}) == "host";
    c.stagedMemoryExplicit = true;
  }
  if (const char* v = env("FASTCOMM_SHM_ONESHOT_BYTES"))
    c.oneShotBytes = parseBytes("FASTCOMM_SHM_ONESHOT_BYTES", v);
  if (const char* v = env("FASTCOMM_P2P_BYTES")) c.p2pBytes = parseBytes("FASTCOMM_P2P_BYTES", v);
  if (const char* v = env("FASTCOMM_SPIN_US")) c.spinMicros = parseBytes("FASTCOMM_SPIN_US", v);
  if (const char* v = env("FASTCOMM_CPU_AFFINITY"))
    c.cpuAffinity = oneOf("FASTCOMM_CPU_AFFINITY", v, {"none", "local"});
  if (const char* v = env("LOCAL_RANK")) c.launcherLocalRank = launcherInt(v);
  if (const char* v = env("LOCAL_WORLD_SIZE")) c.launcherLocalWorldSize = launcherInt(v);
  if (const char* v = env("FASTCOMM_TCP_SOCKETS"))
    c.tcpSocketsPerPeer = static_cast<int>(parseBytes("FASTCOMM_TCP_SOCKETS", v));
  if (const char* v = env("FASTCOMM_TCP_THREADS"))
    c.tcpThreads = static_cast<int>(parseBytes("FASTCOMM_TCP_THREADS", v));
  if (const char* v = env("FASTCOMM_TCP_SOCKET_BUFFER")) {
    c.tcpSocketBufferBytes = parseBytes("FASTCOMM_TCP_SOCKET_BUFFER", v);
    if (c.tcpSocketBufferBytes < 0 || c.tcpSocketBufferBytes > (1 << 30)) {
      throw std::invalid_argument(std::string("fastcomm: FASTCOMM_TCP_SOCKET_BUFFER=") + v +
                                  " is not from 0 to 1G");
    }
  }
  if (const char* v = env("FASTCOMM_SOCKET_IFNAME")) c.socketIfname = v;
  if (const char* v = env("FASTCOMM_IB_HCA")) c.ibHca = v;
  if (const char* v = env("FASTCOMM_IB_GID_INDEX")) {
    char* end = nullptr;
    long idx = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || idx < -1 || idx > 255) {
      throw std::invalid_argument(std::string("fastcomm: FASTCOMM_IB_GID_INDEX=") + v +
                                  " is not a GID index (0..255, or -1 for automatic)");
    }
    c.ibGidIndex = static_cast<int>(idx);
  }
  if (const char* v = env("FASTCOMM_IB_QPS_PER_PEER"))
    c.ibQpsPerPeer = static_cast<int>(parseBytes("FASTCOMM_IB_QPS_PER_PEER", v));
  c.ibGdr = flag("FASTCOMM_IB_GDR", true);
  c.ibEmulate = flag("FASTCOMM_IB_EMULATE", false);
  if (!c.stagedMemoryExplicit) c.stagedHostOnly = c.ibEmulate;  // see config.hpp
  c.check = flag("FASTCOMM_CHECK", false);
  c.crashBacktrace = flag("FASTCOMM_CRASH_BACKTRACE", false);
  c.timeline = flag("FASTCOMM_TIMELINE", false);
  c.blockingWait = flag("FASTCOMM_BLOCKING_WAIT", false);
  c.cudaTiming = flag("FASTCOMM_CUDA_TIMING", false);
  if (const char* v = env("FASTCOMM_LOG")) {
    std::string l = oneOf("FASTCOMM_LOG", v, {"warn", "info", "debug"});
    c.logLevel = l == "warn" ? LogLevel::Warn : l == "info" ? LogLevel::Info : LogLevel::Debug;
  }
  // Chunks below 4 KiB only add barriers; keep them page-sized and sane.
  c.chunkBytes = std::max<int64_t>(4096, c.chunkBytes / 4096 * 4096);
  c.p2pBytes = std::max<int64_t>(4096, c.p2pBytes / 4096 * 4096);
  c.cudaChunkBytes = std::max<int64_t>(4096, c.cudaChunkBytes / 4096 * 4096);
  c.tcpSocketsPerPeer = std::min(64, std::max(1, c.tcpSocketsPerPeer));
  c.tcpThreads = std::min(64, std::max(1, c.tcpThreads));
  c.ibQpsPerPeer = std::min(16, std::max(1, c.ibQpsPerPeer));
  return c;
}

std::string Config::describe() const {
  std::ostringstream os;
  os << "host_id=" << (hostIdOverride.empty() ? "<auto>" : hostIdOverride)
     << " transport=" << transport << " wire_dtype=" << wireDtype << " chunk_bytes=" << chunkBytes
     << " oneshot_bytes=" << oneShotBytes << " p2p_bytes=" << p2pBytes << " spin_us=" << spinMicros
     << " cpu_affinity=" << cpuAffinity << " tcp_sockets=" << tcpSocketsPerPeer
     << " tcp_threads=" << tcpThreads << " tcp_socket_buffer=" << tcpSocketBufferBytes
     << " socket_ifname=" << (socketIfname.empty() ? "<auto>" : socketIfname)
     << " ib_hca=" << (ibHca.empty() ? "<any>" : ibHca) << " ib_gid_index=" << ibGidIndex
     << " ib_qps_per_peer=" << ibQpsPerPeer << " ib_gdr=" << ibGdr << " ib_emulate=" << ibEmulate
     << " check=" << check << " blocking_wait=" << blockingWait << " cuda_timing=" << cudaTiming
     << " cuda_hier=" << cudaHier << " cuda_inter=" << (cudaInterHost ? "host" : "nccl")
     << " cuda_chunk_bytes=" << cudaChunkBytes << " cuda_window=" << cudaWindow
     << " cuda_lag=" << cudaLag << " cuda_streams=" << cudaStreams
     << " cuda_segment_bytes=" << cudaSegmentBytes << " cuda_hier_min_bytes=" << cudaHierMinBytes
     << " staged_kernels=" << (stagedFused ? "fused" : "copy")
     << " staged_memory=" << (stagedHostOnly ? "host" : "auto");
  return os.str();
}

MatmulConfig MatmulConfig::fromEnv() {
  MatmulConfig c;
  if (const char* v = env("FASTCOMM_MATMUL_IMPL"))
    c.impl = oneOf("FASTCOMM_MATMUL_IMPL", v, {"auto", "wgmma", "mma", "simt"});
  if (const char* v = env("FASTCOMM_MATMUL_TILE"))
    c.tile = oneOf("FASTCOMM_MATMUL_TILE", v, {"auto", "large", "small"});
  if (const char* v = env("FASTCOMM_MATMUL_SCHED"))
    c.sched = oneOf("FASTCOMM_MATMUL_SCHED", v, {"auto", "coop", "pingpong"});
  if (const char* v = env("FASTCOMM_MATMUL_CLUSTER"))
    c.cluster = oneOf("FASTCOMM_MATMUL_CLUSTER", v, {"auto", "1", "2"});
  if (const char* v = env("FASTCOMM_MATMUL_EPI"))
    c.epi = oneOf("FASTCOMM_MATMUL_EPI", v, {"auto", "direct", "tma", "tma2", "offload"});
  if (const char* v = env("FASTCOMM_MATMUL_RASTER"))
    c.raster = oneOf("FASTCOMM_MATMUL_RASTER", v, {"auto", "m", "n"});
  if (const char* v = env("FASTCOMM_MATMUL_GROUP")) {
    const int64_t g = parseBytes("FASTCOMM_MATMUL_GROUP", v);
    if (g != 0 && (g < 256 || g > 65536)) {
      throw std::invalid_argument(std::string("fastcomm: FASTCOMM_MATMUL_GROUP=") + v +
                                  " is not 0 (auto) or from 256 to 65536");
    }
    c.group = static_cast<int>(g);
  }
  c.wgmmaMnMajor = flag("FASTCOMM_MATMUL_WGMMA_MN", true);
  return c;
}

std::string MatmulConfig::describe() const {
  std::ostringstream os;
  os << "matmul impl=" << impl << " tile=" << tile << " sched=" << sched << " cluster=" << cluster
     << " epi=" << epi << " raster=" << raster << " group=" << group
     << " wgmma_mn=" << wgmmaMnMajor;
  return os.str();
}

}  // namespace fastcomm
