#include "inter/ib/ib_transport.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common/thread_name.hpp"
#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "inter/ib/device.hpp"
#include "inter/ib/gpu_memory.hpp"
#include "inter/notifier.hpp"
#include "inter/request.hpp"

namespace fastcomm {
namespace transport {
namespace ib {
namespace {

// ----------------------------------------------------------------------------- protocol constants
//
// Both ends run the same build on the same architecture, so control words
// travel in host byte order (as in NCCL's net_ib).

constexpr uint32_t kProtocolVersion = 1;
constexpr int kFifoDepth = 32;                    // slots per connection and direction
constexpr int64_t kPieceBytes = 512 << 10;        // one staging slot
constexpr int64_t kZeroCopyPieceBytes = 8 << 20;  // pieces of registered buffers
constexpr int kStagingSlots = 8;                  // per connection and direction
constexpr int64_t kMinStripeBytes = 64 << 10;     // smaller pieces use one QP
constexpr auto kKeepaliveIdle = std::chrono::milliseconds(1000);
constexpr auto kTimerPeriod = std::chrono::milliseconds(100);
constexpr int kMaxSendWr = 4 * kFifoDepth + 16;
constexpr int kMaxRecvWr = 2 * kFifoDepth + 16;  // bound: see the receive accounting below
static_assert(kFifoDepth <= 1024, "the slot travels in 10 bits of the immediate");

// Immediate: type (2 bits) | stripes (7 bits) << 10 | slot (10 bits).
enum ImmType : uint32_t { kImmFifo = 1, kImmData = 2, kImmMismatch = 3 };
uint32_t makeImm(ImmType t, int slot, int stripes) {
  return (static_cast<uint32_t>(t) << 30) | (static_cast<uint32_t>(stripes) << 10) |
         static_cast<uint32_t>(slot);
}
ImmType immType(uint32_t imm) { return static_cast<ImmType>(imm >> 30); }
int immSlot(uint32_t imm) { return static_cast<int>(imm & 0x3ff); }
int immStripes(uint32_t imm) { return static_cast<int>((imm >> 10) & 0x7f); }

// Work request ids: kind << 56 | payload.
enum WrKind : uint64_t { kWrFifo = 1, kWrData = 2, kWrMismatch = 3, kWrKeepalive = 4, kWrRecv = 5 };
uint64_t wrId(WrKind k, uint64_t payload) {
  return (static_cast<uint64_t>(k) << 56) | (payload & ((1ull << 56) - 1));
}
WrKind wrKind(uint64_t id) { return static_cast<WrKind>(id >> 56); }
uint64_t wrPayload(uint64_t id) { return id & ((1ull << 56) - 1); }

const char* wrWhat(WrKind k) {
  switch (k) {
    case kWrFifo:
      return "a receive-buffer advertisement (RDMA write into the peer's FIFO)";
    case kWrData:
      return "an RDMA write of data";
    case kWrMismatch:
      return "a size-mismatch notice";
    case kWrKeepalive:
      return "a keepalive write";
    case kWrRecv:
      return "a receive";
  }
  return "a work request";
}

// A FIFO slot: where the sender may write one piece of one message.
struct FifoEntry {
  uint64_t addr;
  uint32_t rkey;
  uint32_t len;
  uint64_t seq;       // message number in this direction
  uint64_t offset;    // of the piece within the message
  uint64_t msgBytes;  // the size the receiver posted
  uint64_t idx;       // FIFO index, so a stale slot is recognised
  uint64_t pad[2];
};
static_assert(sizeof(FifoEntry) == 64, "a FIFO slot is part of the wire format");

// Registered per connection; the peer writes into the *In parts.
struct CtrlBlock {
  FifoEntry fifoIn[kFifoDepth];   // slots the peer (as receiver) hands this rank
  FifoEntry fifoOut[kFifoDepth];  // slots this rank hands the peer (write sources)
  uint64_t mmIn[kFifoDepth];      // the peer's message size, when it did not match
  uint64_t mmOut[kFifoDepth];
};

// ----------------------------------------------------------------------------- memory

// Page-aligned, zeroed host memory.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes) : bytes_(bytes) {
    if (posix_memalign(&p_, 4096, bytes) != 0) throw std::bad_alloc();
    std::memset(p_, 0, bytes);
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  char* get() const { return static_cast<char*>(p_); }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Registrations of caller memory, reused for any range they cover and
// deregistered when the last MemoryRegion handle on them goes.
class RegCache {
 public:
  struct Entry {
    uintptr_t start = 0, end = 0;
    MemKind kind = MemKind::Host;
    std::unique_ptr<Mr> mr;
    int refs = 0;
  };

  explicit RegCache(Device* dev) : dev_(dev) {}

  // Host and device ranges never overlap (one virtual address space), so a
  // hit needs no kind check.
  Entry* acquire(void* data, int64_t bytes, MemKind kind) {
    const auto pageMask = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE) - 1);
    const uintptr_t a = reinterpret_cast<uintptr_t>(data) & ~pageMask;
    const uintptr_t b = (reinterpret_cast<uintptr_t>(data) + bytes + pageMask) & ~pageMask;
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw std::runtime_error("fastcomm: ib transport: registerMemory after close()");
    for (auto& e : entries_) {
      if (e->start <= a && b <= e->end) {
        ++e->refs;
        ++hits_;
        return e.get();
      }
    }
    auto e = std::make_unique<Entry>();
    e->start = a;
    e->end = b;
    e->kind = kind;
    e->mr = dev_->regMr(reinterpret_cast<void*>(a), b - a, kind);
    e->refs = 1;
    ++misses_;
    entries_.push_back(std::move(e));
    return entries_.back().get();
  }

  void release(Entry* e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    if (--e->refs > 0) return;
    entries_.erase(std::find_if(entries_.begin(), entries_.end(),
                                [&](const std::unique_ptr<Entry>& x) { return x.get() == e; }));
  }

  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    entries_.clear();
  }

  void counters(std::map<std::string, int64_t>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    (*out)["reg_cache_hits"] = hits_;
    (*out)["reg_cache_misses"] = misses_;
    (*out)["reg_cache_entries"] = static_cast<int64_t>(entries_.size());
  }

