#include "backend/cuda/cuda_collectives.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <nccl.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "intra/nccl/nccl_collectives.hpp"
#include "intra/nccl/nccl_utils.hpp"
#include "intra/nvlink/nvlink_collectives.hpp"
#include "common/deadline.hpp"
#include "common/logging.hpp"
#include "plans/cuda/cuda_hier.hpp"
#include "plans/inter_plan.hpp"

namespace fastcomm {

namespace {

using Tensors = std::vector<at::Tensor>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using Body = std::function<void(ncclComm_t, cudaStream_t)>;

constexpr auto kWatchdogPeriod = std::chrono::milliseconds(100);
constexpr auto kHeartbeatPeriod = std::chrono::milliseconds(1000);
constexpr int64_t kStaleHeartbeatMs = 3000;

bool isCapturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  return status != cudaStreamCaptureStatusNone;
}

int64_t unixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class CudaWork;

// CUDA events are recycled: creating and destroying two per collective costs
// microseconds on the launch path (ProcessGroupNCCL caches them likewise).
// An event returns to the pool when its last holder lets go of it.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  using EventPtr = std::shared_ptr<at::cuda::CUDAEvent>;
  EventPtr get(bool timing) {
    std::unique_ptr<at::cuda::CUDAEvent> event;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = timing ? timed_ : untimed_;
      if (!free.empty()) {
        event = std::move(free.back());
        free.pop_back();
      }
    }
    if (!event) {
      event =
          std::make_unique<at::cuda::CUDAEvent>(timing ? cudaEventDefault : cudaEventDisableTiming);
    }
    std::weak_ptr<EventPool> pool = weak_from_this();
    return EventPtr(event.release(), [pool, timing](at::cuda::CUDAEvent* e) {
      std::unique_ptr<at::cuda::CUDAEvent> owned(e);
      if (auto p = pool.lock()) p->put(std::move(owned), timing);
    });
  }

 private:
  void put(std::unique_ptr<at::cuda::CUDAEvent> event, bool timing) {
    std::lock_guard<std::mutex> lock(mu_);
    (timing ? timed_ : untimed_).push_back(std::move(event));
  }
  std::mutex mu_;
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> timed_, untimed_;
};

}  // namespace

class CudaCollectives::Impl {
 public:
  Impl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
       std::chrono::milliseconds timeout, const Config& cfg, Stats& stats, at::Device device,
       const Topology& topo, TraceRing* trace);
  ~Impl();

  WorkPtr launch(const CudaOpInfo& info, const Tensors& inputs, const Tensors& outputs, Body body);
  // The all_reduce of `t` goes through the multi-node pipeline (CudaHier):
  // the same answer on every rank. Creates the plan at its first use, which
  // must not be under a CUDA graph capture (a clear error then).
  bool useHier(const at::Tensor& t, RedOp op, const CudaOpInfo& info);
  WorkPtr launchHier(const CudaOpInfo& info, const at::Tensor& t, RedOp op);
  // The NVLink kernels, or null where a call cannot take them: none on this
  // group, or inside a coalesced block (one NCCL group).
  NvlinkCollectives* nvlinkForCall();
  // Issues one NVLink collective, `kernel`, reading `inputs` and writing
  // `outputs`, as a work of its own counted under `statKey`.
  using NvlinkKernel =
      std::function<void(NvlinkCollectives*, cudaStream_t, uint64_t seq, bool captured)>;
  WorkPtr launchNvlink(const CudaOpInfo& info, const Tensors& inputs, const Tensors& outputs,
                       const char* statKey, NvlinkKernel kernel);
  // Whether an NVLink kernel reported a wait that timed out; the first time,
  // the group fails with a timeout error naming the op and the peer.
  bool pollNvlink();
  void startCoalescing();
  WorkPtr endCoalescing(const CudaOpInfo& info);
  void cancelCoalescing() {
    std::lock_guard<std::mutex> lock(issueMu_);
    coalescing_ = false;
    deferred_.clear();
  }
  void shutdown();
  void abort(const std::string& why);
  // The group failed (a timeout, the multi-node path): the flight recorder
  // dumps, then abort(why).
  void fail(const std::string& why);
  void checkHealthy();
  // The work of one call on this group's device; a captured call's work has
  // no timing events.
  c10::intrusive_ptr<CudaWork> newWork(const CudaOpInfo& info, const Tensors& inputs,
                                       const Tensors& outputs, bool capturing);
  std::exception_ptr error();
  nccl::Call call(ncclComm_t comm, cudaStream_t s) const;

  at::Device device_;
  int rank_, size_;
  Config cfg_;
  TraceRing* const trace_;

 private:
  struct Deferred {
    Body body;
    c10::intrusive_ptr<CudaWork> work;
  };
  void watchdogLoop();
  std::string missingRanks(uint64_t seq);
  void issue(const std::vector<Deferred>& items, const CudaOpInfo& info, bool capturing);

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  Stats& stats_;
  Topology topo_;
  std::optional<InterPlan> plan_;   // several nodes: the choices agreed through the store
  std::unique_ptr<CudaHier> hier_;  // created at the first all_reduce that takes it
  bool hierTried_ = false;          // (under issueMu_) null hier_ then means unavailable
  // One node whose GPUs all reach each other over NVLink: the peer-memory kernels.
  std::unique_ptr<NvlinkCollectives> nvlink_;
  // (under issueMu_) The last eager NVLink op's end and stream.
  std::shared_ptr<at::cuda::CUDAEvent> nvlinkLastEnd_;
  cudaStream_t nvlinkLastStream_ = nullptr;
  std::atomic<bool> nvlinkReported_{false};
  ncclComm_t comm_ = nullptr;
  std::optional<at::cuda::CUDAStream> stream_;
  at::cuda::CUDAEvent syncEvent_{cudaEventDisableTiming};
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();

  std::mutex issueMu_;  // orders NCCL calls; abort takes it too
  bool coalescing_ = false;
  std::vector<Deferred> deferred_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<CudaWork>> inflight_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::atomic<uint64_t> lastSeq_{0};
  std::thread watchdog_;
};

