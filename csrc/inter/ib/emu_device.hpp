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
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>
#include <cerrno>
#include <system_error>

#include "common/config.hpp"
#include "inter/ib/device.hpp"
#include "inter/ib/emu_fault.hpp"
#include "inter/ib/emu_segment.hpp"
#include "inter/ib/gpu_memory.hpp"

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {

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

}  // namespace emu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
