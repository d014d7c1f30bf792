#include "common/config.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <csignal>
#include <cstring>
#include <functional>
#include <map>
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

std::string bytesText(int64_t v) {
  if (v >= (1 << 30) && v % (1 << 30) == 0) return std::to_string(v >> 30) + "G";
  if (v >= (1 << 20) && v % (1 << 20) == 0) return std::to_string(v >> 20) + "M";
  if (v >= (1 << 10) && v % (1 << 10) == 0) return std::to_string(v >> 10) + "K";
  return std::to_string(v);
}

int64_t bounded(const char* name, const char* text, int64_t lo, int64_t hi) {
  const int64_t v = parseBytes(name, text);
  if (v < lo || v > hi) {
    throw std::invalid_argument(std::string("fastcomm: ") + name + "=" + text + " is not from " +
                                std::to_string(lo) + " to " + std::to_string(hi));
  }
  return v;
}

bool parseFlag(const char* text) {
  const std::string s = lower(text);
  return !(s == "0" || s == "false" || s == "off" || s == "no");
}

// A setting: how it is read and shown. `show` prints what `parse` reads back
// (the agreed tier travels as text).
struct Setting {
  SettingInfo info;
  std::function<void(Config&, const char* text)> parse;
  std::function<std::string(const Config&)> show;
};

Setting bytes(const char* var, Tier tier, int64_t Config::*m, const char* dflt,
              const char* meaning) {
  return {{var, tier, dflt, meaning},
          [var, m](Config& c, const char* t) { c.*m = parseBytes(var, t); },
          [m](const Config& c) { return bytesText(c.*m); }};
}

Setting count(const char* var, Tier tier, int Config::*m, int lo, int hi, const char* dflt,
              const char* meaning) {
  return {{var, tier, dflt, meaning},
          [var, m, lo, hi](Config& c, const char* t) {
            c.*m = static_cast<int>(bounded(var, t, lo, hi));
          },
          [m](const Config& c) { return std::to_string(c.*m); }};
}

Setting onOff(const char* var, Tier tier, bool Config::*m, const char* dflt, const char* meaning) {
  return {{var, tier, dflt, meaning},
          [m](Config& c, const char* t) { c.*m = parseFlag(t); },
          [m](const Config& c) { return std::string(c.*m ? "1" : "0"); }};
}

// Signals FASTCOMM_TRACE_SIGNAL accepts by name (numbers are accepted too).
constexpr std::pair<const char*, int> kSignalNames[] = {
    {"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT},  {"USR1", SIGUSR1},
    {"USR2", SIGUSR2}, {"TERM", SIGTERM}, {"WINCH", SIGWINCH}};

int parseSignal(const char* var, const char* text) {
  std::string s(text);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::toupper(c); });
  if (s.rfind("SIG", 0) == 0) s = s.substr(3);
  for (const auto& [name, number] : kSignalNames)
    if (s == name) return number;
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (end != s.c_str() && *end == '\0' && v >= 0 && v <= 64) return static_cast<int>(v);
  throw std::invalid_argument(std::string("fastcomm: ") + var + "=" + text +
                              " is not a signal (USR1, USR2, HUP, ... or a number; 0 for none)");
}

std::string signalText(int number) {
  for (const auto& [name, n] : kSignalNames)
    if (n == number) return std::string("SIG") + name;
  return std::to_string(number);
}

Setting choice(const char* var, Tier tier, std::string Config::*m,
               std::initializer_list<const char*> allowed, const char* dflt, const char* meaning) {
  std::vector<const char*> options(allowed);
  return {{var, tier, dflt, meaning},
          [var, m, options](Config& c, const char* t) {
            const std::string v = lower(t);
            for (const char* a : options)
              if (v == a) {
                c.*m = v;
                return;
              }
            std::string msg = std::string("fastcomm: ") + var + "=" + t + " is not one of";
            for (const char* a : options) msg += std::string(" ") + a;
            throw std::invalid_argument(msg);
          },
          [m](const Config& c) { return c.*m; }};
}

Setting text(const char* var, Tier tier, std::string Config::*m, const char* dflt,
             const char* meaning) {
  return {{var, tier, dflt, meaning},
          [m](Config& c, const char* t) { c.*m = t; },
          [m](const Config& c) { return c.*m; }};
}

