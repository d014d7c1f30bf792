// The emulated device's verbs: opening a port, memory regions and keys,
// completion queues and queue pairs (emu_device.hpp has the model).
#include "inter/ib/emu_device.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>
#include <string>
#include <system_error>
#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "common/logging.hpp"

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {

namespace {

std::mutex gFaultMu;
FaultPlan gFaultPlan;                 // guarded by gFaultMu
std::atomic<int64_t> gDataWrites{0};  // data writes posted since setFaultPlan()

}  // namespace

class EmuMr : public Mr {
 public:
  EmuMr(EmuDevice* dev) : dev_(dev) {}
  ~EmuMr() override { dev_->deregister(lkey); }

 private:
  EmuDevice* dev_;
};

class EmuQp : public Qp {
 public:
  explicit EmuQp(std::shared_ptr<QpCore> core) : core_(std::move(core)) {}
  ~EmuQp() override { core_->dev->destroyQp(core_); }

  uint32_t qpn() const override { return core_->qpn; }

  void toInit() override {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->state != QpState::Reset)
      throw std::logic_error("ib emulation: INIT from a non-RESET QP");
    core_->state = QpState::Init;
  }

  void toRtr(const QpEndpoint& remote, const RcAttrs& rc) override {
    auto seg = mapPeer(remote.gid);
    const int lane = static_cast<int>(remote.qpn & 0xff);
    if (lane >= kLanes || seg->lane(lane)->qpn.load() != remote.qpn ||
        seg->lane(lane)->state.load() == kLaneFree) {
      throw std::runtime_error("fastcomm: ib emulation: the peer has no QP " +
                               std::to_string(remote.qpn));
    }
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->state != QpState::Init)
      throw std::logic_error("ib emulation: RTR from a non-INIT QP");
    core_->remote = std::move(seg);
    core_->remoteLane = lane;
    core_->remoteQpn = remote.qpn;
    core_->rc = rc;
    core_->state = QpState::Rtr;
    core_->dev->kick();  // packets may be waiting for us to be ready
  }

  void toRts(uint32_t, const RcAttrs& rc) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->state != QpState::Rtr) throw std::logic_error("ib emulation: RTS from a non-RTR QP");
    core_->rc.timeout = rc.timeout;
    core_->rc.retryCnt = rc.retryCnt;
    core_->rc.rnrRetry = rc.rnrRetry;
    core_->state = QpState::Rts;
    core_->lastProgress = Clock::now();
  }

  void toError() override {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->dev->errorLocked(*core_);
  }

  int postSend(const SendWr* wrs, int n) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    QpCore& q = *core_;
    if (q.state == QpState::Reset || q.state == QpState::Init || q.state == QpState::Rtr) {
      return EINVAL;
    }
    if (q.outstandingSends() + n > q.maxSend) return ENOMEM;
    const FaultPlan& f = q.dev->fault();
    for (int i = 0; i < n; ++i) {
      PendingWr p;
      p.wr = wrs[i];
      p.msn = q.nextMsn++;
      if (f.kind != FaultPlan::None && wrs[i].withImm && wrs[i].length > 0) {
        if (gDataWrites.fetch_add(1) == f.after) {
          FASTCOMM_LOG(Warn,
                       "ib emulation: injected fault: "
                           << (f.kind == FaultPlan::QpError ? "QP " : "corrupting the rkey of ")
                           << (f.kind == FaultPlan::QpError
                                   ? std::to_string(q.qpn) + " goes to the error state"
                                   : "a write on QP " + std::to_string(q.qpn))
                           << " after " << f.after << " data writes");
          if (f.kind == FaultPlan::BadRkey) {
            p.wr.rkey ^= 0x00a5a500u;
          } else {
            p.injectFatal = true;
          }
        }
      }
      if (q.state == QpState::Error) {
        q.cq->push(
            Completion{p.wr.wrId, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0, 0, q.qpn, 0});
        continue;
      }
      q.pending.push_back(p);
    }
    q.dev->kick();
    return 0;
  }

  int postRecv(const uint64_t* ids, int n) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    QpCore& q = *core_;
    if (q.state == QpState::Reset) return EINVAL;
    if (static_cast<int>(q.recvs.size()) + n > q.maxRecv) return ENOMEM;
    for (int i = 0; i < n; ++i) {
      if (q.state == QpState::Error) {
        q.cq->push(
            Completion{ids[i], WcStatus::WrFlushErr, WcOpcode::RecvRdmaWithImm, 0, 0, q.qpn, 0});
      } else {
        q.recvs.push_back(ids[i]);
      }
    }
    q.dev->kick();  // a write may be waiting for this receive
    return 0;
  }

 private:
  std::shared_ptr<QpCore> core_;
};