 private:
  std::mutex mu_;
  Device* dev_;
  std::vector<std::unique_ptr<Entry>> entries_;
  bool closed_ = false;
  int64_t hits_ = 0, misses_ = 0;
};

class IbMemoryRegion : public MemoryRegion {
 public:
  IbMemoryRegion(std::shared_ptr<RegCache> cache, RegCache::Entry* e, void* data, int64_t bytes)
      : cache_(std::move(cache)), entry_(e), data_(data), bytes_(bytes) {}
  ~IbMemoryRegion() override {
    if (entry_) cache_->release(entry_);
  }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  bool device() const { return entry_ != nullptr && entry_->kind == MemKind::Device; }

  // The keys when [p, p + n) lies in this registration of `cache`.
  bool covers(const RegCache* cache, const void* p, int64_t n, uint32_t* lkey,
              uint32_t* rkey) const {
    if (entry_ == nullptr || cache != cache_.get()) return false;
    const auto a = reinterpret_cast<uintptr_t>(p);
    if (a < entry_->start || a + static_cast<uint64_t>(n) > entry_->end) return false;
    *lkey = entry_->mr->lkey;
    *rkey = entry_->mr->rkey;
    return true;
  }

 private:
  std::shared_ptr<RegCache> cache_;
  RegCache::Entry* entry_;
  void* data_;
  int64_t bytes_;
};

// A pool of registered staging slots of kPieceBytes, allocated on first use.
class Staging {
 public:
  int take(Device& dev) {
    if (!mem_.get()) {
      mem_ = AlignedBuffer(static_cast<size_t>(kStagingSlots * kPieceBytes));
      mr_ = dev.regMr(mem_.get(), mem_.size(), MemKind::Host);
      for (int i = kStagingSlots - 1; i >= 0; --i) free_.push_back(i);
    }
    if (free_.empty()) return -1;
    int s = free_.back();
    free_.pop_back();
    return s;
  }
  void give(int s) { free_.push_back(s); }
  char* at(int s) const { return mem_.get() + s * kPieceBytes; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  void release() {
    mr_.reset();
    mem_ = AlignedBuffer();
    free_.clear();
  }

 private:
  AlignedBuffer mem_;
  std::unique_ptr<Mr> mr_;
  std::vector<int> free_;
};

// ----------------------------------------------------------------------------- requests

struct Op {
  Op(bool send, char* data, int64_t bytes, uint64_t seq, bool zc, uint32_t lkey, uint32_t rkey)
      : isSend(send), data(data), bytes(bytes), seq(seq), zeroCopy(zc), lkey(lkey), rkey(rkey) {}

  const bool isSend;
  char* const data;
  const int64_t bytes;
  const uint64_t seq;
  const bool zeroCopy;  // registered: pieces go straight to/from `data`
  const uint32_t lkey, rkey;
  std::atomic<OpStatus> status{OpStatus::Pending};
  std::string error;  // written before status becomes Failed, never after

  // Under the engine's mutex.
  int64_t progressed = 0;  // receive: bytes advertised; send: bytes served
  bool allPosted = false;  // receive: no more slots to hand out; send: fully served
  int outstanding = 0;     // receive: slots in flight; send: pieces in flight
};

using IbRequest = OpRequest<Op>;

// ----------------------------------------------------------------------------- peer

struct RecvSlot {
  bool used = false;
  std::shared_ptr<Op> op;
  int64_t off = 0, len = 0;
  int staging = -1;
  int stripesGot = 0;
  int64_t bytesGot = 0;
};

struct SendPiece {
  std::shared_ptr<Op> op;
  int staging = -1;
  int stripesLeft = 0;
};

// One connection's state; guarded by the engine's mutex.
struct Peer {
  int rank = -1;
  std::string where;  // device, port, QPNs: for error messages
  std::vector<std::unique_ptr<Qp>> qps;
  std::vector<int> sqUsed;  // send work requests outstanding per QP
  uint32_t psn = 0;
  AlignedBuffer ctrlMem;
  CtrlBlock* ctrl = nullptr;
  std::unique_ptr<Mr> ctrlMr;
  uint64_t remoteCtrl = 0;
  uint32_t remoteCtrlRkey = 0;

  // Receiving.
  std::list<std::shared_ptr<Op>> recvs;  // posted, not finished, in order
  uint64_t recvSeq = 0;
  uint64_t fifoNext = 0;  // next slot index this rank hands out
  RecvSlot rslots[kFifoDepth];
  Staging recvStaging;

  // Sending.
  std::deque<std::shared_ptr<Op>> sends;  // posted, not fully served, in order
  int sendOpsLive = 0;                    // posted and not finished
  uint64_t sendSeq = 0;
  uint64_t nextServe = 0;     // first message not fully served
  uint64_t fifoConsumed = 0;  // next slot index of the peer to use
  bool fifoArrived[kFifoDepth] = {};
  std::unordered_map<uint64_t, SendPiece> pieces;
  Staging sendStaging;

  // Health.
  bool failed = false;
  std::string error;
  Clock::time_point lastHeard{};
  bool keepaliveOut = false;

  std::string describe() const {
    return "ib connection to rank " + std::to_string(rank) + " (" + where + ")";
  }
  bool busy() const { return !recvs.empty() || sendOpsLive > 0; }
};

// ----------------------------------------------------------------------------- engine

struct PeerHandle {
  int qps = 0, fifo = 0;
  LinkLayer link = LinkLayer::InfiniBand;
  QpEndpoint ep;  // lid, gid, mtu (qpn/psn per QP below)
  uint64_t ctrlAddr = 0;
  uint32_t ctrlRkey = 0;
  std::vector<std::pair<uint32_t, uint32_t>> qpnPsn;
};

std::string encodeHandle(const PeerHandle& h) {
  std::ostringstream os;
  os << "fastcomm-ib " << kProtocolVersion << " " << h.qps << " " << h.fifo << " "
     << (h.link == LinkLayer::Ethernet ? "eth" : "ib") << " " << h.ep.lid << " " << h.ep.gid.str()
     << " " << h.ep.mtu << " " << std::hex << h.ctrlAddr << " " << h.ctrlRkey << std::dec;
  for (auto& [qpn, psn] : h.qpnPsn) os << " " << qpn << " " << psn;
  return os.str();
}

bool decodeHandle(const std::string& text, PeerHandle* h, std::string* why) {
  std::istringstream is(text);
  std::string tag, link, gid;
  uint32_t version = 0;
  is >> tag >> version;
  if (is.fail() || tag != "fastcomm-ib" || version != kProtocolVersion) {
    *why = "not a fastcomm ib handle of protocol version " + std::to_string(kProtocolVersion);
    return false;
  }
  is >> h->qps >> h->fifo >> link >> h->ep.lid >> gid >> h->ep.mtu >> std::hex >> h->ctrlAddr >>
      h->ctrlRkey >> std::dec;
  if (is.fail() || !Gid::parse(gid, &h->ep.gid) || h->qps < 1 || h->qps > 64) {
    *why = "malformed";
    return false;
  }
  h->link = link == "eth" ? LinkLayer::Ethernet : LinkLayer::InfiniBand;
  h->ep.link = h->link;
  for (int i = 0; i < h->qps; ++i) {
    uint32_t qpn = 0, psn = 0;
    is >> qpn >> psn;
    if (is.fail()) {
      *why = "malformed QP list";
      return false;
    }
    h->qpnPsn.emplace_back(qpn, psn);
  }
  return true;
}

std::string handleKey(int from, int to) {
  return "ib/" + std::to_string(from) + "/" + std::to_string(to);
}

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(const Config& cfg);
  ~Engine() { close(); }

