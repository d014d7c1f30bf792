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
    queueLocked(sockFor(seq), OutFrame{h, nullptr, nullptr, 0}, true);
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
    queueLocked(sockFor(op->seq), OutFrame{h, nullptr, nullptr, 0}, true);
    finishLocked(op, OpStatus::Failed,
                 "fastcomm: tcp message size mismatch with rank " + std::to_string(rank_) + " (" +
                     addr_ + "): this rank sent " + std::to_string(op->bytes) + " bytes, rank " +
                     std::to_string(rank_) + " posted a receive of " + std::to_string(posted) +
                     " bytes (message " + std::to_string(op->seq) + " to rank " +
                     std::to_string(rank_) + ")");
    return;
  }
  const size_t nsock = socks_.size();
  const int64_t stripes = stripeCount(op->bytes);
  // Stripe j goes to socket (seq + j) % S: one lock per socket, frames in
  // offset order within each socket.
  for (size_t k = 0; k < std::min<size_t>(nsock, static_cast<size_t>(stripes)); ++k) {
    Sock* s = sockFor(op->seq + k);
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (int64_t j = static_cast<int64_t>(k); j < stripes; j += static_cast<int64_t>(nsock)) {
        int64_t off = j * kStripeBytes;
        int64_t len = std::min(kStripeBytes, op->bytes - off);
        if (len < 0) len = 0;
        FrameHeader h{kFrameMagic, kData, static_cast<uint32_t>(len), op->seq,
                      static_cast<uint64_t>(off)};
        s->data.push_back(OutFrame{h, op, op->data + off, 0});
      }
    }
    s->worker->wake(s);
  }
}

void Peer::queueLocked(Sock* s, OutFrame f, bool control) {
  {
    std::lock_guard<std::mutex> lock(s->mu);
    (control ? s->ctrl : s->data).push_back(std::move(f));
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
