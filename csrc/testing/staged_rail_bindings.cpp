// Test-only: the rail phase of the CUDA multi-node all_reduce
// (plans/staged_rail.hpp) on the CPU. An emulated device runs the device
// operations in issue order on one thread per lane (three for eager ops, one
// under capture, as on a GPU), its waits polling host flags as
// cuStreamWaitValue32 polls them on a GPU, so the proxy, the schedule, the flag protocol, the
// transports and the failure handling are the very code the GPU runs,
// checked without one (tests/test_staged_rail.py).
#include "testing/bindings.hpp"

#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/python.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "common/timeline.hpp"
#include "plans/staged_rail.hpp"

namespace py = pybind11;

namespace fastcomm {
namespace {

uint32_t loadFlag(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void storeFlag(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

struct Abandoned {};

class EmulatedDevice final : public StagedDevice {
 public:
  using Recording = std::vector<std::function<void()>>;

  explicit EmulatedDevice(int64_t window)
      : window_(window), flags_(kStagedFlagKinds * window * 16, 0) {
    for (int i = 0; i < kStagedLanes; ++i) lanes_[i].worker = std::thread([this, i] { loop(i); });
  }
  ~EmulatedDevice() override { stop(); }

  // A stream capture: the operations issued until endCapture() are recorded
  // (with the values they were issued with: addresses, sizes, slots), not
  // run; replay() runs them again, in order, after everything issued before,
  // as a CUDA graph launched on the stream would. Issuing thread only.
  void beginCapture() {
    TORCH_CHECK(!recording_, "fastcomm: staged rail test: already capturing");
    recording_ = std::make_shared<Recording>();
  }
  std::shared_ptr<const Recording> endCapture() {
    TORCH_CHECK(recording_, "fastcomm: staged rail test: not capturing");
    std::shared_ptr<const Recording> r = std::move(recording_);
    recording_.reset();
    return r;
  }
  void replay(const Recording& r) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Lane& p = lanes_[kLaneP];
      p.queue.insert(p.queue.end(), r.begin(), r.end());
      p.issued += static_cast<int64_t>(r.size());
    }
    cv_.notify_all();
  }

  // Runs `fn` on the device thread once everything issued before ran.
  void marker(std::function<void()> fn) { enqueue(std::move(fn)); }
  // True once nothing is queued or running (bounded wait).
  bool drain(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] {
      return std::all_of(lanes_, lanes_ + kStagedLanes,
                         [](const Lane& l) { return l.queue.empty() && !l.busy; });
    });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    for (Lane& l : lanes_)
      if (l.worker.joinable()) l.worker.join();
  }

