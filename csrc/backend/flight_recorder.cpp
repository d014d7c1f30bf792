#include "backend/flight_recorder.hpp"

#include <c10/util/Exception.h>
#include <pthread.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>

#include "common/deadline.hpp"
#include "common/logging.hpp"
#include "common/reduce.hpp"
#include "common/thread_name.hpp"

namespace fastcomm {

namespace {

// The format of torch's FlightRecorder dumps this one follows.
constexpr const char* kDumpVersion = "2.10";
// Keys in the root of the groups' store: a counter every dump request bumps
// and the latest request's reason.
constexpr const char* kDumpCounterKey = "fastcomm/trace_dump";
constexpr const char* kDumpReasonKey = "fastcomm/trace_dump_reason";
// How often the watcher looks for a peer's dump request in the store, and
// for the dump signal's flag.
constexpr auto kStorePollPeriod = std::chrono::milliseconds(1000);
constexpr auto kSignalCheckPeriod = std::chrono::milliseconds(100);
// The counter seen of a store that failed (not asked again).
constexpr int64_t kDeadStore = -1;
// How long the last group's shutdown waits for the watcher to leave.
constexpr auto kWatcherExitWait = std::chrono::seconds(2);

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The calling thread's name, read once per thread (the read is a syscall).
const std::string& threadName() {
  thread_local const std::string name = [] {
    char buf[32] = {};
    if (pthread_getname_np(pthread_self(), buf, sizeof(buf)) != 0) return std::string("?");
    return std::string(buf);
  }();
  return name;
}

uint64_t threadId() {
  thread_local const uint64_t id = static_cast<uint64_t>(pthread_self());
  return id;
}

std::atomic<uint64_t> gNextRecordId{0};
std::atomic<uint64_t> gNextPgId{0};

// The store under every PrefixStore (torch's groups and fastcomm's epochs
// prefix theirs): all ranks of a job share it.
c10::intrusive_ptr<c10d::Store> rootOf(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    store = prefixed->getUnderlyingStore();
  }
  return store;
}

// torch's FlightRecorder names of fastcomm's ops where they differ (the
// analysers match collectives by these names).
std::string frOpName(const char* name) {
  static const std::pair<const char*, const char*> kRenamed[] = {
      {"all_reduce_coalesced", "allreduce_coalesced"},
      {"all_gather_coalesced", "allgather_coalesced"},
      {"all_gather_into_tensor", "_all_gather_base"},
      {"reduce_scatter_tensor", "_reduce_scatter_base"},
      {"recv_anysource", "recv"},
  };
  for (const auto& [ours, theirs] : kRenamed)
    if (std::strcmp(name, ours) == 0) return theirs;
  return name;
}

// ---- the dump trigger of FASTCOMM_TRACE_SIGNAL --------------------------------

std::atomic<int> gSignalled{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler's flag");
struct sigaction gPreviousAction {};
int gInstalledSignal = 0;

// Async-signal-safe: it only sets a lock-free flag, which the watcher checks
// every kSignalCheckMs, and calls the handler it replaced.
void onDumpSignal(int sig, siginfo_t* info, void* uctx) {
  gSignalled.store(sig, std::memory_order_relaxed);
  if ((gPreviousAction.sa_flags & SA_SIGINFO) && gPreviousAction.sa_sigaction != nullptr) {
    gPreviousAction.sa_sigaction(sig, info, uctx);
  } else if (!(gPreviousAction.sa_flags & SA_SIGINFO) && gPreviousAction.sa_handler != SIG_DFL &&
             gPreviousAction.sa_handler != SIG_IGN && gPreviousAction.sa_handler != nullptr) {
    gPreviousAction.sa_handler(sig);
  }
}

// A dump that must not raise (a failure path, the watcher).
void tryDump(const std::string& reason) {
  try {
    dumpTrace("", reason);
  } catch (const std::exception& e) {
    FASTCOMM_LOG(Warn, "flight recorder: no dump (" << reason << "): " << errorText(e));
  }
}

}  // namespace

// ---- entries --------------------------------------------------------------------

struct TraceRing::Entry {
  uint64_t id = 0;  // ring-local, from 1; 0: an empty slot
  uint64_t recordId = 0;
  uint64_t collSeq = 0, p2pSeq = 0, opId = 0;
  const char* name = "";
  bool p2p = false;
  int redop = -1, root = -1, peer = -1;
  int64_t timeoutMs = 0;
  int64_t createdNs = 0, startedNs = 0, completedNs = 0;  // 0: not yet
  bool retired = false;
  // Every input's then every output's dims, back to back; their ranks and dtypes.
  std::vector<int64_t> sizes;
  std::vector<int32_t> ranks;
  std::vector<c10::ScalarType> dtypes;
  size_t inputs = 0;
  std::string threadName;
  uint64_t threadId = 0;
  std::shared_ptr<torch::CapturedTraceback> stack;
};

struct TraceRing::Snapshot {
  uint64_t pgId;
  std::string name, desc;
  std::vector<uint64_t> ranks;
  int rank;
  int64_t lastEnqueued, lastStarted, lastCompleted;
  std::vector<Entry> entries;  // oldest first
};

// ---- the registry of live rings, dumps and the watcher thread ---------------------

class TraceRing::Registry {
 public:
  static Registry& get() {
    static Registry* registry = new Registry();  // leaked: outlives every group
    return *registry;
  }

