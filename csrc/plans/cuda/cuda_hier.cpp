#include "plans/cuda/cuda_hier.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <sys/prctl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "backend/cuda/nccl_utils.hpp"
#include "common/logging.hpp"
#include "common/timeline.hpp"
#include "plans/cuda/kernels/hier_kernels.hpp"

namespace fastcomm {
namespace {

// Chunk slots of pinned staging (and flags) in flight.
constexpr int64_t kWindow = 6;
// The all-gather copies of chunk k are issued after the reduction of chunk
// k + kLag, so the stream does not sit waiting for the network of a chunk
// it just reduced while later chunks' data already arrived.
constexpr int64_t kLag = 2;
static_assert(kLag < kWindow, "the schedule needs kLag < kWindow");
// Without progress for this long, the proxy sleeps between polls.
constexpr auto kSpin = std::chrono::microseconds(100);
constexpr auto kNap = std::chrono::microseconds(20);
// After a failure: how often the proxy releases every GPU wait, and how long
// shutdown waits for the comm stream to drain before leaking the pinned
// memory rather than freeing it under the copy engines.
constexpr auto kDrainPeriod = std::chrono::microseconds(200);
constexpr auto kDrainLimit = std::chrono::seconds(10);
// How long an error waits for a failed peer's published reason.
constexpr auto kReasonWait = std::chrono::seconds(2);

constexpr const char* kThread = "fc-cuda-proxy";

// Flags, one 64-byte line each. Host -> GPU (the stream waits for 1, then
// resets to 0): a slot's staging is free again, a chunk's reduce-scatter
// pieces arrived, its all-gather pieces arrived. GPU -> host (the stream
// writes 1, the proxy resets to 0): a chunk's send pieces are in pinned
// memory, its own piece is reduced and staged, its gathered pieces are in
// place.
enum FlagKind : int { kFree = 0, kRsIn, kAgIn, kPacked, kReduced, kGathered, kFlagKinds };
constexpr int64_t kFlagStride = 16;                  // uint32 words per flag
constexpr int64_t kSelfTest = kFlagKinds * kWindow;  // one spare flag for the probe

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

bool supportedDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
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

ncclRedOp_t ncclOpOf(RedOp op) {
  switch (op) {
    case RedOp::Product:
      return ncclProd;
    case RedOp::Min:
      return ncclMin;
    case RedOp::Max:
      return ncclMax;
    default:
      return ncclSum;  // Avg divides once, after the rail phase
  }
}

hierk::Wire wireOf(const std::string& name) {
  if (name == "bf16") return hierk::Wire::BF16;
  if (name == "fp16") return hierk::Wire::FP16;
  return hierk::Wire::None;
}

int64_t roundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

uint32_t loadFlag(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void storeFlag(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// True once every request of `reqs` completed (null: nothing to move, or
// done before); completed ones are dropped. Throws TransportError.
bool allDone(std::vector<std::unique_ptr<transport::Request>>& reqs) {
  bool all = true;
  for (auto& r : reqs) {
    if (!r) continue;
    if (r->test()) {
      r.reset();
    } else {
      all = false;
    }
  }
  return all;
}

void record(const char* name, int64_t chunk, Clock::time_point a, Clock::time_point b) {
  if (Timeline::enabled()) Timeline::record(name, kThread, chunk, a, b);
}

}  // namespace

// ----------------------------------------------------------------------------- resources

// Pinned staging, the flags and the driver's stream memory operations: what
// a rank needs locally before it can vote for the path.
struct CudaHier::Resources {
  PFN_cuStreamWaitValue32_v11070 waitValue = nullptr;
  PFN_cuStreamWriteValue32_v11070 writeValue = nullptr;
  uint32_t* flags = nullptr;  // mapped pinned
  CUdeviceptr flagsDev = 0;
  char* staging = nullptr;  // pinned
  int64_t stagingBytes = 0;
  int64_t pieceBytes = 0;  // one piece slot
  int64_t slotBytes = 0;   // one chunk slot: (3 (R-1) + 1) pieces
  bool leak = false;       // the GPU may still copy: never free

  uint32_t* flag(int kind, int64_t slot) const {
    return flags + (kind * kWindow + slot) * kFlagStride;
  }
  CUdeviceptr flagDev(int kind, int64_t slot) const {
    return flagsDev +
           static_cast<CUdeviceptr>((kind * kWindow + slot) * kFlagStride * sizeof(uint32_t));
  }

  static std::unique_ptr<Resources> make(int rails, int64_t chunkBytes) {
    auto r = std::make_unique<Resources>();
    cudaDriverEntryPointQueryResult q{};
    // Through the runtime, so fastcomm does not link libcuda itself; the
    // 12.0 ABI of both functions (their _v2 forms) is all we use.
    cudaCheck(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32",
                                               reinterpret_cast<void**>(&r->waitValue), 12000,
                                               cudaEnableDefault, &q),
              "cudaGetDriverEntryPointByVersion(cuStreamWaitValue32)");
    TORCH_CHECK(q == cudaDriverEntryPointSuccess && r->waitValue != nullptr,
                "the driver has no cuStreamWaitValue32");
    cudaCheck(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32",
                                               reinterpret_cast<void**>(&r->writeValue), 12000,
                                               cudaEnableDefault, &q),
              "cudaGetDriverEntryPointByVersion(cuStreamWriteValue32)");
    TORCH_CHECK(q == cudaDriverEntryPointSuccess && r->writeValue != nullptr,
                "the driver has no cuStreamWriteValue32");

    const int64_t flagBytes = (kSelfTest + 1) * kFlagStride * sizeof(uint32_t);
    cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&r->flags), flagBytes,
                            cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc (flags)");
    std::memset(r->flags, 0, flagBytes);
    void* dev = nullptr;
    cudaCheck(cudaHostGetDevicePointer(&dev, r->flags, 0), "cudaHostGetDevicePointer");
    r->flagsDev = reinterpret_cast<CUdeviceptr>(dev);
    for (int64_t w = 0; w < kWindow; ++w) storeFlag(r->flag(kFree, w), 1);

