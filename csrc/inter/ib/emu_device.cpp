// A software RC device: the ib transport's verbs, emulated across the
// processes of one machine (FASTCOMM_IB_EMULATE=1), so that the whole
// protocol runs in CI where there is no RDMA hardware.
//
// Model (what an RC HCA does, in software):
// - Each opened device is a "port" with a POSIX shared-memory segment
//   /dev/shm/fastcomm-ibemu-<pidns>-<pid>-<ctx>: a header (owner pid, a
//   doorbell futex) and one inbound "wire" per queue pair, a single-producer
//   single-consumer byte ring of packets. The port's GIDs encode the segment's
//   name, so QPN + GID exchanged through the store are all a peer needs, as
//   on real hardware.
// - A thread per device plays the HCA. For its QPs it transmits posted work
//   requests as packets (at most 64 KiB of payload each) into the peer QP's
//   wire, and consumes its own wires: it checks each RDMA write's rkey and
//   bounds against the local memory regions (the responder's check), copies
//   the payload into place, takes a posted receive for a write with
//   immediate (no receive: the packet waits, i.e. RNR retry forever), and
//   acknowledges by advancing the wire's `acked` message number, which the
//   requester turns into the send completion. User memory is never touched
//   by another process: only the wires are shared.
// - Device (GPU) memory regions, in a CUDA build with a visible GPU: the
//   HCA thread moves their payload between the wire and GPU memory as a
//   NIC's DMA to and from GPU memory (GPUDirect RDMA) would, with
//   cudaMemcpyAsync through a page-locked bounce buffer on a non-blocking
//   stream of the region's GPU (gpu::DeviceCopier, made at registration:
//   the wires are pageable shared memory, and a copy of pageable memory may
//   wait for the very stream that waits for this transfer; gpu_memory.hpp
//   has the why). Each side only touches its own GPU memory, so no CUDA IPC
//   mapping is needed and a killed peer leaves nothing mapped.
// - Failures as on hardware: a bad rkey or range is NAKed (the requester's
//   work request completes IBV_WC_REM_ACCESS_ERR; both QPs go to the error
//   state, the responder with IBV_EVENT_QP_ACCESS_ERR); a local key that does
//   not cover the buffer gives IBV_WC_LOC_PROT_ERR; a peer whose process
//   exited, whose device closed or whose QP is in the error state or gone
//   stops acknowledging, so after the RC retry budget (timeout and retry_cnt
//   of the QP) the requester gets IBV_WC_RETRY_EXC_ERR. A QP in the error
//   state completes everything outstanding with IBV_WC_WR_FLUSH_ERR, in order.
//   Completions of one QP come in posting order.
// - Tests inject faults through emu_fault.hpp (none by default).
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "common/logging.hpp"
#include "inter/ib/device.hpp"
#include "inter/ib/emu_fault.hpp"
#include "inter/ib/gpu_memory.hpp"

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSegMagic = 0x756d656269636166ULL;  // "fcibemu"
constexpr uint32_t kVersion = 1;
constexpr int kLanes = 128;                 // QPs per emulated device
constexpr uint64_t kLaneBytes = 1 << 20;    // wire bytes per QP
constexpr uint32_t kMaxPayload = 64 << 10;  // payload per packet
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kLaneHeaderBytes = 256;
constexpr int kActiveMtu = 4096;
const char* kDeviceName = "fcemu0";

enum PktKind : uint32_t { kWrite = 1, kWrap = 2 };
constexpr uint32_t kFirst = 1, kLast = 2, kImm = 4;  // packet flags

struct Pkt {
  uint32_t kind;
  uint32_t flags;
  uint64_t msn;     // work request number on the sending QP, from 1
  uint64_t raddr;   // where this packet's payload goes
  uint64_t wrAddr;  // where the whole write goes (checked on the first packet)
  uint32_t rkey;
  uint32_t len;    // payload bytes in this packet
  uint32_t total;  // bytes of the whole write
  uint32_t imm;
  uint64_t pad;
};
static_assert(sizeof(Pkt) == 56, "packet header layout");
constexpr uint64_t kPktHeader = 64;

enum LaneState : uint32_t { kLaneFree = 0, kLaneAlive = 1, kLaneError = 2 };

