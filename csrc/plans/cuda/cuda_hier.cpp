#include "plans/cuda/cuda_hier.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "intra/nccl/nccl_utils.hpp"
#include "common/logging.hpp"
#include "kernels/staged_kernels.hpp"

namespace fastcomm {
namespace {

// After a failure, how long shutdown waits for the comm stream to drain
// before leaking the staging rather than freeing it under the kernels.
constexpr auto kDrainLimit = std::chrono::seconds(10);

constexpr int64_t kFlagStride = 16;  // uint32 words per flag: one 64-byte line each
// Flags are laid out for the largest window, whatever the plan's is.
constexpr int64_t kProbe = kStagedFlagKinds * kCudaWindowMax;  // a spare flag for the probe

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throwCommError(std::string("fastcomm: CUDA multi-node all_reduce: ") + what + ": " +
                   cudaGetErrorString(e));
  }
}

void cuCheck(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    throwCommError(std::string("fastcomm: CUDA multi-node all_reduce: ") + what +
                   " failed with CUresult " + std::to_string(static_cast<int>(r)));
  }
}

hierk::Elem elemOf(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return hierk::Elem::F32;
    case at::kDouble:
      return hierk::Elem::F64;
    case at::kHalf:
      return hierk::Elem::F16;
    case at::kBFloat16:
      return hierk::Elem::BF16;
    case at::kChar:
      return hierk::Elem::I8;
    case at::kByte:
      return hierk::Elem::U8;
    case at::kInt:
      return hierk::Elem::I32;
    case at::kLong:
      return hierk::Elem::I64;
    default:
      TORCH_CHECK(false, "fastcomm: internal: no multi-node CUDA path for ", t);
  }
}

// The kernels' types: what fastcomm reduces (common/reduce.hpp) but int16
// (NCCL, which runs the intra-node phases, has no int16) and bool (NCCL's
// bool reductions are MAX/MIN over 0/1 bytes, which the flat communicator
// does in one call anyway).
bool supportedDtype(at::ScalarType t) {
  return reducibleDtype(t) && t != at::kShort && t != at::kBool;
}

bool supportedOp(RedOp op) {
  return op == RedOp::Sum || op == RedOp::Avg || op == RedOp::Product || op == RedOp::Min ||
         op == RedOp::Max;
}

hierk::Op kernelOp(RedOp op) {
  switch (op) {
    case RedOp::Product:
      return hierk::Op::Prod;
    case RedOp::Min:
      return hierk::Op::Min;
    case RedOp::Max:
      return hierk::Op::Max;
    default:
      return hierk::Op::Sum;  // Sum, and Avg (divided at the end)
  }
}

hierk::Wire kernelWire(WireDtype w) {
  switch (w) {
    case WireDtype::BF16:
      return hierk::Wire::BF16;
    case WireDtype::FP16:
      return hierk::Wire::FP16;
    case WireDtype::INT8:
      return hierk::Wire::INT8;
    case WireDtype::None:
      break;
  }
  return hierk::Wire::None;
}

uint32_t loadFlag(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

}  // namespace

// ----------------------------------------------------------------------------- resources

