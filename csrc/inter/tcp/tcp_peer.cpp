#include "inter/tcp/tcp_peer.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <stdexcept>
#include <mutex>

#include "common/logging.hpp"
#include "inter/tcp/worker.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

std::unique_ptr<Request> Peer::post(bool send, char* data, int64_t bytes) {
  if (bytes < 0) throw std::invalid_argument("fastcomm: tcp: negative message size");
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return failedRequest(send, data, bytes);
  auto& ops = send ? sends_ : recvs_;
  if (ops.size() >= static_cast<size_t>(kMaxRequestsInFlight)) return nullptr;
  uint64_t seq = send ? sendSeq_++ : recvSeq_++;
  auto op = std::make_shared<Op>(send, data, bytes, seq);
  ops.emplace(seq, op);
  if (send) {
    auto it = earlyCts_.find(seq);
    if (it != earlyCts_.end()) {
      int64_t posted = it->second;
      earlyCts_.erase(it);
      startSendLocked(op, posted);
    }
  } else {
    FrameHeader h{kFrameMagic, kCts, 0, seq, static_cast<uint64_t>(bytes)};
    queueControlLocked(controlSocket(seq), OutFrame{h, nullptr, nullptr, 0});
  }
  return std::make_unique<TcpRequest>(std::move(op), rank_);
}

void Peer::onCts(uint64_t seq, uint64_t posted) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  auto it = sends_.find(seq);
  if (it == sends_.end()) {
    if (seq < sendSeq_ || earlyCts_.count(seq)) {
      failLocked(describe() + ": protocol error: a second CTS for message " + std::to_string(seq));
      return;
    }
    earlyCts_[seq] = static_cast<int64_t>(posted);
    return;
  }
  startSendLocked(it->second, static_cast<int64_t>(posted));
}

void Peer::onMismatch(uint64_t seq, uint64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = recvs_.find(seq);
  if (it == recvs_.end()) return;  // failed already
  auto op = it->second;
  finishLocked(op, OpStatus::Failed,
               "fastcomm: tcp message size mismatch with rank " + std::to_string(rank_) + " (" +
                   addr_ + "): this rank posted a receive of " + std::to_string(op->bytes) +
                   " bytes, rank " + std::to_string(rank_) + " sent " + std::to_string(size) +
                   " bytes (message " + std::to_string(seq) + " from rank " +
                   std::to_string(rank_) + ")");
}

std::shared_ptr<Op> Peer::dataTarget(const FrameHeader& h) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return nullptr;
  auto it = recvs_.find(h.seq);
  if (it == recvs_.end() || h.arg + h.len > static_cast<uint64_t>(it->second->bytes)) {
    failLocked(describe() + ": protocol error: data for message " + std::to_string(h.seq) +
               " at offset " + std::to_string(h.arg) + " (+" + std::to_string(h.len) +
               " bytes) fits no posted receive");
    return nullptr;
  }
  return it->second;
}

bool Peer::pin(const std::shared_ptr<Op>& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed) ||
      op->status.load(std::memory_order_relaxed) != OpStatus::Pending ||
      !op->deferredError.empty()) {
    return false;
  }
  ++op->pins;
  return true;
}

void Peer::unpin(const std::shared_ptr<Op>& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--op->pins == 0 && !op->deferredError.empty()) {
    std::string err = std::move(op->deferredError);
    op->deferredError.clear();
    finishLocked(op, OpStatus::Failed, err);
  }
}

void Peer::frameDone(const std::shared_ptr<Op>& op) {
  if (op->framesLeft.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    std::lock_guard<std::mutex> lock(mu_);
    finishLocked(op, OpStatus::Done, "");
  }
}

void Peer::closeSockets() {
  for (auto& s : socks_) {
    s->fd.reset();
    s->dropFrames();
  }
}

std::unique_ptr<Request> Peer::failedRequest(bool send, char* data, int64_t bytes) {
  auto op = std::make_shared<Op>(send, data, bytes, 0);
  op->error = error_;
  op->status.store(OpStatus::Failed, std::memory_order_release);
  return std::make_unique<TcpRequest>(std::move(op), rank_);
}

void Peer::startSendLocked(const std::shared_ptr<Op>& op, int64_t posted) {
  if (posted != op->bytes) {
    // Tell the receiver (its request fails too) and fail ours; the stream
    // stays in step because neither side moves payload for this message.
    FrameHeader h{kFrameMagic, kMismatch, 0, op->seq, static_cast<uint64_t>(op->bytes)};
    queueControlLocked(controlSocket(op->seq), OutFrame{h, nullptr, nullptr, 0});
    finishLocked(op, OpStatus::Failed,
                 "fastcomm: tcp message size mismatch with rank " + std::to_string(rank_) + " (" +
                     addr_ + "): this rank sent " + std::to_string(op->bytes) + " bytes, rank " +
                     std::to_string(rank_) + " posted a receive of " + std::to_string(posted) +
                     " bytes (message " + std::to_string(op->seq) + " to rank " +
                     std::to_string(rank_) + ")");
    return;
  }
  const int64_t stripes = stripeCount(op->bytes);
  uint64_t wake;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    for (int64_t j = 0; j < stripes; ++j) {
      const int64_t off = j * kStripeBytes;
      const int64_t len = std::max<int64_t>(0, std::min(kStripeBytes, op->bytes - off));
      stripes_.push_back(Stripe{op, off, len});
    }
    wake = dispatchLocked();
  }
  wakeSockets(wake);
}