// Every FASTCOMM_* setting, in the order of the README's table.
const std::vector<Setting>& settings() {
  static const std::vector<Setting> all = [] {
    const Tier A = Tier::Agreed, L = Tier::Local, D = Tier::Debug;
    std::vector<Setting> v;
    // ---- agreed across the group
    v.push_back(choice("FASTCOMM_TRANSPORT", A, &Config::transport, {"auto", "ib", "tcp"}, "auto",
                       "inter-node transport: `auto` (`ib` when every rank has a usable RDMA "
                       "device, else `tcp`), `ib`, `tcp`"));
    v.push_back(choice("FASTCOMM_WIRE_DTYPE", A, &Config::wireDtype,
                       {"none", "bf16", "fp16", "int8"}, "none",
                       "float32 SUM/AVG cross nodes coded, accumulated in float32: `bf16` rounds "
                       "each value; `fp16` and `int8` code blocks of 256 values with a "
                       "power-of-two scale each (CPU and CUDA tensors alike)"));
    v.push_back(bytes("FASTCOMM_CHUNK_BYTES", A, &Config::chunkBytes, "1M",
                      "pipeline chunk of the host plans and shared memory, per rank and step "
                      "(K/M/G suffixes)"));
    v.push_back(bytes("FASTCOMM_SHM_ONESHOT_BYTES", A, &Config::oneShotBytes, "32K",
                      "shared-memory all-reduces up to this size use one exchange"));
    v.push_back(bytes("FASTCOMM_P2P_BYTES", A, &Config::p2pBytes, "256K",
                      "shared-memory ring buffer per directed pair for send/recv"));
    v.push_back(onOff("FASTCOMM_CUDA_HIER", A, &Config::cudaHier, "1",
                      "`0`: CUDA all_reduces across nodes stay on the flat NCCL communicator"));
    v.push_back(bytes("FASTCOMM_CUDA_HIER_MIN_BYTES", A, &Config::cudaHierMinBytes, "4M",
                      "CUDA all_reduces across nodes from this size take the staged rail"));
    v.push_back({{"FASTCOMM_CUDA_INTER", A, "nccl",
                  "other CUDA collectives across nodes: `nccl` (flat communicator) or `host` "
                  "(staged through pinned host memory into the host plan; not capturable)"},
                 [](Config& c, const char* t) {
                   std::string v = lower(t);
                   if (v != "nccl" && v != "host")
                     throw std::invalid_argument(std::string("fastcomm: FASTCOMM_CUDA_INTER=") + t +
                                                 " is not one of nccl host");
                   c.cudaInterHost = v == "host";
                 },
                 [](const Config& c) { return std::string(c.cudaInterHost ? "host" : "nccl"); }});
    v.push_back(bytes("FASTCOMM_CUDA_CHUNK_BYTES", A, &Config::cudaChunkBytes, "4M",
                      "staged rail chunk per rank's shard, in bytes on the wire"));
    v.push_back({{"FASTCOMM_CUDA_WINDOW", A, "6", "staged rail chunks in flight per rank, 3 to 32"},
                 [](Config& c, const char* t) {
                   c.cudaWindow =
                       bounded("FASTCOMM_CUDA_WINDOW", t, kCudaWindowMin, kCudaWindowMax);
                 },
                 [](const Config& c) { return std::to_string(c.cudaWindow); }});
    v.push_back({{"FASTCOMM_TCP_SOCKETS", A, "auto",
                  "sockets per peer connection of the tcp transport, 1 to 64 (the most that carry "
                  "data: it sheds those that add no delivery rate); `auto`: 8 per host, split "
                  "among the host's ranks (8 with one rank per host, 4 with two, at least 1)"},
                 [](Config& c, const char* t) {
                   c.tcpSocketsPerPeer =
                       lower(t) == "auto"
                           ? 0
                           : static_cast<int>(bounded("FASTCOMM_TCP_SOCKETS", t, 1, 64));
                 },
                 [](const Config& c) {
                   return c.tcpSocketsPerPeer > 0 ? std::to_string(c.tcpSocketsPerPeer)
                                                  : std::string("auto");
                 }});
    v.push_back(count("FASTCOMM_IB_QPS_PER_PEER", A, &Config::ibQpsPerPeer, 1, 16, "2",
                      "RC queue pairs per connection of the ib transport"));
    v.push_back({{"FASTCOMM_NVLINK", A, "auto",
                  "`auto`: small and medium CUDA all_reduces, all_gathers and reduce_scatters "
                  "of a group on one node whose GPUs all reach each other over NVLink run "
                  "fastcomm's own peer-memory kernels; `0`: NCCL only"},
                 [](Config& c, const char* t) {
                   const std::string v = lower(t);
                   if (v != "auto" && v != "0")
                     throw std::invalid_argument(std::string("fastcomm: FASTCOMM_NVLINK=") + t +
                                                 " is not one of auto 0");
                   c.nvlink = v == "auto";
                 },
                 [](const Config& c) { return std::string(c.nvlink ? "auto" : "0"); }});
    v.push_back(onOff("FASTCOMM_CHECK", A, &Config::check, "0",
                      "`1`: before each CPU collective, ranks compare op, dtype, sizes, root and "
                      "reduce op and name the odd rank"));
    // ---- local to each rank
    v.push_back(text("FASTCOMM_HOST_ID", L, &Config::hostIdOverride,
                     "hostname + boot id + namespaces",
                     "this rank's host identity (one machine acting as several nodes)"));
    v.push_back({{"FASTCOMM_CUDA_LAG", L, "3",
                  "staged rail: the all-gather step of chunk k is issued after the reduction of "
                  "chunk k + lag (1 to window - 1)"},
                 [](Config& c, const char* t) {
                   c.cudaLag = bounded("FASTCOMM_CUDA_LAG", t, 1, kCudaWindowMax - 1);
                 },
                 [](const Config& c) { return std::to_string(c.cudaLag); }});
    v.push_back({{"FASTCOMM_STAGED_MEMORY", L, "`auto` (`host` under `FASTCOMM_IB_EMULATE=1`)",
                  "staged rail staging: `auto` (GPU memory where the transport moves it, else "
                  "pinned host) or `host`"},
                 [](Config& c, const char* t) {
                   std::string v = lower(t);
                   if (v != "auto" && v != "host")
                     throw std::invalid_argument(std::string("fastcomm: FASTCOMM_STAGED_MEMORY=") +
                                                 t + " is not one of host auto");
                   c.stagedHostOnly = v == "host";
                   c.stagedMemoryExplicit = true;
                 },
                 [](const Config& c) { return std::string(c.stagedHostOnly ? "host" : "auto"); }});
    v.push_back(bytes("FASTCOMM_SPIN_US", L, &Config::spinMicros,
                      "20 if cores > local ranks, else 0", "spin before sleeping on a futex"));
    v.push_back(onOff("FASTCOMM_BLOCKING_WAIT", L, &Config::blockingWait, "0",
                      "`1`: `work.wait()` on CUDA blocks the host until done or failed"));
    v.push_back(onOff("FASTCOMM_CUDA_TIMING", L, &Config::cudaTiming, "0",
                      "`1`: time CUDA collectives for `stats()` with GPU events (6-9 us of GPU "
                      "time each)"));
    v.push_back(count("FASTCOMM_TCP_THREADS", L, &Config::tcpThreads, 1, 64, "8",
                      "progress threads of the tcp transport"));
    v.push_back({{"FASTCOMM_TCP_SOCKET_BUFFER", L, "0",
                  "`SO_SNDBUF` / `SO_RCVBUF` of tcp sockets in bytes; `0`: kernel autotuning"},
                 [](Config& c, const char* t) {
                   c.tcpSocketBufferBytes = bounded("FASTCOMM_TCP_SOCKET_BUFFER", t, 0, 1 << 30);
                 },
                 [](const Config& c) { return bytesText(c.tcpSocketBufferBytes); }});
    v.push_back(text("FASTCOMM_SOCKET_IFNAME", L, &Config::socketIfname,
                     "first up non-loopback IPv4, else `lo`",
                     "interface (or prefix) the tcp transport listens on"));
    v.push_back(text("FASTCOMM_IB_HCA", L, &Config::ibHca, "any",
                     "RDMA devices/ports: `mlx5_0:1,mlx5_1`, `=mlx5_0` (exact), `^mlx5_1` (all "
                     "but)"));
    v.push_back({{"FASTCOMM_IB_GID_INDEX", L, "automatic (RoCE v2, IPv4-mapped first)",
                  "RoCE GID index (0..255)"},
                 [](Config& c, const char* t) {
                   char* end = nullptr;
                   const long idx = std::strtol(t, &end, 10);
                   if (end == t || *end != '\0' || idx < -1 || idx > 255)
                     throw std::invalid_argument(
                         std::string("fastcomm: FASTCOMM_IB_GID_INDEX=") + t +
                         " is not a GID index (0..255, or -1 for automatic)");
                   c.ibGidIndex = static_cast<int>(idx);
                 },
                 [](const Config& c) { return std::to_string(c.ibGidIndex); }});
    v.push_back(onOff("FASTCOMM_IB_GDR", L, &Config::ibGdr, "1",
                      "`0`: no GPUDirect RDMA even where detected"));
    v.push_back(onOff("FASTCOMM_IB_EMULATE", L, &Config::ibEmulate, "0",
                      "`1`: the ib transport runs on a software RC device (no NIC needed)"));
    // ---- diagnostics and tests
    v.push_back(
        {{"FASTCOMM_LOG", D, "WARN", "`WARN`, `INFO` (topology, paths, config at init), `DEBUG`"},
         [](Config& c, const char* t) {
           const std::string l = lower(t);
           if (l != "warn" && l != "info" && l != "debug")
             throw std::invalid_argument(std::string("fastcomm: FASTCOMM_LOG=") + t +
                                         " is not one of warn info debug");
           c.logLevel = l == "warn"   ? LogLevel::Warn
                        : l == "info" ? LogLevel::Info
                                      : LogLevel::Debug;
         },
         [](const Config& c) {
           return std::string(c.logLevel == LogLevel::Warn   ? "warn"
                              : c.logLevel == LogLevel::Info ? "info"
                                                             : "debug");
         }});
    v.push_back(onOff("FASTCOMM_TIMELINE", D, &Config::timeline, "0",
                      "`1`: record pipeline phases; `torchext.timeline()`, "
                      "`torchext.save_timeline(\"t.json\")`"));
    v.push_back(onOff("FASTCOMM_CRASH_BACKTRACE", D, &Config::crashBacktrace, "0",
                      "`1`: native stack on a segfault; `kill -USR2 <pid>` prints every "
                      "thread's stack"));
    v.push_back(count("FASTCOMM_TRACE_BUFFER_SIZE", D, &Config::traceBufferSize, 0, 1 << 20, "2000",
                      "flight recorder: the last N collectives of each group, dumped on a "
                      "timeout, a signal or `torchext.dump_trace()`; `0`: off"));
    v.push_back(text("FASTCOMM_TRACE_FILE", D, &Config::traceFile, "/tmp/fastcomm_trace_rank_",
                     "flight recorder dumps go to `<this><global rank>`"));
    v.push_back(onOff("FASTCOMM_TRACE_DUMP_ON_TIMEOUT", D, &Config::traceDumpOnTimeout, "1",
                      "`1`: a rank whose collective times out or fails dumps, and asks every "
                      "other rank (through the store) to dump too"));
    v.push_back(
        {{"FASTCOMM_TRACE_SIGNAL", D, "0",
          "a signal (`USR1`, ...) that makes the rank dump its flight recorder; `0`: "
          "none"},
         [](Config& c, const char* t) { c.traceSignal = parseSignal("FASTCOMM_TRACE_SIGNAL", t); },
         [](const Config& c) {
           return c.traceSignal == 0 ? std::string("0") : signalText(c.traceSignal);
         }});
    v.push_back(onOff("FASTCOMM_TRACE_PYTHON_STACK", D, &Config::tracePythonStack, "0",
                      "`1`: each flight recorder entry keeps the caller's Python stack (costs "
                      "microseconds per collective)"));
    return v;
  }();
  return all;
}

}  // namespace