  uint32_t* hostFlag(int kind, int64_t slot) override {
    return &flags_[(kind * window_ + slot) * 16];
  }
  void waitFlag(int kind, int64_t slot) override {
    uint32_t* f = hostFlag(kind, slot);
    enqueue([this, f] {
      while (loadFlag(f) != 1) {
        if (stopping()) throw Abandoned{};
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      storeFlag(f, 0);
    });
  }
  void setFlag(int kind, int64_t slot) override {
    uint32_t* f = hostFlag(kind, slot);
    enqueue([f] { storeFlag(f, 1); });
  }
  // The steps, each one operation (what one kernel does on a GPU).
  void packToStaging(WireDtype wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                     const HierLayout& l, int64_t k, int me) override {
    enqueue([=] {
      for (int j = 0; j < l.rails - 1; ++j) {
        const int p = peerNode(j, me);
        const char* src = static_cast<const char*>(chunk) + l.pieceOff(k, p) * esize;
        char* dst = static_cast<char*>(slots) + j * pitch;
        const int64_t len = l.pieceLen(k, p);
        if (wire == WireDtype::None) {
          std::memcpy(dst, src, len * esize);
        } else if (len > 0) {
          WireCodec(wire).encode(reinterpret_cast<const float*>(src), len, dst);
        }
      }
    });
  }
  void reduceFromStaging(at::ScalarType dt, RedOp op, WireDtype wire, void* own, const void* recv,
                         int64_t pitch, int nPeers, int64_t n, int64_t divisor,
                         void* out) override {
    enqueue([=] {
      auto peer = [&](int j) { return static_cast<const char*>(recv) + j * pitch; };
      if (wire != WireDtype::None) {
        // The kernels' arithmetic: own + each peer in turn, in float32.
        const WireCodec codec(wire);
        float* o = static_cast<float*>(own);
        for (int j = 0; j < nPeers; ++j) codec.decodeAdd(peer(j), n, o);
        if (divisor > 0)
          for (int64_t i = 0; i < n; ++i) o[i] /= static_cast<float>(divisor);
        codec.encode(o, n, out);
        codec.decode(out, n, o);
        return;
      }
      std::vector<const void*> ins{own};
      for (int j = 0; j < nPeers; ++j) ins.push_back(peer(j));
      reduceInto(own, ins.data(), static_cast<int>(ins.size()), n, dt, op,
                 divisor > 0 ? static_cast<int>(divisor) : 1);
      if (out != nullptr) std::memcpy(out, own, n * static_cast<int64_t>(c10::elementSize(dt)));
    });
  }
  void gatherFromStaging(WireDtype wire, int64_t esize, const void* slots, int64_t pitch,
                         void* chunk, const HierLayout& l, int64_t k, int me) override {
    enqueue([=] {
      for (int j = 0; j < l.rails - 1; ++j) {
        const int p = peerNode(j, me);
        const char* src = static_cast<const char*>(slots) + j * pitch;
        char* dst = static_cast<char*>(chunk) + l.pieceOff(k, p) * esize;
        const int64_t len = l.pieceLen(k, p);
        if (wire == WireDtype::None) {
          std::memcpy(dst, src, len * esize);
        } else if (len > 0) {
          WireCodec(wire).decode(src, len, reinterpret_cast<float*>(dst));
        }
      }
    });
  }
  bool capturing() override { return recording_ != nullptr; }
  // A lane's operations run on a thread of its own; fork and join are
  // operations that wait for the other lanes' counts of finished operations
  // (what an event records).
  void forkLanes() override {
    const int64_t upTo = issuedOn(kLaneP);
    for (int lane : {kLaneA, kLaneB}) enqueueOn(lane, waitForLane(kLaneP, upTo));
  }
  void useLane(int lane) override { current_ = lane; }
  void joinLanes() override {
    for (int lane : {kLaneA, kLaneB}) enqueueOn(kLaneP, waitForLane(lane, issuedOn(lane)));
    current_ = kLaneP;
  }
  void hostCall(void (*fn)(void*), void* arg) override {
    // In stream order on the device thread, as CUDA runs a host function
    // once the stream's earlier work is done (and holds the stream meanwhile).
    enqueue([fn, arg] { fn(arg); });
  }

  // "" once every flag is back at its initial value (free slots 1, the rest
  // 0), else what is not, after `limit`: the proxy may still be finishing
  // the last op when the device already ran it.
  std::string flagsAtRest(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      std::string bad;
      for (int kind = 0; kind < kStagedFlagKinds; ++kind)
        for (int64_t w = 0; w < window_; ++w) {
          const uint32_t v = loadFlag(hostFlag(kind, w));
          if (v != (kind == kFlagFree ? 1u : 0u))
            bad += " flag " + std::to_string(kind) + " of slot " + std::to_string(w) + " is " +
                   std::to_string(v) + ";";
        }
      if (bad.empty() || std::chrono::steady_clock::now() >= until) return bad;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  bool stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  }
  void enqueue(std::function<void()> fn) {
    if (recording_) {
      // The rail records on one stream (staged_rail.hpp, "Streams").
      TORCH_CHECK(current_ == kLaneP, "fastcomm: staged rail test: a lane in a capture");
      recording_->push_back(std::move(fn));
      return;
    }
    enqueueOn(current_, std::move(fn));
  }
  void enqueueOn(int lane, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      lanes_[lane].queue.push_back(std::move(fn));
      ++lanes_[lane].issued;
    }
    cv_.notify_all();
  }
  int64_t issuedOn(int lane) {
    std::lock_guard<std::mutex> lock(mu_);
    return lanes_[lane].issued;
  }
  // An operation that waits until `lane` finished its first `count`.
  std::function<void()> waitForLane(int lane, int64_t count) {
    return [this, lane, count] {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || lanes_[lane].finished >= count; });
      if (lanes_[lane].finished < count) throw Abandoned{};
    };
  }
  void loop(int lane) {
    Lane& me = lanes_[lane];
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !me.queue.empty(); });
        if (me.queue.empty()) return;
        fn = std::move(me.queue.front());
        me.queue.pop_front();
        me.busy = true;
      }
      try {
        fn();
      } catch (const Abandoned&) {
        std::lock_guard<std::mutex> lock(mu_);
        me.queue.clear();  // stopped while waiting: what follows never runs
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        me.busy = false;
        ++me.finished;
      }
      cv_.notify_all();
    }
  }

  struct Lane {
    std::deque<std::function<void()>> queue;
    bool busy = false;
    int64_t issued = 0, finished = 0;  // operations
    std::thread worker;
  };

  int64_t window_;
  std::vector<uint32_t> flags_;
  std::shared_ptr<Recording> recording_;  // while capturing (issuing thread)
  int current_ = kLaneP;                  // where operations go (issuing thread)
  std::mutex mu_;
  std::condition_variable cv_;
  Lane lanes_[kStagedLanes];
  bool stop_ = false;
};

