#include "backend/process_group.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstring>
#include <future>
#include <numeric>

#include "common/logging.hpp"
#include "common/reduce.hpp"
#include "common/store_util.hpp"
#include "common/timeline.hpp"

#ifdef FASTCOMM_WITH_CUDA
#include "backend/cuda/cuda_collectives.hpp"
#include "backend/cuda/host_staging.hpp"
#endif

namespace fastcomm {

namespace {

// Names as torch.distributed spells the collectives (stats keys, errors) and
// the profiler range of each.
#define FASTCOMM_OP(ident, text)      \
  constexpr const char* ident = text; \
  constexpr const char* ident##Title = "fastcomm:" text;
FASTCOMM_OP(kBroadcast, "broadcast")
FASTCOMM_OP(kAllReduce, "all_reduce")
FASTCOMM_OP(kAllReduceCoalesced, "all_reduce_coalesced")
FASTCOMM_OP(kReduce, "reduce")
FASTCOMM_OP(kAllGather, "all_gather")
FASTCOMM_OP(kAllGatherInto, "all_gather_into_tensor")
FASTCOMM_OP(kAllGatherIntoCoalesced, "all_gather_into_tensor_coalesced")
FASTCOMM_OP(kGather, "gather")
FASTCOMM_OP(kScatter, "scatter")
FASTCOMM_OP(kReduceScatter, "reduce_scatter")
FASTCOMM_OP(kReduceScatterTensor, "reduce_scatter_tensor")
FASTCOMM_OP(kReduceScatterCoalesced, "reduce_scatter_tensor_coalesced")
FASTCOMM_OP(kAllToAllSingle, "all_to_all_single")
FASTCOMM_OP(kAllToAll, "all_to_all")
FASTCOMM_OP(kSend, "send")
FASTCOMM_OP(kRecv, "recv")
FASTCOMM_OP(kRecvAny, "recv_anysource")
FASTCOMM_OP(kBarrier, "barrier")
FASTCOMM_OP(kCoalesced, "coalesced")
#undef FASTCOMM_OP
// stats() key counting the CUDA collectives staged through host memory
// (FASTCOMM_CUDA_INTER=host); each is also counted under its own name.
constexpr const char* kCudaViaHost = "cuda_via_host";

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "fastcomm: ", op, ": undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "fastcomm: ", op, " supports dense tensors only, got ",
              t.layout());
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "fastcomm: ", op,
              " supports CPU and CUDA tensors, got ", t.device());
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "fastcomm: ", op, " takes exactly one tensor per rank, got ",
              tensors.size());
  checkTensor(tensors[0], op);
  return tensors[0];
}

void checkSameKind(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* what) {
  checkTensor(t, op);
  TORCH_CHECK(t.device() == ref.device(), "fastcomm: ", op, ": ", what, " is on ", t.device(),
              " but the input is on ", ref.device(), "; all tensors of a call must share a device");
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "fastcomm: ", op, ": ", what, " has dtype ",
              t.scalar_type(), " but the input has ", ref.scalar_type());
}

// Complex tensors reduce as pairs of reals where that is exact (SUM, AVG).
at::Tensor realView(const at::Tensor& t, const c10d::ReduceOp& op, const char* name) {
  if (!t.is_complex()) return t;
  TORCH_CHECK(c10d::isComplexViewAsRealAllowed(op), "fastcomm: ", name,
              " supports complex tensors only with SUM and AVG");
  return at::view_as_real(t);
}

// A contiguous tensor to run on: `t` itself, or a copy written back by
// `finish()` after the collective.
struct Contig {
  at::Tensor orig, work;
  explicit Contig(const at::Tensor& t) : orig(t), work(t.is_contiguous() ? t : t.contiguous()) {}
  void finish() const {
    if (!work.is_same(orig)) orig.copy_(work);
  }
};

// The tensors back to back in one new contiguous 1-D tensor.
at::Tensor catFlat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flats;
  for (const auto& t : tensors) flats.push_back(t.reshape({-1}));
  return at::cat(flats);
}

OpSignature signature(const char* name, const at::Tensor& t, int root = -1, int redop = -1,
                      int64_t aux = 0) {
  OpSignature s;
  std::strncpy(s.name, name, sizeof(s.name) - 1);
  s.dtype = t.defined() ? static_cast<int32_t>(t.scalar_type()) : -1;
  s.numel = t.defined() ? t.numel() : 0;
  s.root = root;
  s.redop = redop;
  s.aux = aux;
  return s;
}

// torch reuses group names (and, with env://, the store) after a destroy and
// re-init, so every key of one initialisation lives under its own epoch:
// each rank takes a ticket, and the size tickets of one init share an epoch.
c10::intrusive_ptr<c10d::Store> epochStore(const c10::intrusive_ptr<c10d::Store>& store, int size) {
  const int64_t ticket = store->add("fastcomm/init_tickets", 1);
  const int64_t epoch = (ticket - 1) / size;
  return c10::make_intrusive<c10d::PrefixStore>("fastcomm/" + std::to_string(epoch), store);
}

}  // namespace