  void add(const std::shared_ptr<TraceRing>& ring) {
    const Config& cfg = ring->cfg_;
    std::unique_lock<std::mutex> lock(mu_);
    rings_.erase(std::remove_if(rings_.begin(), rings_.end(),
                                [](const std::weak_ptr<TraceRing>& w) { return w.expired(); }),
                 rings_.end());
    rings_.push_back(ring);
    if (cfg.traceSignal != 0 && gInstalledSignal == 0) installSignal(cfg.traceSignal);
    if (!cfg.traceDumpOnTimeout && gInstalledSignal == 0) return;
    if (cfg.traceDumpOnTimeout && ring->rootStore_) {
      // Requests made before this group existed are not for it.
      bool known = false;
      for (const auto& s : seen_) known = known || s.first == ring->rootStore_;
      if (!known) {
        lock.unlock();
        int64_t now = kDeadStore;
        try {
          now = ring->rootStore_->add(kDumpCounterKey, 0);
        } catch (const std::exception& e) {
          FASTCOMM_LOG(Debug,
                       "flight recorder: no dump requests through the store: " << errorText(e));
        }
        lock.lock();
        known = false;
        for (const auto& s : seen_) known = known || s.first == ring->rootStore_;
        if (!known) seen_.emplace_back(ring->rootStore_, now);
      }
    }
    if (!watcher_.joinable()) {
      // Its own stop flag: a watcher being stopped by remove() may still be
      // on its way out when the next one starts.
      auto state = std::make_shared<WatcherState>();
      watcherState_ = state;
      watcher_ = std::thread([this, state] {
        watch(state->stop);
        std::lock_guard<std::mutex> lock(mu_);
        state->exited = true;
        exitedCv_.notify_all();
      });
    }
  }

  void remove(TraceRing* ring) {
    std::thread done;
    std::shared_ptr<WatcherState> state;
    {
      std::lock_guard<std::mutex> lock(mu_);
      rings_.erase(std::remove_if(rings_.begin(), rings_.end(),
                                  [ring](const std::weak_ptr<TraceRing>& w) {
                                    auto r = w.lock();
                                    return !r || r.get() == ring;
                                  }),
                   rings_.end());
      // Stores of groups that are gone are not watched (nor kept alive).
      std::vector<std::pair<c10::intrusive_ptr<c10d::Store>, int64_t>> kept;
      for (auto& s : seen_) {
        bool used = false;
        for (const auto& w : rings_)
          if (auto r = w.lock()) used = used || r->rootStore_ == s.first;
        if (used) kept.push_back(std::move(s));
      }
      seen_.swap(kept);
      if (!rings_.empty() || !watcher_.joinable()) return;
      state = std::move(watcherState_);
      state->stop = true;
      done = std::move(watcher_);
    }
    wakeCv_.notify_all();
    // The watcher leaves at once unless it is inside a dump or a store call
    // that hangs (its host stopped): then it is left to finish on its own.
    std::unique_lock<std::mutex> lock(mu_);
    const bool exited = done.get_id() != std::this_thread::get_id() &&
                        exitedCv_.wait_for(lock, kWatcherExitWait, [&] { return state->exited; });
    lock.unlock();
    if (exited) {
      done.join();
    } else {
      done.detach();
    }
  }