namespace {

class CudaWork : public c10d::Work {
 public:
  CudaWork(int rank, const CudaOpInfo& info, const Tensors& inputs, Tensors outputs,
           at::Device device, CudaCollectives::Impl* owner, EventPool& events, bool timing,
           bool captured)
      : Work(rank, info.type, info.title, std::optional<Tensors>(inputs)),
        captured_(captured),
        name_(info.name),
        seq_(info.seq),
        bytes_(info.bytes),
        timeout_(info.timeout),
        device_(device),
        owner_(owner),
        inputs_(inputs),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device})),
        start_(timing ? events.get(true) : nullptr),
        end_(events.get(timing)),
        trace_(owner->trace_ != nullptr ? info.trace : 0) {}

  bool isCompleted() override {
    if (exception()) return true;
    // Querying an event recorded during a capture is an error in CUDA; the
    // work completes once per replay, which the host cannot name here.
    TORCH_CHECK(!captured_, "fastcomm: ", name_, " (seq ", seq_,
                ") was captured into a CUDA graph: it runs with every replay and has no "
                "completion state of its own; synchronize the stream that replays the graph");
    const bool done = end_->query();
    if (done) {
      failIfNvlinkTimedOut();
      traceCompleted();
    }
    return done;
  }
  bool isSuccess() const override { return !exception(); }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return exception_;
  }
  void synchronize() override {
    auto current = at::cuda::getCurrentCUDAStream(device_.index());
    end_->block(current);
  }
  bool wait(std::chrono::milliseconds timeout) override {
    if (auto e = exception()) std::rethrow_exception(e);
    if (captured_) {
      // Inside the capture the stream dependency is all a wait can mean (the
      // work has not run yet: no host block, no event query). Outside it the
      // event belongs to the graph and cannot order eager work.
      TORCH_CHECK(isCapturing(at::cuda::getCurrentCUDAStream(device_.index()).stream()),
                  "fastcomm: ", name_, " (seq ", seq_,
                  ") was captured into a CUDA graph; wait on it inside the same capture, "
                  "the replay orders it after that");
      synchronize();
      return true;
    }
    synchronize();
    // A positive `timeout` (work.wait(timeout=...)) also blocks the host.
    if (owner_->cfg_.blockingWait || timeout.count() > 0) {
      const auto limit = timeout.count() > 0 ? timeout : timeout_;
      const auto until = Clock::now() + limit + std::chrono::seconds(5);
      while (!end_->query()) {
        if (auto e = exception()) std::rethrow_exception(e);
        TORCH_CHECK(Clock::now() < until, "fastcomm: ", name_, " (seq ", seq_,
                    ") did not complete within ", limit.count(), " ms");
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      failIfNvlinkTimedOut();
      traceCompleted();
    }
    if (auto e = exception()) std::rethrow_exception(e);
    return true;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  uint64_t getSequencenumber() const override { return seq_; }

  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (exception_) return;
      exception_ = e;
    }
    if (trace_) owner_->trace_->retire(trace_);
    endProfiling();
  }
  void traceCompleted() {
    if (trace_) owner_->trace_->completed(trace_);
  }
  // An NVLink kernel that gave up on a peer completes like any other: its
  // report, not its end event, tells the failure.
  void failIfNvlinkTimedOut() {
    if (!viaNvlink_ || !owner_->pollNvlink()) return;
    // Null only while another thread is still failing the group.
    if (auto e = owner_->error()) fail(e);
  }
  // Marks the entry started once the start event has fired (timing only).
  void traceStarted() {
    if (trace_ && start_ && !traceStarted_ && start_->query()) {
      traceStarted_ = true;
      owner_->trace_->started(trace_);
    }
  }
  void endProfiling() {
    if (recordFunctionEndCallback_) {
      recordFunctionEndCallback_();
      recordFunctionEndCallback_ = nullptr;
    }
  }

  const bool captured_;  // issued while the current stream was being captured
  std::string name_;
  uint64_t seq_;
  int64_t bytes_;
  std::chrono::milliseconds timeout_;
  at::Device device_;
  CudaCollectives::Impl* owner_;
  Tensors inputs_;
  Tensors outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<at::cuda::CUDAEvent> start_;
  std::shared_ptr<at::cuda::CUDAEvent> end_;
  Clock::time_point enqueued_ = Clock::now();
  const uint64_t trace_;       // flight recorder entry, 0: none
  bool traceStarted_ = false;  // (watchdog thread only)
  bool viaNvlink_ = false;     // ran on the NVLink kernels
};

}  // namespace