Config Config::fromEnv() {
  Config c;
  for (const Setting& s : settings()) {
    if (const char* v = env(s.info.variable)) s.parse(c, v);
  }
  if (c.cudaLag >= c.cudaWindow) {
    throw std::invalid_argument("fastcomm: FASTCOMM_CUDA_LAG=" + std::to_string(c.cudaLag) +
                                " is not from 1 to FASTCOMM_CUDA_WINDOW - 1 (" +
                                std::to_string(c.cudaWindow - 1) + ")");
  }
  if (!c.stagedMemoryExplicit) c.stagedHostOnly = c.ibEmulate;  // see LocalSettings
  // Chunks below 4 KiB only add barriers; keep them page-sized and sane.
  c.chunkBytes = std::max<int64_t>(4096, c.chunkBytes / 4096 * 4096);
  c.p2pBytes = std::max<int64_t>(4096, c.p2pBytes / 4096 * 4096);
  c.cudaChunkBytes = std::max<int64_t>(4096, c.cudaChunkBytes / 4096 * 4096);
  return c;
}

std::string Config::describe() const {
  std::ostringstream os;
  bool first = true;
  for (const Setting& s : settings()) {
    std::string name = lower(s.info.variable + std::strlen("FASTCOMM_"));
    std::string value = s.show(*this);
    os << (first ? "" : " ") << name << "=" << (value.empty() ? "<auto>" : value);
    first = false;
  }
  return os.str();
}