EmuDevice::EmuDevice() {
  {
    std::lock_guard<std::mutex> lock(gFaultMu);
    fault_ = gFaultPlan;
  }
  static std::atomic<uint32_t> counter{0};
  const uint32_t ns = pidNamespace();
  const int pid = static_cast<int>(getpid());
  removeStaleSegments(ns);
  ctx_ = counter.fetch_add(1) + 1;
  const std::string name = segmentName(ns, pid, ctx_);
  shm_unlink(name.c_str());  // a leftover of an earlier process with our pid
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    throw std::system_error(errno, std::generic_category(),
                            "fastcomm: ib emulation: shm_open " + name);
  if (ftruncate(fd, static_cast<off_t>(segmentBytes())) != 0) {
    int err = errno;
    ::close(fd);
    shm_unlink(name.c_str());
    throw std::system_error(err, std::generic_category(),
                            "fastcomm: ib emulation: ftruncate " + name);
  }
  void* p = mmap(nullptr, segmentBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw std::system_error(err, std::generic_category(), "fastcomm: ib emulation: mmap " + name);
  }
  seg_ = std::make_shared<Segment>(name, p);
  SegHeader* h = seg_->hdr();
  h->version = kVersion;
  h->pid = pid;
  bool zombie = false;
  h->startTime = processStart(pid, &zombie);
  h->ctx = ctx_;
  h->lanes = kLanes;
  h->laneBytes = kLaneBytes;
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kSegMagic, std::memory_order_release);

  lanes_.resize(kLanes);
  asyncFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (asyncFd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");

  port_ = portInfo();
  port_.gids.clear();
  port_.gids.push_back({0, makeGid(0xfe80, ns, pid, ctx_), GidType::RoCEv1});
  port_.gids.push_back({1, makeGid(0xfe80, ns, pid, ctx_), GidType::RoCEv2});
  port_.gids.push_back({2, makeGid(0xfdfc, ns, pid, ctx_), GidType::RoCEv1});
  port_.gids.push_back({3, makeGid(0xfdfc, ns, pid, ctx_), GidType::RoCEv2});
  thread_ = std::thread([this] { run(); });
}

EmuDevice::~EmuDevice() {
  stop_.store(true);
  seg_->ring();
  if (thread_.joinable()) thread_.join();
  copiers_.clear();  // the HCA thread is gone: nobody copies any more
  // Peers talking to us stop getting acknowledgements from now on.
  seg_->hdr()->closed.store(1, std::memory_order_release);
  seg_->ring();
  shm_unlink(seg_->name().c_str());
  ::close(asyncFd_);
}

std::unique_ptr<Mr> EmuDevice::regMr(void* addr, size_t length, MemKind kind) {
  if (addr == nullptr || length == 0) {
    throw std::invalid_argument("fastcomm: ib emulation: registering an empty memory region");
  }
  // Device memory: checked (and its device found) now, and its device's
  // copier made now, so the HCA thread knows how to move each region's data
  // and makes no CUDA call but copies; throws saying why without CUDA.
  gpu::DeviceCopier* copier =
      kind == MemKind::Device ? copierFor(gpu::deviceOf(addr, length)) : nullptr;
  auto mr = std::make_unique<EmuMr>(this);
  std::unique_lock<std::shared_mutex> lock(mrMu_);
  // Keys as hardware makes them: an index with a rotating low byte.
  uint32_t key;
  do {
    const uint32_t index = nextKey_++;
    key = (index << 8) | ((index * 37u) & 0xff);
  } while (mrs_.count(key) || key == 0);
  mrs_[key] = MrEntry{reinterpret_cast<uintptr_t>(addr), length, copier};
  mr->addr = addr;
  mr->length = length;
  mr->lkey = mr->rkey = key;
  return mr;
}

std::unique_ptr<Qp> EmuDevice::createQp(Cq& cq, int maxSend, int maxRecv) {
  std::lock_guard<std::mutex> lock(qpMu_);
  // Lanes are reused round-robin, so a destroyed QP's acknowledgements stay
  // readable as long as possible.
  for (int k = 0; k < kLanes; ++k) {
    const int i = (nextLane_ + k) % kLanes;
    if (lanes_[i]) continue;
    nextLane_ = i + 1;
    const uint32_t qpn = ((qpGen_++ & 0xffff) << 8) | static_cast<uint32_t>(i);
    auto core =
        std::make_shared<QpCore>(this, i, qpn, static_cast<EmuCq&>(cq).core, maxSend, maxRecv);
    LaneHeader* l = seg_->lane(i);
    // The new QPN first: a producer of the previous QP stops writing here.
    l->qpn.store(qpn, std::memory_order_release);
    l->head.store(0);
    l->tail.store(0);
    l->acked.store(0);
    l->nakStatus.store(0);
    l->nakMsn.store(0);
    l->state.store(kLaneAlive, std::memory_order_release);
    lanes_[i] = core;
    return std::make_unique<EmuQp>(std::move(core));
  }
  throw std::runtime_error("fastcomm: ib emulation: the emulated device has at most " +
                           std::to_string(kLanes) + " queue pairs");
}

void EmuDevice::destroyQp(const std::shared_ptr<QpCore>& qp) {
  {
    std::lock_guard<std::mutex> lock(qp->mu);
    qp->state = QpState::Destroyed;
    qp->pending.clear();
    qp->inflight.clear();
    qp->recvs.clear();
    qp->remote.reset();
  }
  std::lock_guard<std::mutex> lock(qpMu_);
  // The lane keeps the QPN and the acknowledgements it gave until it is
  // reused: a requester may read them after we are gone (on the wire, the
  // acknowledgements left before the QP was destroyed).
  seg_->lane(qp->lane)->state.store(kLaneFree, std::memory_order_release);
  lanes_[qp->lane].reset();
}

gpu::DeviceCopier* EmuDevice::copierFor(int device) {
  std::lock_guard<std::mutex> lock(copierMu_);
  auto& c = copiers_[device];
  if (!c) c = std::make_unique<gpu::DeviceCopier>(device);
  return c.get();
}

PortInfo portInfo() {
  PortInfo p;
  p.device = kDeviceName;
  p.port = 1;
  p.link = LinkLayer::Ethernet;
  p.active = true;
  p.lid = 0;
  p.activeMtu = kActiveMtu;
  p.rate = "software emulation";
  return p;
}

std::unique_ptr<Device> open(const Config&) { return std::make_unique<EmuDevice>(); }

void setFaultPlan(const FaultPlan& plan) {
  std::lock_guard<std::mutex> lock(gFaultMu);
  gFaultPlan = plan;
  gDataWrites.store(0);
}

}  // namespace emu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