  std::vector<std::shared_ptr<Peer>> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                             int size, const std::vector<int>& peers,
                                             const OpContext& ctx);
  std::unique_ptr<Request> post(Peer& p, bool send, char* data, int64_t bytes,
                                const MemoryRegion* mr);
  std::unique_ptr<MemoryRegion> registerMemory(void* data, int64_t bytes);
  std::unique_ptr<MemoryRegion> registerDeviceMemory(void* data, int64_t bytes);
  void waitForProgress(std::chrono::microseconds max) { notifier_->wait(max, spinMicros_); }
  void close();
  bool deviceMemory() const { return deviceMemory_; }
  std::map<std::string, int64_t> counters();

 private:
  void run();
  void handle(const Completion* wcs, int n);
  void handleAsync();
  void timers();
  void pump(Peer& p);
  void advertise(Peer& p);
  void serve(Peer& p);
  void onData(Peer& p, int slot, int stripes, uint32_t bytes);
  void onMismatch(Peer& p, int slot);
  void finishRecvIfDone(Peer& p, const std::shared_ptr<Op>& op);
  void finishSendIfDone(Peer& p, const std::shared_ptr<Op>& op);
  void finish(const std::shared_ptr<Op>& op, OpStatus st, const std::string& err);
  void failPeer(Peer& p, const std::string& why);
  bool postWrite(Peer& p, int q, const SendWr& wr);
  bool sqRoom(const Peer& p, int q, int n) const { return p.sqUsed[q] + n <= kMaxSendWr; }
  [[noreturn]] void protocolError(Peer& p, const std::string& what);

  const int qps_;
  int64_t spinMicros_ = 0;
  RcAttrs rc_;
  std::string gidWhy_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<Cq> cq_;
  std::shared_ptr<RegCache> regCache_;
  bool deviceMemory_ = false;
  std::string gdrHow_;  // the GPUDirect RDMA route, or why there is none
  std::shared_ptr<Notifier> notifier_;

  std::mutex mu_;
  std::vector<std::shared_ptr<Peer>> peers_;
  std::unordered_map<uint32_t, std::pair<Peer*, int>> byQpn_;
  uint64_t nextPiece_ = 1;
  int64_t zeroCopyBytes_ = 0, stagedBytes_ = 0, keepalives_ = 0;

  std::thread thread_;
  std::atomic<bool> stop_{false};
  int wakeFd_ = -1;
  std::mutex closeMu_;
  bool closed_ = false, connected_ = false;
};

// Thrown inside the engine for a peer that broke the protocol; failPeer()
// has already run.
struct PeerFailed {};

Engine::Engine(const Config& cfg)
    : qps_(std::max(1, cfg.ibQpsPerPeer)), notifier_(std::make_shared<Notifier>()) {
  spinMicros_ =
      cfg.spinMicros >= 0 ? cfg.spinMicros : (std::thread::hardware_concurrency() >= 8 ? 20 : 0);
  dev_ = openDevice(cfg);
  const PortInfo& port = dev_->port();
  rc_.gidIndex = chooseGid(port, cfg.ibGidIndex, &gidWhy_);
  rc_.useGrh = port.link == LinkLayer::Ethernet || cfg.ibGidIndex >= 0;
  if (port.link == LinkLayer::Ethernet && rc_.gidIndex < 0) {
    throw std::runtime_error("fastcomm: ib transport: " + port.device + " port " +
                             std::to_string(port.port) +
                             " is RoCE but has no GID (is an IP address configured on it?)");
  }
  regCache_ = std::make_shared<RegCache>(dev_.get());
  GdrSupport gdr = detectGdr(cfg, *dev_);
  // Every route registers device memory through Device::regMr (dma-buf,
  // nvidia-peermem, or the emulation's cudaMemcpy).
  deviceMemory_ = gdr.available;
  gdrHow_ = gdr.how;
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  FASTCOMM_LOG(Info, "ib transport on "
                         << port.device << " port " << port.port << " (" << linkLayerName(port.link)
                         << ", " << port.rate << ", MTU " << port.activeMtu << "), GID: " << gidWhy_
                         << "; " << qps_ << " QP(s) per peer, FIFO of " << kFifoDepth
                         << " slots, pieces of " << (kPieceBytes >> 10) << " KiB (staged) / "
                         << (kZeroCopyPieceBytes >> 20)
                         << " MiB (registered); GPUDirect RDMA: " << gdr.how);
}