struct SegHeader {
  uint64_t magic;
  uint32_t version;
  int32_t pid;
  uint64_t startTime;  // the owner's start time, so a reused pid is not taken for it
  uint32_t ctx;
  uint32_t lanes;
  uint64_t laneBytes;
  alignas(64) std::atomic<uint32_t> bell;
  alignas(64) std::atomic<uint32_t> sleepers;
  alignas(64) std::atomic<uint32_t> closed;
};

struct LaneHeader {
  // Written by the owner (the consumer).
  alignas(64) std::atomic<uint64_t> head;
  std::atomic<uint64_t> acked;      // last message number fully processed
  std::atomic<uint32_t> qpn;        // the QP that owns the lane now (0: none)
  std::atomic<uint32_t> state;      // LaneState
  std::atomic<uint32_t> nakStatus;  // WcStatus + 1 of a NAK, 0: none
  std::atomic<uint64_t> nakMsn;
  // Written by the producer (the peer QP's HCA).
  alignas(64) std::atomic<uint64_t> tail;
};
static_assert(sizeof(LaneHeader) <= kLaneHeaderBytes, "lane header layout");

constexpr uint64_t segmentBytes() {
  return kHeaderBytes + kLanes * kLaneHeaderBytes + kLanes * kLaneBytes;
}

uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, timeout,
                 nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint32_t pidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint32_t>(st.st_ino) : 0;
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks), and whether the
// process is a zombie; 0 when the process does not exist.
uint64_t processStart(int pid, bool* zombie) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return 0;
  auto paren = s.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream is(s.substr(paren + 2));
  std::string field;
  uint64_t start = 0;
  for (int i = 3; i <= 22 && is >> field; ++i) {
    if (i == 3 && zombie) *zombie = field == "Z" || field == "X";
    if (i == 22) start = std::strtoull(field.c_str(), nullptr, 10);
  }
  return start;
}

std::string segmentName(uint32_t ns, int pid, uint32_t ctx) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "/fastcomm-ibemu-%u-%d-%u", ns, pid, ctx);
  return buf;
}

void putBe32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

uint32_t getBe32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}

// GID layout of an emulated port: prefix (2 bytes), 0, pid namespace, pid, ctx.
Gid makeGid(uint16_t prefix, uint32_t ns, int pid, uint32_t ctx) {
  Gid g;
  g.raw[0] = static_cast<uint8_t>(prefix >> 8);
  g.raw[1] = static_cast<uint8_t>(prefix);
  putBe32(g.raw + 4, ns);
  putBe32(g.raw + 8, static_cast<uint32_t>(pid));
  putBe32(g.raw + 12, ctx);
  return g;
}

