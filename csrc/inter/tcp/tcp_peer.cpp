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
    queueControlLocked(sockFor(seq), OutFrame{h, nullptr, nullptr, 0});
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
    queueControlLocked(sockFor(op->seq), OutFrame{h, nullptr, nullptr, 0});
    finishLocked(op, OpStatus::Failed,
                 "fastcomm: tcp message size mismatch with rank " + std::to_string(rank_) + " (" +
                     addr_ + "): this rank sent " + std::to_string(op->bytes) + " bytes, rank " +
                     std::to_string(rank_) + " posted a receive of " + std::to_string(posted) +
                     " bytes (message " + std::to_string(op->seq) + " to rank " +
                     std::to_string(rank_) + ")");
    return;
  }
  const int64_t stripes = stripeCount(op->bytes);
  int active;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    for (int64_t j = 0; j < stripes; ++j) {
      const int64_t off = j * kStripeBytes;
      const int64_t len = std::max<int64_t>(0, std::min(kStripeBytes, op->bytes - off));
      stripes_.push_back(Stripe{op, off, len});
    }
    active = activeSockets_;
  }
  // Every data socket with nothing to write takes stripes from here on.
  for (int k = 0; k < active; ++k) socks_[k]->worker->wake(socks_[k].get());
}

bool Peer::nextStripe(int sockIndex, OutFrame* out) {
  std::lock_guard<std::mutex> lock(stripeMu_);
  if (sockIndex >= activeSockets_ || stripes_.empty()) return false;
  Stripe st = std::move(stripes_.front());
  stripes_.pop_front();
  const char* payload = st.op->data + st.off;
  FrameHeader h{kFrameMagic, kData, static_cast<uint32_t>(st.len), st.op->seq,
                static_cast<uint64_t>(st.off)};
  *out = OutFrame{h, std::move(st.op), payload, 0};
  return true;
}

void Peer::sendRate(int64_t bytes, double seconds) {
  int grownTo = 0;
  {
    std::lock_guard<std::mutex> lock(stripeMu_);
    rateBytes_ += bytes;
    rateSeconds_ += seconds;
    if (rateBytes_ < kRateSampleBytes) return;
    const double perSocket = rateBytes_ / std::max(rateSeconds_, 1e-9);
    const int n = activeSockets_;
    if (perSocket >= kSocketRateToGrow && n < static_cast<int>(socks_.size())) {
      grownTo = ++activeSockets_;
    } else if (n > 1 && perSocket * n < 0.5 * kSocketRateToGrow * (n - 1)) {
      --activeSockets_;
    }
    rateBytes_ = 0;
    rateSeconds_ = 0;
  }
  if (grownTo > 0) socks_[grownTo - 1]->worker->wake(socks_[grownTo - 1].get());
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
