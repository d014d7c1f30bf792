#include "plans/staged_rail.hpp"

#include <sys/prctl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <sstream>

#include "common/thread_name.hpp"
#include "common/logging.hpp"
#include "common/timeline.hpp"

namespace fastcomm {
namespace {

// Without progress for this long, the proxy sleeps between polls.
constexpr auto kSpin = std::chrono::microseconds(100);
constexpr auto kNap = std::chrono::microseconds(20);
// After a failure: how often the proxy releases every device wait.
constexpr auto kDrainPeriod = std::chrono::microseconds(200);
// How long an error waits for a failed peer's published reason.
constexpr auto kReasonWait = std::chrono::seconds(2);

constexpr const char* kThread = "fc-cuda-proxy";

// Small ops: at least this many chunks, of at least kMinChunkBytes, so that
// their steps overlap; not more, since every chunk costs the proxy and the
// stream a fixed share.
constexpr int64_t kSmallOpChunks = 4;
constexpr int64_t kMinChunkBytes = 256 << 10;

int64_t roundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Bytes of one element's code on the wire (scales aside).
int64_t codeBytes(WireDtype wire) { return wire == WireDtype::INT8 ? 1 : 2; }

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

struct StagedRail::ChunkState {
  std::vector<std::unique_ptr<transport::Request>> rsRecv, agRecv, rsSend, agSend;
  int rsRecvPosted = 0, agRecvPosted = 0, rsSendPosted = 0, agSendPosted = 0;
  bool packed = false, rsArrived = false, reduced = false, agArrived = false, gathered = false,
       freed = false;
  // When the proxy saw each step (FASTCOMM_TIMELINE).
  Clock::time_point tRecvPosted{}, tPacked{}, tRsArrived{}, tReduced{}, tAgArrived{}, tFreed{};
  explicit ChunkState(int peers) : rsRecv(peers), agRecv(peers), rsSend(peers), agSend(peers) {}
};

// What a host call of the stream reaches the rail through. stop() clears
// `rail`, so a host call that runs later (a replay after the group was
// destroyed, which is not allowed, or one the owner could not wait for after
// a failure) touches no freed rail: it only finds nothing to feed.
struct StagedRail::Gate {
  std::mutex mu;
  StagedRail* rail = nullptr;
};

// An op handed to the proxy from the stream: a captured one (owned by the
// rail, run on every replay) or, once the rail has captured ops, an eager
// one (run once, frees itself).
struct StagedRail::HostOp {
  std::shared_ptr<Gate> gate;
  Op op;
  bool captured = false;
};

// ----------------------------------------------------------------------------- setup

StagedRail::Staging StagedRail::stagingFor(int rails, int64_t chunkBytes, int64_t window) {
  Staging s;
  s.pieceBytes = roundUp(HierLayout::pieceSlotBytes(rails, chunkBytes), 256);
  s.slotBytes = (3 * static_cast<int64_t>(rails - 1) + 1) * s.pieceBytes;
  s.bytes = window * s.slotBytes;
  return s;
}

HierLayout StagedRail::layoutFor(int64_t shardElems, at::ScalarType dt, RedOp op) const {
  const int64_t wsize =
      wireFor(dt, op) ? codeBytes(wire_) : static_cast<int64_t>(c10::elementSize(dt));
  // A small op in one chunk runs its steps one after the other (stage, send,
  // reduce, send, place): cut it into kSmallOpChunks chunks, down to
  // kMinChunkBytes, so they overlap. The same on every rank (the shard and
  // the agreed chunk size decide it).
  const int64_t chunk = std::clamp((shardElems + kSmallOpChunks - 1) / kSmallOpChunks * wsize,
                                   std::min(kMinChunkBytes, chunkBytes_), chunkBytes_);
  return HierLayout::make(shardElems, static_cast<int>(railRanks_.size()), chunk, wsize);
}

StagedRail::StagedRail(StagedDevice& device, std::vector<int> railRanks, int me, int groupRank,
                       int groupSize, int64_t chunkBytes, int64_t window, int64_t lag,
                       WireDtype wire, const c10::intrusive_ptr<c10d::Store>& store, Hooks hooks)
    : dev_(device),
      railRanks_(std::move(railRanks)),
      me_(me),
      groupRank_(groupRank),
      groupSize_(groupSize),
      exchange_(railRanks_.size() == 2),
      chunkBytes_(chunkBytes),
      window_(window),
      // Rank 0's window may be smaller than this rank's: the lag must stay below it.
      lag_(std::min(lag, window - 1)),
      wire_(wire),
      store_(store),
      hooks_(std::move(hooks)),
      gate_(std::make_shared<Gate>()) {
  gate_->rail = this;
  const int rails = static_cast<int>(railRanks_.size());
  TORCH_CHECK(rails >= 2 && me_ >= 0 && me_ < rails && railRanks_[me_] == groupRank_,
              "fastcomm: internal: bad rail");
  TORCH_CHECK(window_ >= kCudaWindowMin && window_ <= kCudaWindowMax && lag_ >= 1,
              "fastcomm: internal: staged window ", window_, " or lag ", lag_, " out of range");
  for (int j = 0; j < rails - 1; ++j) peers_.push_back(railRanks_[peerNode(j, me_)]);
  staging_ = stagingFor(rails, chunkBytes_, window_);
  for (int64_t w = 0; w < window_; ++w) storeFlag(dev_.hostFlag(kFlagFree, w), 1);
}

void StagedRail::connect(const std::string& transport, const Config& cfg,
                         const c10::intrusive_ptr<c10d::Store>& store, const OpContext& ctx,
                         const StagingAllocator& allocate) {
  // The reduce-scatter and all-gather messages of a chunk travel on
  // separate connections, each in chunk order, so the two phases never have
  // to agree on one interleaving.
  rsNet_ = transport::createTransport(transport, cfg);
  agNet_ = transport::createTransport(transport, cfg);
  // Where the staging lives depends on what the transports can move, so it
  // is allocated only now (each rank on its own: a peer's staging may be
  // host memory while this rank's is device memory, the bytes are the same).
  allocate(staging_, rsNet_->supportsDeviceMemory() && agNet_->supportsDeviceMemory());
  TORCH_CHECK(staging_.base != nullptr && reinterpret_cast<uintptr_t>(staging_.base) % 256 == 0,
              "fastcomm: internal: no staging for the rail");
  rsConns_ = rsNet_->connect(c10::make_intrusive<c10d::PrefixStore>("rs", store), groupRank_,
                             groupSize_, peers_, ctx);
  agConns_ = agNet_->connect(c10::make_intrusive<c10d::PrefixStore>("ag", store), groupRank_,
                             groupSize_, peers_, ctx);
  if (staging_.device) {
    rsMr_ = rsNet_->registerDeviceMemory(staging_.base, staging_.bytes);
    agMr_ = agNet_->registerDeviceMemory(staging_.base, staging_.bytes);
  } else {
    rsMr_ = rsNet_->registerMemory(staging_.base, staging_.bytes);
    agMr_ = agNet_->registerMemory(staging_.base, staging_.bytes);
  }
  proxy_ = std::thread([this] { proxyLoop(); });
}

StagedRail::~StagedRail() { stop(); }

std::string StagedRail::transportName() const { return rsNet_ ? rsNet_->name() : "?"; }

void StagedRail::stop(bool deviceMayRun) {
  {
    // First: an op that comes in after this could not be served.
    std::lock_guard<std::mutex> lock(gate_->mu);
    gate_->rail = nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (proxy_.joinable()) proxy_.join();
  if (aborter_.joinable()) aborter_.join();
  // No request may touch the staging once its owner frees it.
  if (rsNet_) rsNet_->close();
  if (agNet_) agNet_->close();
  rsConns_.clear();
  agConns_.clear();
  if (deviceMayRun) {
    // A replay may still run a host node that reads its descriptor; the
    // gate keeps it away from this rail.
    for (auto& h : captured_) (void)h.release();
  }
  captured_.clear();
}

void StagedRail::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (abortWhy_.empty()) abortWhy_ = why;
    failed_.store(true);
  }
  cv_.notify_all();
  // Requests in flight fail at once; peers see their connections close.
  if (rsNet_) rsNet_->close();
  if (agNet_) agNet_->close();
}

// ----------------------------------------------------------------------------- device side

char* StagedRail::sendSlot(int64_t slot, int j) const {
  return staging_.base + slot * staging_.slotBytes + j * staging_.pieceBytes;
}
char* StagedRail::recvSlot(int64_t slot, int j) const {
  return staging_.base + slot * staging_.slotBytes +
         (static_cast<int64_t>(peers_.size()) + j) * staging_.pieceBytes;
}
char* StagedRail::agSendSlot(int64_t slot) const {
  return staging_.base + slot * staging_.slotBytes +
         2 * static_cast<int64_t>(peers_.size()) * staging_.pieceBytes;
}
char* StagedRail::agRecvSlot(int64_t slot, int j) const {
  return staging_.base + slot * staging_.slotBytes +
         (2 * static_cast<int64_t>(peers_.size()) + 1 + j) * staging_.pieceBytes;
}

char* StagedRail::exchangeRecvSlot(int64_t slot) const {
  return staging_.base + slot * staging_.slotBytes + 2 * staging_.pieceBytes;
}

bool StagedRail::anyPeerPiece(const HierLayout& l, int64_t k) const {
  for (int j = 0; j < static_cast<int>(peers_.size()); ++j)
    if (l.pieceLen(k, peerNode(j, me_)) > 0) return true;
  return false;
}

void StagedRail::issueP(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize,
                        bool wire) {
  dev_.waitFlag(kFlagFree, slot);
  if (anyPeerPiece(l, k)) {
    dev_.packToStaging(wire ? wire_ : WireDtype::None, esize, shard + l.chunkOff(k) * esize,
                       sendSlot(slot, 0), staging_.pieceBytes, l, k, me_);
  }
  dev_.setFlag(kFlagPacked, slot);
}

void StagedRail::issueA(const HierLayout& l, int64_t k, int64_t slot, char* shard,
                        at::ScalarType dt, RedOp op, bool wire) {
  dev_.waitFlag(kFlagRsIn, slot);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t len = l.pieceLen(k, me_);
  if (len > 0) {
    char* own = shard + (l.chunkOff(k) + l.pieceOff(k, me_)) * esize;
    const int64_t divisor = op == RedOp::Avg ? groupSize_ : 0;
    dev_.reduceFromStaging(dt, op, wire ? wire_ : WireDtype::None, own, recvSlot(slot, 0),
                           staging_.pieceBytes, static_cast<int>(peers_.size()), len, divisor,
                           agSendSlot(slot));
  }
  dev_.setFlag(kFlagReduced, slot);
}

void StagedRail::issueB(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize,
                        bool wire) {
  dev_.waitFlag(kFlagAgIn, slot);
  if (anyPeerPiece(l, k)) {
    dev_.gatherFromStaging(wire ? wire_ : WireDtype::None, esize, agRecvSlot(slot, 0),
                           staging_.pieceBytes, shard + l.chunkOff(k) * esize, l, k, me_);
  }
  dev_.setFlag(kFlagGathered, slot);
}

void StagedRail::issuePWhole(const HierLayout& l, int64_t k, int64_t slot, char* shard,
                             int64_t esize, bool wire) {
  dev_.waitFlag(kFlagFree, slot);
  dev_.packToStaging(wire ? wire_ : WireDtype::None, esize, shard + l.chunkOff(k) * esize,
                     sendSlot(slot, 0), 0, HierLayout::wholeRange(l.chunkLen(k)), 0, 1);
  dev_.setFlag(kFlagPacked, slot);
}

void StagedRail::issueAWhole(const HierLayout& l, int64_t k, int64_t slot, char* shard,
                             at::ScalarType dt, RedOp op, bool wire) {
  dev_.waitFlag(kFlagRsIn, slot);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t len = l.chunkLen(k);
  char* own = shard + l.chunkOff(k) * esize;
  if (wire) {
    // This rank's operand as the peer receives it: its staged codes, decoded.
    dev_.gatherFromStaging(wire_, esize, sendSlot(slot, 0), 0, own, HierLayout::wholeRange(len), 0,
                           1);
  }
  const int64_t divisor = op == RedOp::Avg ? groupSize_ : 0;
  dev_.reduceFromStaging(dt, op, wire ? wire_ : WireDtype::None, own, exchangeRecvSlot(slot),
                         staging_.pieceBytes, 1, len, divisor, wire ? sendSlot(slot, 0) : nullptr);
  dev_.setFlag(kFlagReduced, slot);
}

void StagedRail::allreduce(char* shard, int64_t shardElems, at::ScalarType dt, RedOp op,
                           const OpContext& ctx, std::function<void(std::exception_ptr)> failWork) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load()) {
      throwCommError("fastcomm: " + ctx.describe() +
                     ": the multi-node path of this group failed earlier: " + abortWhy_);
    }
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const bool wire = wireFor(dt, op);
  const HierLayout l = layoutFor(shardElems, dt, op);

  const bool capture = dev_.capturing();
  Op desc;
  desc.name = std::string(ctx.name) + (capture ? " (in a CUDA graph replay)" : "");
  desc.seq = ctx.seq;
  desc.timeout = ctx.timeout;
  desc.deadline = ctx.deadline;  // captured: reset by every replay's host call
  desc.layout = l;
  desc.firstChunk = nextChunk_;
  desc.esize = esize;
  desc.wire = wire ? wire_ : WireDtype::None;
  desc.failWork = std::move(failWork);
  const int64_t first = nextChunk_;
  nextChunk_ += l.chunks;
  if (capture || !captured_.empty()) {
    // Handed over in stream order, before the op's first device wait (the
    // header says why eager ops join once a graph may replay).
    auto h = std::make_unique<HostOp>();
    h->gate = gate_;
    h->op = std::move(desc);
    h->captured = capture;
    dev_.hostCall(&StagedRail::enqueueFromStream, h.get());
    if (capture) {
      captured_.push_back(std::move(h));
    } else {
      (void)h.release();  // the host call frees it
    }
  } else {
    // First, so the proxy posts the receives while the device still works on
    // what came before.
    enqueue(std::move(desc));
  }

  // The schedule (see the header): P of the first window_ chunks, then for
  // each chunk t its reduction A(t), the all-gather copies B(t - lag_) and
  // the staging P of the chunk that reuses B's slot. Eager ops put each step
  // on its lane, in this same order; captured ones keep one stream.
  const bool lanes = !capture;
  auto lane = [&](int which) {
    if (lanes) dev_.useLane(which);
  };
  const int64_t n = l.chunks;
  auto slotOf = [&](int64_t k) { return (first + k) % window_; };
  auto P = [&](int64_t k) {
    lane(kLaneP);
    if (exchange_) {
      issuePWhole(l, k, slotOf(k), shard, esize, wire);
    } else {
      issueP(l, k, slotOf(k), shard, esize, wire);
    }
  };
  auto A = [&](int64_t k) {
    lane(kLaneA);
    if (exchange_) {
      issueAWhole(l, k, slotOf(k), shard, dt, op, wire);
    } else {
      issueA(l, k, slotOf(k), shard, dt, op, wire);
    }
  };
  auto B = [&](int64_t k) {
    lane(kLaneB);
    issueB(l, k, slotOf(k), shard, esize, wire);
  };
  // The two-member exchange has no all-gather step: no B, and the slot of
  // chunk t is staged again right after its reduction (no lag).
  const int64_t lag = exchange_ ? 0 : lag_;
  if (lanes) dev_.forkLanes();
  for (int64_t k = 0; k < std::min(window_, n); ++k) P(k);
  for (int64_t t2 = 0; t2 < n; ++t2) {
    A(t2);
    if (t2 >= lag) {
      const int64_t b = t2 - lag;
      if (!exchange_) B(b);
      if (b + window_ < n) P(b + window_);
    }
  }
  for (int64_t b = std::max<int64_t>(0, n - lag); b < n; ++b) B(b);
  if (lanes) dev_.joinLanes();
}