// Removes segments whose owner died without unlinking them (killed).
void removeStaleSegments(uint32_t ns) {
  const std::string prefix = "fastcomm-ibemu-" + std::to_string(ns) + "-";
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    int pid = std::atoi(name.c_str() + prefix.size());
    bool zombie = false;
    if (pid > 0 && (processStart(pid, &zombie) == 0 || zombie)) shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

// ----------------------------------------------------------------------------- segments

// A mapped port segment, ours or a peer's.
class Segment {
 public:
  Segment(std::string name, void* base) : name_(std::move(name)), base_(base) {}
  ~Segment() { munmap(base_, segmentBytes()); }

  SegHeader* hdr() const { return static_cast<SegHeader*>(base_); }
  LaneHeader* lane(int i) const {
    return reinterpret_cast<LaneHeader*>(static_cast<char*>(base_) + kHeaderBytes +
                                         i * kLaneHeaderBytes);
  }
  char* laneData(int i) const {
    return static_cast<char*>(base_) + kHeaderBytes + kLanes * kLaneHeaderBytes + i * kLaneBytes;
  }
  const std::string& name() const { return name_; }

  void ring() {
    hdr()->bell.fetch_add(1, std::memory_order_seq_cst);
    if (hdr()->sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&hdr()->bell);
  }

  // Whether the owner still answers: its device is open and its process
  // lives. Checked at most every 50 ms.
  bool ownerAlive() {
    if (hdr()->closed.load(std::memory_order_acquire) != 0) return false;
    std::lock_guard<std::mutex> lock(mu_);  // devices of this process share the mapping
    auto now = Clock::now();
    if (now < nextCheck_) return alive_;
    nextCheck_ = now + std::chrono::milliseconds(50);
    bool zombie = false;
    uint64_t start = processStart(hdr()->pid, &zombie);
    alive_ = start != 0 && !zombie && start == hdr()->startTime;
    if (!alive_ && !unlinked_) {
      // The owner was killed: nobody else will remove its name.
      shm_unlink(name_.c_str());
      unlinked_ = true;
    }
    return alive_;
  }

 private:
  std::string name_;
  void* base_;
  std::mutex mu_;
  Clock::time_point nextCheck_{};
  bool alive_ = true;
  bool unlinked_ = false;
};

// Peer segments are mapped once per process and shared by every QP that
// talks to that port.
std::shared_ptr<Segment> mapPeer(const Gid& gid) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<Segment>> cache;
  const uint32_t ns = getBe32(gid.raw + 4), ctx = getBe32(gid.raw + 12);
  const int pid = static_cast<int>(getBe32(gid.raw + 8));
  const std::string name = segmentName(ns, pid, ctx);
  std::lock_guard<std::mutex> lock(mu);
  if (auto s = cache[name].lock()) return s;
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw std::runtime_error("fastcomm: ib emulation: no emulated port with GID " + gid.str() +
                             " (" + name + ": " + std::strerror(errno) +
                             "; did the peer's process exit, or is FASTCOMM_IB_EMULATE not set "
                             "on every rank?)");
  }
  void* p = mmap(nullptr, segmentBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    throw std::system_error(err, std::generic_category(), "fastcomm: ib emulation: mmap " + name);
  }
  auto seg = std::make_shared<Segment>(name, p);
  if (seg->hdr()->magic != kSegMagic || seg->hdr()->version != kVersion) {
    throw std::runtime_error("fastcomm: ib emulation: " + name + " is not an emulated port");
  }
  cache[name] = seg;
  return seg;
}

// ----------------------------------------------------------------------------- fault injection

std::mutex gFaultMu;
FaultPlan gFaultPlan;                 // guarded by gFaultMu
std::atomic<int64_t> gDataWrites{0};  // data writes posted since setFaultPlan()

// ----------------------------------------------------------------------------- CQ

class CqCore {
 public:
  explicit CqCore(int depth) : depth_(depth) {
    fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  }
  ~CqCore() { ::close(fd_); }

  // False on overflow (the CQ is then in error, as on hardware).
  bool push(const Completion& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int>(q_.size()) >= depth_) return false;
    q_.push_back(c);
    if (armed_) {
      armed_ = false;
      uint64_t one = 1;
      ssize_t r = ::write(fd_, &one, sizeof one);
      (void)r;
    }
    return true;
  }
  int poll(Completion* out, int max) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    while (n < max && !q_.empty()) {
      out[n++] = q_.front();
      q_.pop_front();
    }
    return n;
  }
  void arm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
  }
  int fd() const { return fd_; }
  void drain() {
    uint64_t v;
    ssize_t r = ::read(fd_, &v, sizeof v);
    (void)r;
  }

 private:
  std::mutex mu_;
  std::deque<Completion> q_;
  int depth_;
  bool armed_ = false;
  int fd_ = -1;
};

class EmuCq : public Cq {
 public:
  explicit EmuCq(int depth) : core(std::make_shared<CqCore>(depth)) {}
  int poll(Completion* out, int max) override { return core->poll(out, max); }
  void arm() override { core->arm(); }
  int fd() const override { return core->fd(); }
  void drainEvents() override { core->drain(); }
  std::shared_ptr<CqCore> core;
};

// ----------------------------------------------------------------------------- device

class EmuDevice;

struct MrEntry {
  uintptr_t addr;
  size_t length;
  // Device memory: the copier of its CUDA device (owned by the device,
  // which outlives its regions); null: host memory.
  gpu::DeviceCopier* copier;
};

enum class QpState { Reset, Init, Rtr, Rts, Error, Destroyed };