CudaCollectives::Impl::Impl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                            std::chrono::milliseconds timeout, const Config& cfg, Stats& stats,
                            at::Device device, const Topology& topo, TraceRing* trace)
    : device_(device),
      rank_(rank),
      size_(size),
      cfg_(cfg),
      trace_(trace),
      store_(store),
      timeout_(timeout),
      stats_(stats),
      topo_(topo) {
  c10::cuda::CUDAGuard guard(device_);
  std::vector<int> everyone(size_);
  std::iota(everyone.begin(), everyone.end(), 0);
  if (topo_.numNodes() > 1 && preferNcclSocketParallelism()) {
    FASTCOMM_LOG(Info, "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 set for NCCL's socket "
                           << "transport across hosts (neither was set; they apply process-wide)");
  }
  comm_ = ncclCommFromStore(store_, "fastcomm/nccl/", size_, rank_, everyone, rank_, timeout_,
                            "NCCL communicator setup");
  if (topo_.numNodes() > 1) {
    plan_ = InterPlan::agree(store_, rank_, size_, topo_.maxLocalSize(), cfg_,
                             OpContext::start("NCCL communicator setup", 0, timeout_));
  }
  stream_ = at::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index());
  if (cfg_.nvlink && topo_.numNodes() == 1 && size_ > 1) {
    try {
      nvlink_ = NvlinkCollectives::create(store_, rank_, size_, device_, timeout_);
    } catch (...) {
      ncclCommAbort(comm_);  // no destructor runs for a constructor that throws
      comm_ = nullptr;
      throw;
    }
  }
  int version = 0;
  ncclGetVersion(&version);
  if (rank_ == 0) {
    FASTCOMM_LOG(Info, "NCCL communicator of " << size_ << " ranks on " << device_
                                               << ": NCCL runtime " << version << ", headers "
                                               << NCCL_VERSION_CODE);
  }
  watchdog_ = std::thread([this] { watchdogLoop(); });
}

CudaCollectives::Impl::~Impl() { shutdown(); }

void CudaCollectives::Impl::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  c10::cuda::CUDAGuard guard(device_);
  if (hier_) {
    // Not under issueMu_: draining the stream may need the plan's proxy to
    // abort the group, which takes it.
    hier_->shutdown(stream_->stream(), error() != nullptr);
  }
  std::lock_guard<std::mutex> lock(issueMu_);
  hier_.reset();
  const bool failed = error() != nullptr;
  // Kernels waiting on a peer that is gone give up, so waiting for them
  // returns.
  if (nvlink_ && failed) nvlink_->abort();
  if (comm_ != nullptr) {
    if (failed) {
      ncclCommAbort(comm_);
    } else {
      // Let queued collectives finish, then release the communicator.
      C10_CUDA_CHECK_WARN(cudaStreamSynchronize(stream_->stream()));
      ncclRelease(comm_);
    }
    comm_ = nullptr;
  }
  if (nvlink_) {
    // Every eager NVLink op is ordered before the last one (launchNvlink).
    if (nvlinkLastEnd_) nvlinkLastEnd_->synchronize();
    nvlink_->shutdown(failed);
    nvlink_.reset();
  }
}

std::exception_ptr CudaCollectives::Impl::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void CudaCollectives::Impl::checkHealthy() {
  if (auto e = error()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      throwCommError(std::string("fastcomm: the NCCL communicator of this group was aborted "
                                 "after an earlier failure: ") +
                     ex.what());
    }
  }
}