  std::vector<std::shared_ptr<TraceRing>> live() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<TraceRing>> out;
    for (const auto& w : rings_)
      if (auto r = w.lock()) out.push_back(std::move(r));
    return out;
  }

  // This process failed: the first failure stays in every later dump, and
  // the watcher asks the peers to dump.
  void failed(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (firstFailure_.empty()) firstFailure_ = why;
      peerRequests_.push_back(why);
    }
    wakeCv_.notify_all();
  }

  std::string firstFailure() {
    std::lock_guard<std::mutex> lock(mu_);
    return firstFailure_;
  }

  std::mutex dumpMu;  // one dump at a time

 private:
  Registry() = default;

  void installSignal(int sig) {
    struct sigaction sa {};
    sa.sa_sigaction = onDumpSignal;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(sig, &sa, &gPreviousAction) == 0) {
      gInstalledSignal = sig;
    } else {
      FASTCOMM_LOG(Warn,
                   "flight recorder: cannot handle signal " << sig << ": " << std::strerror(errno));
    }
  }

  struct WatcherState {
    bool stop = false;    // (under mu_)
    bool exited = false;  // (under mu_)
  };

  // `stop` is read under mu_.
  void watch(const bool& stop) {
    nameThisThread("fc-trace");
    auto nextStorePoll = Clock::now() + kStorePollPeriod;
    while (true) {
      std::vector<std::string> requests;
      std::vector<std::pair<c10::intrusive_ptr<c10d::Store>, int64_t>> stores;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wakeCv_.wait_for(lock, kSignalCheckPeriod, [&] { return stop || !peerRequests_.empty(); });
        if (stop) return;
        requests.swap(peerRequests_);
        if (!requests.empty() || Clock::now() >= nextStorePoll) {
          stores = seen_;
          nextStorePoll = Clock::now() + kStorePollPeriod;
        }
      }
      if (const int sig = gSignalled.exchange(0)) {
        tryDump("signal " + std::to_string(sig) + " (" + strsignal(sig) + ")");
      }
      for (auto& [store, seen] : stores) {
        if (seen == kDeadStore) continue;
        try {
          for (const auto& why : requests) {
            store->set(kDumpReasonKey, std::vector<uint8_t>(why.begin(), why.end()));
            seen = store->add(kDumpCounterKey, 1);
          }
          const int64_t now = store->add(kDumpCounterKey, 0);
          if (now > seen) {
            seen = now;
            const auto v = store->get(kDumpReasonKey);
            tryDump("asked by a peer: " + std::string(v.begin(), v.end()));
          }
        } catch (const std::exception& e) {
          // Its host (usually rank 0) is gone: the job is ending or failed.
          // Not asked again (each attempt would log the store's error).
          FASTCOMM_LOG(Debug,
                       "flight recorder: the store is unreachable, no more dump requests "
                       "through it: "
                           << errorText(e));
          seen = kDeadStore;
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : seen_)
        for (const auto& [store, seen] : stores)
          if (s.first == store && s.second != kDeadStore)
            s.second = seen == kDeadStore ? kDeadStore : std::max(s.second, seen);
    }
  }

  std::mutex mu_;
  std::vector<std::weak_ptr<TraceRing>> rings_;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Store>, int64_t>> seen_;  // root store, counter
  std::vector<std::string> peerRequests_;
  std::string firstFailure_;
  std::thread watcher_;
  std::shared_ptr<WatcherState> watcherState_;  // the running watcher's
  std::condition_variable exitedCv_;
  std::condition_variable wakeCv_;  // a stop or a peer request for the watcher
};

// ---- the ring -------------------------------------------------------------------