// What a rank needs locally before it can vote for the path: the driver's
// stream memory operations, mapped pinned flags, mapped pinned staging (the
// rail may trade it for device memory at connect: placeStaging). It is also
// the rail's device: every operation goes to `stream` (the group's comm
// stream, set for each all_reduce), or with lanes to the lane's stream.
//
// Memory ordering of the steps, whose kernels read and write the
// staging directly (mapped pinned host memory, or device memory that the
// transport moves: GPUDirect RDMA or the ib emulation's cudaMemcpy):
// - Device -> proxy: a kernel's stores to the staging are followed on the
//   stream by setFlag's cuStreamWriteValue32 without
//   CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER. The driver API documents that
//   this write runs after the preceding work of the stream completed and
//   "will provide a memory fence before the write, which has similar
//   semantics to __threadfence_system() but is scoped to the stream rather
//   than a CUDA thread" (CUstreamWriteValue_flags), i.e. every store of the
//   finished kernel is visible system-wide (to the proxy, to the NIC) before
//   the flag is.
//   The kernels store to the staging with st.global.wt (write through L2 to
//   system memory; PTX ISA, "Cache Operators"), so nothing waits in L2.
// - Proxy -> device: the proxy writes the flag (release) only after the
//   transport reported the data in place, and the kernel that reads it is
//   issued after the cuStreamWaitValue32 on that flag, so it starts after
//   the data landed. It loads the staging with ld.global.cv ("consider
//   cached system memory lines stale, fetch again", PTX ISA), so no L2 line
//   an earlier chunk on the same slot left behind is read. Device staging
//   written by a NIC needs its PCIe writes flushed to the GPU's view before
//   dependent work on pre-Hopper GPUs (NCCL's ncclTopoNeedFlush,
//   graph/paths.cc: no flush from compute capability 9.0 on, except
//   C2C-attached CPUs); placeStaging takes device memory only where the GPU
//   is sm_90+ or can flush remote writes, and then the arrival waits carry
//   CU_STREAM_WAIT_VALUE_FLUSH ("if a remote write operation is guaranteed
//   to have reached the device before the wait can be satisfied, that write
//   is guaranteed to be visible to downstream device work").
struct CudaHier::Resources : StagedDevice {
  PFN_cuStreamWaitValue32_v11070 waitValue = nullptr;
  PFN_cuStreamWriteValue32_v11070 writeValue = nullptr;
  uint32_t* flags = nullptr;  // mapped pinned
  CUdeviceptr flagsDev = 0;
  char* pinnedStaging = nullptr;  // mapped pinned, the same address on host and device
  char* deviceStaging = nullptr;  // cudaMalloc'd (placeStaging)
  int64_t stagingBytes = 0;
  bool flushArrivals = false;     // CU_STREAM_WAIT_VALUE_FLUSH on the network-arrival waits
  std::string stagingWhy;         // where the staging is, and why (describe())
  bool leak = false;              // the GPU may still use the memory: never free
  cudaStream_t stream = nullptr;  // the op's (lane P)
  // Where operations go now: `stream`, or a lane's (eager ops).
  cudaStream_t active = nullptr;
  // Lanes A and B, and the events that fork them from `stream` and join
  // them back, reused by every op (a wait takes the event's last record at
  // the time it is issued, so re-recording is safe).
  cudaStream_t laneA = nullptr, laneB = nullptr;
  cudaEvent_t laneFork = nullptr, laneJoinA = nullptr, laneJoinB = nullptr;

  CUdeviceptr flagDev(int kind, int64_t slot) const {
    return flagsDev + static_cast<CUdeviceptr>((kind * kCudaWindowMax + slot) * kFlagStride *
                                               sizeof(uint32_t));
  }