struct PendingWr {
  SendWr wr;
  uint64_t msn = 0;
  uint64_t sent = 0;           // payload bytes already in the wire
  Clock::time_point sentAt{};  // when its last packet went out
  bool injectFatal = false;
  gpu::DeviceCopier* localCopier = nullptr;  // the source is device memory: its copier
};

// A QP's state, shared between its owner (the transport) and the HCA thread.
class QpCore {
 public:
  QpCore(EmuDevice* dev, int lane, uint32_t qpn, std::shared_ptr<CqCore> cq, int maxSend,
         int maxRecv)
      : dev(dev), lane(lane), qpn(qpn), cq(std::move(cq)), maxSend(maxSend), maxRecv(maxRecv) {}

  EmuDevice* dev;
  const int lane;
  const uint32_t qpn;
  std::shared_ptr<CqCore> cq;
  const int maxSend, maxRecv;

  std::mutex mu;
  QpState state = QpState::Reset;
  RcAttrs rc;
  // The peer's port and lane (after RTR).
  std::shared_ptr<Segment> remote;
  int remoteLane = -1;
  uint32_t remoteQpn = 0;
  // Requester side.
  std::deque<PendingWr> pending;   // posted, not fully in the wire
  std::deque<PendingWr> inflight;  // in the wire, waiting for the acknowledgement
  uint64_t nextMsn = 1;
  Clock::time_point lastProgress{};  // last packet out or acknowledgement in
  Clock::time_point lastAck{};
  // Responder side.
  std::deque<uint64_t> recvs;  // posted receive wr ids
  bool curValid = false;       // the write being received passed its checks

  int outstandingSends() const { return static_cast<int>(pending.size() + inflight.size()); }
};

class EmuDevice : public Device {
 public:
  EmuDevice();
  ~EmuDevice() override;

  const PortInfo& port() const override { return port_; }
  bool emulated() const override { return true; }
  std::unique_ptr<Mr> regMr(void* addr, size_t length, MemKind kind) override;
  std::unique_ptr<Cq> createCq(int depth) override { return std::make_unique<EmuCq>(depth); }
  std::unique_ptr<Qp> createQp(Cq& cq, int maxSend, int maxRecv) override;
  int asyncFd() const override { return asyncFd_; }
  bool nextAsyncEvent(AsyncEvent* out) override {
    std::lock_guard<std::mutex> lock(asyncMu_);
    uint64_t v;
    ssize_t r = ::read(asyncFd_, &v, sizeof v);
    (void)r;
    if (async_.empty()) return false;
    *out = async_.front();
    async_.pop_front();
    if (!async_.empty()) {
      uint64_t one = 1;
      r = ::write(asyncFd_, &one, sizeof one);
    }
    return true;
  }

  // Called by the QP wrappers and the HCA thread.
  void deregister(uint32_t key) {
    std::unique_lock<std::shared_mutex> lock(mrMu_);
    mrs_.erase(key);
  }
  void destroyQp(const std::shared_ptr<QpCore>& qp);
  void kick() { seg_->ring(); }
  void raiseAsync(AsyncKind kind, const char* name, uint32_t qpn) {
    {
      std::lock_guard<std::mutex> lock(asyncMu_);
      async_.push_back(AsyncEvent{kind, name, qpn});
    }
    uint64_t one = 1;
    ssize_t r = ::write(asyncFd_, &one, sizeof one);
    (void)r;
  }
  Segment& segment() { return *seg_; }
  const FaultPlan& fault() const { return fault_; }

  // Moves `qp` (locked) to the error state and flushes its queues.
  void errorLocked(QpCore& qp);

 private:
  void run();
  // One pass over a QP; true when anything moved.
  bool service(QpCore& qp);
  bool receive(QpCore& qp);
  bool transmit(QpCore& qp);
  bool checkAcks(QpCore& qp);
  void complete(QpCore& qp, uint64_t wrId, WcStatus st, WcOpcode op, uint32_t len, uint32_t imm);
  // Local key check: [addr, addr + len) inside the region of `lkey`;
  // *copier gets the region's copier (null: host memory).
  bool localOk(uint32_t lkey, const void* addr, uint32_t len, gpu::DeviceCopier** copier);
  // The payload copy of either side: memcpy for host memory, the copier of
  // the region's GPU where it is device memory (what a NIC's DMA to GPU
  // memory is). `toRegion`: into the region (responder), else out of it.
  bool copyPayload(void* dst, const void* src, size_t n, gpu::DeviceCopier* copier, bool toRegion,
                   uint32_t qpn);
  // The copier of CUDA device `device`, made on first use (at registration,
  // on the registering thread: never on the HCA thread, see gpu_memory.hpp).
  gpu::DeviceCopier* copierFor(int device);