RedOp redOpOf(const std::string& name) {
  static const std::map<std::string, RedOp> ops{{"SUM", RedOp::Sum},
                                                {"AVG", RedOp::Avg},
                                                {"PRODUCT", RedOp::Product},
                                                {"MIN", RedOp::Min},
                                                {"MAX", RedOp::Max}};
  auto it = ops.find(name);
  TORCH_CHECK(it != ops.end(), "fastcomm: no staged all_reduce for op ", name);
  return it->second;
}

// Every rank of the store's group is one node; the rail is the whole group.
class StagedRailEndpoint {
 public:
  StagedRailEndpoint(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                     int rank, int size, int64_t chunkBytes, int64_t window, int64_t lag,
                     const std::string& wire, std::chrono::milliseconds timeout)
      : timeout_(timeout), rails_(size), chunkBytes_(chunkBytes), dev_(window) {
    TORCH_CHECK(window >= kCudaWindowMin && window <= kCudaWindowMax,
                "fastcomm: staged rail test: window must be from ", kCudaWindowMin, " to ",
                kCudaWindowMax);
    auto group = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    std::vector<int> ranks(size);
    for (int r = 0; r < size; ++r) ranks[r] = r;
    StagedRail::Hooks hooks;
    hooks.abortGroup = [this](const std::string& why) {
      // What the CUDA side's abort does to the rail.
      if (rail_) rail_->abort(why);
    };
    rail_ = std::make_unique<StagedRail>(dev_, ranks, rank, rank, size, chunkBytes, window, lag,
                                         parseWireDtype(wire), group, hooks);
    const Config cfg = Config::fromEnv();
    if (cfg.timeline) Timeline::setEnabled(true);  // as a process group would
    rail_->connect("tcp", cfg, c10::make_intrusive<c10d::PrefixStore>("rail", group),
                   OpContext::start("staged rail setup", 0, timeout),
                   [this](StagedRail::Staging& s, bool /*deviceMemoryMoves: never over tcp*/) {
                     buffer_.reset(new char[s.bytes + 256]);
                     const auto at = reinterpret_cast<uintptr_t>(buffer_.get());
                     s.base = buffer_.get() + (256 - at % 256) % 256;
                     s.device = false;
                   });
  }
  ~StagedRailEndpoint() { close(); }