std::string Config::encodeAgreed() const {
  std::string out;
  for (const Setting& s : settings()) {
    if (s.info.tier == Tier::Agreed)
      out += std::string(s.info.variable) + "=" + s.show(*this) + "\n";
  }
  return out;
}

std::string Config::adoptAgreed(const std::string& rankZero) {
  std::map<std::string, std::string> theirs;
  std::istringstream is(rankZero);
  std::string line;
  while (std::getline(is, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) theirs[line.substr(0, eq)] = line.substr(eq + 1);
  }
  std::string differ;
  for (const Setting& s : settings()) {
    if (s.info.tier != Tier::Agreed) continue;
    const auto it = theirs.find(s.info.variable);
    if (it == theirs.end()) {
      throw std::runtime_error(std::string("fastcomm: group rank 0 sent no ") + s.info.variable +
                               " (a different fastcomm build?)");
    }
    const std::string mine = s.show(*this);
    if (mine == it->second) continue;
    differ += std::string(differ.empty() ? "" : ", ") + s.info.variable + "=" + mine +
              " (group rank 0: " + it->second + ")";
    s.parse(*this, it->second.c_str());
  }
  // The lag is this rank's own, but must stay below the agreed window.
  cudaLag = std::min<int64_t>(cudaLag, cudaWindow - 1);
  return differ;
}