  PortInfo port_;
  FaultPlan fault_;
  std::shared_ptr<Segment> seg_;
  uint32_t ctx_ = 0;

  std::shared_mutex mrMu_;
  std::unordered_map<uint32_t, MrEntry> mrs_;
  uint32_t nextKey_ = 0x100;
  std::mutex copierMu_;
  std::map<int, std::unique_ptr<gpu::DeviceCopier>> copiers_;  // by CUDA device

  std::mutex qpMu_;
  std::vector<std::shared_ptr<QpCore>> lanes_;
  uint32_t qpGen_ = 1;
  int nextLane_ = 0;

  std::mutex asyncMu_;
  std::deque<AsyncEvent> async_;
  int asyncFd_ = -1;

  std::atomic<bool> stop_{false};
  std::thread thread_;
};

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

void EmuDevice::complete(QpCore& qp, uint64_t wrId, WcStatus st, WcOpcode op, uint32_t len,
                         uint32_t imm) {
  if (!qp.cq->push(Completion{wrId, st, op, len, imm, qp.qpn, 0})) {
    raiseAsync(AsyncKind::CqErr, "IBV_EVENT_CQ_ERR", qp.qpn);
  }
}

void EmuDevice::errorLocked(QpCore& qp) {
  if (qp.state == QpState::Error || qp.state == QpState::Destroyed) return;
  qp.state = QpState::Error;
  seg_->lane(qp.lane)->state.store(kLaneError, std::memory_order_release);
  // Flushed in order: first what was on the wire, then the rest.
  for (auto* q : {&qp.inflight, &qp.pending}) {
    for (auto& p : *q) complete(qp, p.wr.wrId, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0, 0);
    q->clear();
  }
  for (uint64_t id : qp.recvs)
    complete(qp, id, WcStatus::WrFlushErr, WcOpcode::RecvRdmaWithImm, 0, 0);
  qp.recvs.clear();
}

gpu::DeviceCopier* EmuDevice::copierFor(int device) {
  std::lock_guard<std::mutex> lock(copierMu_);
  auto& c = copiers_[device];
  if (!c) c = std::make_unique<gpu::DeviceCopier>(device);
  return c.get();
}

bool EmuDevice::localOk(uint32_t lkey, const void* addr, uint32_t len, gpu::DeviceCopier** copier) {
  *copier = nullptr;
  if (len == 0) return true;
  std::shared_lock<std::shared_mutex> lock(mrMu_);
  auto it = mrs_.find(lkey);
  const auto a = reinterpret_cast<uintptr_t>(addr);
  if (it == mrs_.end() || a < it->second.addr || a + len > it->second.addr + it->second.length) {
    return false;
  }
  *copier = it->second.copier;
  return true;
}

bool EmuDevice::copyPayload(void* dst, const void* src, size_t n, gpu::DeviceCopier* copier,
                            bool toRegion, uint32_t qpn) {
  if (copier == nullptr) {
    std::memcpy(dst, src, n);
    return true;
  }
  std::string err;
  if (toRegion ? copier->toDevice(dst, src, n, &err) : copier->fromDevice(dst, src, n, &err)) {
    return true;
  }
  FASTCOMM_LOG(Warn, "ib emulation: QP " << qpn << ": " << err);
  return false;
}