ProcessGroupFastComm::ProcessGroupFastComm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout,
                                           std::vector<uint64_t> globalRanks, std::string groupName)
    : Backend(rank, size),
      store_(epochStore(store, size)),
      timeout_(timeout),
      globalRanks_(std::move(globalRanks)),
      groupName_(std::move(groupName)),
      cfg_(Config::fromEnv()),
      options_(c10::make_intrusive<Options>("fastcomm", timeout)) {
  options_->global_ranks_in_group = globalRanks_;
  options_->group_name = groupName_;
  if (cfg_.crashBacktrace) installCrashBacktrace();
  if (cfg_.timeline) Timeline::setEnabled(true);
  // The agreed settings ride along with the host ids: group rank 0's hold.
  std::vector<std::string> settings;
  topo_ = Topology::exchange(store_, rank, size, localHostId(cfg_), timeout_,
                             cfg_.encodeAgreed(), &settings);
  const std::string differ = cfg_.adoptAgreed(settings[0]);
  if (!differ.empty()) {
    FASTCOMM_LOG(Warn, "group '" << groupName_ << "', group rank " << rank
                                 << ": settings that must agree across the group follow group "
                                    "rank 0: "
                                 << differ);
  }
  if (topo_.numNodes() > 1 && cfg_.transport == "ib") {
    // Forced ib without a device fails here, at init, not at the first collective.
    std::string why;
    if (!transport::transportUsable("ib", cfg_, &why)) {
      throw std::runtime_error("fastcomm: FASTCOMM_TRANSPORT=ib, but group rank " +
                               std::to_string(rank) + " has no usable RDMA device: " + why +
                               " (FASTCOMM_TRANSPORT=auto falls back to tcp)");
    }
  }
#ifdef FASTCOMM_WITH_CUDA
  cudaThroughHost_ = topo_.numNodes() > 1 && cfg_.cudaInterHost;
#endif
  if (rank == 0) {
    FASTCOMM_LOG(
        Info,
        "group '" << groupName_ << "' of " << size << " ranks, timeout " << timeout_.count()
                  << " ms; " << topo_.describe() << "; CPU tensors: "
                  << (topo_.numNodes() > 1 ? "hierarchical (shared memory + "
                                             "transport)"
                                           : "shared memory")
                  << "; CUDA tensors: "
#ifdef FASTCOMM_WITH_CUDA
                  << (topo_.numNodes() == 1 ? "NCCL"
                      : cudaThroughHost_    ? "across nodes staged through host memory and run by "
                                              "the hierarchical host plan (FASTCOMM_CUDA_INTER=host), "
                                              "except all_reduce: NCCL, large ones staged over the "
                                              "transport"
                      : cfg_.cudaHier ? "NCCL; large all_reduces across nodes staged over the "
                                        "transport"
                                      : "NCCL")
#else
                  << "unsupported (CPU-only build)"
#endif
                  << "; config: " << cfg_.describe());
  }
  hostLane_ = std::make_unique<SerialLane>("fc-host");
}

ProcessGroupFastComm::~ProcessGroupFastComm() { shutdown(); }

void ProcessGroupFastComm::shutdown() {
  // Lanes finish what was queued (each job bounded by its timeout), then join.
  {
    std::lock_guard<std::mutex> lock(lanesMu_);
    p2pLanes_.clear();
  }
  hostLane_.reset();
#ifdef FASTCOMM_WITH_CUDA
  {
    std::lock_guard<std::mutex> lock(cudaMu_);
    if (cuda_) cuda_->shutdown();
    cuda_.reset();
  }
#endif
  host_.reset();
}

void ProcessGroupFastComm::abort() {
  try {
    throwCommError("fastcomm: process group aborted");
  } catch (...) {
    markBroken(std::current_exception());
  }
#ifdef FASTCOMM_WITH_CUDA
  std::lock_guard<std::mutex> lock(cudaMu_);
  if (cuda_) cuda_->abort();
#endif
}

void ProcessGroupFastComm::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  options_->timeout = timeout;
}

void ProcessGroupFastComm::checkUsable() const {
  std::lock_guard<std::mutex> lock(brokenMu_);
  if (broken_) {
    try {
      std::rethrow_exception(broken_);
    } catch (const std::exception& e) {
      throwCommError(std::string("fastcomm: this process group failed earlier and cannot be "
                                 "used any more (destroy and recreate it): ") +
                     e.what());
    }
  }
}

