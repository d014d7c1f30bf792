// The emulated HCA: the thread that moves each QP's work requests over the
// wires as packets and plays both ends of RC (emu_device.hpp has the model).
#include <algorithm>
#include <cstring>
#include <string>
#include <chrono>
#include <mutex>
#include <shared_mutex>

#include "common/logging.hpp"
#include "inter/ib/emu_device.hpp"

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {

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

}  // namespace emu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