// Responder: consumes this QP's wire.
bool EmuDevice::receive(QpCore& qp) {
  if (qp.state != QpState::Rtr && qp.state != QpState::Rts && qp.state != QpState::Error) {
    return false;  // not ready: the packets wait (the requester keeps retrying)
  }
  LaneHeader* l = seg_->lane(qp.lane);
  char* data = seg_->laneData(qp.lane);
  bool moved = false;
  for (int budget = 0; budget < 64; ++budget) {
    const uint64_t head = l->head.load(std::memory_order_relaxed);
    const uint64_t tail = l->tail.load(std::memory_order_acquire);
    if (head == tail) break;
    const uint64_t off = head % kLaneBytes;
    Pkt pkt;
    std::memcpy(&pkt, data + off, sizeof pkt);
    if (pkt.kind == kWrap) {
      l->head.store(head + (kLaneBytes - off), std::memory_order_release);
      moved = true;
      continue;
    }
    const uint64_t size = kPktHeader + alignUp(pkt.len, 64);
    if (qp.state == QpState::Error) {
      // An errored QP drops what arrives and acknowledges nothing.
      l->head.store(head + size, std::memory_order_release);
      moved = true;
      continue;
    }
    if (l->nakStatus.load() != 0) break;
    if (pkt.flags & kFirst) {
      qp.curValid = true;
      if (pkt.total > 0) {
        std::shared_lock<std::shared_mutex> lock(mrMu_);
        auto it = mrs_.find(pkt.rkey);
        qp.curValid = it != mrs_.end() && pkt.wrAddr >= it->second.addr &&
                      pkt.wrAddr + pkt.total <= it->second.addr + it->second.length;
      }
      if (!qp.curValid) {
        // NAK (remote access error): the requester's work request fails and
        // both QPs go to the error state.
        l->nakMsn.store(pkt.msn);
        l->nakStatus.store(static_cast<uint32_t>(WcStatus::RemAccessErr) + 1,
                           std::memory_order_release);
        l->head.store(head + size, std::memory_order_release);
        FASTCOMM_LOG(Info, "ib emulation: QP " << qp.qpn << " rejected an RDMA write of "
                                               << pkt.total << " bytes to 0x" << std::hex
                                               << pkt.wrAddr << " with rkey 0x" << pkt.rkey
                                               << std::dec << " (no such region or out of bounds)");
        // The event first: the flushed completions it causes come after it.
        raiseAsync(AsyncKind::QpAccessErr, "IBV_EVENT_QP_ACCESS_ERR", qp.qpn);
        errorLocked(qp);
        if (qp.remote) qp.remote->ring();
        return true;
      }
    }
    const bool needRecv = (pkt.flags & kLast) && (pkt.flags & kImm);
    if (needRecv && qp.recvs.empty()) break;  // receiver not ready: RNR, retried forever
    if (pkt.len > 0) {
      // The region may have been deregistered since the first packet: check
      // again, holding the table while the data lands.
      std::shared_lock<std::shared_mutex> lock(mrMu_);
      auto it = mrs_.find(pkt.rkey);
      // A failed device copy is NAKed like a bad region: the data did not land.
      if (it == mrs_.end() || pkt.raddr < it->second.addr ||
          pkt.raddr + pkt.len > it->second.addr + it->second.length ||
          !copyPayload(reinterpret_cast<void*>(pkt.raddr), data + off + kPktHeader, pkt.len,
                       it->second.copier, /*toRegion=*/true, qp.qpn)) {
        lock.unlock();
        l->nakMsn.store(pkt.msn);
        l->nakStatus.store(static_cast<uint32_t>(WcStatus::RemAccessErr) + 1,
                           std::memory_order_release);
        l->head.store(head + size, std::memory_order_release);
        // The event first: the flushed completions it causes come after it.
        raiseAsync(AsyncKind::QpAccessErr, "IBV_EVENT_QP_ACCESS_ERR", qp.qpn);
        errorLocked(qp);
        if (qp.remote) qp.remote->ring();
        return true;
      }
    }
    l->head.store(head + size, std::memory_order_release);
    if (pkt.flags & kLast) {
      if (needRecv) {
        uint64_t id = qp.recvs.front();
        qp.recvs.pop_front();
        complete(qp, id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, pkt.total, pkt.imm);
      }
      l->acked.store(pkt.msn, std::memory_order_release);
    }
    moved = true;
  }
  if (moved && qp.remote) qp.remote->ring();  // space and acknowledgements for the requester
  return moved;
}