c10::intrusive_ptr<CudaWork> CudaCollectives::Impl::newWork(const CudaOpInfo& info,
                                                            const Tensors& inputs,
                                                            const Tensors& outputs,
                                                            bool capturing) {
  return c10::make_intrusive<CudaWork>(rank_, info, inputs, outputs, device_, this, *events_,
                                       cfg_.cudaTiming && !capturing, capturing);
}

WorkPtr CudaCollectives::Impl::launch(const CudaOpInfo& info, const Tensors& inputs,
                                      const Tensors& outputs, Body body) {
  checkHealthy();
  c10::cuda::CUDAGuard guard(device_);
  auto current = at::cuda::getCurrentCUDAStream(device_.index());
  const bool capturing = isCapturing(current.stream());
  auto work = newWork(info, inputs, outputs, capturing);
  std::lock_guard<std::mutex> lock(issueMu_);
  if (coalescing_) {
    deferred_.push_back({std::move(body), work});
    return work;
  }
  issue({{std::move(body), work}}, info, capturing);
  return work;
}

bool CudaCollectives::Impl::useHier(const at::Tensor& t, RedOp op, const CudaOpInfo& info) {
  if (!plan_ || !CudaHier::eligible(*plan_, topo_, t.scalar_type(), op, t.numel(),
                                    t.numel() * static_cast<int64_t>(t.element_size()))) {
    return false;
  }
  checkHealthy();
  c10::cuda::CUDAGuard guard(device_);
  std::unique_lock<std::mutex> lock(issueMu_);
  // A coalesced block is one NCCL group: it stays on the flat communicator.
  if (coalescing_) return false;
  if (hierTried_) return hier_ != nullptr;
  // The set-up (a vote through the store, pinned memory, connections, the
  // node's NCCL communicator) cannot run inside a capture, and setting it
  // up at group creation would cost pinned memory and connections for
  // groups that never send a large CUDA all_reduce. As DDP's warm-up before
  // a capture already runs the step eagerly, the first use must be eager:
  // refused here, on every rank alike (they all capture), before anything
  // is issued.
  TORCH_CHECK(!isCapturing(at::cuda::getCurrentCUDAStream(device_.index()).stream()),
              "fastcomm: ", info.name, " (seq ", info.seq,
              ") is the first CUDA all_reduce across nodes of this group of at least "
              "FASTCOMM_CUDA_HIER_MIN_BYTES (",
              plan_->cudaHierMinBytes,
              " B), and its multi-node path cannot be set up during a CUDA graph capture: run "
              "one such all_reduce eagerly before capturing (as a warm-up iteration does)");
  hierTried_ = true;
  CudaHier::Hooks hooks;
  hooks.abortGroup = [this](const std::string& why) { fail(why); };
  hooks.laggingRanks = [this](uint64_t seq) {
    const std::string m = missingRanks(seq);
    return m.rfind("(unknown", 0) == 0 ? std::string() : m;
  };
  std::string failure;
  try {
    hier_ = CudaHier::create(store_, topo_, *plan_, cfg_, device_, timeout_, std::move(hooks));
  } catch (const std::exception& e) {
    failure = errorText(e);
  }
  if (failure.empty()) return hier_ != nullptr;
  // Other ranks may have got further: none of them may go on, or the group
  // would disagree on the path and hang.
  lock.unlock();
  const std::string why = failure.rfind("fastcomm:", 0) == 0
                              ? failure
                              : std::string("fastcomm: ") + info.name +
                                    ": setting up the CUDA multi-node path failed: " + failure;
  fail(why);
  throwCommError(why);
}

WorkPtr CudaCollectives::Impl::launchHier(const CudaOpInfo& info, const at::Tensor& t, RedOp op) {
  checkHealthy();
  c10::cuda::CUDAGuard guard(device_);
  auto current = at::cuda::getCurrentCUDAStream(device_.index());
  // Under capture the plan records a host node that hands the op to its
  // proxy on every replay (plans/staged_rail.hpp). The work is then the
  // capture's only: no timing events, not watched, and a failure in a
  // replay fails the group (the next call raises), not this work.
  const bool capturing = isCapturing(current.stream());
  // Always on the internal stream: the pipeline's flag slots are reused in
  // issue order, which one stream keeps for every all_reduce of the group
  // (replays must be ordered with them by the caller's streams, as any two
  // collectives of a group must).
  CudaOpInfo hinfo = info;
  hinfo.onCurrentStream = false;
  auto work = newWork(hinfo, Tensors{t}, Tensors{t}, capturing);
  const auto ctx = OpContext::start(info.name, info.seq, info.timeout);
  std::lock_guard<std::mutex> lock(issueMu_);
  TORCH_CHECK(hier_ != nullptr && !coalescing_, "fastcomm: internal: ", info.name,
              " lost its multi-node plan");
  CudaHier* hier = hier_.get();
  std::function<void(std::exception_ptr)> failWork;
  if (!capturing) {
    c10::intrusive_ptr<CudaWork> failTarget = work;
    failWork = [failTarget](std::exception_ptr e) { failTarget->fail(e); };
  }
  Body body = [hier, t, op, ctx, failWork](ncclComm_t, cudaStream_t s) {
    nccl::DeviceContig c(t);
    c.load();
    hier->allreduce(c.work, op, s, ctx, failWork);
    c.finish();
  };
  issue({{std::move(body), work}}, hinfo, capturing);
  return work;
}

