#include <algorithm>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <mutex>

#include "common/logging.hpp"
#include "inter/ib/engine.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

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

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