TraceRing::TraceRing(const Config& cfg, TraceGroup group)
    : capacity_(static_cast<size_t>(cfg.traceBufferSize)),
      pythonStack_(cfg.tracePythonStack),
      pgId_(gNextPgId.fetch_add(1)),
      group_(std::move(group)),
      rootStore_(group_.store ? rootOf(group_.store) : nullptr),
      cfg_(cfg) {}

TraceRing::~TraceRing() = default;

std::shared_ptr<TraceRing> TraceRing::create(const Config& cfg, TraceGroup group) {
  TORCH_CHECK(cfg.traceBufferSize > 0, "fastcomm: internal: a flight recorder ring of no entries");
  std::shared_ptr<TraceRing> ring(new TraceRing(cfg, std::move(group)));
  Registry::get().add(ring);
  return ring;
}

void TraceRing::unregister() { Registry::get().remove(this); }

TraceRing::Entry& TraceRing::slot(uint64_t id) { return entries_[(id - 1) % capacity_]; }

TraceRing::Entry& TraceRing::nextSlot(uint64_t id) {
  // The ring grows to its capacity as ops come (a group that runs a few ops
  // holds a few entries), then wraps.
  if (entries_.size() < capacity_) entries_.emplace_back();
  return slot(id);
}

uint64_t TraceRing::record(const TraceOp& op, const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& outputs,
                           std::chrono::milliseconds timeout) {
  std::shared_ptr<torch::CapturedTraceback> stack;
  if (pythonStack_) stack = torch::CapturedTraceback::gather(true, false, false);
  const int64_t now = nowNs();
  const uint64_t recordId = gNextRecordId.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);  // released before the replaced stack is
  if (desc_.empty() && group_.desc != nullptr) desc_ = *group_.desc;
  const uint64_t id = ++lastId_;
  Entry& e = nextSlot(id);
  e.id = id;
  e.recordId = recordId;
  if (op.p2p) {
    lastP2P_ = op.seq;
  } else {
    lastColl_ = op.seq;
    lastEnqueued_ = static_cast<int64_t>(op.seq);
  }
  e.collSeq = lastColl_;
  e.p2pSeq = lastP2P_;
  e.opId = opCount_++;
  e.name = op.name;
  e.p2p = op.p2p;
  e.redop = op.redop;
  e.root = op.root;
  e.peer = op.peer;
  e.timeoutMs = timeout.count();
  e.createdNs = now;
  e.startedNs = e.completedNs = 0;
  e.retired = false;
  e.sizes.clear();
  e.ranks.clear();
  e.dtypes.clear();
  e.inputs = inputs.size();
  for (const auto* list : {&inputs, &outputs}) {
    for (const auto& t : *list) {
      if (!t.defined()) {
        e.ranks.push_back(0);
        e.dtypes.push_back(c10::ScalarType::Undefined);
        continue;
      }
      const auto dims = t.sizes();
      e.ranks.push_back(static_cast<int32_t>(dims.size()));
      e.sizes.insert(e.sizes.end(), dims.begin(), dims.end());
      e.dtypes.push_back(t.scalar_type());
    }
  }
  const std::string& tn = threadName();
  if (e.threadName != tn) e.threadName = tn;
  e.threadId = threadId();
  e.stack.swap(stack);
  return id;
}

void TraceRing::started(uint64_t id) {
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = slot(id);
  if (e.id != id || e.startedNs != 0) return;
  e.startedNs = now;
  if (!e.p2p) lastStarted_ = std::max(lastStarted_, static_cast<int64_t>(e.collSeq));
}

void TraceRing::completed(uint64_t id) {
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = slot(id);
  if (e.id != id || e.completedNs != 0) return;
  if (e.startedNs == 0) e.startedNs = now;
  e.completedNs = now;
  e.retired = true;
  if (!e.p2p) {
    lastStarted_ = std::max(lastStarted_, static_cast<int64_t>(e.collSeq));
    lastCompleted_ = std::max(lastCompleted_, static_cast<int64_t>(e.collSeq));
  }
}

void TraceRing::retire(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = slot(id);
  if (e.id == id) e.retired = true;
}

void TraceRing::groupFailed(const std::string& why) {
  if (!cfg_.traceDumpOnTimeout) return;
  const uint64_t me = group_.ranks.empty() ? static_cast<uint64_t>(group_.rank)
                                           : group_.ranks[static_cast<size_t>(group_.rank)];
  Registry::get().failed("rank " + std::to_string(me) + ": " + why);
  tryDump("failure: " + why);
}