NvlinkCollectives* CudaCollectives::Impl::nvlinkForCall() {
  if (!nvlink_) return nullptr;
  std::lock_guard<std::mutex> lock(issueMu_);
  return coalescing_ ? nullptr : nvlink_.get();
}

WorkPtr CudaCollectives::Impl::launchNvlink(const CudaOpInfo& info, const Tensors& inputs,
                                            const Tensors& outputs, const char* statKey,
                                            NvlinkKernel kernel) {
  checkHealthy();
  c10::cuda::CUDAGuard guard(device_);
  auto current = at::cuda::getCurrentCUDAStream(device_.index());
  // Under capture the kernel goes into the graph as it is: it reads the
  // captured tensors itself and advances the call counter on the device, so
  // every replay is a fresh collective of those tensors.
  const bool capturing = isCapturing(current.stream());
  auto work = newWork(info, inputs, outputs, capturing);
  work->viaNvlink_ = true;
  std::lock_guard<std::mutex> lock(issueMu_);
  NvlinkCollectives* nvlink = nvlink_.get();
  TORCH_CHECK(nvlink != nullptr, "fastcomm: internal: ", info.name, " lost its NVLink path");
  // Two eager calls on different streams (async_op=True on the internal
  // stream, then a synchronous one on the caller's) would otherwise run at
  // once on the same buffers and counters: a call waits for the previous one
  // where the stream changed. A replay is ordered by the stream it runs on.
  std::shared_ptr<at::cuda::CUDAEvent> lastEnd = capturing ? nullptr : nvlinkLastEnd_;
  const cudaStream_t lastStream = nvlinkLastStream_;
  cudaStream_t used = nullptr;
  const uint64_t seq = info.seq;
  Body body = [nvlink, kernel = std::move(kernel), seq, capturing, lastEnd, lastStream, &used](
                  ncclComm_t, cudaStream_t s) {
    if (lastEnd && lastStream != s) C10_CUDA_CHECK(cudaStreamWaitEvent(s, lastEnd->event(), 0));
    used = s;
    kernel(nvlink, s, seq, capturing);
  };
  issue({{std::move(body), work}}, info, capturing);
  if (!capturing) {
    nvlinkLastEnd_ = work->end_;
    nvlinkLastStream_ = used;
  }
  stats_.addCall(statKey, static_cast<uint64_t>(info.bytes));
  return work;
}

bool CudaCollectives::Impl::pollNvlink() {
  if (!nvlink_) return false;
  const auto t = nvlink_->timedOut();
  if (!t) return false;
  if (!nvlinkReported_.exchange(true)) {
    const std::string why =
        "fastcomm: " + std::string(t->collective) + " (seq " + std::to_string(t->seq) +
        (t->captured ? ", captured in a CUDA graph" : "") + ") failed on group rank " +
        std::to_string(rank_) + ": timeout after " + std::to_string(timeout_.count()) +
        " ms waiting for group rank(s) " + formatRanks({t->peer}) +
        " in the NVLink kernel; the NCCL communicator was aborted";
    FASTCOMM_LOG(Warn, why);
    fail(why);
  }
  return true;
}