void ProcessGroupFastComm::markBroken(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(brokenMu_);
  if (!broken_) broken_ = std::move(error);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::remember(c10::intrusive_ptr<c10d::Work> work) {
  std::lock_guard<std::mutex> lock(coalesceMu_);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

HostComm& ProcessGroupFastComm::host(const OpContext& ctx) {
  if (!host_) {
    if (topo_.numNodes() > 1) {
      host_ = std::make_unique<HierComm>(store_, topo_, cfg_, ctx);
    } else {
      std::vector<int> members = topo_.nodeRanks[topo_.myNode];
      host_ =
          std::make_unique<ShmComm>(store_, "fastcomm/shm", members, topo_.localRank, cfg_, ctx);
    }
  }
  return *host_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::runHost(
    const char* name, const char* title, c10d::OpType type, const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs, int64_t bytes, const OpSignature& sig, HostBody body,
    std::shared_ptr<HostStaging> staging) {
  checkUsable();
#ifdef FASTCOMM_WITH_CUDA
  if (staging) {
    body = [staging, body = std::move(body)](HostComm& comm, const OpContext& ctx) {
      staging->waitForInputs(ctx);
      body(comm, ctx);
      staging->copyOutputsBack(ctx);
    };
  }
#else
  (void)staging;  // CUDA tensors are never staged without CUDA support
#endif
  const uint64_t seq = ++seq_;
  const auto ctx = OpContext::start(name, seq, timeout_);
  auto work = c10::make_intrusive<HostWork>(rank_, type, title, seq, inputs, std::move(outputs));
  stats_.addCall(name, static_cast<uint64_t>(bytes));
  hostLane_->submit([this, work, ctx, sig, body = std::move(body)] {
    try {
      checkUsable();
      HostComm& comm = host(ctx);
      if (cfg_.check) comm.checkSignatures(sig, ctx);
      const auto t0 = Clock::now();
      body(comm, ctx);
      stats_.addTime(ctx.name,
                     std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      work->complete();
    } catch (...) {
      auto error = std::current_exception();
      markBroken(error);
      work->fail(error);
    }
  });
  return remember(work);
}

SerialLane& ProcessGroupFastComm::p2pLane(int peer, bool sending) {
  std::lock_guard<std::mutex> lock(lanesMu_);
  auto& lane = p2pLanes_[{peer, sending}];
  if (!lane)
    lane = std::make_unique<SerialLane>((sending ? "fc-send" : "fc-recv") + std::to_string(peer));
  return *lane;
}

c10::intrusive_ptr<HostWork> ProcessGroupFastComm::runP2P(
    const char* name, const char* title, c10d::OpType type, SerialLane& lane,
    const at::Tensor& tensor, std::function<void(HostComm&, const OpContext&, HostWork&)> body,
    std::shared_ptr<HostStaging> staging) {
  checkUsable();
#ifdef FASTCOMM_WITH_CUDA
  if (staging) {
    body = [staging, body = std::move(body)](HostComm& comm, const OpContext& ctx, HostWork& work) {
      staging->waitForInputs(ctx);
      body(comm, ctx, work);
      staging->copyOutputsBack(ctx);
    };
  }
#else
  (void)staging;  // CUDA tensors are never staged without CUDA support
#endif
  const auto ctx = OpContext::start(name, ++p2pSeq_, timeout_);
  auto work =
      c10::make_intrusive<HostWork>(rank_, type, title, ctx.seq, std::vector<at::Tensor>{tensor},
                                    std::vector<at::Tensor>{tensor});
  stats_.addCall(name, static_cast<uint64_t>(nbytes(tensor)));
  // The host communicator (shm segment, transports) is created by the host
  // lane (a collective step); wait for it there so point-to-point lanes never
  // race its creation.
  if (!host_) {
    std::lock_guard<std::mutex> lock(hostInitMu_);
    if (!host_) {
      auto ready = std::make_shared<std::promise<void>>();
      auto done = ready->get_future();
      hostLane_->submit([this, ctx, ready] {
        try {
          host(ctx);
          ready->set_value();
        } catch (...) {
          ready->set_exception(std::current_exception());
        }
      });
      done.get();
    }
  }
  auto job = [this, work, ctx, body = std::move(body)] {
    try {
      checkUsable();
      const auto t0 = Clock::now();
      body(*host_, ctx, *work);
      stats_.addTime(ctx.name,
                     std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      work->complete();
    } catch (...) {
      auto error = std::current_exception();
      markBroken(error);
      work->fail(error);
    }
  };
  {
    std::lock_guard<std::mutex> lock(coalesceMu_);
    if (coalescing_) {
      coalescedJobs_.emplace_back(&lane, std::move(job));
      coalesced_.push_back(work);
      return work;
    }
  }
  lane.submit(std::move(job));
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::deferErrorInBlock(
    const std::function<c10::intrusive_ptr<c10d::Work>()>& op) {
  bool inBlock;
  {
    std::lock_guard<std::mutex> lock(coalesceMu_);
    inBlock = coalescing_;
  }
  if (!inBlock) return op();
  try {
    return op();
  } catch (...) {
    std::lock_guard<std::mutex> lock(coalesceMu_);
    if (!coalesceError_) coalesceError_ = std::current_exception();
    auto work = c10::make_intrusive<HostWork>(rank_, c10d::OpType::UNKNOWN, nullptr, 0,
                                              std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
    work->fail(coalesceError_);
    return work;
  }
}

CudaCollectives& ProcessGroupFastComm::cuda(const at::Tensor& sample, const char* op) {
#ifdef FASTCOMM_WITH_CUDA
  checkUsable();
  std::lock_guard<std::mutex> lock(cudaMu_);
  if (!cuda_) {
    // Creating the NCCL communicators, streams and events allocates and
    // synchronises, which would invalidate a capture on the current stream
    // (the user would then only see CUDA's "operation failed due to a
    // previous error during capture"). Refused before any CUDA call; every
    // rank captures alike, so all refuse.
    TORCH_CHECK(!CudaCollectives::currentStreamCapturing(sample.device()),
                "fastcomm: ", op ? op : "this collective",
                " is the first CUDA collective of this group, whose set-up (NCCL communicators, "
                "streams) cannot run during a CUDA graph capture: run one CUDA collective eagerly "
                "before capturing (as a warm-up iteration does), or pass device_id to "
                "init_process_group");
    try {
      cuda_ = std::make_unique<CudaCollectives>(store_, rank_, size_, timeout_, cfg_, stats_,
                                                sample.device(), topo_);
    } catch (const c10::DistBackendError& e) {
      if (op == nullptr) throw;
      throwCommError(std::string("fastcomm: ") + op + ": " + e.what());
    }
    std::lock_guard<std::mutex> coalesceLock(coalesceMu_);
    if (coalescing_) {  // the first CUDA op of the group came inside a block
      coalescingCuda_ = true;
      cuda_->startCoalescing();
    }
  }
  TORCH_CHECK(cuda_->device() == sample.device(), "fastcomm: this process group uses ",
              cuda_->device(), " but got a tensor on ", sample.device(),
              "; use one CUDA device per rank and group");
  return *cuda_;
#else
  TORCH_CHECK(false, "fastcomm was built without CUDA support, so it cannot run collectives on ",
              sample.device(), " tensors; reinstall it where torch has CUDA and nvcc is found");
#endif
}

std::shared_ptr<HostStaging> ProcessGroupFastComm::stageThroughHost(
    const char* op, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
#ifdef FASTCOMM_WITH_CUDA
  const at::Tensor& sample = inputs.empty() ? outputs.at(0) : inputs[0];
  if (!cudaThroughHost_ || !sample.is_cuda()) return nullptr;
  checkUsable();
  auto staging = HostStaging::begin(op, inputs, outputs);
  int64_t bytes = 0;
  for (const auto& t : inputs) bytes += nbytes(t);
  stats_.addCall(kCudaViaHost, static_cast<uint64_t>(bytes));
  return staging;
#else
  (void)op, (void)inputs, (void)outputs;
  return nullptr;
#endif
}

// Host mirror of `t` when the collective is staged through host memory.
static at::Tensor onHost(const std::shared_ptr<HostStaging>& staging, const at::Tensor& t) {
#ifdef FASTCOMM_WITH_CUDA
  if (staging) return staging->host(t);
#else
  (void)staging;
#endif
  return t;
}

static std::vector<at::Tensor> onHost(const std::shared_ptr<HostStaging>& staging,
                                      const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(onHost(staging, t));
  return out;
}

void ProcessGroupFastComm::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda()) cuda(at::empty({0}, at::TensorOptions().device(device)));
}

// ---- collectives ---------------------------------------------------------------

#ifdef FASTCOMM_WITH_CUDA
// A synchronous call (async_op=False) runs on the caller's stream, as
// ProcessGroupNCCL does: no cross-stream event pair on the critical path.
#define FASTCOMM_CUDA_INFO(op, bytes, opts) \
  CudaOpInfo { op, op##Title, c10d::OpType::UNKNOWN, ++seq_, timeout_, bytes, !(opts).asyncOp }
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, kBroadcast);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "fastcomm: broadcast: invalid root ",
              opts.rootRank, " for a group of ", size_);
  TORCH_CHECK(opts.rootTensor == 0, "fastcomm: broadcast: rootTensor must be 0");
  auto staging = stageThroughHost(kBroadcast, tensors, tensors);
  if (t.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kBroadcast, nbytes(t), opts);
    info.type = c10d::OpType::BROADCAST;
    return remember(cuda(t, info.name).broadcast(t, opts.rootRank, info));
#else
    cuda(t);
#endif
  }
  Contig c(onHost(staging, t));
  const int root = opts.rootRank;
  return runHost(
      kBroadcast, kBroadcastTitle, c10d::OpType::BROADCAST, tensors, tensors, nbytes(t),
      signature(kBroadcast, t, root),
      [c, root](HostComm& comm, const OpContext& ctx) {
        comm.broadcast(c.work.data_ptr(), nbytes(c.work), root, ctx);
        c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, kAllReduce);
  at::Tensor real = realView(t, opts.reduceOp, kAllReduce);
  const RedOp op = toRedOp(opts.reduceOp, real.scalar_type(), kAllReduce);
  if (t.is_cuda()) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kAllReduce, nbytes(t), opts);
    info.type = c10d::OpType::ALLREDUCE;
    return remember(cuda(t, info.name).allreduce({real}, op, info));
#else
    cuda(t);
#endif
  }
  Contig c(real);
  return runHost(kAllReduce, kAllReduceTitle, c10d::OpType::ALLREDUCE, tensors, tensors, nbytes(t),
                 signature(kAllReduce, real, -1, static_cast<int>(op)),
                 [c, op](HostComm& comm, const OpContext& ctx) {
                   comm.allreduce(c.work.data_ptr(), c.work.numel(), c.work.scalar_type(), op, ctx);
                   c.finish();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "fastcomm: all_reduce_coalesced needs at least one tensor");
  std::vector<at::Tensor> reals;
  for (const auto& t : tensors) {
    checkSameKind(tensors[0], t, kAllReduceCoalesced, "a tensor");
    reals.push_back(realView(t, opts.reduceOp, kAllReduceCoalesced));
  }
  const RedOp op = toRedOp(opts.reduceOp, reals[0].scalar_type(), kAllReduceCoalesced);
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += nbytes(t);
  if (tensors[0].is_cuda()) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kAllReduceCoalesced, bytes, opts);
    info.type = c10d::OpType::ALLREDUCE_COALESCED;
    return remember(cuda(tensors[0], info.name).allreduce(reals, op, info));
#else
    cuda(tensors[0]);
#endif
  }
  // One flat buffer: one pipelined all-reduce instead of one per tensor.
  at::Tensor flat = catFlat(reals);
  return runHost(kAllReduceCoalesced, kAllReduceCoalescedTitle, c10d::OpType::ALLREDUCE_COALESCED,
                 tensors, tensors, bytes,
                 signature(kAllReduceCoalesced, flat, -1, static_cast<int>(op)),
                 [flat, reals, op](HostComm& comm, const OpContext& ctx) {
                   comm.allreduce(flat.data_ptr(), flat.numel(), flat.scalar_type(), op, ctx);
                   int64_t off = 0;
                   for (const auto& r : reals) {
                     r.copy_(flat.narrow(0, off, r.numel()).view(r.sizes()));
                     off += r.numel();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors, kReduce);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "fastcomm: reduce: invalid root ",
              opts.rootRank, " for a group of ", size_);
  TORCH_CHECK(opts.rootTensor == 0, "fastcomm: reduce: rootTensor must be 0");
  at::Tensor real = realView(t, opts.reduceOp, kReduce);
  const RedOp op = toRedOp(opts.reduceOp, real.scalar_type(), kReduce);
  const int root = static_cast<int>(opts.rootRank);
  // Only the root's tensor is written back (NCCL leaves the others unchanged).
  auto staging =
      stageThroughHost(kReduce, tensors, rank_ == root ? tensors : std::vector<at::Tensor>{});
  if (t.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kReduce, nbytes(t), opts);
    info.type = c10d::OpType::REDUCE;
    return remember(cuda(t, info.name).reduce(real, op, root, info));
#else
    cuda(t);
#endif
  }
  Contig c(staging ? realView(onHost(staging, t), opts.reduceOp, kReduce) : real);
  return runHost(
      kReduce, kReduceTitle, c10d::OpType::REDUCE, tensors, tensors, nbytes(t),
      signature(kReduce, real, root, static_cast<int>(op)),
      [c, op, root](HostComm& comm, const OpContext& ctx) {
        comm.reduce(c.work.data_ptr(), c.work.numel(), c.work.scalar_type(), op, root, ctx);
        if (comm.index() == root) c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, kAllGather);
  TORCH_CHECK(outputs.size() == 1, "fastcomm: all_gather takes one output list, got ",
              outputs.size());
  auto& outs = outputs[0];
  TORCH_CHECK(static_cast<int>(outs.size()) == size_, "fastcomm: all_gather: the output list has ",
              outs.size(), " tensors but the group has ", size_, " ranks");
  for (const auto& o : outs) {
    checkSameKind(in, o, kAllGather, "an output tensor");
    TORCH_CHECK(o.numel() == in.numel(),
                "fastcomm: all_gather: output tensors must have the "
                "input's ",
                in.numel(), " elements, got ", o.numel());
  }
  auto staging = stageThroughHost(kAllGather, inputs, outs);
  if (in.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kAllGather, nbytes(in), opts);
    info.type = c10d::OpType::ALLGATHER;
    return remember(cuda(in, info.name).allgather(outs, in, info));
#else
    cuda(in);
#endif
  }
  at::Tensor src = onHost(staging, in).contiguous();
  at::Tensor flat = at::empty({size_, in.numel()}, src.options());
  return runHost(
      kAllGather, kAllGatherTitle, c10d::OpType::ALLGATHER, inputs, outs, nbytes(in),
      signature(kAllGather, in),
      [src, flat, hostOuts = onHost(staging, outs)](HostComm& comm, const OpContext& ctx) {
        comm.allgather(src.data_ptr(), flat.data_ptr(), nbytes(src), ctx);
        for (size_t i = 0; i < hostOuts.size(); ++i)
          hostOuts[i].copy_(flat[static_cast<int64_t>(i)].view(hostOuts[i].sizes()));
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  checkTensor(input, kAllGatherInto);
  checkSameKind(input, output, kAllGatherInto, "the output");
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "fastcomm: all_gather_into_tensor: output "
              "has ",
              output.numel(), " elements but must have world_size (", size_, ") x input (",
              input.numel(), ")");
  auto staging = stageThroughHost(kAllGatherInto, {input}, {output});
  if (input.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kAllGatherInto, nbytes(input), opts);
    info.type = c10d::OpType::_ALLGATHER_BASE;
    return remember(cuda(input, info.name).allgather({output}, input, info));
#else
    cuda(input);
#endif
  }
  at::Tensor src = onHost(staging, input).contiguous();
  Contig c(onHost(staging, output));
  return runHost(
      kAllGatherInto, kAllGatherIntoTitle, c10d::OpType::_ALLGATHER_BASE, {input}, {output},
      nbytes(input), signature(kAllGatherInto, input),
      [src, c](HostComm& comm, const OpContext& ctx) {
        comm.allgather(src.data_ptr(), c.work.data_ptr(), nbytes(src), ctx);
        c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "fastcomm: all_gather_into_tensor_coalesced needs as many outputs as inputs (got ",
              outputs.size(), " and ", inputs.size(), ")");
  int64_t bytes = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], kAllGatherIntoCoalesced);
    checkSameKind(inputs[0], inputs[i], kAllGatherIntoCoalesced, "an input");
    checkSameKind(inputs[i], outputs[i], kAllGatherIntoCoalesced, "an output");
    TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * size_,
                "fastcomm: all_gather_into_tensor_coalesced: output ", i,
                " must have world_size x "
                "input elements");
    bytes += nbytes(inputs[i]);
  }
  auto staging = stageThroughHost(kAllGatherIntoCoalesced, inputs, outputs);
  if (inputs[0].is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto& cc = cuda(inputs[0]);
    auto info = FASTCOMM_CUDA_INFO(kAllGatherIntoCoalesced, bytes, opts);
    info.type = c10d::OpType::COALESCED;
    cc.startCoalescing();
    for (size_t i = 0; i < inputs.size(); ++i) cc.allgather({outputs[i]}, inputs[i], info);
    return remember(cc.endCoalescing(info));
#else
    cuda(inputs[0]);
#endif
  }
  std::vector<at::Tensor> srcs;
  std::vector<Contig> dsts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    srcs.push_back(onHost(staging, inputs[i]).contiguous());
    dsts.emplace_back(onHost(staging, outputs[i]));
  }
  return runHost(
      kAllGatherIntoCoalesced, kAllGatherIntoCoalescedTitle, c10d::OpType::COALESCED, inputs,
      outputs, bytes,
      signature(kAllGatherIntoCoalesced, inputs[0], -1, -1, static_cast<int64_t>(inputs.size())),
      [srcs, dsts](HostComm& comm, const OpContext& ctx) {
        for (size_t i = 0; i < srcs.size(); ++i) {
          comm.allgather(srcs[i].data_ptr(), dsts[i].work.data_ptr(), nbytes(srcs[i]), ctx);
          dsts[i].finish();
        }
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs, kGather);
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "fastcomm: gather: invalid root ", root,
              " for a group of ", size_);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                "fastcomm: gather: the root needs one output list of ", size_, " tensors");
    outs = outputs[0];
    for (const auto& o : outs) {
      checkSameKind(in, o, kGather, "an output tensor");
      TORCH_CHECK(o.numel() == in.numel(),
                  "fastcomm: gather: output tensors must have the "
                  "input's ",
                  in.numel(), " elements, got ", o.numel());
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "fastcomm: gather: only the root may pass output tensors");
  }
  auto staging = stageThroughHost(kGather, inputs, outs);
  if (in.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kGather, nbytes(in), opts);
    info.type = c10d::OpType::GATHER;
    return remember(cuda(in, info.name).gather(outs, in, root, info));