// ----------------------------------------------------------------------------- proxy

void StagedRail::enqueue(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_one();
}

void StagedRail::enqueueFromStream(void* hostOp) {
  // A host function of the stream (CUDA's host-function thread, or the
  // emulated device's): no CUDA calls, only the queue. It must not throw.
  auto* h = static_cast<HostOp*>(hostOp);
  {
    std::lock_guard<std::mutex> lock(h->gate->mu);
    StagedRail* rail = h->gate->rail;
    if (rail != nullptr) {
      try {
        if (h->captured) {
          Op op = h->op;  // the descriptor stays for the next replay
          op.deadline = Clock::now() + op.timeout;
          rail->enqueue(std::move(op));
        } else {
          rail->enqueue(std::move(h->op));
        }
      } catch (const std::exception& e) {
        // Out of memory copying the descriptor: nobody would release the
        // op's device waits but the failed rail's drain.
        rail->abort(std::string("fastcomm: internal: a CUDA host function could not hand an op "
                                "to the multi-node proxy: ") +
                    e.what());
      }
    }
  }
  if (!h->captured) delete h;
}

void StagedRail::proxyLoop() {
  nameThisThread(kThread);  // the name its timeline rows carry
  // Precise short naps: the default 50 us timer slack would stretch every
  // poll interval.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (failed_.load()) {
        // Drain mode: fail what still comes in and keep every device wait
        // released, so the comm stream runs dry.
        std::deque<Op> late;
        late.swap(queue_);
        const bool stop = stop_;
        const std::string why = abortWhy_;
        lock.unlock();
        if (!late.empty()) {
          std::exception_ptr e;
          try {
            throwCommError("fastcomm: the multi-node path of this group failed earlier: " + why);
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

void StagedRail::runExchange(Op& op) {
  const HierLayout& l = op.layout;
  const int64_t n = l.chunks;
  const bool wire = op.wire != WireDtype::None;
  struct Chunk {
    std::unique_ptr<transport::Request> recv, send;
    bool recvPosted = false, sendPosted = false, packed = false, released = false, reduced = false;
    Clock::time_point tPacked{}, tReleased{};
  };
  std::vector<Chunk> cs(n);
  auto slotOf = [&](int64_t k) { return (op.firstChunk + k) % window_; };
  auto done = [](std::unique_ptr<transport::Request>& r) {
    if (r && r->test()) r.reset();
    return !r;
  };
  // Cursors in chunk order (each connection's messages are matched in order).
  int64_t recvNext = 0, sendNext = 0, packedNext = 0, releasedNext = 0, reducedNext = 0,
          freedNext = 0;
  const auto opStart = Clock::now();
  auto lastProgress = opStart;
  try {
    while (freedNext < n) {
      throwIfAborted(op);
      bool progressed = false;
      // The peer's chunk, once the slot's previous chunk was reduced (A read it).
      while (recvNext < n && (recvNext < window_ || cs[recvNext - window_].reduced)) {
        auto& c = cs[recvNext];
        c.recv = rsConns_[0]->irecv(exchangeRecvSlot(slotOf(recvNext)),
                                    op.pieceBytes(l.chunkLen(recvNext)), rsMr_.get());
        if (!c.recv) break;  // the connection's request limit: later
        c.recvPosted = true;
        ++recvNext;
        progressed = true;
      }
      while (packedNext < n && takeFlag(kFlagPacked, slotOf(packedNext))) {
        cs[packedNext].packed = true;
        cs[packedNext].tPacked = Clock::now();
        record("d2h", packedNext, opStart, cs[packedNext].tPacked);
        ++packedNext;
        progressed = true;
      }
      while (sendNext < n && cs[sendNext].packed) {
        auto& c = cs[sendNext];
        c.send = rsConns_[0]->isend(sendSlot(slotOf(sendNext), 0),
                                    op.pieceBytes(l.chunkLen(sendNext)), rsMr_.get());
        if (!c.send) break;
        c.sendPosted = true;
        ++sendNext;
        progressed = true;
      }
      // The peer's chunk arrived and this rank's was staged (A overwrites
      // what P read; on lanes only these flags order them), and where A
      // writes the send slot (a wire dtype) this rank's went out: let the
      // device reduce.
      while (releasedNext < n && cs[releasedNext].packed && cs[releasedNext].recvPosted &&
             done(cs[releasedNext].recv) &&
             (!wire || (cs[releasedNext].sendPosted && done(cs[releasedNext].send)))) {
        auto& c = cs[releasedNext];
        c.released = true;
        c.tReleased = releaseReduction(releasedNext, slotOf(releasedNext), c.tPacked);
        ++releasedNext;
        progressed = true;
      }
      while (reducedNext < n && cs[reducedNext].released &&
             takeFlag(kFlagReduced, slotOf(reducedNext))) {
        cs[reducedNext].reduced = true;
        record("h2d+reduce", reducedNext, cs[reducedNext].tReleased, Clock::now());
        ++reducedNext;
        progressed = true;
      }
      // Reduced and sent: the slot may take its next chunk.
      while (freedNext < n && freedNext < reducedNext && cs[freedNext].sendPosted &&
             done(cs[freedNext].send)) {
        storeFlag(dev_.hostFlag(kFlagFree, slotOf(freedNext)), 1);
        ++freedNext;
        progressed = true;
      }
      const auto now = Clock::now();
      if (progressed) {
        lastProgress = now;
        continue;
      }
      if (now >= op.deadline) {
        // Waiting for the peer when a transfer of the earliest unfinished
        // chunk is still open; otherwise for our own device.
        const int64_t k = std::min(releasedNext, freedNext);
        if (k < n && ((cs[k].recv && !cs[k].recv->test()) || (cs[k].send && !cs[k].send->test())))
          failNetwork(op, {peers_[0]});
        failDevice(op);
      }
      pause(now - lastProgress);
    }
  } catch (const transport::TransportError& e) {
    failTransport(op, e);
  }
}

void StagedRail::runOp(Op& op) {
  if (exchange_) {
    runExchange(op);
    return;
  }
  const HierLayout& l = op.layout;
  const int64_t n = l.chunks;
  const int peers = static_cast<int>(peers_.size());
  std::vector<ChunkState> cs;
  cs.reserve(n);
  for (int64_t k = 0; k < n; ++k) cs.emplace_back(peers);
  auto slotOf = [&](int64_t k) { return (op.firstChunk + k) % window_; };
  // Cursors, each moving in chunk order: per connection, messages must be
  // posted in the order the peer posts the matching ones.
  int64_t rsRecvNext = 0, agRecvNext = 0, rsSendNext = 0, agSendNext = 0;
  int64_t packedNext = 0, rsArrNext = 0, reducedNext = 0, agArrNext = 0, gatheredNext = 0,
          freedNext = 0;
  const auto opStart = Clock::now();
  auto lastProgress = opStart;
  // The device may stage chunk k once its slot's previous chunk freed it.
  auto stageStart = [&](int64_t k) {
    return k < window_ || cs[k - window_].tFreed == Clock::time_point{} ? opStart
                                                                        : cs[k - window_].tFreed;
  };
  try {
    while (gatheredNext < n || freedNext < n) {
      throwIfAborted(op);
      bool progressed = false;
      // Receives, as soon as the slot's buffers are no longer read by the device.
      while (rsRecvNext < n && (rsRecvNext < window_ || cs[rsRecvNext - window_].reduced)) {
        auto& c = cs[rsRecvNext];
        const int64_t w = slotOf(rsRecvNext), len = l.pieceLen(rsRecvNext, me_);
        for (; c.rsRecvPosted < peers; ++c.rsRecvPosted) {
          const int j = c.rsRecvPosted;
          if (len == 0) continue;
          auto r = rsConns_[j]->irecv(recvSlot(w, j), op.pieceBytes(len), rsMr_.get());
          if (!r) break;  // the connection's request limit: later
          c.rsRecv[j] = std::move(r);
        }
        if (c.rsRecvPosted < peers) break;
        c.tRecvPosted = Clock::now();
        ++rsRecvNext;
        progressed = true;
      }
      while (agRecvNext < n && (agRecvNext < window_ || cs[agRecvNext - window_].gathered)) {
        auto& c = cs[agRecvNext];
        const int64_t w = slotOf(agRecvNext);
        for (; c.agRecvPosted < peers; ++c.agRecvPosted) {
          const int j = c.agRecvPosted;
          const int64_t len = l.pieceLen(agRecvNext, peerNode(j, me_));
          if (len == 0) continue;
          auto r = agConns_[j]->irecv(agRecvSlot(w, j), op.pieceBytes(len), agMr_.get());
          if (!r) break;
          c.agRecv[j] = std::move(r);
        }
        if (c.agRecvPosted < peers) break;
        ++agRecvNext;
        progressed = true;
      }
      // The device staged a chunk's send pieces: send them.
      while (packedNext < n && takeFlag(kFlagPacked, slotOf(packedNext))) {
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
          auto r = rsConns_[j]->isend(sendSlot(w, j), op.pieceBytes(len), rsMr_.get());
          if (!r) break;
          c.rsSend[j] = std::move(r);
        }
        if (c.rsSendPosted < peers) break;
        ++rsSendNext;
        progressed = true;
      }
      // Every peer's copy of this rank's piece arrived: let the device reduce.
      // Not before the slot's previous chunk was sent: the reduction writes
      // the slot's all-gather send piece (on one stream, P's kFlagFree wait
      // already held it back until then; with lanes this is the guard).
      while (rsArrNext < n && rsArrNext < rsRecvNext &&
             (rsArrNext < window_ || cs[rsArrNext - window_].freed) &&
             allDone(cs[rsArrNext].rsRecv)) {
        auto& c = cs[rsArrNext];
        c.rsArrived = true;
        // From this rank's send (or, when the peer's pieces came first, its
        // receive) to the arrival of every peer's pieces.
        c.tRsArrived =
            releaseReduction(rsArrNext, slotOf(rsArrNext),
                             c.tPacked == Clock::time_point{} ? c.tRecvPosted : c.tPacked);
        ++rsArrNext;
        progressed = true;
      }
      while (reducedNext < n && cs[reducedNext].rsArrived &&
             takeFlag(kFlagReduced, slotOf(reducedNext))) {
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
          auto r = agConns_[j]->isend(agSendSlot(w), op.pieceBytes(len), agMr_.get());
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
        storeFlag(dev_.hostFlag(kFlagAgIn, slotOf(agArrNext)), 1);
        record("net (all-gather)", agArrNext, c.tReduced, c.tAgArrived);
        ++agArrNext;
        progressed = true;
      }
      while (gatheredNext < n && cs[gatheredNext].agArrived &&
             takeFlag(kFlagGathered, slotOf(gatheredNext))) {
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
        storeFlag(dev_.hostFlag(kFlagFree, slotOf(freedNext)), 1);
        ++freedNext;
        progressed = true;
      }
      const auto now = Clock::now();
      if (progressed) {
        lastProgress = now;
        continue;
      }
      if (now >= op.deadline) {
        // Whom are we waiting for on the network? The peers of the earliest
        // unfinished exchange: later ones only wait because of it (a peer
        // missing from the reduce-scatter also holds back everybody's
        // all-gather). Nobody: our own device.
        std::vector<int> pending;
        auto unfinished = [](std::unique_ptr<transport::Request>& r) { return r && !r->test(); };
        using Reqs = std::vector<std::unique_ptr<transport::Request>> ChunkState::*;
        for (Reqs kind :
             {&ChunkState::rsRecv, &ChunkState::agRecv, &ChunkState::rsSend, &ChunkState::agSend}) {
          for (int64_t k = std::min({rsArrNext, agArrNext, freedNext}); k < n && pending.empty();
               ++k) {
            auto& reqs = cs[k].*kind;
            for (int j = 0; j < peers; ++j)
              if (unfinished(reqs[j])) pending.push_back(peers_[j]);
          }
          if (!pending.empty()) break;
        }
        std::sort(pending.begin(), pending.end());
        pending.erase(std::unique(pending.begin(), pending.end()), pending.end());
        if (pending.empty()) failDevice(op);
        failNetwork(op, pending);
      }
      pause(now - lastProgress);
    }
  } catch (const transport::TransportError& e) {
    failTransport(op, e);
  }
}

Clock::time_point StagedRail::releaseReduction(int64_t k, int64_t slot, Clock::time_point since) {
  const auto now = Clock::now();
  storeFlag(dev_.hostFlag(kFlagRsIn, slot), 1);
  record("net", k, since, now);
  return now;
}

bool StagedRail::takeFlag(int flag, int64_t slot) {
  uint32_t* f = dev_.hostFlag(flag, slot);
  if (loadFlag(f) != 1) return false;
  storeFlag(f, 0);
  return true;
}

void StagedRail::throwIfAborted(const Op& op) {
  if (!failed_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                 ") failed on group rank " + std::to_string(groupRank_) + ": " + abortWhy_);
}

void StagedRail::failTransport(const Op& op, const transport::TransportError& e) {
  throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                 ") failed on group rank " + std::to_string(groupRank_) +
                 ": inter-node transfer with group rank [" + std::to_string(e.peer()) +
                 "] failed (timeout " + std::to_string(op.timeout.count()) +
                 " ms not reached): " + e.what() + peerReason(e.peer()) + laggingNote(op));
}

void StagedRail::pause(Clock::duration sinceProgress) {
  if (sinceProgress < kSpin) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(kNap);
  }
}