void CudaCollectives::Impl::issue(const std::vector<Deferred>& items, const CudaOpInfo& info,
                                  bool capturing) {
  auto current = at::cuda::getCurrentCUDAStream(device_.index());
  // Ops of a coalesced block carry the block's info, which never asks for the
  // current stream: their works may be waited on from anywhere.
  const bool onCurrent = info.onCurrentStream && items.size() == 1;
  at::cuda::CUDAStream comm = onCurrent ? current : *stream_;
  if (!onCurrent) {
    // The internal stream starts after everything the caller queued so far.
    syncEvent_.record(current);
    syncEvent_.block(comm);
  }
  auto& first = items.front().work;
  if (first->start_) first->start_->record(comm);
  {
    at::cuda::CUDAStreamGuard streamGuard(comm);  // temporaries belong to the comm stream
    if (items.size() > 1) ncclCheck(ncclGroupStart(), comm_, info.name);
    for (const auto& item : items) item.body(comm_, comm.stream());
    if (items.size() > 1) ncclCheck(ncclGroupEnd(), comm_, info.name);
  }
  first->end_->record(comm);
  lastSeq_.store(std::max(lastSeq_.load(), info.seq));
  for (const auto& item : items) {
    auto& w = item.work;
    w->end_ = first->end_;
    // One NCCL group, one interval: its time is booked to the first op only.
    if (w != first) w->start_ = nullptr;
    // The caching allocator must not hand these blocks out again before the
    // comm stream is done with them (on the caller's stream it knows already).
    if (!onCurrent)
      for (const auto* list : {&w->inputs_, &w->outputs_})
        for (const auto& t : *list)
          if (t.defined() && t.numel() > 0 && t.is_cuda())
            c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), comm);
    {
      c10::cuda::CUDAMultiStreamGuard futureGuard(comm);
      w->future_->markCompleted(c10::IValue(w->outputs_));
    }
    // The profiler range ends on the thread that opened it, once the op is
    // queued (as ProcessGroupNCCL's): the profiler records the GPU side apart.
    w->endProfiling();
    stats_.addCall(w->name_, static_cast<uint64_t>(w->bytes_));
  }
  if (capturing) return;
  // No wake-up: the watchdog polls every kWatchdogPeriod, and a syscall per
  // collective would sit on the launch path.
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& item : items) inflight_.push_back(item.work);
}

void CudaCollectives::Impl::startCoalescing() {
  std::lock_guard<std::mutex> lock(issueMu_);
  coalescing_ = true;
  deferred_.clear();
}

WorkPtr CudaCollectives::Impl::endCoalescing(const CudaOpInfo& info) {
  c10::cuda::CUDAGuard guard(device_);
  std::lock_guard<std::mutex> lock(issueMu_);
  coalescing_ = false;
  std::vector<Deferred> items;
  items.swap(deferred_);
  if (items.empty()) return nullptr;  // nothing on CUDA in the block
  auto current = at::cuda::getCurrentCUDAStream(device_.index());
  issue(items, info, isCapturing(current.stream()));
  // The group's work: every part shares the same end event, so the last one
  // stands for all; its outputs are everyone's.
  auto last = items.back().work;
  for (const auto& item : items)
    if (item.work != last)
      for (const auto& t : item.work->outputs_) last->outputs_.push_back(t);
  return last;
}

std::string CudaCollectives::Impl::missingRanks(uint64_t seq) {
  // Ranks that did not issue collective `seq`, or whose heartbeat stopped
  // (the process died or hangs outside fastcomm).
  std::vector<int> missing;
  const int64_t now = unixMillis();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const std::string key = "fastcomm/cuda_hb/" + std::to_string(r);
    if (!store_->check({key})) {
      missing.push_back(r);
      continue;
    }
    auto v = store_->get(key);
    std::istringstream is(std::string(v.begin(), v.end()));
    uint64_t theirSeq = 0;
    int64_t at = 0;
    is >> theirSeq >> at;
    if (theirSeq < seq || now - at > kStaleHeartbeatMs) missing.push_back(r);
  }
  return missing.empty() ? std::string("(unknown: all ranks issued it)") : formatRanks(missing);
}

void CudaCollectives::Impl::watchdogLoop() {
  // Event queries and, above all, ncclCommAbort must run on the
  // communicator's device, not on this thread's default device 0.
  c10::cuda::CUDAGuard deviceGuard(device_);
  // A capture in global mode (torch.cuda.graph's default) forbids event
  // queries in every thread of the process whose own mode is global, and
  // eager works issued before the capture may still be queued here. This
  // thread never captures and queries only events of eager works (captured
  // ones are never queued), so other threads' captures do not concern it
  // (ProcessGroupNCCL's watchdog does the same).
  cudaStreamCaptureMode captureMode = cudaStreamCaptureModeThreadLocal;
  C10_CUDA_CHECK_WARN(cudaThreadExchangeStreamCaptureMode(&captureMode));
  auto nextHeartbeat = Clock::now();
  while (true) {
    c10::intrusive_ptr<CudaWork> expired;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kWatchdogPeriod, [&] { return stop_; });
      if (stop_) return;
    }
    try {
      if (Clock::now() >= nextHeartbeat) {
        // "<last issued collective seq> <unix ms>": lets peers tell a rank
        // that is behind or gone from one that is merely slow.
        const std::string v = std::to_string(lastSeq_.load()) + " " + std::to_string(unixMillis());
        store_->set("fastcomm/cuda_hb/" + std::to_string(rank_),
                    std::vector<uint8_t>(v.begin(), v.end()));
        nextHeartbeat = Clock::now() + kHeartbeatPeriod;
      }
    } catch (const std::exception& e) {
      FASTCOMM_LOG(Debug, "heartbeat to the store failed: " << e.what());
    }
    // Before the completions below: a kernel that gave up has completed too.
    pollNvlink();
    std::deque<c10::intrusive_ptr<CudaWork>> works;
    {
      std::lock_guard<std::mutex> lock(mu_);
      works.swap(inflight_);
    }
    std::deque<c10::intrusive_ptr<CudaWork>> pending;
    for (auto& w : works) {
      if (w->end_->query()) {
        w->traceCompleted();
        try {
          if (w->start_) stats_.addTime(w->name_, 1000.0 * w->start_->elapsed_time(*w->end_));
        } catch (const std::exception& e) {
          FASTCOMM_LOG(Debug, "no GPU time for " << w->name_ << ": " << e.what());
        }
      } else if (!expired && Clock::now() - w->enqueued_ > w->timeout_) {
        w->traceStarted();
        expired = w;
        pending.push_back(w);
      } else {
        w->traceStarted();
        pending.push_back(w);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = pending.rbegin(); it != pending.rend(); ++it) inflight_.push_front(*it);
    }
    if (expired) {
      const std::string why =
          "fastcomm: " + expired->name_ + " (seq " + std::to_string(expired->seq_) +
          ") failed on group rank " + std::to_string(rank_) + ": timeout after " +
          std::to_string(expired->timeout_.count()) + " ms waiting for group rank(s) " +
          missingRanks(expired->seq_) + "; the NCCL communicator was aborted";
      FASTCOMM_LOG(Warn, why);
      fail(why);
    }
  }
}