    r->pieceBytes = roundUp(HierLayout::pieceSlotBytes(rails, chunkBytes), 256);
    r->slotBytes = (3 * static_cast<int64_t>(rails - 1) + 1) * r->pieceBytes;
    r->stagingBytes = kWindow * r->slotBytes;
    cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&r->staging), r->stagingBytes,
                            cudaHostAllocPortable),
              "cudaHostAlloc (staging)");

    // Probe the stream memory operations on host memory once, on a stream
    // of our own: some drivers or platforms refuse them.
    cudaStream_t s = nullptr;
    cudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::string problem;
    try {
      const CUdeviceptr probe =
          r->flagsDev + static_cast<CUdeviceptr>(kSelfTest * kFlagStride * sizeof(uint32_t));
      cuCheck(r->writeValue(s, probe, 1, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32");
      cuCheck(r->waitValue(s, probe, 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32");
      cuCheck(r->writeValue(s, probe, 2, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32");
      cudaCheck(cudaStreamSynchronize(s), "stream memory operation probe");
      if (loadFlag(r->flags + kSelfTest * kFlagStride) != 2) {
        problem = "the stream memory operation probe did not write host memory";
      }
    } catch (const std::exception& e) {
      problem = e.what();
    }
    cudaStreamDestroy(s);
    if (!problem.empty()) throw std::runtime_error(problem);
    return r;
  }

  ~Resources() {
    if (leak) return;
    if (staging != nullptr) cudaFreeHost(staging);
    if (flags != nullptr) cudaFreeHost(flags);
  }
};

struct CudaHier::ChunkState {
  std::vector<std::unique_ptr<transport::Request>> rsRecv, agRecv, rsSend, agSend;
  int rsRecvPosted = 0, agRecvPosted = 0, rsSendPosted = 0, agSendPosted = 0;
  bool packed = false, rsArrived = false, reduced = false, agArrived = false, gathered = false,
       freed = false;
  // When the proxy saw each step (FASTCOMM_TIMELINE).
  Clock::time_point tRecvPosted{}, tPacked{}, tRsArrived{}, tReduced{}, tAgArrived{}, tFreed{};
  explicit ChunkState(int peers) : rsRecv(peers), agRecv(peers), rsSend(peers), agSend(peers) {}
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
    res = Resources::make(topo.numNodes(), plan.cudaChunkBytes);
  } catch (const std::exception& e) {
    problem = e.what();
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
  std::unique_ptr<CudaHier> h(
      new CudaHier(store, topo, plan, cfg, device, timeout, std::move(hooks), std::move(res)));
  h->connect(ctx);
  h->proxy_ = std::thread([p = h.get()] { p->proxyLoop(); });
  if (topo.rank == 0) FASTCOMM_LOG(Info, h->describe());
  return h;
}

CudaHier::CudaHier(const c10::intrusive_ptr<c10d::Store>& store, const Topology& topo,
                   const InterPlan& plan, const Config& cfg, at::Device device,
                   std::chrono::milliseconds timeout, Hooks hooks, std::unique_ptr<Resources> res)
    : store_(store),
      topo_(topo),
      plan_(plan),
      cfg_(cfg),
      device_(device),
      timeout_(timeout),
      hooks_(std::move(hooks)),
      res_(std::move(res)),
      nodes_(topo.numNodes()),
      local_(topo.localSize),
      me_(topo.myNode),
      localRank_(topo.localRank) {
  for (int j = 0; j < nodes_ - 1; ++j)
    railPeers_.push_back(topo_.nodeRanks[peerNode(j, me_)][localRank_]);
}

void CudaHier::connect(const OpContext& ctx) {
  if (local_ > 1) {
    intra_ =
        ncclCommFromStore(store_, "fastcomm/cuda_hier/node" + std::to_string(me_) + "/", local_,
                          localRank_, topo_.nodeRanks[me_], topo_.rank, ctx.remaining(),
                          "NCCL intra-node communicator setup (all_reduce across nodes)");
  }
  // The reduce-scatter and all-gather messages of a chunk travel on
  // separate connections, each in chunk order, so the two phases never have
  // to agree on one interleaving.
  rsNet_ = transport::createTransport(plan_.transport, cfg_);
  agNet_ = transport::createTransport(plan_.transport, cfg_);
  rsConns_ =
      rsNet_->connect(c10::make_intrusive<c10d::PrefixStore>("fastcomm/cuda_hier/rs", store_),
                      topo_.rank, topo_.size, railPeers_, ctx);
  agConns_ =
      agNet_->connect(c10::make_intrusive<c10d::PrefixStore>("fastcomm/cuda_hier/ag", store_),
                      topo_.rank, topo_.size, railPeers_, ctx);
  rsMr_ = rsNet_->registerMemory(res_->staging, res_->stagingBytes);
  agMr_ = agNet_->registerMemory(res_->staging, res_->stagingBytes);
}

CudaHier::~CudaHier() {
  // shutdown() normally ran already; this only covers a setup that threw.
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (proxy_.joinable()) proxy_.join();
  if (aborter_.joinable()) aborter_.join();
  if (rsNet_) rsNet_->close();
  if (agNet_) agNet_->close();
  if (intra_ != nullptr) ncclCommAbort(intra_);
}

std::string CudaHier::describe() const {
  std::ostringstream os;
  os << "CUDA all_reduce across nodes (from " << plan_.cudaHierMinBytes << " B, "
     << "SUM/AVG/PRODUCT/MIN/MAX on float and integer types): "
     << (local_ > 1 ? "NCCL reduce-scatter in the node, " : "") << nodes_ - 1
     << " rail peer(s) per rank over " << rsNet_->name()
     << " through pinned staging, pipelined in chunks of " << plan_.cudaChunkBytes << " B (window "
     << kWindow << "), reduction on the GPU"
     << (plan_.wireDtype != "none" ? ", float32 sums as " + plan_.wireDtype + " on the wire" : "")
     << (local_ > 1 ? ", NCCL all-gather in the node" : "") << "; " << (res_->stagingBytes >> 20)
     << " MiB pinned staging per rank";
  return os.str();
}

// ----------------------------------------------------------------------------- GPU side

char* CudaHier::sendSlot(int64_t slot, int j) const {
  return res_->staging + slot * res_->slotBytes + j * res_->pieceBytes;
}
char* CudaHier::recvSlot(int64_t slot, int j) const {
  return res_->staging + slot * res_->slotBytes + (nodes_ - 1 + j) * res_->pieceBytes;
}
char* CudaHier::agSendSlot(int64_t slot) const {
  return res_->staging + slot * res_->slotBytes + 2 * (nodes_ - 1) * res_->pieceBytes;
}
char* CudaHier::agRecvSlot(int64_t slot, int j) const {
  return res_->staging + slot * res_->slotBytes + (2 * (nodes_ - 1) + 1 + j) * res_->pieceBytes;
}

void CudaHier::waitFlag(cudaStream_t s, int kind, int64_t slot) {
  // Wait for 1, then put the flag back to 0 for its next use: the same
  // values on every use, so a replayed sequence works as the first one did.
  cuCheck(res_->waitValue(s, res_->flagDev(kind, slot), 1, CU_STREAM_WAIT_VALUE_EQ),
          "cuStreamWaitValue32");
  cuCheck(res_->writeValue(s, res_->flagDev(kind, slot), 0, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue32");
}

void CudaHier::writeFlag(cudaStream_t s, int kind, int64_t slot, uint32_t value) {
  // The default flags fence the stream's earlier copies before the write, so
  // the proxy sees their data once it sees the flag.
  cuCheck(res_->writeValue(s, res_->flagDev(kind, slot), value, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue32");
}

void CudaHier::issueP(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize,
                      bool wire, char* dPack, cudaStream_t s) {
  waitFlag(s, kFree, slot);
  char* chunk = shard + l.chunkOff(k) * esize;
  if (wire) {
    hierk::pack(wireOf(plan_.wireDtype), reinterpret_cast<const float*>(chunk), dPack, l, k, me_,
                s);
  }
  const int64_t wsize = wire ? 2 : esize;
  for (int j = 0; j < nodes_ - 1; ++j) {
    const int p = peerNode(j, me_);
    const int64_t len = l.pieceLen(k, p);
    if (len == 0) continue;
    const char* src = wire ? dPack + j * l.qMax * wsize : chunk + l.pieceOff(k, p) * esize;
    cudaCheck(cudaMemcpyAsync(sendSlot(slot, j), src, len * wsize, cudaMemcpyDeviceToHost, s),
              "copy of send pieces to pinned memory");
  }
  writeFlag(s, kPacked, slot, 1);
}

void CudaHier::issueA(const HierLayout& l, int64_t k, int64_t slot, char* shard, at::ScalarType dt,
                      RedOp op, bool wire, char* dRecv, char* dOut, cudaStream_t s) {
  waitFlag(s, kRsIn, slot);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t wsize = wire ? 2 : esize;
  const int64_t len = l.pieceLen(k, me_);
  if (len > 0) {
    const int peers = nodes_ - 1;
    // Every peer sent its copy of this rank's piece: R-1 rows of equal length.
    cudaCheck(cudaMemcpy2DAsync(dRecv, l.qMax * wsize, recvSlot(slot, 0), res_->pieceBytes,
                                len * wsize, peers, cudaMemcpyHostToDevice, s),
              "copy of received pieces to the GPU");
    char* own = shard + (l.chunkOff(k) + l.pieceOff(k, me_)) * esize;
    hierk::reduce(elemOf(dt), kernelOp(op), wire ? wireOf(plan_.wireDtype) : hierk::Wire::None, own,
                  dRecv, l.qMax, peers, len, op == RedOp::Avg ? topo_.size : 0, dOut, s);
    cudaCheck(cudaMemcpyAsync(agSendSlot(slot), wire ? dOut : own, len * wsize,
                              cudaMemcpyDeviceToHost, s),
              "copy of the reduced piece to pinned memory");
  }
  writeFlag(s, kReduced, slot, 1);
}

void CudaHier::issueB(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize,
                      bool wire, char* dPack, cudaStream_t s) {
  waitFlag(s, kAgIn, slot);
  char* chunk = shard + l.chunkOff(k) * esize;
  const int64_t wsize = wire ? 2 : esize;
  bool any = false;
  for (int j = 0; j < nodes_ - 1; ++j) {
    const int p = peerNode(j, me_);
    const int64_t len = l.pieceLen(k, p);
    if (len == 0) continue;
    any = true;
    char* dst = wire ? dPack + j * l.qMax * wsize : chunk + l.pieceOff(k, p) * esize;
    cudaCheck(cudaMemcpyAsync(dst, agRecvSlot(slot, j), len * wsize, cudaMemcpyHostToDevice, s),
              "copy of gathered pieces to the GPU");
  }
  if (wire && any) {
    hierk::unpack(wireOf(plan_.wireDtype), dPack, reinterpret_cast<float*>(chunk), l, k, me_, s);
  }
  writeFlag(s, kGathered, slot, 1);
}

void CudaHier::allreduce(const at::Tensor& t, RedOp op, cudaStream_t s, const OpContext& ctx,
                         std::function<void(std::exception_ptr)> failWork) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load()) {
      throwCommError("fastcomm: " + ctx.describe() +
                     ": the multi-node CUDA path of this group failed earlier: " + abortWhy_);
    }
  }
  TORCH_CHECK(local_ == 1 || intra_ != nullptr,
              "fastcomm: internal: no intra-node communicator for ", ctx.describe());
  TORCH_INTERNAL_ASSERT(t.is_contiguous());
  const at::ScalarType dt = t.scalar_type();
  const int64_t esize = static_cast<int64_t>(t.element_size());
  const int64_t numel = t.numel();
  const int64_t S = (numel + local_ - 1) / local_;  // shard elements
  at::Tensor flat = t.view({-1});
  at::Tensor buf = flat;
  if (S * local_ != numel) {
    // NCCL's in-place reduce-scatter needs local_ equal shards: pad.
    buf = at::empty({S * local_}, t.options());
    buf.narrow(0, 0, numel).copy_(flat);
    buf.narrow(0, numel, S * local_ - numel).zero_();
  }
  char* base = static_cast<char*>(buf.data_ptr());
  char* shard = base + localRank_ * S * esize;
  if (local_ > 1) {
    ncclCheck(ncclReduceScatter(base, shard, S, ncclType(dt), ncclOpOf(op), intra_, s), intra_,
              ctx.name);
  }
  const bool wire =
      plan_.wireDtype != "none" && dt == at::kFloat && (op == RedOp::Sum || op == RedOp::Avg);
  const int64_t wsize = wire ? 2 : esize;
  const HierLayout l = HierLayout::make(S, nodes_, plan_.cudaChunkBytes, esize);
  const int peers = nodes_ - 1;
  // Device scratch from the caching allocator, on this stream: received
  // pieces, and for a 16-bit wire the packed casts and the rounded result.
  const int64_t recvBytes = roundUp(peers * l.qMax * wsize, 256);
  const int64_t packBytes = wire ? roundUp(peers * l.qMax * 2, 256) : 0;
  const int64_t outBytes = wire ? roundUp(l.qMax * 2, 256) : 0;
  at::Tensor scratch = at::empty({recvBytes + packBytes + outBytes}, t.options().dtype(at::kByte));
  char* dRecv = static_cast<char*>(scratch.data_ptr());
  char* dPack = dRecv + recvBytes;
  char* dOut = dPack + packBytes;

  Op desc;
  desc.name = ctx.name;
  desc.seq = ctx.seq;
  desc.timeout = ctx.timeout;
  desc.deadline = ctx.deadline;
  desc.layout = l;
  desc.firstChunk = nextChunk_;
  desc.esize = wsize;
  desc.failWork = std::move(failWork);
  const int64_t first = nextChunk_;
  nextChunk_ += l.chunks;
  {
    // First, so the proxy posts the receives while the GPU still reduces in
    // the node.
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(desc));
  }
  cv_.notify_one();

  // The schedule (see the header): P of the first kWindow chunks, then for
  // each chunk t its reduction A(t), the all-gather copies B(t - kLag) and
  // the send copies P of the chunk that reuses B's slot.
  const int64_t n = l.chunks;
  auto slotOf = [&](int64_t k) { return (first + k) % kWindow; };
  for (int64_t k = 0; k < std::min(kWindow, n); ++k)
    issueP(l, k, slotOf(k), shard, esize, wire, dPack, s);
  for (int64_t t2 = 0; t2 < n; ++t2) {
    issueA(l, t2, slotOf(t2), shard, dt, op, wire, dRecv, dOut, s);
    if (t2 >= kLag) {
      const int64_t b = t2 - kLag;
      issueB(l, b, slotOf(b), shard, esize, wire, dPack, s);
      if (b + kWindow < n)
        issueP(l, b + kWindow, slotOf(b + kWindow), shard, esize, wire, dPack, s);
    }
  }
  for (int64_t b = std::max<int64_t>(0, n - kLag); b < n; ++b)
    issueB(l, b, slotOf(b), shard, esize, wire, dPack, s);

  if (local_ > 1) {
    ncclCheck(ncclAllGather(shard, base, S, ncclType(dt), intra_, s), intra_, ctx.name);
  }
  if (!buf.is_same(flat)) flat.copy_(buf.narrow(0, 0, numel));
}

// ----------------------------------------------------------------------------- proxy

void CudaHier::proxyLoop() {
  // Precise short naps: the default 50 us timer slack would stretch every
  // poll interval.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (failed_.load()) {
        // Drain mode: fail what still comes in and keep every GPU wait
        // released, so the comm stream runs dry.
        std::deque<Op> late;
        late.swap(queue_);
        const bool stop = stop_;
        const std::string why = abortWhy_;
        lock.unlock();
        if (!late.empty()) {
          std::exception_ptr e;
          try {
            throwCommError("fastcomm: the multi-node CUDA path of this group failed earlier: " +
                           why);
          } catch (...) {
            e = std::current_exception();
          }
          for (auto& o : late)
            if (o.failWork) o.failWork(e);
        }
        releaseAllWaits();
        if (stop) return;
        lock.lock();
        cv_.wait_for(lock, kDrainPeriod, [&] { return stop_; });
        continue;
      }
      cv_.wait(lock, [&] { return stop_ || !queue_.empty() || failed_.load(); });
      if (failed_.load()) continue;
      if (queue_.empty()) return;  // stop_, and nothing left to serve
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      runOp(op);
    } catch (...) {
      failAll(std::current_exception(), &op);
    }
  }
}

void CudaHier::runOp(Op& op) {
  const HierLayout& l = op.layout;
  const int64_t n = l.chunks;
  const int peers = nodes_ - 1;
  const int64_t es = op.esize;
  std::vector<ChunkState> cs;
  cs.reserve(n);
  for (int64_t k = 0; k < n; ++k) cs.emplace_back(peers);
  auto slotOf = [&](int64_t k) { return (op.firstChunk + k) % kWindow; };
  // Cursors, each moving in chunk order: per connection, messages must be
  // posted in the order the peer posts the matching ones.
  int64_t rsRecvNext = 0, agRecvNext = 0, rsSendNext = 0, agSendNext = 0;
  int64_t packedNext = 0, rsArrNext = 0, reducedNext = 0, agArrNext = 0, gatheredNext = 0,
          freedNext = 0;
  const auto opStart = Clock::now();
  auto lastProgress = opStart;
  // The GPU may stage chunk k once its slot's previous chunk freed it.
  auto stageStart = [&](int64_t k) {
    return k < kWindow || cs[k - kWindow].tFreed == Clock::time_point{} ? opStart
                                                                        : cs[k - kWindow].tFreed;
  };
  try {
    while (gatheredNext < n || freedNext < n) {
      if (failed_.load()) {
        std::lock_guard<std::mutex> lock(mu_);
        throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                       ") failed on group rank " + std::to_string(topo_.rank) + ": " + abortWhy_);
      }
      bool progressed = false;
      // Receives, as soon as the slot's buffers are no longer read by the GPU.
      while (rsRecvNext < n && (rsRecvNext < kWindow || cs[rsRecvNext - kWindow].reduced)) {
        auto& c = cs[rsRecvNext];
        const int64_t w = slotOf(rsRecvNext), len = l.pieceLen(rsRecvNext, me_);
        for (; c.rsRecvPosted < peers; ++c.rsRecvPosted) {
          const int j = c.rsRecvPosted;
          if (len == 0) continue;
          auto r = rsConns_[j]->irecv(recvSlot(w, j), len * es, rsMr_.get());
          if (!r) break;  // the connection's request limit: later
          c.rsRecv[j] = std::move(r);
        }
        if (c.rsRecvPosted < peers) break;
        c.tRecvPosted = Clock::now();
        ++rsRecvNext;
        progressed = true;
      }
      while (agRecvNext < n && (agRecvNext < kWindow || cs[agRecvNext - kWindow].gathered)) {
        auto& c = cs[agRecvNext];
        const int64_t w = slotOf(agRecvNext);
        for (; c.agRecvPosted < peers; ++c.agRecvPosted) {
          const int j = c.agRecvPosted;
          const int64_t len = l.pieceLen(agRecvNext, peerNode(j, me_));
          if (len == 0) continue;
          auto r = agConns_[j]->irecv(agRecvSlot(w, j), len * es, agMr_.get());
          if (!r) break;
          c.agRecv[j] = std::move(r);
        }
        if (c.agRecvPosted < peers) break;
        ++agRecvNext;
        progressed = true;
      }
      // The GPU staged a chunk's send pieces: send them.
      while (packedNext < n && loadFlag(res_->flag(kPacked, slotOf(packedNext))) == 1) {
        storeFlag(res_->flag(kPacked, slotOf(packedNext)), 0);
        auto& c = cs[packedNext];
        c.packed = true;
        c.tPacked = Clock::now();
        record("d2h", packedNext, stageStart(packedNext), c.tPacked);
        ++packedNext;
        progressed = true;
      }
      while (rsSendNext < n && cs[rsSendNext].packed) {
        auto& c = cs[rsSendNext];
        const int64_t w = slotOf(rsSendNext);
        for (; c.rsSendPosted < peers; ++c.rsSendPosted) {
          const int j = c.rsSendPosted;
          const int64_t len = l.pieceLen(rsSendNext, peerNode(j, me_));
          if (len == 0) continue;
          auto r = rsConns_[j]->isend(sendSlot(w, j), len * es, rsMr_.get());
          if (!r) break;
          c.rsSend[j] = std::move(r);
        }
        if (c.rsSendPosted < peers) break;
        ++rsSendNext;
        progressed = true;
      }
      // Every peer's copy of this rank's piece arrived: let the GPU reduce.
      while (rsArrNext < n && rsArrNext < rsRecvNext && allDone(cs[rsArrNext].rsRecv)) {
        auto& c = cs[rsArrNext];
        c.rsArrived = true;
        c.tRsArrived = Clock::now();
        storeFlag(res_->flag(kRsIn, slotOf(rsArrNext)), 1);
        // From this rank's send (or, when the peer's pieces came first, its
        // receive) to the arrival of every peer's pieces.
        record("net", rsArrNext, c.tPacked == Clock::time_point{} ? c.tRecvPosted : c.tPacked,
               c.tRsArrived);
        ++rsArrNext;
        progressed = true;
      }
      while (reducedNext < n && cs[reducedNext].rsArrived &&
             loadFlag(res_->flag(kReduced, slotOf(reducedNext))) == 1) {
        storeFlag(res_->flag(kReduced, slotOf(reducedNext)), 0);
        auto& c = cs[reducedNext];
        c.reduced = true;
        c.tReduced = Clock::now();
        record("h2d+reduce", reducedNext, c.tRsArrived, c.tReduced);
        ++reducedNext;
        progressed = true;
      }
      while (agSendNext < n && cs[agSendNext].reduced) {
        auto& c = cs[agSendNext];
        const int64_t w = slotOf(agSendNext), len = l.pieceLen(agSendNext, me_);
        for (; c.agSendPosted < peers; ++c.agSendPosted) {
          const int j = c.agSendPosted;
          if (len == 0) continue;
          auto r = agConns_[j]->isend(agSendSlot(w), len * es, agMr_.get());
          if (!r) break;
          c.agSend[j] = std::move(r);
        }
        if (c.agSendPosted < peers) break;
        ++agSendNext;
        progressed = true;
      }
      while (agArrNext < n && agArrNext < agRecvNext && agArrNext < reducedNext &&
             allDone(cs[agArrNext].agRecv)) {
        auto& c = cs[agArrNext];
        c.agArrived = true;
        c.tAgArrived = Clock::now();
        storeFlag(res_->flag(kAgIn, slotOf(agArrNext)), 1);
        record("net (all-gather)", agArrNext, c.tReduced, c.tAgArrived);
        ++agArrNext;
        progressed = true;
      }
      while (gatheredNext < n && cs[gatheredNext].agArrived &&
             loadFlag(res_->flag(kGathered, slotOf(gatheredNext))) == 1) {
        storeFlag(res_->flag(kGathered, slotOf(gatheredNext)), 0);
        auto& c = cs[gatheredNext];
        c.gathered = true;
        record("h2d (all-gather)", gatheredNext, c.tAgArrived, Clock::now());
        ++gatheredNext;
        progressed = true;
      }
      // A chunk's sends are done: its slot may take the next chunk's pieces.
      while (freedNext < n && freedNext < rsSendNext && freedNext < agSendNext &&
             allDone(cs[freedNext].rsSend) && allDone(cs[freedNext].agSend)) {
        cs[freedNext].freed = true;
        cs[freedNext].tFreed = Clock::now();
        storeFlag(res_->flag(kFree, slotOf(freedNext)), 1);
        ++freedNext;
        progressed = true;
      }
      const auto now = Clock::now();
      if (progressed) {
        lastProgress = now;
        continue;
      }
      if (now >= op.deadline) {
        // Whom are we waiting for on the network? Nobody: our own GPU.
        std::vector<int> pending;
        auto unfinished = [](std::unique_ptr<transport::Request>& r) { return r && !r->test(); };
        for (int64_t k = std::min({rsArrNext, agArrNext, freedNext}); k < n; ++k) {
          auto& c = cs[k];
          for (int j = 0; j < peers; ++j) {
            if (unfinished(c.rsRecv[j]) || unfinished(c.agRecv[j]) || unfinished(c.rsSend[j]) ||
                unfinished(c.agSend[j])) {
              pending.push_back(railPeers_[j]);
            }
          }
        }
        std::sort(pending.begin(), pending.end());
        pending.erase(std::unique(pending.begin(), pending.end()), pending.end());
        if (pending.empty()) failGpu(op);
        failNetwork(op, pending);
      }
      if (now - lastProgress < kSpin) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(kNap);
      }
    }
  } catch (const transport::TransportError& e) {
    throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                   ") failed on group rank " + std::to_string(topo_.rank) +
                   ": inter-node transfer with group rank [" + std::to_string(e.peer()) +
                   "] failed (timeout " + std::to_string(op.timeout.count()) +
                   " ms not reached): " + e.what() + peerReason(e.peer()));
  }
}