  // -- StagedDevice
  uint32_t* hostFlag(int kind, int64_t slot) override {
    return flags + (kind * kCudaWindowMax + slot) * kFlagStride;
  }
  void waitFlag(int kind, int64_t slot) override {
    // Wait for 1, then put the flag back to 0 for its next use: the same
    // values on every use, so a replayed sequence works as the first one did.
    const bool arrival = kind == kFlagRsIn || kind == kFlagAgIn;
    const unsigned int how =
        CU_STREAM_WAIT_VALUE_EQ | (flushArrivals && arrival ? CU_STREAM_WAIT_VALUE_FLUSH : 0);
    cuCheck(waitValue(active, flagDev(kind, slot), 1, how), "cuStreamWaitValue32");
    cuCheck(writeValue(active, flagDev(kind, slot), 0, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue32");
  }
  void setFlag(int kind, int64_t slot) override {
    // The default flags fence the stream's earlier copies before the write,
    // so the proxy sees their data once it sees the flag.
    cuCheck(writeValue(active, flagDev(kind, slot), 1, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue32");
  }
  void packToStaging(WireDtype wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                     const HierLayout& l, int64_t k, int me) override {
    hierk::packToStaging(kernelWire(wire), esize, chunk, slots, pitch, l, k, me, active);
  }
  void reduceFromStaging(at::ScalarType dt, RedOp op, WireDtype wire, void* own, const void* recv,
                         int64_t pitch, int nPeers, int64_t n, int64_t divisor,
                         void* out) override {
    hierk::reduceFromStaging(elemOf(dt), kernelOp(op), kernelWire(wire), own, recv, pitch, nPeers,
                             n, divisor, out, active);
  }
  void gatherFromStaging(WireDtype wire, int64_t esize, const void* slots, int64_t pitch,
                         void* chunk, const HierLayout& l, int64_t k, int me) override {
    hierk::gatherFromStaging(kernelWire(wire), esize, slots, pitch, chunk, l, k, me, active);
  }
  void forkLanes() override {
    cudaCheck(cudaEventRecord(laneFork, stream), "cudaEventRecord");
    cudaCheck(cudaStreamWaitEvent(laneA, laneFork, 0), "cudaStreamWaitEvent");
    cudaCheck(cudaStreamWaitEvent(laneB, laneFork, 0), "cudaStreamWaitEvent");
  }
  void useLane(int lane) override {
    active = lane == kLaneA ? laneA : (lane == kLaneB ? laneB : stream);
  }
  void joinLanes() override {
    cudaCheck(cudaEventRecord(laneJoinA, laneA), "cudaEventRecord");
    cudaCheck(cudaEventRecord(laneJoinB, laneB), "cudaEventRecord");
    cudaCheck(cudaStreamWaitEvent(stream, laneJoinA, 0), "cudaStreamWaitEvent");
    cudaCheck(cudaStreamWaitEvent(stream, laneJoinB, 0), "cudaStreamWaitEvent");
    active = stream;
  }
  bool capturing() override {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaCheck(cudaStreamIsCapturing(stream, &st), "cudaStreamIsCapturing");
    return st != cudaStreamCaptureStatusNone;
  }
  void hostCall(void (*fn)(void*), void* arg) override {
    // Under capture a host node: the graph runs it on every replay, on the
    // driver's host-function thread, before the nodes that follow it.
    cudaCheck(cudaLaunchHostFunc(stream, fn, arg), "cudaLaunchHostFunc");
  }

  static std::unique_ptr<Resources> make(int rails, int64_t chunkBytes, int64_t window) {
    auto r = std::make_unique<Resources>();
    cudaCheck(cudaStreamCreateWithFlags(&r->laneA, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaCheck(cudaStreamCreateWithFlags(&r->laneB, cudaStreamNonBlocking), "cudaStreamCreate");
    for (cudaEvent_t* e : {&r->laneFork, &r->laneJoinA, &r->laneJoinB})
      cudaCheck(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
    cudaDriverEntryPointQueryResult q{};
    // Through the runtime, so fastcomm does not link libcuda itself; the
    // 12.0 ABI of both functions (their _v2 forms) is all we use.
    cudaCheck(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32",
                                               reinterpret_cast<void**>(&r->waitValue), 12000,
                                               cudaEnableDefault, &q),
              "cudaGetDriverEntryPointByVersion(cuStreamWaitValue32)");
    if (q != cudaDriverEntryPointSuccess || r->waitValue == nullptr)
      throw std::runtime_error("the driver has no cuStreamWaitValue32");
    cudaCheck(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32",
                                               reinterpret_cast<void**>(&r->writeValue), 12000,
                                               cudaEnableDefault, &q),
              "cudaGetDriverEntryPointByVersion(cuStreamWriteValue32)");
    if (q != cudaDriverEntryPointSuccess || r->writeValue == nullptr)
      throw std::runtime_error("the driver has no cuStreamWriteValue32");

    const int64_t flagBytes = (kProbe + 1) * kFlagStride * sizeof(uint32_t);
    cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&r->flags), flagBytes,
                            cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc (flags)");
    std::memset(r->flags, 0, flagBytes);
    void* dev = nullptr;
    cudaCheck(cudaHostGetDevicePointer(&dev, r->flags, 0), "cudaHostGetDevicePointer");
    r->flagsDev = reinterpret_cast<CUdeviceptr>(dev);

    // Mapped, so kernels reach it; allocated before the
    // vote, so a rank that cannot get it keeps every rank on the flat path.
    r->stagingBytes = StagedRail::stagingFor(rails, chunkBytes, window).bytes;
    cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&r->pinnedStaging), r->stagingBytes,
                            cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc (staging)");
    void* stagingDev = nullptr;
    cudaCheck(cudaHostGetDevicePointer(&stagingDev, r->pinnedStaging, 0),
              "cudaHostGetDevicePointer (staging)");
    // The rail hands one address to the device and to the proxy alike.
    if (stagingDev != r->pinnedStaging)
      throw std::runtime_error(
          "mapped pinned memory has a device address other than its host "
          "address (no unified addressing)");

    // Probe the stream memory operations on host memory once, on a stream
    // of our own: some drivers or platforms refuse them.
    cudaStream_t s = nullptr;
    cudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::string problem;
    try {
      const CUdeviceptr probe =
          r->flagsDev + static_cast<CUdeviceptr>(kProbe * kFlagStride * sizeof(uint32_t));
      cuCheck(r->writeValue(s, probe, 1, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32");
      cuCheck(r->waitValue(s, probe, 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32");
      cuCheck(r->writeValue(s, probe, 2, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32");
      cudaCheck(cudaStreamSynchronize(s), "stream memory operation probe");
      if (loadFlag(r->flags + kProbe * kFlagStride) != 2) {
        problem = "the stream memory operation probe did not write host memory";
      }
    } catch (const std::exception& e) {
      problem = errorText(e);
    }
    cudaStreamDestroy(s);
    if (!problem.empty()) throw std::runtime_error(problem);

    // Every kernel of the path loaded now, not at its first launch: the
    // issue order puts launches behind the stream's waits on the network,
    // and loading a kernel may synchronize the context (staged_kernels.hpp).
    hierk::preload();
    return r;
  }

  // The rail's StagingAllocator: device memory where the rail's transports
  // move it (`deviceMemoryMoves`), unless FASTCOMM_STAGED_MEMORY=host (or its
  // default under the ib emulation, config.hpp), the GPU could not see a
  // NIC's writes in order (see the memory ordering above) or cudaMalloc
  // fails; else the mapped pinned staging.
  void placeStaging(StagedRail::Staging& s, bool deviceMemoryMoves, const Config& cfg,
                    const std::string& transport, at::Device device) {
    TORCH_INTERNAL_ASSERT(s.bytes == stagingBytes);
    std::string why;
    if (cfg.stagedHostOnly) {
      why = cfg.stagedMemoryExplicit
                ? "FASTCOMM_STAGED_MEMORY=host"
                : "the default under the ib emulation, whose HCA moves device memory with CUDA "
                  "copies of this process; FASTCOMM_STAGED_MEMORY=auto stages in device memory";
    } else if (!deviceMemoryMoves) {
      why = "the " + transport + " transport cannot move device memory" +
            (transport == "ib" ? " (GPUDirect RDMA unavailable or FASTCOMM_IB_GDR=0)" : "");
    } else {
      int major = 0, canFlush = 0;
      cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()),
                "cudaDeviceGetAttribute");
      cudaCheck(cudaDeviceGetAttribute(&canFlush, cudaDevAttrCanFlushRemoteWrites, device.index()),
                "cudaDeviceGetAttribute");
      if (major < 9 && canFlush == 0) {
        why =
            "this GPU (before sm_90) cannot flush a NIC's writes to its memory ahead of the "
            "kernels that read them";
      } else {
        const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&deviceStaging), s.bytes);
        if (e == cudaSuccess) {
          flushArrivals = canFlush != 0;
        } else {
          (void)cudaGetLastError();
          deviceStaging = nullptr;
          why = std::string("cudaMalloc failed: ") + cudaGetErrorString(e);
        }
      }
    }
    if (deviceStaging != nullptr) {
      // The unused pinned staging stays allocated until ~Resources: freeing
      // it now would be a cudaFreeHost while other work (the flat
      // communicator's, other groups' staged all_reduces, whose streams may
      // sit in rail waits) can be in flight on this GPU, and freeing memory
      // may synchronize the whole device ("Managing memory allocations using
      // cudaMalloc and cudaFree causes the GPU to synchronize across all
      // executing CUDA streams", CUDA C++ Programming Guide, Stream-Ordered
      // Memory Allocator).
      s.base = deviceStaging;
      s.device = true;
      stagingWhy = "device staging (the " + transport + " transport moves device memory" +
                   (flushArrivals ? "; arrival waits flush remote writes" : "") + ")";
    } else {
      s.base = pinnedStaging;
      s.device = false;
      stagingWhy = "pinned host staging (" + why + ")";
    }
    FASTCOMM_LOG(Info,
                 "CUDA all_reduce across nodes: " << (s.bytes >> 20) << " MiB of " << stagingWhy);
  }

  ~Resources() override {
    if (leak) return;
    for (cudaEvent_t e : {laneFork, laneJoinA, laneJoinB})
      if (e != nullptr) cudaEventDestroy(e);
    for (cudaStream_t l : {laneA, laneB})
      if (l != nullptr) cudaStreamDestroy(l);
    if (pinnedStaging != nullptr) cudaFreeHost(pinnedStaging);
    if (deviceStaging != nullptr) cudaFree(deviceStaging);
    if (flags != nullptr) cudaFreeHost(flags);
  }
};

// ----------------------------------------------------------------------------- setup

bool CudaHier::eligible(const InterPlan& plan, const Topology& topo, at::ScalarType dt, RedOp op,
                        int64_t numel, int64_t bytes) {
  if (!plan.cudaHier || topo.numNodes() < 2 || numel <= 0) return false;
  for (const auto& node : topo.nodeRanks)
    if (static_cast<int>(node.size()) != topo.localSize) return false;  // uneven: flat
  return supportedDtype(dt) && supportedOp(op) && bytes >= plan.cudaHierMinBytes;
}

std::unique_ptr<CudaHier> CudaHier::create(const c10::intrusive_ptr<c10d::Store>& store,
                                           const Topology& topo, const InterPlan& plan,
                                           const Config& cfg, at::Device device,
                                           std::chrono::milliseconds timeout, Hooks hooks) {
  c10::cuda::CUDAGuard guard(device);
  const auto ctx = OpContext::start("CUDA multi-node setup", 0, timeout);
  std::unique_ptr<Resources> res;
  std::string problem;
  try {
    res = Resources::make(topo.numNodes(), plan.cudaChunkBytes, plan.cudaWindow);
  } catch (const std::exception& e) {
    problem = errorText(e);
    if (problem.empty()) problem = "unknown error";
  }
  // Every rank says whether it can run the path; all take it or none does.
  const std::string prefix = "fastcomm/cuda_hier/vote/";
  const std::string mine = problem.empty() ? std::string("ok") : problem;
  store->set(prefix + std::to_string(topo.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < topo.size; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store->wait(keys, ctx.remaining());
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r = 0; r < topo.size; ++r)
      if (!store->check({keys[r]})) missing.push_back(r);
    throwCommError(
        "fastcomm: all_reduce across nodes: setup of the CUDA multi-node path failed "
        "on group rank " +
        std::to_string(topo.rank) + ": timeout after " + std::to_string(timeout.count()) +
        " ms waiting for group rank(s) " + formatRanks(missing));
  }
  std::string refusals;
  for (int r = 0; r < topo.size; ++r) {
    auto v = store->get(keys[r]);
    std::string s(v.begin(), v.end());
    if (s != "ok") refusals += " group rank " + std::to_string(r) + ": " + s + ";";
  }
  if (!refusals.empty()) {
    if (topo.rank == 0) {
      FASTCOMM_LOG(Info,
                   "CUDA all_reduce across nodes stays on the flat NCCL communicator: the "
                   "staged multi-node path is unavailable on"
                       << refusals);
    }
    return nullptr;
  }
  std::unique_ptr<CudaHier> h(new CudaHier(topo, plan, device, std::move(res)));
  if (h->topo_.localSize > 1) {
    h->intra_ = ncclCommFromStore(
        store, "fastcomm/cuda_hier/node" + std::to_string(topo.myNode) + "/", topo.localSize,
        topo.localRank, topo.nodeRanks[topo.myNode], topo.rank, ctx.remaining(),
        "NCCL intra-node communicator setup (all_reduce across nodes)");
  }
  std::vector<int> rail;
  for (const auto& node : topo.nodeRanks) rail.push_back(node[topo.localRank]);
  h->rail_ = std::make_unique<StagedRail>(
      *h->res_, std::move(rail), topo.myNode, topo.rank, topo.size, plan.cudaChunkBytes,
      plan.cudaWindow, cfg.cudaLag, parseWireDtype(plan.wireDtype), store, std::move(hooks));
  Resources* r = h->res_.get();
  h->rail_->connect(plan.transport, plan.transportConfig(cfg),
                    c10::make_intrusive<c10d::PrefixStore>("fastcomm/cuda_hier", store), ctx,
                    [r, &cfg, &plan, device](StagedRail::Staging& s, bool deviceMemoryMoves) {
                      r->placeStaging(s, deviceMemoryMoves, cfg, plan.transport, device);
                    });
  if (topo.rank == 0) FASTCOMM_LOG(Info, h->describe());
  return h;
}

CudaHier::CudaHier(const Topology& topo, const InterPlan& plan, at::Device device,
                   std::unique_ptr<Resources> res)
    : topo_(topo), plan_(plan), device_(device), res_(std::move(res)) {}

CudaHier::~CudaHier() {
  // shutdown() normally ran already; this covers a setup that threw.
  rail_.reset();
  if (intra_ != nullptr) ncclCommAbort(intra_);
}

std::string CudaHier::describe() const {
  std::ostringstream os;
  os << "CUDA all_reduce across nodes (from " << plan_.cudaHierMinBytes << " B, "
     << "SUM/AVG/PRODUCT/MIN/MAX on float and integer types): "
     << (topo_.localSize > 1 ? "NCCL reduce-scatter in the node, " : "") << topo_.numNodes() - 1
     << " rail peer(s) per rank over " << rail_->transportName()
     << (rail_->transportName() == "tcp"
             ? " (" + std::to_string(plan_.tcpSocketsPerPeer) + " sockets per peer)"
             : std::string())
     << " through " << (rail_->stagingOnDevice() ? "device" : "pinned host")
     << " staging, pipelined in chunks of " << plan_.cudaChunkBytes << " B (window "
     << plan_.cudaWindow << ", lag " << rail_->lag()
     << "), reduction on the GPU, staging kernels on 3 streams (1 in a CUDA graph)"
     << (plan_.wireDtype != "none" ? ", float32 sums as " + plan_.wireDtype + " on the wire" : "")
     << (topo_.localSize > 1 ? ", NCCL all-gather in the node" : "") << "; "
     << (rail_->stagingBytes() >> 20) << " MiB of staging per rank (here " << res_->stagingWhy
     << ")";
  return os.str();
}

// ----------------------------------------------------------------------------- issue

void CudaHier::allreduce(const at::Tensor& t, RedOp op, cudaStream_t s, const OpContext& ctx,
                         std::function<void(std::exception_ptr)> failWork) {
  const int L = topo_.localSize;
  if (L > 1 && intra_ == nullptr) {
    throwCommError("fastcomm: " + ctx.describe() +
                   ": the multi-node CUDA path of this group was aborted");
  }
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  const at::ScalarType dt = t.scalar_type();
  const int64_t esize = static_cast<int64_t>(t.element_size());
  const int64_t numel = t.numel();
  const int64_t S = (numel + L - 1) / L;  // shard elements
  at::Tensor flat = t.view({-1});
  at::Tensor buf = flat;
  if (S * L != numel) {
    // NCCL's in-place reduce-scatter needs L equal shards: pad.
    buf = at::empty({S * L}, t.options());
    buf.narrow(0, 0, numel).copy_(flat);
    buf.narrow(0, numel, S * L - numel).zero_();
  }
  char* base = static_cast<char*>(buf.data_ptr());
  char* shard = base + topo_.localRank * S * esize;
  if (L > 1) {
    ncclCheck(ncclReduceScatter(base, shard, S, ncclType(dt), ncclRedOp(op, dt, NcclAvg::AsSum),
                                intra_, s),
              intra_, ctx.name);
  }
  res_->stream = res_->active = s;
  rail_->allreduce(shard, S, dt, op, ctx, std::move(failWork));
  if (L > 1) {
    ncclCheck(ncclAllGather(shard, base, S, ncclType(dt), intra_, s), intra_, ctx.name);
  }
  if (!buf.is_same(flat)) flat.copy_(buf.narrow(0, 0, numel));
}

// ----------------------------------------------------------------------------- failures

void CudaHier::abortComms(const std::string& why, ncclComm_t flat) {
  // The rail first: from now on its proxy keeps releasing every device wait.
  // The aborts below wait for the device while they free, and the comm
  // stream holds rail waits between the node communicator's reduce-scatter
  // and all-gather; released, the stream runs through.
  if (rail_) rail_->abort(why);
  // Kernels of either communicator may be stuck on a dead peer, each
  // blocking the other's abort: both at once (ncclAbortAll).
  ncclAbortAll({intra_, flat});
  intra_ = nullptr;
}

void CudaHier::shutdown(cudaStream_t stream, bool failed) {
  c10::cuda::CUDAGuard guard(device_);
  failed = failed || (rail_ && rail_->failed());
  // A CUDA graph holding one of these all_reduces replays on streams of its
  // own, which `stream` does not cover: a replay launched before the destroy
  // may not even have handed its op to the proxy yet.
  const bool graphs = rail_ && rail_->hasCaptured();
  bool drained = true;
  if (failed) {
    // The rail's proxy releases every wait; give the stream a bounded time.
    const auto until = Clock::now() + kDrainLimit;
    cudaError_t st;
    while ((st = cudaStreamQuery(stream)) == cudaErrorNotReady && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    drained = st != cudaErrorNotReady;
    (void)cudaGetLastError();  // a failed stream's sticky error is not ours to report
    // Replays cannot be waited for without risking a hang (a device-wide
    // synchronize would also wait for other groups' stuck kernels): one may
    // still use the staging and run its host node later.
    if (graphs) drained = false;
  } else if (graphs) {
    // Replays in flight finish (the proxy serves their ops), as queued
    // eager ones do below.
    C10_CUDA_CHECK_WARN(cudaDeviceSynchronize());
  } else {
    // Queued all_reduces finish (the proxy serves them), then the proxy stops.
    C10_CUDA_CHECK_WARN(cudaStreamSynchronize(stream));
  }
  if (rail_) rail_->stop(/*deviceMayRun=*/!drained);
  if (!drained) {
    res_->leak = true;
    FASTCOMM_LOG(Warn, (graphs ? "after a failure, CUDA graph replays holding this group's "
                                 "multi-node all_reduce cannot be waited for"
                               : "the comm stream did not drain within " +
                                     std::to_string(kDrainLimit.count()) + " s after a failure")
                           << "; the staging memory is not freed");
  }
  rail_.reset();
  res_.reset();
  if (intra_ != nullptr) {
    if (failed) {
      ncclCommAbort(intra_);
    } else {
      ncclRelease(intra_);  // its stream drained above
    }
    intra_ = nullptr;
  }
}

}  // namespace fastcomm