void CudaCollectives::Impl::fail(const std::string& why) {
  if (trace_ != nullptr) trace_->groupFailed(why);
  abort(why);
}

void CudaCollectives::Impl::abort(const std::string& why) {
  std::exception_ptr e;
  try {
    throwCommError(why);
  } catch (...) {
    e = std::current_exception();
  }
  std::deque<c10::intrusive_ptr<CudaWork>> works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = e;
    works.swap(inflight_);
  }
  // Fail the works before aborting: the abort lets their end events fire, and
  // a waiter that sees the event must already see the error too.
  for (auto& w : works) w->fail(e);
  {
    c10::cuda::CUDAGuard guard(device_);
    std::lock_guard<std::mutex> lock(issueMu_);
    // Aborting makes NCCL kernels stuck on the dead peer return. Each abort
    // waits for the device while it frees (NCCL issues #829, #1013), so the
    // communicators that share the comm stream are aborted together, after
    // the rail's flag waits between them are released (CudaHier).
    if (nvlink_) nvlink_->abort();
    if (hier_) {
      hier_->abortComms(why, comm_);
    } else {
      ncclAbortAll({comm_});
    }
    comm_ = nullptr;
  }
}

// ---- public API ----------------------------------------------------------------

CudaCollectives::CudaCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout, const Config& cfg, Stats& stats,
                                 at::Device device, const Topology& topo, TraceRing* trace)
    : impl_(std::make_unique<Impl>(store, rank, size, timeout, cfg, stats, device, topo, trace)) {}

CudaCollectives::~CudaCollectives() = default;

at::Device CudaCollectives::device() const { return impl_->device_; }
void CudaCollectives::startCoalescing() { impl_->startCoalescing(); }
WorkPtr CudaCollectives::endCoalescing(const CudaOpInfo& info) {
  return impl_->endCoalescing(info);
}
void CudaCollectives::cancelCoalescing() { impl_->cancelCoalescing(); }
void CudaCollectives::shutdown() { impl_->shutdown(); }
void CudaCollectives::abort() { impl_->abort("fastcomm: process group aborted"); }

bool CudaCollectives::currentStreamCapturing(at::Device device) {
  return isCapturing(at::cuda::getCurrentCUDAStream(device.index()).stream());
}

nccl::Call CudaCollectives::Impl::call(ncclComm_t comm, cudaStream_t s) const {
  return nccl::Call{comm, s, rank_, size_};
}

WorkPtr CudaCollectives::allreduce(Tensors tensors, RedOp op, const CudaOpInfo& info) {
  if (tensors.size() == 1) {
    const at::Tensor& t = tensors[0];
    if (impl_->useHier(t, op, info)) return impl_->launchHier(info, t, op);
    NvlinkCollectives* nvlink = impl_->nvlinkForCall();
    const NvlinkAlgo algo = nvlink != nullptr ? nvlink->choose(t, op) : NvlinkAlgo::None;
    if (algo != NvlinkAlgo::None) {
      return impl_->launchNvlink(
          info, tensors, tensors,
          algo == NvlinkAlgo::OneShot ? "nvlink_one_shot" : "nvlink_two_shot",
          [t, op, algo](NvlinkCollectives* nv, cudaStream_t s, uint64_t seq, bool captured) {
            nccl::DeviceContig c(t);
            c.load();
            nv->allreduce(c.work, c.work, op, algo, s, seq, captured);
            c.finish();
          });
    }
  }
  Impl* impl = impl_.get();
  return impl->launch(info, tensors, tensors, [impl, tensors, op](ncclComm_t c, cudaStream_t s) {
    nccl::allreduce(impl->call(c, s), tensors, op);
  });
}