std::string StagedRail::laggingNote(const Op& op) {
  // The heartbeat view: who stopped issuing collectives, e.g. a dead rank
  // behind the peer that broke or timed out here.
  const std::string lagging = hooks_.laggingRanks ? hooks_.laggingRanks(op.seq) : std::string();
  return lagging.empty() ? std::string()
                         : "; group rank(s) " + lagging + " stopped issuing collectives";
}

void StagedRail::failNetwork(const Op& op, const std::vector<int>& pendingPeers) {
  std::string why;
  for (int p : pendingPeers) why += peerReason(p);
  throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                 ") failed on group rank " + std::to_string(groupRank_) + ": timed out after " +
                 std::to_string(op.timeout.count()) + " ms (timeout) waiting for group rank(s) " +
                 formatRanks(pendingPeers) + " across the inter-node transport" + why +
                 laggingNote(op));
}

void StagedRail::failDevice(const Op& op) {
  throwCommError("fastcomm: " + op.name + " (seq " + std::to_string(op.seq) +
                 ") failed on group rank " + std::to_string(groupRank_) + ": timeout after " +
                 std::to_string(op.timeout.count()) +
                 " ms waiting for this rank's GPU to reach the inter-node phase (the intra-node "
                 "reduce-scatter or earlier work on its stream did not finish)" +
                 laggingNote(op));
}

std::string StagedRail::peerReason(int peer) {
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

void StagedRail::publishReason(const std::string& why) {
  try {
    const std::string key = "fastcomm/failed/" + std::to_string(groupRank_);
    if (!store_->check({key})) store_->set(key, std::vector<uint8_t>(why.begin(), why.end()));
  } catch (...) {
    // The store may be gone with the failed rank.
  }
}

void StagedRail::failAll(std::exception_ptr e, Op* current) {
  std::string why = "unknown error";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    why = errorText(ex);
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
  // The works fail before the device is released: a waiter that sees the end
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

void StagedRail::releaseAllWaits() {
  for (int64_t w = 0; w < window_; ++w)
    for (int kind : {kFlagFree, kFlagRsIn, kFlagAgIn}) storeFlag(dev_.hostFlag(kind, w), 1);
}

}  // namespace fastcomm