#else
    cuda(in);
#endif
  }
  at::Tensor src = onHost(staging, in).contiguous();
  at::Tensor flat = rank_ == root ? at::empty({size_, in.numel()}, src.options()) : at::Tensor();
  return runHost(
      kGather, kGatherTitle, c10d::OpType::GATHER, inputs, outs, nbytes(in),
      signature(kGather, in, root),
      [src, flat, hostOuts = onHost(staging, outs), root](HostComm& comm, const OpContext& ctx) {
        comm.gather(src.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, nbytes(src), root,
                    ctx);
        for (size_t i = 0; i < hostOuts.size(); ++i)
          hostOuts[i].copy_(flat[static_cast<int64_t>(i)].view(hostOuts[i].sizes()));
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs, kScatter);
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "fastcomm: scatter: invalid root ", root,
              " for a group of ", size_);
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                "fastcomm: scatter: the root needs one input list of ", size_, " tensors");
    ins = inputs[0];
    for (const auto& i : ins) {
      checkSameKind(out, i, kScatter, "an input tensor");
      TORCH_CHECK(i.numel() == out.numel(),
                  "fastcomm: scatter: input tensors must have the "
                  "output's ",
                  out.numel(), " elements, got ", i.numel());
    }
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "fastcomm: scatter: only the root may pass input tensors");
  }
  auto staging = stageThroughHost(kScatter, ins, outputs);
  if (out.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kScatter, nbytes(out), opts);
    info.type = c10d::OpType::SCATTER;
    return remember(cuda(out, info.name).scatter(out, ins, root, info));