void CudaHier::failNetwork(const Op& op, const std::vector<int>& pendingPeers) {
  std::string why;
  for (int p : pendingPeers) why += peerReason(p);
  std::string lagging = hooks_.laggingRanks ? hooks_.laggingRanks(op.seq) : std::string();
  throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                 ") failed on group rank " + std::to_string(topo_.rank) + ": timed out after " +
                 std::to_string(op.timeout.count()) + " ms (timeout) waiting for group rank(s) " +
                 formatRanks(pendingPeers) + " across the inter-node transport" + why +
                 (lagging.empty() ? std::string()
                                  : "; group rank(s) " + lagging +
                                        " stopped issuing collectives (heartbeats)"));
}

void CudaHier::failGpu(const Op& op) {
  std::string lagging = hooks_.laggingRanks ? hooks_.laggingRanks(op.seq) : std::string();
  throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                 ") failed on group rank " + std::to_string(topo_.rank) + ": timeout after " +
                 std::to_string(op.timeout.count()) +
                 " ms waiting for this rank's GPU to reach the inter-node phase (the intra-node "
                 "reduce-scatter or earlier work did not finish)" +
                 (lagging.empty() ? std::string() : "; waiting for group rank(s) " + lagging));
}

std::string CudaHier::peerReason(int peer) {
  // A peer that failed publishes why; it may be timing out right now.
  const auto until = Clock::now() + kReasonWait;
  const std::string key = "fastcomm/failed/" + std::to_string(peer);
  try {
    do {
      if (store_->check({key})) {
        auto v = store_->get(key);
        return " (group rank " + std::to_string(peer) +
               " failed too: " + std::string(v.begin(), v.end()) + ")";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (Clock::now() < until);
  } catch (...) {
    // The store may be gone with its host: nothing more to learn.
  }
  return "";
}

void CudaHier::publishReason(const std::string& why) {
  try {
    const std::string key = "fastcomm/failed/" + std::to_string(topo_.rank);
    if (!store_->check({key})) store_->set(key, std::vector<uint8_t>(why.begin(), why.end()));
  } catch (...) {
    // The store may be gone with the failed rank.
  }
}

void CudaHier::failAll(std::exception_ptr e, Op* current) {
  std::string why = "unknown error";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    why = ex.what();
  } catch (...) {
  }
  std::deque<Op> queued;
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = !failed_.load();
    failed_.store(true);
    if (abortWhy_.empty()) abortWhy_ = why;
    queued.swap(queue_);
  }
  // The works fail before the GPU is released: a waiter that sees the end
  // event fire must already see the error.
  if (current != nullptr && current->failWork) current->failWork(e);
  for (auto& o : queued)
    if (o.failWork) o.failWork(e);
  releaseAllWaits();
  if (!aborter_.joinable()) {
    // Aborting the group takes its issue lock, which a caller may hold while
    // a launch waits for stream space, i.e. for this thread to keep releasing
    // waits: another thread does it (and tells the peers why) meanwhile.
    aborter_ = std::thread([this, why, first] {
      publishReason(why);
      if (first && hooks_.abortGroup) hooks_.abortGroup(why);
    });
  }
  FASTCOMM_LOG(Warn, why);
}