  // Issues an in-place all_reduce of the contiguous CPU tensor `t`: a ticket
  // for wait(), or -1 while capturing (the op then runs with every replay).
  int64_t issue(const at::Tensor& t, const std::string& opName) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && t.numel() > 0,
                "fastcomm: staged rail test: a non-empty contiguous CPU tensor is needed");
    const RedOp op = redOpOf(opName);
    const auto ctx = OpContext::start("all_reduce", ++seq_, timeout_);
    if (capture_) {
      // The graph keeps its buffers (as a CUDA graph's memory pool does); a
      // failure in a replay fails the replays of it in flight.
      capture_->keep.push_back(t);
      std::weak_ptr<Graph> g = capture_;
      rail_->allreduce(static_cast<char*>(t.data_ptr()), t.numel(), t.scalar_type(), op, ctx,
                       [g](std::exception_ptr e) {
                         if (auto graph = g.lock()) graph->fail(e);
                       });
      return -1;
    }
    auto p = std::make_shared<Pending>();
    p->tensor = t;
    rail_->allreduce(static_cast<char*>(t.data_ptr()), t.numel(), t.scalar_type(), op, ctx,
                     [p](std::exception_ptr e) { p->fail(e); });
    dev_.marker([p] { p->finish(); });
    const int64_t id = nextTicket_++;
    pending_[id] = p;
    return id;
  }

  // Between captureBegin() and captureEnd(), issue() records its ops into a
  // graph instead of running them; replay(graph) runs them all again.
  void captureBegin() {
    TORCH_CHECK(!capture_, "fastcomm: staged rail test: already capturing");
    capture_ = std::make_shared<Graph>();
    dev_.beginCapture();
  }
  int64_t captureEnd() {
    TORCH_CHECK(capture_, "fastcomm: staged rail test: not capturing");
    capture_->ops = dev_.endCapture();
    const int64_t id = nextGraph_++;
    graphs_[id] = std::move(capture_);
    capture_.reset();
    return id;
  }
  // A ticket for wait(): done once the replay ran on the device, raising the
  // error of a captured op that failed in it.
  int64_t replay(int64_t graph) {
    auto it = graphs_.find(graph);
    TORCH_CHECK(it != graphs_.end(), "fastcomm: unknown graph ", graph);
    auto g = it->second;
    auto p = std::make_shared<Pending>();
    {
      std::lock_guard<std::mutex> lock(g->mu);
      g->inflight.push_back(p);
    }
    dev_.replay(*g->ops);
    dev_.marker([g, p] {
      g->finished(p);
      p->finish();
    });
    const int64_t id = nextTicket_++;
    pending_[id] = p;
    return id;
  }

  std::string flagsAtRest(double limitS) {
    return dev_.flagsAtRest(std::chrono::milliseconds(static_cast<int64_t>(limitS * 1000)));
  }

  // Waits for op `ticket` on the device, then raises its error if it failed.
  void wait(int64_t ticket) {
    auto it = pending_.find(ticket);
    TORCH_CHECK(it != pending_.end(), "fastcomm: unknown ticket ", ticket);
    auto p = it->second;
    pending_.erase(it);
    std::unique_lock<std::mutex> lock(p->mu);
    // The rail itself fails within its timeout and then releases the
    // device; this bound only turns a hang of the code under test into an
    // error instead of a stuck test.
    const bool done =
        p->cv.wait_for(lock, timeout_ + std::chrono::seconds(20), [&] { return p->done; });
    if (p->error) std::rethrow_exception(p->error);
    TORCH_CHECK(done, "fastcomm: staged rail test: op ", ticket, " hung");
  }

  void close() {
    if (!rail_) return;
    const bool drained = rail_->failed() ? dev_.drain(std::chrono::seconds(10))
                                         : dev_.drain(timeout_ + std::chrono::seconds(20));
    // Not drained: the device may still reach a recorded host call before it
    // stops, so the rail must not free the captured descriptors.
    rail_->stop(/*deviceMayRun=*/!drained);
    dev_.stop();
    rail_.reset();
  }

 private:
  struct Pending {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    at::Tensor tensor;
    void fail(std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = e;
    }
    void finish() {
      {
        std::lock_guard<std::mutex> lock(mu);
        done = true;
      }
      cv.notify_all();
    }
  };
  struct Graph {
    std::shared_ptr<const EmulatedDevice::Recording> ops;
    std::vector<at::Tensor> keep;
    std::mutex mu;
    std::deque<std::shared_ptr<Pending>> inflight;  // replays not finished yet
    void fail(std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& p : inflight) p->fail(e);
    }
    void finished(const std::shared_ptr<Pending>& p) {
      std::lock_guard<std::mutex> lock(mu);
      inflight.erase(std::find(inflight.begin(), inflight.end(), p));
    }
  };
  std::chrono::milliseconds timeout_;
  int rails_ = 0;
  int64_t chunkBytes_ = 0;
  EmulatedDevice dev_;
  std::unique_ptr<char[]> buffer_;
  std::unique_ptr<StagedRail> rail_;
  uint64_t seq_ = 0;
  int64_t nextTicket_ = 0;
  std::map<int64_t, std::shared_ptr<Pending>> pending_;
  std::shared_ptr<Graph> capture_;  // while capturing
  std::map<int64_t, std::shared_ptr<Graph>> graphs_;
  int64_t nextGraph_ = 0;
};

}  // namespace

namespace testing {

void bindStagedRail(py::module_& m) {
  py::class_<StagedRailEndpoint>(m, "_StagedRailEndpoint")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                       int rank, int size, int64_t chunkBytes, int64_t window, int64_t lag,
                       const std::string& wire, double timeoutS) {
             return std::make_unique<StagedRailEndpoint>(
                 store, prefix, rank, size, chunkBytes, window, lag, wire,
                 std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000)));
           }),
           py::arg("store"), py::arg("prefix"), py::arg("rank"), py::arg("size"),
           py::arg("chunk_bytes"), py::arg("window") = Config().cudaWindow,
           py::arg("lag") = Config().cudaLag, py::arg("wire") = "none", py::arg("timeout_s") = 30.0,
           py::call_guard<py::gil_scoped_release>())
      .def("issue", &StagedRailEndpoint::issue, py::arg("tensor"), py::arg("op") = "SUM",
           py::call_guard<py::gil_scoped_release>())
      .def("wait", &StagedRailEndpoint::wait, py::arg("ticket"),
           py::call_guard<py::gil_scoped_release>())
      .def("capture_begin", &StagedRailEndpoint::captureBegin,
           py::call_guard<py::gil_scoped_release>())
      .def("capture_end", &StagedRailEndpoint::captureEnd, py::call_guard<py::gil_scoped_release>())
      .def("replay", &StagedRailEndpoint::replay, py::arg("graph"),
           py::call_guard<py::gil_scoped_release>())
      .def("flags_at_rest", &StagedRailEndpoint::flagsAtRest, py::arg("limit_s") = 5.0,
           py::call_guard<py::gil_scoped_release>())
      .def("close", &StagedRailEndpoint::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace testing
}  // namespace fastcomm