TraceRing::Snapshot TraceRing::snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.pgId = pgId_;
  s.name = group_.name.empty() ? std::to_string(pgId_) : group_.name;
  s.desc = desc_.empty() ? "undefined" : desc_;
  s.ranks = group_.ranks;
  s.rank = group_.rank;
  s.lastEnqueued = lastEnqueued_;
  s.lastStarted = lastStarted_;
  s.lastCompleted = lastCompleted_;
  const uint64_t n = std::min<uint64_t>(lastId_, capacity_);
  s.entries.reserve(n);
  for (uint64_t id = lastId_ - n + 1; id <= lastId_; ++id) s.entries.push_back(slot(id));
  return s;
}

// ---- dumps ----------------------------------------------------------------------

namespace {

using Dict = c10::Dict<c10::IValue, c10::IValue>;
using List = c10::List<c10::IValue>;

Dict newDict() { return Dict(c10::AnyType::get(), c10::AnyType::get()); }
List newList() { return List(c10::AnyType::get()); }

std::string ranksText(const std::vector<uint64_t>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

c10::IValue optionalNs(int64_t ns) { return ns == 0 ? c10::IValue() : c10::IValue(ns); }

std::string profilingName(const TraceRing::Entry& e, int myRank) {
  std::string name = "fastcomm:" + frOpName(e.name);
  if (!e.p2p) return name;
  const std::string peer = e.peer < 0 ? "?" : std::to_string(e.peer);
  const std::string me = std::to_string(myRank);
  return std::strcmp(e.name, "send") == 0 ? name + " " + me + "->" + peer
                                          : name + " " + me + "<-" + peer;
}

}  // namespace

std::string dumpTrace(const std::string& path, const std::string& reason) {
  auto& registry = TraceRing::Registry::get();
  const auto rings = registry.live();
  if (rings.empty()) return "";
  std::lock_guard<std::mutex> dumpLock(registry.dumpMu);
  std::vector<TraceRing::Snapshot> groups;
  for (const auto& r : rings) groups.push_back(r->snapshot());
  const TraceRing::Snapshot& first = groups.front();
  const uint64_t globalRank = first.ranks.empty() ? static_cast<uint64_t>(first.rank)
                                                  : first.ranks[static_cast<size_t>(first.rank)];

  // Every group's entries in the order they were recorded.
  std::vector<std::pair<const TraceRing::Snapshot*, const TraceRing::Entry*>> order;
  for (const auto& g : groups)
    for (const auto& e : g.entries) order.emplace_back(&g, &e);
  std::sort(order.begin(), order.end(),
            [](const auto& a, const auto& b) { return a.second->recordId < b.second->recordId; });

  std::vector<torch::CapturedTraceback*> stacks;
  for (const auto& [g, e] : order)
    if (e->stack) stacks.push_back(e->stack.get());
  torch::SymbolizedTracebacks symbols;
  if (!stacks.empty()) symbols = torch::symbolize(stacks);

  List entries = newList();
  size_t stackIndex = 0;
  for (const auto& [g, e] : order) {
    Dict d = newDict();
    List frames = newList();
    if (e->stack) {
      for (uint64_t f : symbols.tracebacks.at(stackIndex++)) {
        const auto& frame = symbols.all_frames.at(f);
        Dict fd = newDict();
        fd.insert("name", frame.funcname);
        fd.insert("filename", frame.filename);
        fd.insert("line", static_cast<int64_t>(frame.lineno));
        frames.push_back(fd);
      }
    }
    d.insert("frames", frames);
    d.insert("record_id", static_cast<int64_t>(e->recordId));
    d.insert("pg_id", static_cast<int64_t>(g->pgId));
    d.insert("process_group", c10::ivalue::Tuple::create(g->name, g->desc));
    d.insert("thread_name", e->threadName);
    d.insert("thread_id", std::to_string(e->threadId));
    d.insert("collective_seq_id", static_cast<int64_t>(e->collSeq));
    d.insert("p2p_seq_id", static_cast<int64_t>(e->p2pSeq));
    d.insert("op_id", static_cast<int64_t>(e->opId));
    d.insert("profiling_name", profilingName(*e, g->rank));
    d.insert("time_created_ns", e->createdNs);
    if (e->startedNs != 0 && e->completedNs != 0)
      d.insert("duration_ms", static_cast<double>(e->completedNs - e->startedNs) / 1e6);
    List inSizes = newList(), outSizes = newList(), inTypes = newList(), outTypes = newList();
    size_t at = 0;
    for (size_t t = 0; t < e->ranks.size(); ++t) {
      c10::List<int64_t> dims;
      for (int32_t k = 0; k < e->ranks[t]; ++k) dims.push_back(e->sizes[at++]);
      const bool input = t < e->inputs;
      (input ? inSizes : outSizes).push_back(dims);
      (input ? inTypes : outTypes).push_back(std::string(c10::toString(e->dtypes[t])));
    }
    d.insert("input_sizes", inSizes);
    d.insert("input_dtypes", inTypes);
    d.insert("output_sizes", outSizes);
    d.insert("output_dtypes", outTypes);
    d.insert("state", e->completedNs ? "completed" : e->startedNs ? "started" : "scheduled");
    d.insert("time_discovered_started_ns", optionalNs(e->startedNs));
    d.insert("time_discovered_completed_ns", optionalNs(e->completedNs));
    d.insert("retired", e->retired);
    d.insert("timeout_ms", e->timeoutMs);
    d.insert("is_p2p", e->p2p);
    // fastcomm's own fields (torch's readers skip keys they do not know).
    d.insert("reduce_op", e->redop < 0
                              ? c10::IValue()
                              : c10::IValue(std::string(redOpName(static_cast<RedOp>(e->redop)))));
    d.insert("root", e->root < 0 ? c10::IValue() : c10::IValue(static_cast<int64_t>(e->root)));
    entries.push_back(d);
  }

  Dict pgConfig = newDict(), pgStatus = newDict();
  for (const auto& g : groups) {
    Dict c = newDict();
    c.insert("name", g.name);
    c.insert("desc", g.desc);
    c.insert("ranks", ranksText(g.ranks));
    pgConfig.insert(g.name, c);
    Dict s = newDict();
    s.insert("last_enqueued_collective", g.lastEnqueued);
    s.insert("last_started_collective", g.lastStarted);
    s.insert("last_completed_collective", g.lastCompleted);
    pgStatus.insert(std::to_string(g.pgId), s);
  }
  Dict result = newDict();
  result.insert("version", kDumpVersion);
  result.insert("pg_config", pgConfig);
  result.insert("comm_lib_version", "fastcomm");
  result.insert("pg_status", pgStatus);
  result.insert("entries", entries);
  result.insert("rank", static_cast<int64_t>(globalRank));
  result.insert("pid", static_cast<int64_t>(::getpid()));
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  result.insert("hostname", std::string(host));
  result.insert("dump_reason", reason);
  result.insert("failure", registry.firstFailure());
  result.insert("time_ns", nowNs());

  std::string bytes;
  {
    torch::jit::Pickler pickler([&](const char* data, size_t size) { bytes.append(data, size); },
                                nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(result);
    pickler.stop();
  }

  const std::string target =
      path.empty() ? rings.front()->config().traceFile + std::to_string(globalRank) : path;
  // Written whole, then renamed: a reader never sees half a dump.
  const std::string tmp = target + ".tmp" + std::to_string(::getpid());
  try {
    const auto dir = std::filesystem::path(target).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir);
  } catch (const std::exception&) {
    // The open below names the problem.
  }
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      throw std::runtime_error("fastcomm: cannot write the flight recorder dump " + tmp + ": " +
                               std::strerror(errno));
    }
  }
  if (std::rename(tmp.c_str(), target.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("fastcomm: cannot write the flight recorder dump " + target + ": " +
                             err);
  }
  FASTCOMM_LOG(Warn, "flight recorder: " << order.size() << " entries of " << groups.size()
                                         << " group(s) written to " << target << " (" << reason
                                         << ")");
  return target;
}

}  // namespace fastcomm