std::vector<std::shared_ptr<Peer>> Engine::connect(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size,
                                                   const std::vector<int>& peers,
                                                   const OpContext& ctx) {
  if (connected_ || closed_) {
    throw std::logic_error("fastcomm: ib transport: connect() may be called once, before close()");
  }
  connected_ = true;
  checkPeerList("ib", rank, size, peers);
  const PortInfo& port = dev_->port();
  QpEndpoint local;
  local.lid = port.lid;
  local.mtu = port.activeMtu;
  local.link = port.link;
  for (const auto& g : port.gids)
    if (g.index == rc_.gidIndex) local.gid = g.gid;

  if (!peers.empty()) {
    const int depth = static_cast<int>(peers.size()) * qps_ * (kMaxSendWr + kMaxRecvWr) + 64;
    cq_ = dev_->createCq(depth);
  }
  std::mt19937 rng(std::random_device{}());
  std::vector<std::shared_ptr<Peer>> out;
  for (int r : peers) {
    auto p = std::make_shared<Peer>();
    p->rank = r;
    p->ctrlMem = AlignedBuffer(sizeof(CtrlBlock));
    p->ctrl = reinterpret_cast<CtrlBlock*>(p->ctrlMem.get());
    p->ctrlMr = dev_->regMr(p->ctrlMem.get(), p->ctrlMem.size(), MemKind::Host);
    p->psn = rng() & 0xffffff;
    p->where = port.device + " port " + std::to_string(port.port) + ", QP";
    for (int q = 0; q < qps_; ++q) {
      auto qp = dev_->createQp(*cq_, kMaxSendWr, kMaxRecvWr);
      qp->toInit();
      std::vector<uint64_t> ids(kMaxRecvWr, wrId(kWrRecv, 0));
      if (int rc = qp->postRecv(ids.data(), kMaxRecvWr)) {
        throw std::system_error(rc, std::generic_category(), "fastcomm: ib: post receives");
      }
      p->where += (q ? "," : "") + std::string(" ") + std::to_string(qp->qpn());
      byQpn_[qp->qpn()] = {p.get(), q};
      p->qps.push_back(std::move(qp));
      p->sqUsed.push_back(0);
    }
    PeerHandle h;
    h.qps = qps_;
    h.fifo = kFifoDepth;
    h.link = port.link;
    h.ep = local;
    h.ctrlAddr = reinterpret_cast<uint64_t>(p->ctrl);
    h.ctrlRkey = p->ctrlMr->rkey;
    for (auto& qp : p->qps) h.qpnPsn.emplace_back(qp->qpn(), p->psn);
    const std::string text = encodeHandle(h);
    store->set(handleKey(rank, r), std::vector<uint8_t>(text.begin(), text.end()));
    out.push_back(p);
  }

  auto missing = [&](const std::vector<bool>& have, const char* what) {
    std::vector<int> m;
    std::string details;
    for (size_t i = 0; i < peers.size(); ++i) {
      if (have[i]) continue;
      m.push_back(peers[i]);
      details += "; rank " + std::to_string(peers[i]) + " " + what;
    }
    throwCommError("fastcomm: " + ctx.describe() + ": ib transport of rank " +
                   std::to_string(rank) + " could not connect to rank(s) " + formatRanks(m) +
                   " within the timeout of " + std::to_string(ctx.timeout.count()) + " ms" +
                   details);
  };

  // 1. The peers' handles: bring our QPs to RTR and RTS against theirs.
  std::vector<bool> have(peers.size(), false);
  for (size_t done = 0; done < peers.size();) {
    bool progressed = false;
    for (size_t i = 0; i < peers.size(); ++i) {
      if (have[i]) continue;
      const std::string key = handleKey(peers[i], rank);
      if (!store->check({key})) continue;
      const std::string text = storeGet(store, key);
      PeerHandle h;
      std::string why;
      if (!decodeHandle(text, &h, &why)) {
        throwCommError("fastcomm: " + ctx.describe() + ": ib transport: the handle of rank " +
                       std::to_string(peers[i]) + " in the store (" + key + ") is " + why + ": '" +
                       text + "'");
      }
      if (h.qps != qps_) {
        throwCommError("fastcomm: " + ctx.describe() + ": rank " + std::to_string(peers[i]) +
                       " uses FASTCOMM_IB_QPS_PER_PEER=" + std::to_string(h.qps) + " but rank " +
                       std::to_string(rank) + " uses " + std::to_string(qps_) +
                       "; it must be the same on every rank");
      }
      if (h.link != port.link) {
        throwCommError("fastcomm: " + ctx.describe() + ": rank " + std::to_string(peers[i]) +
                       " is on " + linkLayerName(h.link) + " but rank " + std::to_string(rank) +
                       " is on " + linkLayerName(port.link) + "; RC needs one fabric");
      }
      Peer& p = *out[i];
      p.remoteCtrl = h.ctrlAddr;
      p.remoteCtrlRkey = h.ctrlRkey;
      for (int q = 0; q < qps_; ++q) {
        QpEndpoint remote = h.ep;
        remote.qpn = h.qpnPsn[q].first;
        remote.psn = h.qpnPsn[q].second;
        p.qps[q]->toRtr(remote, rc_);
        p.qps[q]->toRts(p.psn, rc_);
      }
      store->set(handleKey(rank, peers[i]) + "/ready", std::vector<uint8_t>{'1'});
      have[i] = true;
      ++done;
      progressed = true;
    }
    if (done == peers.size()) break;
    if (ctx.expired()) missing(have, "never published its queue pairs");
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // 2. Every peer's QPs are ready to receive before anything is written.
  std::vector<bool> ready(peers.size(), false);
  for (size_t done = 0; done < peers.size();) {
    for (size_t i = 0; i < peers.size(); ++i) {
      if (!ready[i] && store->check({handleKey(peers[i], rank) + "/ready"})) {
        ready[i] = true;
        ++done;
      }
    }
    if (done == peers.size()) break;
    if (ctx.expired()) missing(ready, "did not bring its queue pairs to RTR");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : out) {
      p->lastHeard = Clock::now();
      peers_.push_back(p);
    }
  }
  if (!peers.empty()) thread_ = std::thread([this] { run(); });
  return out;
}

std::unique_ptr<MemoryRegion> Engine::registerMemory(void* data, int64_t bytes) {
  // Device pointers are told apart only in a CUDA build (never true in a
  // CPU-only one); the check creates no CUDA context.
  if (data != nullptr && gpu::isDeviceMemory(data)) return registerDeviceMemory(data, bytes);
  if (data == nullptr || bytes <= 0) {
    return std::make_unique<IbMemoryRegion>(regCache_, nullptr, data, bytes);
  }
  return std::make_unique<IbMemoryRegion>(regCache_, regCache_->acquire(data, bytes, MemKind::Host),
                                          data, bytes);
}

std::unique_ptr<MemoryRegion> Engine::registerDeviceMemory(void* data, int64_t bytes) {
  if (!deviceMemory_) {
    std::ostringstream os;
    os << "fastcomm: ib transport: cannot register " << bytes << " bytes of device memory at "
       << data << ": GPUDirect RDMA is " << gdrHow_;
    throw std::runtime_error(os.str());
  }
  if (data == nullptr || bytes <= 0) {
    return std::make_unique<IbMemoryRegion>(regCache_, nullptr, data, bytes);
  }
  return std::make_unique<IbMemoryRegion>(
      regCache_, regCache_->acquire(data, bytes, MemKind::Device), data, bytes);
}