uint64_t Peer::dispatchLocked() {
  const int n = activeSockets_;
  const uint64_t active = n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  int64_t unclaimed =
      static_cast<int64_t>(stripes_.size()) - static_cast<int64_t>(__builtin_popcountll(woken_));
  uint64_t free = idle_ & active & ~closed_;
  uint64_t wake = 0;
  for (; unclaimed > 0 && free != 0; --unclaimed) {
    const uint64_t bit = free & (~free + 1);  // the lowest
    free &= free - 1;
    idle_ &= ~bit;
    woken_ |= bit;
    wake |= bit;
  }
  return wake;
}

void Peer::wakeSockets(uint64_t mask) {
  for (; mask != 0; mask &= mask - 1) {
    Sock* s = socks_[static_cast<size_t>(__builtin_ctzll(mask))].get();
    s->worker->wake(s);
  }
}

bool Peer::nextStripe(int sockIndex, OutFrame* out) {
  const uint64_t bit = uint64_t{1} << sockIndex;
  uint64_t wake = 0;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    if (idle_ & bit) return false;
    woken_ &= ~bit;
    if (sockIndex < activeSockets_ && !stripes_.empty()) {
      Stripe st = std::move(stripes_.front());
      stripes_.pop_front();
      const char* payload = st.op->data + st.off;
      FrameHeader h{kFrameMagic, kData, static_cast<uint32_t>(st.len), st.op->seq,
                    static_cast<uint64_t>(st.off)};
      *out = OutFrame{h, std::move(st.op), payload, 0};
      return true;
    }
    idle_ |= bit;
    // Shed while it was busy: what it leaves goes to a socket still in use.
    if (!stripes_.empty()) wake = dispatchLocked();
  }
  wakeSockets(wake);
  return false;
}

void Peer::stripeWritten(int sockIndex) {
  const uint64_t bit = uint64_t{1} << sockIndex;
  uint64_t wake = 0;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    if (!stripes_.empty() && sockIndex < activeSockets_) return;  // it takes the next one
    idle_ |= bit;
    if (!stripes_.empty()) wake = dispatchLocked();
  }
  wakeSockets(wake);
}

void Peer::dataSocketClosed(int sockIndex) {
  const uint64_t bit = uint64_t{1} << sockIndex;
  uint64_t wake = 0;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    if (closed_ & bit) return;
    closed_ |= bit;
    idle_ |= bit;
    woken_ &= ~bit;
    if (!stripes_.empty()) wake = dispatchLocked();
  }
  wakeSockets(wake);
}

Sock* Peer::controlSocket(uint64_t seq) {
  uint64_t free;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    free = idle_ & ~closed_;
  }
  if (free != 0) return socks_[static_cast<size_t>(__builtin_ctzll(free))].get();
  return socks_[seq % socks_.size()].get();
}

void Peer::flowRate(double bytesPerSecond) {
  uint64_t wake = 0;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    rates_[static_cast<size_t>(rateSamples_)] = bytesPerSecond;
    if (++rateSamples_ < kRateSamples) return;
    rateSamples_ = 0;
    // Quartiles, not the mean: a sample taken as a burst of acknowledgements
    // arrives can exceed the link many times over. A socket comes back when
    // three in four samples say each flow is fast, and goes when three in
    // four say the flows are slow.
    std::sort(rates_.begin(), rates_.end());
    const double low = rates_[kRateSamples / 4];
    const double high = rates_[kRateSamples * 3 / 4];
    const int n = activeSockets_;
    if (low >= kSocketRateToGrow && n < static_cast<int>(socks_.size())) {
      ++activeSockets_;
      wake = dispatchLocked();
    } else {
      // The fewest sockets that carry the measured total at kSocketRateToShed
      // each; at most half of them go per decision, so that one skewed
      // decision does not drop a fast connection to a single flow.
      const int enough = 1 + static_cast<int>(std::min(high * n / kSocketRateToShed, 64.0));
      if (enough < n) activeSockets_ = std::max(enough, (n + 1) / 2);
    }
  }
  wakeSockets(wake);
}

void Peer::queueControlLocked(Sock* s, OutFrame f) {
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->ctrl.push_back(std::move(f));
  }
  s->worker->wake(s);
}

void Peer::finishLocked(const std::shared_ptr<Op>& op, OpStatus st, const std::string& err) {
  if (op->status.load(std::memory_order_relaxed) != OpStatus::Pending) return;
  if (st == OpStatus::Failed && op->pins > 0) {
    if (op->deferredError.empty()) op->deferredError = err;
    return;
  }
  op->error = err;
  op->status.store(st, std::memory_order_release);
  auto& ops = op->isSend ? sends_ : recvs_;
  auto it = ops.find(op->seq);
  if (it != ops.end() && it->second == op) ops.erase(it);
  notifier_->notify();
}

void Peer::failLocked(const std::string& why) {
  if (failed_.load(std::memory_order_relaxed)) return;
  error_ = why;
  failed_.store(true, std::memory_order_release);
  earlyCts_.clear();
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    stripes_.clear();
  }
  for (auto* ops : {&sends_, &recvs_}) {
    std::vector<std::shared_ptr<Op>> pending;
    for (auto& kv : *ops) pending.push_back(kv.second);
    for (auto& op : pending) finishLocked(op, OpStatus::Failed, why);
  }
  // The other side learns at once (EOF), and our workers see every socket
  // of this peer become readable and drop it from their epoll sets.
  for (auto& s : socks_) {
    if (s->fd.valid()) ::shutdown(s->fd.get(), SHUT_RDWR);
  }
  FASTCOMM_LOG(Info, why);
}

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