// Requester: acknowledgements, NAKs, and the retry budget.
bool EmuDevice::checkAcks(QpCore& qp) {
  if (!qp.remote || (qp.state != QpState::Rts)) return false;
  LaneHeader* rl = qp.remote->lane(qp.remoteLane);
  bool moved = false;
  const bool sameQp = rl->qpn.load(std::memory_order_acquire) == qp.remoteQpn;
  const uint64_t acked = sameQp ? rl->acked.load(std::memory_order_acquire) : 0;
  while (!qp.inflight.empty() && qp.inflight.front().msn <= acked) {
    const PendingWr& p = qp.inflight.front();
    complete(qp, p.wr.wrId, WcStatus::Success, WcOpcode::RdmaWrite, p.wr.length, 0);
    qp.inflight.pop_front();
    qp.lastProgress = qp.lastAck = Clock::now();
    moved = true;
  }
  const uint32_t nak = sameQp ? rl->nakStatus.load(std::memory_order_acquire) : 0;
  if (nak != 0 && !qp.inflight.empty() && qp.inflight.front().msn == rl->nakMsn.load()) {
    complete(qp, qp.inflight.front().wr.wrId, static_cast<WcStatus>(nak - 1), WcOpcode::RdmaWrite,
             0, 0);
    qp.inflight.pop_front();
    errorLocked(qp);
    return true;
  }
  if (qp.outstandingSends() == 0) return moved;
  // No acknowledgement for the whole retry budget from a peer that cannot
  // answer any more (process gone, device closed, QP in error or destroyed):
  // IBV_WC_RETRY_EXC_ERR, as the hardware reports it.
  const bool answers =
      sameQp && rl->state.load(std::memory_order_acquire) == kLaneAlive && qp.remote->ownerAlive();
  if (answers) return moved;
  // The retry timer runs from the oldest unacknowledged write (restarted by
  // every acknowledgement), or, with nothing on the wire yet, from the last
  // time anything moved.
  auto since = qp.lastProgress;
  if (!qp.inflight.empty()) since = std::max(qp.inflight.front().sentAt, qp.lastAck);
  const double perTry = 4.096e-6 * static_cast<double>(1ull << std::min<int>(qp.rc.timeout, 31));
  const auto budget = std::chrono::duration<double>(perTry * (qp.rc.retryCnt + 1));
  if (Clock::now() - since < budget) return moved;
  FASTCOMM_LOG(Info, "ib emulation: QP "
                         << qp.qpn << " gives up on QP " << qp.remoteQpn << ": "
                         << (!sameQp || rl->state.load() == kLaneFree ? "it was destroyed"
                             : rl->state.load() == kLaneError         ? "it is in the error state"
                                                              : "its process or device is gone")
                         << ", nothing acknowledged for "
                         << std::chrono::duration<double>(Clock::now() - since).count() << " s");
  auto& head = !qp.inflight.empty() ? qp.inflight.front() : qp.pending.front();
  complete(qp, head.wr.wrId, WcStatus::RetryExcErr, WcOpcode::RdmaWrite, 0, 0);
  if (!qp.inflight.empty()) {
    qp.inflight.pop_front();
  } else {
    qp.pending.pop_front();
  }
  errorLocked(qp);
  return true;
}