int Config::tcpSocketsFor(int ranksPerHost) const {
  if (tcpSocketsPerPeer > 0) return tcpSocketsPerPeer;
  return std::max(1, kTcpSocketsPerHost / std::max(1, ranksPerHost));
}

std::vector<SettingInfo> settingsTable() {
  std::vector<SettingInfo> out;
  for (const Setting& s : settings()) out.push_back(s.info);
  return out;
}

const char* tierName(Tier tier) {
  switch (tier) {
    case Tier::Agreed:
      return "agreed";
    case Tier::Local:
      return "local";
    case Tier::Debug:
      return "debug";
  }
  return "?";
}

namespace {

const char* const kMatmulSettings[] = {"impl", "tile", "sched", "epi", "raster", "group", "splits"};

// "tile" -> "FASTCOMM_MATMUL_TILE".
std::string matmulVar(const std::string& name) {
  std::string var = "FASTCOMM_MATMUL_";
  for (char ch : name) var += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return var;
}

}  // namespace

MatmulConfig MatmulConfig::fromEnv() {
  MatmulConfig c;
  for (const char* name : kMatmulSettings) {
    if (const char* v = env(matmulVar(name).c_str())) c.set(name, v);
  }
  return c;
}

void MatmulConfig::set(const std::string& name, const std::string& value) {
  const std::string n = lower(name);
  const std::string var = matmulVar(n);
  const char* v = value.c_str();
  if (n == "impl") {
    impl = oneOf(var.c_str(), v, {"auto", "skinny", "wgmma", "mma", "simt"});
  } else if (n == "tile") {
    tile = oneOf(var.c_str(), v, {"auto", "large", "medium", "small", "narrow"});
  } else if (n == "sched") {
    sched = oneOf(var.c_str(), v, {"auto", "coop", "pingpong"});
  } else if (n == "epi") {
    epi = oneOf(var.c_str(), v, {"auto", "direct", "tma", "offload"});
  } else if (n == "raster") {
    raster = oneOf(var.c_str(), v, {"auto", "m", "n"});
  } else if (n == "group") {
    const int64_t g = parseBytes(var.c_str(), v);
    if (g != 0 && (g < 256 || g > 65536)) {
      throw std::invalid_argument("fastcomm: " + var + "=" + value +
                                  " is not 0 (auto) or from 256 to 65536");
    }
    group = static_cast<int>(g);
  } else if (n == "splits") {
    const std::string t = lower(value);
    char* end = nullptr;
    const long s = t == "auto" ? 0 : std::strtol(v, &end, 10);
    if (t != "auto" && (end == v || *end != '\0' || s < 0 || s > 16)) {
      throw std::invalid_argument("fastcomm: " + var + "=" + value +
                                  " is not auto, 0 (auto) or from 1 to 16");
    }
    splits = static_cast<int>(s);
  } else {
    throw std::invalid_argument("fastcomm: no matmul setting " + name +
                                " (impl, tile, sched, epi, raster, group, splits)");
  }
}

std::string MatmulConfig::describe() const {
  std::ostringstream os;
  os << "matmul impl=" << impl << " tile=" << tile << " sched=" << sched << " epi=" << epi
     << " raster=" << raster << " group=" << group << " splits=" << splits;
  return os.str();
}

}  // namespace fastcomm
