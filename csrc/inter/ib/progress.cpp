#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <map>
#include <mutex>

#include "common/thread_name.hpp"
#include "common/logging.hpp"
#include "inter/ib/engine.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

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

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