// Requester: puts posted work requests on the wire while it has room.
bool EmuDevice::transmit(QpCore& qp) {
  if (qp.state != QpState::Rts || !qp.remote) return false;
  LaneHeader* rl = qp.remote->lane(qp.remoteLane);
  if (rl->qpn.load(std::memory_order_acquire) != qp.remoteQpn ||
      rl->state.load(std::memory_order_acquire) == kLaneFree) {
    return false;  // the peer QP is gone: nothing more goes out (the retry timer runs)
  }
  char* data = qp.remote->laneData(qp.remoteLane);
  bool moved = false;
  while (!qp.pending.empty()) {
    PendingWr& p = qp.pending.front();
    if (p.sent == 0) {
      if (p.injectFatal) {
        FASTCOMM_LOG(Info, "ib emulation: QP " << qp.qpn << " enters the error state (injected)");
        raiseAsync(AsyncKind::QpFatal, "IBV_EVENT_QP_FATAL", qp.qpn);
        errorLocked(qp);
        return true;
      }
      if (!localOk(p.wr.lkey, p.wr.local, p.wr.length, &p.localCopier)) {
        complete(qp, p.wr.wrId, WcStatus::LocProtErr, WcOpcode::RdmaWrite, 0, 0);
        qp.pending.pop_front();
        errorLocked(qp);
        return true;
      }
    }
    const uint32_t len =
        static_cast<uint32_t>(std::min<uint64_t>(kMaxPayload, p.wr.length - p.sent));
    const uint64_t need = kPktHeader + alignUp(len, 64);
    uint64_t tail = rl->tail.load(std::memory_order_relaxed);
    const uint64_t head = rl->head.load(std::memory_order_acquire);
    const uint64_t toEnd = kLaneBytes - tail % kLaneBytes;
    if (toEnd < need) {
      if (tail + toEnd - head > kLaneBytes) break;  // no room for the wrap marker yet
      Pkt wrap{};
      wrap.kind = kWrap;
      std::memcpy(data + tail % kLaneBytes, &wrap, sizeof wrap);
      tail += toEnd;
      rl->tail.store(tail, std::memory_order_release);
      moved = true;
      continue;
    }
    if (tail + need - head > kLaneBytes) break;  // the wire is full
    Pkt pkt{};
    pkt.kind = kWrite;
    pkt.flags = (p.sent == 0 ? kFirst : 0) | (p.sent + len == p.wr.length ? kLast : 0) |
                (p.wr.withImm ? kImm : 0);
    pkt.msn = p.msn;
    pkt.raddr = p.wr.remoteAddr + p.sent;
    pkt.wrAddr = p.wr.remoteAddr;
    pkt.rkey = p.wr.rkey;
    pkt.len = len;
    pkt.total = p.wr.length;
    pkt.imm = p.wr.imm;
    char* dst = data + tail % kLaneBytes;
    std::memcpy(dst, &pkt, sizeof pkt);
    if (len > 0 && !copyPayload(dst + kPktHeader, static_cast<const char*>(p.wr.local) + p.sent,
                                len, p.localCopier, /*toRegion=*/false, qp.qpn)) {
      // The HCA could not read the local buffer: a local protection error,
      // as a DMA read fault is on hardware. Nothing of this packet was sent.
      complete(qp, p.wr.wrId, WcStatus::LocProtErr, WcOpcode::RdmaWrite, 0, 0);
      qp.pending.pop_front();
      errorLocked(qp);
      return true;
    }
    rl->tail.store(tail + need, std::memory_order_release);
    p.sent += len;
    moved = true;
    if (p.sent == p.wr.length) {
      p.sentAt = Clock::now();
      qp.inflight.push_back(p);
      qp.pending.pop_front();
    }
  }
  if (moved) {
    qp.lastProgress = Clock::now();
    qp.remote->ring();
  }
  return moved;
}

bool EmuDevice::service(QpCore& qp) {
  std::lock_guard<std::mutex> lock(qp.mu);
  if (qp.state == QpState::Destroyed) return false;
  bool moved = receive(qp);
  moved = checkAcks(qp) || moved;
  moved = transmit(qp) || moved;
  return moved;
}

void EmuDevice::run() {
  SegHeader* h = seg_->hdr();
  std::vector<std::shared_ptr<QpCore>> qps;
  while (!stop_.load(std::memory_order_acquire)) {
    const uint32_t bell = h->bell.load(std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lock(qpMu_);
      qps.clear();
      for (auto& q : lanes_)
        if (q) qps.push_back(q);
    }
    bool moved = false, waiting = false;
    for (auto& q : qps) {
      moved = service(*q) || moved;
      std::lock_guard<std::mutex> lock(q->mu);
      waiting = waiting || q->outstandingSends() > 0;
    }
    qps.clear();
    if (moved) continue;
    // Sleep until rung; with work on the wire, wake up for the retry timer.
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (h->bell.load(std::memory_order_seq_cst) == bell && !stop_.load()) {
      timespec ts{0, (waiting ? 5 : 200) * 1000000L};
      futexWait(&h->bell, bell, &ts);
    }
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace

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