#else
    cuda(out);
#endif
  }
  at::Tensor flat;
  if (rank_ == root) {
    flat = catFlat(onHost(staging, ins));
  }
  Contig c(onHost(staging, out));
  return runHost(
      kScatter, kScatterTitle, c10d::OpType::SCATTER, ins, outputs, nbytes(out),
      signature(kScatter, out, root),
      [flat, c, root](HostComm& comm, const OpContext& ctx) {
        comm.scatter(flat.defined() ? flat.data_ptr() : nullptr, c.work.data_ptr(), nbytes(c.work),
                     root, ctx);
        c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, kReduceScatter);
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
              "fastcomm: reduce_scatter: the input list has ",
              inputs.empty() ? 0 : inputs[0].size(), " tensors but the group has ", size_,
              " ranks");
  for (const auto& i : inputs[0]) {
    checkSameKind(out, i, kReduceScatter, "an input tensor");
    TORCH_CHECK(i.numel() == out.numel(),
                "fastcomm: reduce_scatter: input tensors must have the "
                "output's ",
                out.numel(), " elements, got ", i.numel());
  }
  at::Tensor realOut = realView(out, opts.reduceOp, kReduceScatter);
  const RedOp op = toRedOp(opts.reduceOp, realOut.scalar_type(), kReduceScatter);
  std::vector<at::Tensor> realIns;
  for (const auto& i : inputs[0]) realIns.push_back(realView(i, opts.reduceOp, kReduceScatter));
  auto staging = stageThroughHost(kReduceScatter, inputs[0], outputs);
  if (out.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kReduceScatter, nbytes(out) * size_, opts);
    info.type = c10d::OpType::REDUCE_SCATTER;
    return remember(cuda(out, info.name).reduceScatter(realOut, realIns, op, info));