std::unique_ptr<Request> Engine::post(Peer& p, bool send, char* data, int64_t bytes,
                                      const MemoryRegion* mr) {
  if (bytes < 0) throw std::invalid_argument("fastcomm: ib: negative message size");
  uint32_t lkey = 0, rkey = 0;
  bool zc = false;
  if (auto* imr = dynamic_cast<const IbMemoryRegion*>(mr)) {
    zc = bytes > 0 && imr->covers(regCache_.get(), data, bytes, &lkey, &rkey);
    // Staging copies with memcpy: device memory must move zero-copy.
    if (bytes > 0 && !zc && imr->device()) {
      throw std::invalid_argument(
          "fastcomm: ib: a buffer of device memory must lie inside its registration "
          "(registerMemory of this transport covering all of it)");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (p.failed) {
    auto op = std::make_shared<Op>(send, data, bytes, 0, false, 0, 0);
    op->error = p.error;
    op->status.store(OpStatus::Failed, std::memory_order_release);
    return std::make_unique<IbRequest>(std::move(op), p.rank);
  }
  if (send ? p.sendOpsLive >= kMaxRequestsInFlight
           : static_cast<int>(p.recvs.size()) >= kMaxRequestsInFlight) {
    return nullptr;
  }
  auto op =
      std::make_shared<Op>(send, data, bytes, send ? p.sendSeq++ : p.recvSeq++, zc, lkey, rkey);
  if (send) {
    p.sends.push_back(op);
    ++p.sendOpsLive;
  } else {
    p.recvs.push_back(op);
  }
  try {
    pump(p);
  } catch (const PeerFailed&) {
  }
  return std::make_unique<IbRequest>(std::move(op), p.rank);
}

void Engine::finish(const std::shared_ptr<Op>& op, OpStatus st, const std::string& err) {
  if (op->status.load(std::memory_order_relaxed) != OpStatus::Pending) return;
  op->error = err;
  op->status.store(st, std::memory_order_release);
  notifier_->notify();
}

void Engine::finishRecvIfDone(Peer& p, const std::shared_ptr<Op>& op) {
  if (!op->allPosted || op->outstanding > 0) return;
  finish(op, OpStatus::Done, "");
  p.recvs.remove(op);
}

void Engine::finishSendIfDone(Peer& p, const std::shared_ptr<Op>& op) {
  if (!op->allPosted || op->outstanding > 0) return;
  if (op->status.load(std::memory_order_relaxed) == OpStatus::Pending) {
    finish(op, OpStatus::Done, "");
    --p.sendOpsLive;
  }
}

void Engine::failPeer(Peer& p, const std::string& why) {
  if (p.failed) return;
  p.failed = true;
  p.error = why;
  // No more data lands in our memory once the QPs are in the error state;
  // then the requests may fail (their buffers become the caller's again).
  for (auto& qp : p.qps) qp->toError();
  for (auto& op : p.recvs) finish(op, OpStatus::Failed, why);
  for (auto& op : p.sends) finish(op, OpStatus::Failed, why);
  for (auto& kv : p.pieces) finish(kv.second.op, OpStatus::Failed, why);
  p.recvs.clear();
  p.sends.clear();
  p.pieces.clear();
  for (auto& s : p.rslots) s = RecvSlot{};
  p.sendOpsLive = 0;
  FASTCOMM_LOG(Info, why);
  notifier_->notify();
}

void Engine::protocolError(Peer& p, const std::string& what) {
  failPeer(p, "fastcomm: " + p.describe() + ": protocol error: " + what);
  throw PeerFailed{};
}

bool Engine::postWrite(Peer& p, int q, const SendWr& wr) {
  if (int rc = p.qps[q]->postSend(&wr, 1)) {
    failPeer(p, "fastcomm: " + p.describe() + ": posting " + wrWhat(wrKind(wr.wrId)) + " on QP " +
                    std::to_string(p.qps[q]->qpn()) + " failed: " + std::strerror(rc));
    throw PeerFailed{};
  }
  ++p.sqUsed[q];
  return true;
}

void Engine::pump(Peer& p) {
  if (p.failed) return;
  advertise(p);
  serve(p);
}

// Receiver: hands out slots for the posted receives, in order, while the
// FIFO has room (and, for unregistered buffers, staging slots are free).
void Engine::advertise(Peer& p) {
  for (auto& op : p.recvs) {
    while (!op->allPosted) {
      const int slot = static_cast<int>(p.fifoNext % kFifoDepth);
      if (p.rslots[slot].used || !sqRoom(p, 0, 1)) return;
      const int64_t off = op->progressed;
      const int64_t len =
          std::min(op->zeroCopy ? kZeroCopyPieceBytes : kPieceBytes, op->bytes - off);
      FifoEntry& e = p.ctrl->fifoOut[slot];
      int staging = -1;
      if (len == 0) {
        // An empty message still takes a slot, so it completes only when the
        // matching send exists; a zero-length write touches no memory.
        e.addr = reinterpret_cast<uint64_t>(p.ctrl);
        e.rkey = p.ctrlMr->rkey;
      } else if (op->zeroCopy) {
        e.addr = reinterpret_cast<uint64_t>(op->data + off);
        e.rkey = op->rkey;
      } else {
        staging = p.recvStaging.take(*dev_);
        if (staging < 0) return;
        e.addr = reinterpret_cast<uint64_t>(p.recvStaging.at(staging));
        e.rkey = p.recvStaging.rkey();
      }
      e.len = static_cast<uint32_t>(len);
      e.seq = op->seq;
      e.offset = static_cast<uint64_t>(off);
      e.msgBytes = static_cast<uint64_t>(op->bytes);
      e.idx = p.fifoNext;
      SendWr wr;
      wr.wrId = wrId(kWrFifo, static_cast<uint64_t>(slot));
      wr.withImm = true;
      wr.imm = makeImm(kImmFifo, slot, 0);
      wr.local = &e;
      wr.length = sizeof(FifoEntry);
      wr.lkey = p.ctrlMr->lkey;
      wr.remoteAddr = p.remoteCtrl + offsetof(CtrlBlock, fifoIn) + slot * sizeof(FifoEntry);
      wr.rkey = p.remoteCtrlRkey;
      RecvSlot& rs = p.rslots[slot];
      rs.used = true;
      rs.op = op;
      rs.off = off;
      rs.len = len;
      rs.staging = staging;
      rs.stripesGot = 0;
      rs.bytesGot = 0;
      ++p.fifoNext;
      op->progressed += len;
      ++op->outstanding;
      if (op->progressed == op->bytes) op->allPosted = true;
      postWrite(p, 0, wr);
    }
  }
}

// Sender: writes a piece into every slot the receiver handed out, in order.
void Engine::serve(Peer& p) {
  for (;;) {
    const int slot = static_cast<int>(p.fifoConsumed % kFifoDepth);
    if (!p.fifoArrived[slot]) return;
    const FifoEntry e = p.ctrl->fifoIn[slot];
    if (e.idx != p.fifoConsumed) {
      protocolError(p, "FIFO slot " + std::to_string(slot) + " holds entry " +
                           std::to_string(e.idx) + ", expected " + std::to_string(p.fifoConsumed));
    }
    auto replyMismatch = [&](uint64_t size) {
      if (!sqRoom(p, 0, 1)) return false;
      p.ctrl->mmOut[slot] = size;
      SendWr wr;
      wr.wrId = wrId(kWrMismatch, static_cast<uint64_t>(slot));
      wr.withImm = true;
      wr.imm = makeImm(kImmMismatch, slot, 0);
      wr.local = &p.ctrl->mmOut[slot];
      wr.length = sizeof(uint64_t);
      wr.lkey = p.ctrlMr->lkey;
      wr.remoteAddr = p.remoteCtrl + offsetof(CtrlBlock, mmIn) + slot * sizeof(uint64_t);
      wr.rkey = p.remoteCtrlRkey;
      postWrite(p, 0, wr);
      p.fifoArrived[slot] = false;
      ++p.fifoConsumed;
      return true;
    };
    if (e.seq < p.nextServe) {
      // Another slot of a message whose sizes did not match: give it back.
      if (!replyMismatch(0)) return;
      continue;
    }
    if (p.sends.empty()) return;  // the matching isend is not posted yet
    std::shared_ptr<Op> op = p.sends.front();
    if (op->seq != e.seq) {
      protocolError(p, "a slot for message " + std::to_string(e.seq) + " while message " +
                           std::to_string(op->seq) + " is being sent");
    }
    if (e.msgBytes != static_cast<uint64_t>(op->bytes)) {
      if (!replyMismatch(static_cast<uint64_t>(op->bytes))) return;
      finish(op, OpStatus::Failed,
             "fastcomm: ib message size mismatch with rank " + std::to_string(p.rank) +
                 ": this rank sent " + std::to_string(op->bytes) + " bytes, rank " +
                 std::to_string(p.rank) + " posted a receive of " + std::to_string(e.msgBytes) +
                 " bytes (message " + std::to_string(op->seq) + " to rank " +
                 std::to_string(p.rank) + ")");
      p.sends.pop_front();
      --p.sendOpsLive;
      ++p.nextServe;
      continue;
    }
    if (e.offset != static_cast<uint64_t>(op->progressed) ||
        e.len > static_cast<uint64_t>(op->bytes - op->progressed)) {
      protocolError(p, "slot for bytes " + std::to_string(e.offset) + "+" + std::to_string(e.len) +
                           " of message " + std::to_string(e.seq) + ", but " +
                           std::to_string(op->progressed) + " of " + std::to_string(op->bytes) +
                           " were sent");
    }
    // Stripes over the QPs, each at least kMinStripeBytes (rounded to pages).
    const int64_t len = e.len;
    int stripes = len == 0 ? 1
                           : static_cast<int>(std::min<int64_t>(
                                 qps_, std::max<int64_t>(1, len / kMinStripeBytes)));
    const int64_t stripeBytes = len == 0 ? 0 : ((len + stripes - 1) / stripes + 4095) / 4096 * 4096;
    if (len > 0) stripes = static_cast<int>((len + stripeBytes - 1) / stripeBytes);
    for (int j = 0; j < stripes; ++j) {
      if (!sqRoom(p, static_cast<int>((p.fifoConsumed + j) % qps_), 1)) return;
    }
    const char* src;
    uint32_t lkey;
    int staging = -1;
    if (len == 0) {
      src = reinterpret_cast<const char*>(p.ctrl);
      lkey = p.ctrlMr->lkey;
    } else if (op->zeroCopy) {
      src = op->data + e.offset;
      lkey = op->lkey;
      zeroCopyBytes_ += len;
    } else {
      staging = p.sendStaging.take(*dev_);
      if (staging < 0) return;  // a staging slot frees when an earlier piece completes
      std::memcpy(p.sendStaging.at(staging), op->data + e.offset, static_cast<size_t>(len));
      src = p.sendStaging.at(staging);
      lkey = p.sendStaging.lkey();
      stagedBytes_ += len;
    }
    const uint64_t piece = nextPiece_++;
    p.pieces[piece] = SendPiece{op, staging, stripes};
    ++op->outstanding;
    op->progressed += len;
    const uint64_t first = p.fifoConsumed;
    p.fifoArrived[slot] = false;
    ++p.fifoConsumed;
    if (op->progressed == op->bytes) {
      op->allPosted = true;
      p.sends.pop_front();
      ++p.nextServe;
    }
    for (int j = 0; j < stripes; ++j) {
      const int64_t so = j * stripeBytes;
      SendWr wr;
      wr.wrId = wrId(kWrData, piece);
      wr.withImm = true;
      wr.imm = makeImm(kImmData, slot, stripes);
      wr.local = src + so;
      wr.length = static_cast<uint32_t>(std::min(stripeBytes, len - so));
      wr.lkey = lkey;
      wr.remoteAddr = e.addr + static_cast<uint64_t>(so);
      wr.rkey = e.rkey;
      postWrite(p, static_cast<int>((first + j) % qps_), wr);
    }
  }
}

void Engine::onData(Peer& p, int slot, int stripes, uint32_t bytes) {
  RecvSlot& s = p.rslots[slot];
  if (!s.used || stripes < 1) {
    protocolError(p, "data for slot " + std::to_string(slot) + ", which was not handed out");
  }
  ++s.stripesGot;
  s.bytesGot += bytes;
  if (s.stripesGot < stripes) return;
  if (s.bytesGot != s.len) {
    protocolError(p, "slot " + std::to_string(slot) + " got " + std::to_string(s.bytesGot) +
                         " bytes for a piece of " + std::to_string(s.len));
  }
  std::shared_ptr<Op> op = std::move(s.op);
  if (s.staging >= 0) {
    std::memcpy(op->data + s.off, p.recvStaging.at(s.staging), static_cast<size_t>(s.len));
    p.recvStaging.give(s.staging);
    stagedBytes_ += s.len;
  } else {
    zeroCopyBytes_ += s.len;
  }
  s = RecvSlot{};
  --op->outstanding;
  finishRecvIfDone(p, op);
}

void Engine::onMismatch(Peer& p, int slot) {
  RecvSlot& s = p.rslots[slot];
  if (!s.used) {
    protocolError(p, "a size-mismatch notice for slot " + std::to_string(slot) +
                         ", which was not handed out");
  }
  std::shared_ptr<Op> op = std::move(s.op);
  if (s.staging >= 0) p.recvStaging.give(s.staging);
  s = RecvSlot{};
  // No byte of this message was written; stop handing out its slots.
  op->allPosted = true;
  --op->outstanding;
  finish(op, OpStatus::Failed,
         "fastcomm: ib message size mismatch with rank " + std::to_string(p.rank) +
             ": this rank posted a receive of " + std::to_string(op->bytes) + " bytes, rank " +
             std::to_string(p.rank) + " sent " + std::to_string(p.ctrl->mmIn[slot]) +
             " bytes (message " + std::to_string(op->seq) + " from rank " + std::to_string(p.rank) +
             ")");
  if (op->outstanding == 0) p.recvs.remove(op);
}

// Accounting of posted receives: a receive is consumed by a slot
// advertisement from the peer (at most kFifoDepth unanswered: the peer
// reuses a slot only after this rank used it), by a data stripe or a
// mismatch notice (at most one per QP and outstanding slot of ours), so
// 2 * kFifoDepth receives per QP never run dry; each is reposted at once.
void Engine::handle(const Completion* wcs, int n) {
  std::vector<Peer*> touched;
  for (int i = 0; i < n; ++i) {
    const Completion& c = wcs[i];
    auto it = byQpn_.find(c.qpn);
    if (it == byQpn_.end()) continue;
    Peer& p = *it->second.first;
    const int q = it->second.second;
    const WrKind kind = wrKind(c.wrId);
    if (kind != kWrRecv) --p.sqUsed[q];
    if (p.failed) continue;
    try {
      if (c.status != WcStatus::Success) {
        if (c.status == WcStatus::WrFlushErr) {
          // Flushed work follows the error that caused it; an async event
          // (QP fatal, access error) names the cause better than the flush.
          handleAsync();
          if (p.failed) continue;
        }
        std::ostringstream os;
        os << "fastcomm: " << p.describe() << " broke: " << wrWhat(kind) << " on QP " << c.qpn
           << " completed with " << wcStatusName(c.status) << ": " << wcStatusMeaning(c.status);
        if (c.vendorErr != 0) os << " (vendor error 0x" << std::hex << c.vendorErr << ")";
        failPeer(p, os.str());
        continue;
      }
      p.lastHeard = Clock::now();
      if (std::find(touched.begin(), touched.end(), &p) == touched.end()) touched.push_back(&p);
      switch (kind) {
        case kWrRecv: {
          const uint64_t id = wrId(kWrRecv, 0);
          if (int rc = p.qps[q]->postRecv(&id, 1)) {
            failPeer(p, "fastcomm: " + p.describe() +
                            ": reposting a receive failed: " + std::strerror(rc));
            continue;
          }
          const int slot = immSlot(c.imm);
          if (slot >= kFifoDepth) protocolError(p, "immediate names slot " + std::to_string(slot));
          switch (immType(c.imm)) {
            case kImmFifo:
              p.fifoArrived[slot] = true;
              break;
            case kImmData:
              onData(p, slot, immStripes(c.imm), c.byteLen);
              break;
            case kImmMismatch:
              onMismatch(p, slot);
              break;
            default:
              protocolError(p, "unknown immediate 0x" + std::to_string(c.imm));
          }
          break;
        }
        case kWrData: {
          auto pit = p.pieces.find(wrPayload(c.wrId));
          if (pit == p.pieces.end()) break;
          if (--pit->second.stripesLeft > 0) break;
          std::shared_ptr<Op> op = std::move(pit->second.op);
          if (pit->second.staging >= 0) p.sendStaging.give(pit->second.staging);
          p.pieces.erase(pit);
          --op->outstanding;
          finishSendIfDone(p, op);
          break;
        }
        case kWrKeepalive:
          p.keepaliveOut = false;
          break;
        default:
          break;
      }
    } catch (const PeerFailed&) {
    }
  }
  for (Peer* p : touched) {
    try {
      pump(*p);
    } catch (const PeerFailed&) {
    }
  }
}

void Engine::handleAsync() {
  AsyncEvent ev;
  while (dev_->nextAsyncEvent(&ev)) {
    if (ev.kind == AsyncKind::Harmless) {
      FASTCOMM_LOG(Debug, "ib: async event " << ev.name);
      continue;
    }
    if (ev.qpn != 0) {
      auto it = byQpn_.find(ev.qpn);
      if (it == byQpn_.end()) continue;
      Peer& p = *it->second.first;
      failPeer(p, "fastcomm: " + p.describe() + " broke: async event " + ev.name + " on QP " +
                      std::to_string(ev.qpn) + " (the queue pair entered the error state)");
      continue;
    }
    for (auto& p : peers_) {
      failPeer(*p, "fastcomm: " + p->describe() + " broke: async event " + ev.name + " on " +
                       dev_->port().device);
    }
  }
}

// Keepalive: a peer that owes this rank data or slots and has been silent
// for kKeepaliveIdle gets a zero-length RDMA write; if it cannot acknowledge
// it (process gone, QP destroyed or in error), the write completes with
// IBV_WC_RETRY_EXC_ERR after the RC retry budget and the connection fails,
// instead of the requests waiting for the collective's timeout.
void Engine::timers() {
  const auto now = Clock::now();
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (p.failed || !p.busy() || p.keepaliveOut || now - p.lastHeard < kKeepaliveIdle) continue;
    if (!sqRoom(p, 0, 1)) continue;
    SendWr wr;
    wr.wrId = wrId(kWrKeepalive, 0);
    wr.withImm = false;
    wr.local = p.ctrl;
    wr.length = 0;
    wr.lkey = p.ctrlMr->lkey;
    wr.remoteAddr = p.remoteCtrl;
    wr.rkey = p.remoteCtrlRkey;
    try {
      postWrite(p, 0, wr);
      p.keepaliveOut = true;
      ++keepalives_;
    } catch (const PeerFailed&) {
    }
  }
}

void Engine::run() {
  nameThisThread("fc-ib");
  std::vector<Completion> wcs(64);
  auto nextTimer = Clock::now() + kTimerPeriod;
  while (!stop_.load(std::memory_order_acquire)) {
    int n = cq_->poll(wcs.data(), static_cast<int>(wcs.size()));
    if (n > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      handle(wcs.data(), n);
    }
    const auto now = Clock::now();
    if (now >= nextTimer) {
      std::lock_guard<std::mutex> lock(mu_);
      timers();
      nextTimer = now + kTimerPeriod;
    }
    if (n > 0) continue;
    if (spinMicros_ > 0) {
      // Where cores are plenty, polling a little longer saves the wake-up.
      const auto until = now + std::chrono::microseconds(spinMicros_);
      while (n == 0 && Clock::now() < until) n = cq_->poll(wcs.data(), 1);
      if (n > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        handle(wcs.data(), n);
        continue;
      }
    }
    // Arm, then look once more: a completion between the last poll and the
    // arm would otherwise raise no event.
    cq_->arm();
    n = cq_->poll(wcs.data(), static_cast<int>(wcs.size()));
    if (n > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      handle(wcs.data(), n);
      continue;
    }
    pollfd fds[3] = {{cq_->fd(), POLLIN, 0}, {dev_->asyncFd(), POLLIN, 0}, {wakeFd_, POLLIN, 0}};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(nextTimer - Clock::now()).count();
    int r = ::poll(fds, 3, static_cast<int>(std::max<int64_t>(1, left)));
    if (r <= 0) continue;
    if (fds[0].revents) cq_->drainEvents();
    if (fds[1].revents) {
      std::lock_guard<std::mutex> lock(mu_);
      handleAsync();
    }
    if (fds[2].revents) {
      uint64_t v;
      ssize_t rd = ::read(wakeFd_, &v, sizeof v);
      (void)rd;
    }
  }
}

void Engine::close() {
  std::lock_guard<std::mutex> closeLock(closeMu_);
  if (closed_) return;
  closed_ = true;
  stop_.store(true);
  if (wakeFd_ >= 0) {
    uint64_t one = 1;
    ssize_t w = ::write(wakeFd_, &one, sizeof one);
    (void)w;
  }
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : peers_) {
      failPeer(
          *p, "fastcomm: " + p->describe() + " was closed by this rank (the transport was closed)");
    }
    // Queue pairs before the memory they may write, all before the device.
    for (auto& p : peers_) {
      p->qps.clear();
      p->ctrlMr.reset();
      p->recvStaging.release();
      p->sendStaging.release();
    }
    byQpn_.clear();
  }
  if (regCache_) regCache_->close();
  cq_.reset();
  dev_.reset();
  if (wakeFd_ >= 0) ::close(wakeFd_);
  wakeFd_ = -1;
  notifier_->notify();
}