WorkPtr CudaCollectives::broadcast(at::Tensor tensor, int root, const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, {tensor}, {tensor}, [impl, tensor, root](ncclComm_t c, cudaStream_t s) {
    nccl::broadcast(impl->call(c, s), tensor, root);
  });
}

WorkPtr CudaCollectives::reduce(at::Tensor tensor, RedOp op, int root, const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, {tensor}, {tensor},
                      [impl, tensor, op, root](ncclComm_t c, cudaStream_t s) {
                        nccl::reduce(impl->call(c, s), tensor, op, root);
                      });
}

WorkPtr CudaCollectives::allgather(Tensors outputs, at::Tensor input, const CudaOpInfo& info) {
  NvlinkCollectives* nvlink = impl_->nvlinkForCall();
  if (nvlink != nullptr && outputs.size() == 1 && outputs[0].is_contiguous() &&
      outputs[0].numel() == impl_->size_ * input.numel() &&
      outputs[0].scalar_type() == input.scalar_type() && nvlink->takesAllgather(input)) {
    const at::Tensor out = outputs[0];
    return impl_->launchNvlink(
        info, {input}, outputs, "nvlink_all_gather",
        [input, out](NvlinkCollectives* nv, cudaStream_t s, uint64_t seq, bool captured) {
          nv->allgather(input.contiguous(), out, s, seq, captured);
        });
  }
  Impl* impl = impl_.get();
  return impl->launch(info, {input}, outputs, [impl, outputs, input](ncclComm_t c, cudaStream_t s) {
    nccl::allgather(impl->call(c, s), outputs, input);
  });
}

WorkPtr CudaCollectives::gather(Tensors outputs, at::Tensor input, int root,
                                const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, {input}, outputs,
                      [impl, outputs, input, root](ncclComm_t c, cudaStream_t s) {
                        nccl::gather(impl->call(c, s), outputs, input, root);
                      });
}

WorkPtr CudaCollectives::scatter(at::Tensor output, Tensors inputs, int root,
                                 const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, inputs, {output},
                      [impl, output, inputs, root](ncclComm_t c, cudaStream_t s) {
                        nccl::scatter(impl->call(c, s), output, inputs, root);
                      });
}

WorkPtr CudaCollectives::reduceScatter(at::Tensor output, Tensors inputs, RedOp op,
                                       const CudaOpInfo& info) {
  NvlinkCollectives* nvlink = impl_->nvlinkForCall();
  if (nvlink != nullptr && inputs.size() == 1 && inputs[0].is_contiguous() &&
      inputs[0].numel() == impl_->size_ * output.numel() &&
      inputs[0].scalar_type() == output.scalar_type() && nvlink->takesReduceScatter(output, op)) {
    const at::Tensor in = inputs[0];
    return impl_->launchNvlink(
        info, inputs, {output}, "nvlink_reduce_scatter",
        [in, output, op](NvlinkCollectives* nv, cudaStream_t s, uint64_t seq, bool captured) {
          nccl::DeviceContig c(output);
          nv->reduceScatter(in, c.work, op, s, seq, captured);
          c.finish();
        });
  }
  Impl* impl = impl_.get();
  return impl->launch(info, inputs, {output},
                      [impl, output, inputs, op](ncclComm_t c, cudaStream_t s) {
                        nccl::reduceScatter(impl->call(c, s), output, inputs, op);
                      });
}

WorkPtr CudaCollectives::alltoall(Tensors outputs, Tensors inputs, std::vector<int64_t> sendCounts,
                                  std::vector<int64_t> recvCounts, const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, inputs, outputs, [=](ncclComm_t c, cudaStream_t s) {
    nccl::alltoall(impl->call(c, s), outputs, inputs, sendCounts, recvCounts);
  });
}

WorkPtr CudaCollectives::send(at::Tensor tensor, int peer, const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, {tensor}, {tensor}, [impl, tensor, peer](ncclComm_t c, cudaStream_t s) {
    nccl::send(impl->call(c, s), tensor, peer);
  });
}

WorkPtr CudaCollectives::recv(at::Tensor tensor, int peer, const CudaOpInfo& info) {
  Impl* impl = impl_.get();
  return impl->launch(info, {tensor}, {tensor}, [impl, tensor, peer](ncclComm_t c, cudaStream_t s) {
    nccl::recv(impl->call(c, s), tensor, peer);
  });
}

}  // namespace fastcomm