void CudaHier::releaseAllWaits() {
  for (int64_t w = 0; w < kWindow; ++w)
    for (int kind : {kFree, kRsIn, kAgIn}) storeFlag(res_->flag(kind, w), 1);
}

void CudaHier::abortComms(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (abortWhy_.empty()) abortWhy_ = why;
    failed_.store(true);
  }
  cv_.notify_all();
  // Kernels of the node's communicator stuck on a dead peer return.
  if (intra_ != nullptr) {
    ncclCommAbort(intra_);
    intra_ = nullptr;
  }
  // Requests in flight fail at once; peers see their connections close.
  if (rsNet_) rsNet_->close();
  if (agNet_) agNet_->close();
}

void CudaHier::shutdown(cudaStream_t stream, bool failed) {
  c10::cuda::CUDAGuard guard(device_);
  bool drained = true;
  if (failed || failed_.load()) {
    // The proxy releases every wait; give the stream a bounded time.
    const auto until = Clock::now() + kDrainLimit;
    cudaError_t st;
    while ((st = cudaStreamQuery(stream)) == cudaErrorNotReady && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    drained = st != cudaErrorNotReady;
    (void)cudaGetLastError();  // a sticky error of the failed stream is not ours to report
  } else {
    // Queued all_reduces finish (the proxy serves them), then the proxy stops.
    C10_CUDA_CHECK_WARN(cudaStreamSynchronize(stream));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (proxy_.joinable()) proxy_.join();
  if (aborter_.joinable()) aborter_.join();
  // No request may touch the staging once it is freed.
  if (rsNet_) rsNet_->close();
  if (agNet_) agNet_->close();
  rsConns_.clear();
  agConns_.clear();
  if (!drained) {
    res_->leak = true;
    FASTCOMM_LOG(Warn, "the comm stream did not drain within "
                           << kDrainLimit.count()
                           << " s after a failure; its pinned staging memory is not freed");
  }
  res_.reset();
  if (intra_ != nullptr) {
    if (failed || failed_.load()) {
      ncclCommAbort(intra_);
    } else {
      ncclCommDestroy(intra_);
    }
    intra_ = nullptr;
  }
}

}  // namespace fastcomm