std::map<std::string, int64_t> Engine::counters() {
  std::map<std::string, int64_t> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out["zero_copy_bytes"] = zeroCopyBytes_;
    out["staged_bytes"] = stagedBytes_;
    out["keepalives"] = keepalives_;
    out["qps_per_peer"] = qps_;
    out["emulated"] = dev_ && dev_->emulated() ? 1 : 0;
  }
  regCache_->counters(&out);
  return out;
}

// ----------------------------------------------------------------------------- interface

class IbConnection : public Connection {
 public:
  IbConnection(std::shared_ptr<Engine> engine, std::shared_ptr<Peer> peer)
      : engine_(std::move(engine)), peer_(std::move(peer)) {}
  int peer() const override { return peer_->rank; }
  std::unique_ptr<Request> isend(const void* data, int64_t bytes, const MemoryRegion* mr) override {
    // The buffer is only read; Op keeps one pointer type for both directions.
    return engine_->post(*peer_, true, static_cast<char*>(const_cast<void*>(data)), bytes, mr);
  }
  std::unique_ptr<Request> irecv(void* data, int64_t bytes, const MemoryRegion* mr) override {
    return engine_->post(*peer_, false, static_cast<char*>(data), bytes, mr);
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<Peer> peer_;
};

class IbTransport : public Transport {
 public:
  explicit IbTransport(const Config& cfg) : engine_(std::make_shared<Engine>(cfg)) {}
  ~IbTransport() override { close(); }