#else
    cuda(out);
#endif
  }
  if (staging) {
    realOut = realView(onHost(staging, out), opts.reduceOp, kReduceScatter);
    realIns.clear();
    for (const auto& i : inputs[0])
      realIns.push_back(realView(onHost(staging, i), opts.reduceOp, kReduceScatter));
  }
  at::Tensor flat = catFlat(realIns);
  Contig c(realOut);
  return runHost(
      kReduceScatter, kReduceScatterTitle, c10d::OpType::REDUCE_SCATTER, inputs[0], outputs,
      nbytes(flat), signature(kReduceScatter, realOut, -1, static_cast<int>(op)),
      [flat, c, op](HostComm& comm, const OpContext& ctx) {
        comm.reduceScatter(flat.data_ptr(), c.work.data_ptr(), c.work.numel(), c.work.scalar_type(),
                           op, ctx);
        c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, kReduceScatterTensor);
  checkSameKind(input, output, kReduceScatterTensor, "the output");
  TORCH_CHECK(input.numel() == output.numel() * size_,
              "fastcomm: reduce_scatter_tensor: input "
              "has ",
              input.numel(), " elements but must have world_size (", size_, ") x output (",
              output.numel(), ")");
  at::Tensor realOut = realView(output, opts.reduceOp, kReduceScatterTensor);
  at::Tensor realIn = realView(input, opts.reduceOp, kReduceScatterTensor);
  const RedOp op = toRedOp(opts.reduceOp, realOut.scalar_type(), kReduceScatterTensor);
  auto staging = stageThroughHost(kReduceScatterTensor, {input}, {output});
  if (input.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kReduceScatterTensor, nbytes(input), opts);
    info.type = c10d::OpType::_REDUCE_SCATTER_BASE;
    return remember(cuda(input, info.name).reduceScatter(realOut, {realIn}, op, info));
#else
    cuda(input);
#endif
  }
  if (staging) {
    realOut = realView(onHost(staging, output), opts.reduceOp, kReduceScatterTensor);
    realIn = realView(onHost(staging, input), opts.reduceOp, kReduceScatterTensor);
  }
  at::Tensor src = realIn.contiguous();
  Contig c(realOut);
  return runHost(
      kReduceScatterTensor, kReduceScatterTensorTitle, c10d::OpType::_REDUCE_SCATTER_BASE, {input},
      {output}, nbytes(input), signature(kReduceScatterTensor, realOut, -1, static_cast<int>(op)),
      [src, c, op](HostComm& comm, const OpContext& ctx) {
        comm.reduceScatter(src.data_ptr(), c.work.data_ptr(), c.work.numel(), c.work.scalar_type(),
                           op, ctx);
        c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "fastcomm: reduce_scatter_tensor_coalesced needs as many outputs as inputs (got ",
              outputs.size(), " and ", inputs.size(), ")");
  std::vector<at::Tensor> srcs;
  std::vector<Contig> dsts;
  int64_t bytes = 0;
  RedOp op = RedOp::Sum;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], kReduceScatterCoalesced);
    checkSameKind(inputs[0], inputs[i], kReduceScatterCoalesced, "an input");
    checkSameKind(inputs[i], outputs[i], kReduceScatterCoalesced, "an output");
    TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * size_,
                "fastcomm: reduce_scatter_tensor_coalesced: input ", i,
                " must have world_size x output elements");
    at::Tensor ri = realView(inputs[i], opts.reduceOp, kReduceScatterCoalesced);
    at::Tensor ro = realView(outputs[i], opts.reduceOp, kReduceScatterCoalesced);
    op = toRedOp(opts.reduceOp, ri.scalar_type(), kReduceScatterCoalesced);
    srcs.push_back(ri.contiguous());
    dsts.emplace_back(ro);
    bytes += nbytes(inputs[i]);
  }
  auto staging = stageThroughHost(kReduceScatterCoalesced, inputs, outputs);
  if (staging) {
    srcs.clear();
    dsts.clear();
    for (size_t i = 0; i < inputs.size(); ++i) {
      srcs.push_back(realView(onHost(staging, inputs[i]), opts.reduceOp, kReduceScatterCoalesced)
                         .contiguous());
      dsts.emplace_back(
          realView(onHost(staging, outputs[i]), opts.reduceOp, kReduceScatterCoalesced));
    }
  }
  if (inputs[0].is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto& cc = cuda(inputs[0]);
    auto info = FASTCOMM_CUDA_INFO(kReduceScatterCoalesced, bytes, opts);
    info.type = c10d::OpType::COALESCED;
    cc.startCoalescing();
    for (size_t i = 0; i < srcs.size(); ++i) cc.reduceScatter(dsts[i].orig, {srcs[i]}, op, info);
    return remember(cc.endCoalescing(info));
#else
    cuda(inputs[0]);
#endif
  }
  return runHost(
      kReduceScatterCoalesced, kReduceScatterCoalescedTitle, c10d::OpType::COALESCED, inputs,
      outputs, bytes,
      signature(kReduceScatterCoalesced, inputs[0], -1, static_cast<int>(op),
                static_cast<int64_t>(inputs.size())),
      [srcs, dsts, op](HostComm& comm, const OpContext& ctx) {
        for (size_t i = 0; i < srcs.size(); ++i) {
          comm.reduceScatter(srcs[i].data_ptr(), dsts[i].work.data_ptr(), dsts[i].work.numel(),
                             dsts[i].work.scalar_type(), op, ctx);
          dsts[i].finish();
        }
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  checkTensor(input, kAllToAllSingle);
  checkSameKind(input, output, kAllToAllSingle, "the output");
  // Counts in rows of dim 0 (equal splits when none are given).
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    std::vector<int64_t> c(size_);
    if (splits.empty()) {
      const int64_t rows = t.dim() == 0 ? t.numel() : t.size(0);
      TORCH_CHECK(rows % size_ == 0, "fastcomm: all_to_all_single: ", what, " dim 0 (", rows,
                  ") is not divisible by the group size ", size_);
      std::fill(c.begin(), c.end(), rows / size_);
    } else {
      TORCH_CHECK(static_cast<int>(splits.size()) == size_, "fastcomm: all_to_all_single: ", what,
                  " split sizes have ", splits.size(), " entries, expected ", size_);
      const int64_t sum = std::accumulate(splits.begin(), splits.end(), int64_t{0});
      TORCH_CHECK(t.dim() > 0 && sum == t.size(0), "fastcomm: all_to_all_single: ", what,
                  " split sizes sum to ", sum, " but dim 0 is ", t.dim() > 0 ? t.size(0) : 0);
      for (int64_t s : splits) TORCH_CHECK(s >= 0, "fastcomm: all_to_all_single: negative split");
      c = splits;
    }
    const int64_t rows = t.dim() == 0 ? t.numel() : t.size(0);
    const int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    for (auto& v : c) v *= rowElems;  // elements
    return c;
  };
  std::vector<int64_t> sendCounts = counts(input, inputSplits, "input");
  std::vector<int64_t> recvCounts = counts(output, outputSplits, "output");
  auto staging = stageThroughHost(kAllToAllSingle, {input}, {output});
  if (input.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kAllToAllSingle, nbytes(input), opts);
    info.type = c10d::OpType::ALLTOALL_BASE;
    return remember(
        cuda(input, info.name).alltoall({output}, {input}, sendCounts, recvCounts, info));
#else
    cuda(input);
#endif
  }
  const int64_t es = input.element_size();
  std::vector<int64_t> sendBytes(size_), sendOffs(size_), recvBytes(size_), recvOffs(size_);
  for (int i = 0, so = 0, ro = 0; i < size_; ++i) {
    sendBytes[i] = sendCounts[i] * es;
    recvBytes[i] = recvCounts[i] * es;
    sendOffs[i] = so;
    recvOffs[i] = ro;
    so += static_cast<int>(sendBytes[i]);
    ro += static_cast<int>(recvBytes[i]);
  }
  at::Tensor src = onHost(staging, input).contiguous();
  Contig c(onHost(staging, output));
  return runHost(
      kAllToAllSingle, kAllToAllSingleTitle, c10d::OpType::ALLTOALL_BASE, {input}, {output},
      nbytes(input), signature(kAllToAllSingle, input, -1, -1, output.numel()),
      [=](HostComm& comm, const OpContext& ctx) {
        comm.alltoall(src.data_ptr(), sendBytes, sendOffs, c.work.data_ptr(), recvBytes, recvOffs,
                      ctx);
        c.finish();
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
              "fastcomm: all_to_all needs ", size_, " input and ", size_, " output tensors, got ",
              inputs.size(), " and ", outputs.size());
  checkTensor(inputs[0], kAllToAll);
  for (const auto& t : inputs) checkSameKind(inputs[0], t, kAllToAll, "an input tensor");
  for (const auto& t : outputs) checkSameKind(inputs[0], t, kAllToAll, "an output tensor");
  std::vector<int64_t> sendCounts, recvCounts;
  int64_t bytes = 0;
  for (int i = 0; i < size_; ++i) {
    sendCounts.push_back(inputs[i].numel());
    recvCounts.push_back(outputs[i].numel());
    bytes += nbytes(inputs[i]);
  }
  auto staging = stageThroughHost(kAllToAll, inputs, outputs);
  if (inputs[0].is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = FASTCOMM_CUDA_INFO(kAllToAll, bytes, opts);
    info.type = c10d::OpType::ALLTOALL;
    return remember(
        cuda(inputs[0], info.name).alltoall(outputs, inputs, sendCounts, recvCounts, info));
#else
    cuda(inputs[0]);
#endif
  }
  const int64_t es = inputs[0].element_size();
  at::Tensor src = catFlat(onHost(staging, inputs));
  int64_t recvTotal = std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0});
  at::Tensor dst = at::empty({recvTotal}, src.options());
  std::vector<int64_t> sendBytes(size_), sendOffs(size_), recvBytes(size_), recvOffs(size_);
  for (int i = 0; i < size_; ++i) {
    sendBytes[i] = sendCounts[i] * es;
    recvBytes[i] = recvCounts[i] * es;
    sendOffs[i] = i ? sendOffs[i - 1] + sendBytes[i - 1] : 0;
    recvOffs[i] = i ? recvOffs[i - 1] + recvBytes[i - 1] : 0;
  }
  std::vector<at::Tensor> outs = onHost(staging, outputs);
  return runHost(
      kAllToAll, kAllToAllTitle, c10d::OpType::ALLTOALL, inputs, outputs, bytes,
      signature(kAllToAll, src, -1, -1, recvTotal),
      [=](HostComm& comm, const OpContext& ctx) {
        comm.alltoall(src.data_ptr(), sendBytes, sendOffs, dst.data_ptr(), recvBytes, recvOffs,
                      ctx);
        for (int i = 0; i < static_cast<int>(outs.size()); ++i)
          outs[i].copy_(dst.narrow(0, recvOffs[i] / es, recvCounts[i]).view(outs[i].sizes()));
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::send(std::vector<at::Tensor>& tensors,
                                                          int dstRank, int tag) {
  return deferErrorInBlock([&] { return sendNow(tensors, dstRank, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::sendNow(std::vector<at::Tensor>& tensors,
                                                             int dstRank, int tag) {
  const at::Tensor& t = single(tensors, kSend);
  TORCH_CHECK(dstRank >= 0 && dstRank < size_ && dstRank != rank_,
              "fastcomm: send: invalid "
              "destination ",
              dstRank, " (group of ", size_, ", this is rank ", rank_, ")");
  auto staging = stageThroughHost(kSend, {t}, {});
  if (t.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = CudaOpInfo{kSend, kSendTitle, c10d::OpType::SEND, ++p2pSeq_, timeout_, nbytes(t)};
    return remember(cuda(t, info.name).send(t, dstRank, info));
#else
    cuda(t);
#endif
  }
  at::Tensor src = onHost(staging, t).contiguous();
  const int peer = dstRank;  // single node: group rank == local index
  return runP2P(
      kSend, kSendTitle, c10d::OpType::SEND, p2pLane(peer, true), t,
      [src, peer, tag](HostComm& comm, const OpContext& ctx, HostWork&) {
        comm.send(src.data_ptr(), nbytes(src), peer, tag, ctx);
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::recv(std::vector<at::Tensor>& tensors,
                                                          int srcRank, int tag) {
  return deferErrorInBlock([&] { return recvNow(tensors, srcRank, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::recvNow(std::vector<at::Tensor>& tensors,
                                                             int srcRank, int tag) {
  const at::Tensor& t = single(tensors, kRecv);
  TORCH_CHECK(srcRank >= 0 && srcRank < size_ && srcRank != rank_,
              "fastcomm: recv: invalid "
              "source ",
              srcRank, " (group of ", size_, ", this is rank ", rank_, ")");
  auto staging = stageThroughHost(kRecv, {}, {t});
  if (t.is_cuda() && !staging) {
#ifdef FASTCOMM_WITH_CUDA
    auto info = CudaOpInfo{kRecv, kRecvTitle, c10d::OpType::RECV, ++p2pSeq_, timeout_, nbytes(t)};
    return remember(cuda(t, info.name).recv(t, srcRank, info));
#else
    cuda(t);
#endif
  }
  Contig c(onHost(staging, t));
  const int peer = srcRank;
  return runP2P(
      kRecv, kRecvTitle, c10d::OpType::RECV, p2pLane(peer, false), t,
      [c, peer, tag](HostComm& comm, const OpContext& ctx, HostWork& work) {
        comm.recv(c.work.data_ptr(), nbytes(c.work), peer, tag, ctx);
        c.finish();
        work.setSourceRank(peer);
      },
      staging);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                   int tag) {
  const at::Tensor& t = single(tensors, kRecvAny);
  TORCH_CHECK(!t.is_cuda(),
              "fastcomm: recv from any source is supported for CPU tensors only "
              "(NCCL has no wildcard receive); pass an explicit source rank");
  Contig c(t);
  // Own lane: it must not queue behind a blocked recv from one particular peer.
  return runP2P(kRecvAny, kRecvAnyTitle, c10d::OpType::RECVANYSOURCE, p2pLane(-1, false), t,
                [c, tag](HostComm& comm, const OpContext& ctx, HostWork& work) {
                  const int src = comm.recvAny(c.work.data_ptr(), nbytes(c.work), tag, ctx);
                  c.finish();
                  work.setSourceRank(src);
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::barrier(const c10d::BarrierOptions& opts) {
  // A host barrier: every rank's host reached it. (ProcessGroupNCCL's device
  // all-reduce also orders GPU work; fastcomm's work.wait() already does.)
  return runHost(kBarrier, kBarrierTitle, c10d::OpType::BARRIER, {}, {}, 0,
                 signature(kBarrier, at::Tensor()),
                 [](HostComm& comm, const OpContext& ctx) { comm.barrier(ctx); });
}

void ProcessGroupFastComm::startCoalescing() {
#ifdef FASTCOMM_WITH_CUDA
  std::lock_guard<std::mutex> cudaLock(cudaMu_);  // lock order: cudaMu_, then coalesceMu_
#endif
  std::lock_guard<std::mutex> lock(coalesceMu_);
  // torch leaves a block open when an op inside it raised; start afresh.
  coalescing_ = true;
  coalesced_.clear();
  coalescedJobs_.clear();
  coalesceError_ = nullptr;
#ifdef FASTCOMM_WITH_CUDA
  // CUDA ops of the block are issued as one NCCL group at endCoalescing.
  coalescingCuda_ = cuda_ != nullptr;
  if (coalescingCuda_) cuda_->startCoalescing();
#endif
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::endCoalescing() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::pair<SerialLane*, std::function<void()>>> jobs;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(coalesceMu_);
    TORCH_CHECK(coalescing_, "fastcomm: endCoalescing without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_);
    jobs.swap(coalescedJobs_);
    std::swap(error, coalesceError_);
  }
#ifdef FASTCOMM_WITH_CUDA
  const bool cudaBlock = coalescingCuda_;
  coalescingCuda_ = false;
  if (cudaBlock && error) cuda_->cancelCoalescing();
#endif
  // An invalid op in the block: nothing of the block was issued; raise now.
  if (error) std::rethrow_exception(error);
  for (auto& [lane, job] : jobs) lane->submit(std::move(job));
#ifdef FASTCOMM_WITH_CUDA
  if (cudaBlock) {
    CudaOpInfo info{kCoalesced, kCoalescedTitle, c10d::OpType::COALESCED, seq_.load(), timeout_, 0};
    auto cudaWork = cuda_->endCoalescing(info);
    // The CUDA parts complete with the group's work; host parts on their own.
    std::vector<c10::intrusive_ptr<c10d::Work>> host;
    for (auto& w : works)
      if (dynamic_cast<HostWork*>(w.get()) != nullptr) host.push_back(w);
    host.push_back(cudaWork);
    works.swap(host);
  }
#endif
  std::vector<at::Tensor> outputs;
  for (auto& w : works)
    for (auto& t : w->result()) outputs.push_back(t);
  return c10::make_intrusive<GroupedWork>(rank_, std::move(works), std::move(outputs));
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupFastComm::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;  // not a member of the new group
  const int newRank = static_cast<int>(it - ranks.begin());
  std::vector<uint64_t> globals;
  for (int r : ranks)
    globals.push_back(globalRanks_.empty() ? static_cast<uint64_t>(r) : globalRanks_[r]);
  auto timeout = opts ? opts->timeout : timeout_;
  auto name = opts ? opts->group_name : std::string();
  return c10::make_intrusive<ProcessGroupFastComm>(store, newRank, static_cast<int>(ranks.size()),
                                                   timeout, globals, name);
}

}  // namespace fastcomm