  std::string name() const override { return "ib"; }
  std::unique_ptr<MemoryRegion> registerMemory(void* data, int64_t bytes) override {
    return engine_->registerMemory(data, bytes);
  }
  std::unique_ptr<MemoryRegion> registerDeviceMemory(void* data, int64_t bytes) override {
    return engine_->registerDeviceMemory(data, bytes);
  }
  std::vector<std::unique_ptr<Connection>> connect(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size,
                                                   const std::vector<int>& peers,
                                                   const OpContext& ctx) override {
    std::vector<std::unique_ptr<Connection>> conns;
    for (auto& p : engine_->connect(store, rank, size, peers, ctx)) {
      conns.push_back(std::make_unique<IbConnection>(engine_, std::move(p)));
    }
    return conns;
  }
  void waitForProgress(std::chrono::microseconds max) override { engine_->waitForProgress(max); }
  void close() override { engine_->close(); }
  bool supportsDeviceMemory() const override { return engine_->deviceMemory(); }
  std::map<std::string, int64_t> counters() const override { return engine_->counters(); }

 private:
  std::shared_ptr<Engine> engine_;
};

}  // namespace

std::unique_ptr<Transport> createIbTransport(const Config& cfg) {
  return std::make_unique<IbTransport>(cfg);
}

bool ibUsable(const Config& cfg, std::string* why) {
  Probe p = probe(cfg);
  *why = p.reason;
  return p.usable;
}

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
