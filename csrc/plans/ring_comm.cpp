#include "plans/ring_comm.hpp"

#include <algorithm>
#include <cstring>
#include <string>

namespace fastcomm {
namespace {

// Requests a ring keeps posted per direction: enough to keep every socket of
// a connection busy, well under the transport's limit.
constexpr int kWindow = 8;
constexpr auto kProgressSleep = std::chrono::microseconds(200);

int mod(int a, int n) { return ((a % n) + n) % n; }

float* floats(char* p) { return reinterpret_cast<float*>(p); }

// Thrown inside the pipelines, turned into the user-facing error by named(),
// which knows how to ask why a peer is missing.
struct RingTimeout {
  std::vector<int> pending;
};

[[noreturn]] void failTimeout(const OpContext&, const std::vector<int>& pending) {
  throw RingTimeout{pending};
}

bool done(std::unique_ptr<transport::Request>& r) {
  if (!r || r->test()) {
    r.reset();
    return true;
  }
  return false;
}

}  // namespace

RingComm::RingComm(transport::Transport& transport, std::vector<int> members, int me,
                   std::vector<transport::Connection*> conns, int64_t chunkBytes, WireDtype wire)
    : transport_(transport),
      members_(std::move(members)),
      me_(me),
      conns_(std::move(conns)),
      chunkBytes_(std::max<int64_t>(4096, chunkBytes)),
      wire_(wire) {}

template <typename Fn>
void RingComm::named(const OpContext& ctx, Fn fn) {
  try {
    fn();
  } catch (const RingTimeout& t) {
    std::string why;
    for (int peer : t.pending)
      if (peerReason_) why += peerReason_(peer);
    throwCommError("fastcomm: " + ctx.describe() + " timed out after " +
                   std::to_string(ctx.timeout.count()) +
                   " ms (timeout) waiting for group rank(s) " + formatRanks(t.pending) +
                   " across the inter-node transport" + why);
  } catch (const transport::TransportError& e) {
    throwCommError("fastcomm: " + ctx.describe() + ": inter-node transfer with group rank [" +
                   std::to_string(e.peer()) + "] failed (timeout " +
                   std::to_string(ctx.timeout.count()) + " ms not reached): " + e.what() +
                   (peerReason_ ? peerReason_(e.peer()) : std::string()));
  }
}

bool RingComm::useWire(at::ScalarType dt, RedOp op) const {
  return wire_.dtype() != WireDtype::None && dt == at::kFloat &&
         (op == RedOp::Sum || op == RedOp::Avg);
}

char* RingComm::scratch(int64_t bytes) {
  if (static_cast<int64_t>(scratch_.size()) < bytes) scratch_.resize(bytes);
  return scratch_.data();
}

// The pipeline of every ring pass. Item k = step * K + piece; the send of
// item k carries what item k - K received (the block moves one hop per step),
// so it may start as soon as that piece was processed.
namespace {

struct Piece {
  int64_t off = 0, len = 0;  // elements within the data buffer
};

template <typename PieceOf, typename BytesOf, typename Prepare, typename Process>
void ringPipeline(transport::Transport& transport, transport::Connection* left,
                  transport::Connection* right, int steps, int64_t K, PieceOf pieceOf,
                  BytesOf bytesOf, Prepare prepare, Process process, const OpContext& ctx) {
  const int64_t total = static_cast<int64_t>(steps) * K;
  std::vector<std::unique_ptr<transport::Request>> sends(kWindow), recvs(kWindow);
  int64_t sendPosted = 0, sendDone = 0, recvPosted = 0, processed = 0;
  while (processed < total || sendDone < total) {
    bool progressed = false;
    // Retire finished sends in order (frees their staging slots).
    while (sendDone < sendPosted && done(sends[sendDone % kWindow])) {
      ++sendDone;
      progressed = true;
    }
    // Post sends whose data is ready.
    while (sendPosted < total && sendPosted - sendDone < kWindow &&
           (sendPosted < K || processed > sendPosted - K)) {
      const int step = static_cast<int>(sendPosted / K);
      const Piece p = pieceOf(step, /*sending=*/true, sendPosted % K);
      std::unique_ptr<transport::Request> req;
      if (p.len > 0) {
        const void* src = prepare(step, p, sendPosted % kWindow);
        req = right->isend(src, bytesOf(p.len), nullptr);
        if (!req) break;  // retry later
      }
      sends[sendPosted % kWindow] = std::move(req);
      ++sendPosted;
      progressed = true;
    }
    // Keep a window of receives posted.
    while (recvPosted < total && recvPosted - processed < kWindow) {
      const int step = static_cast<int>(recvPosted / K);
      const Piece p = pieceOf(step, /*sending=*/false, recvPosted % K);
      std::unique_ptr<transport::Request> req;
      if (p.len > 0) {
        void* dst = process(step, p, recvPosted % kWindow, /*postOnly=*/true);
        req = left->irecv(dst, bytesOf(p.len), nullptr);
        if (!req) break;
      }
      recvs[recvPosted % kWindow] = std::move(req);
      ++recvPosted;
      progressed = true;
    }
    // Process arrived pieces in order.
    while (processed < recvPosted && done(recvs[processed % kWindow])) {
      const int step = static_cast<int>(processed / K);
      const Piece p = pieceOf(step, /*sending=*/false, processed % K);
      if (p.len > 0) process(step, p, processed % kWindow, /*postOnly=*/false);
      ++processed;
      progressed = true;
    }
    if (progressed) continue;
    if (ctx.expired()) {
      std::vector<int> pending;
      if (processed < total) pending.push_back(left->peer());
      if (sendDone < total && right->peer() != left->peer()) pending.push_back(right->peer());
      failTimeout(ctx, pending);
    }
    transport.waitForProgress(kProgressSleep);
  }
}

}  // namespace

void RingComm::pass(char* data, const Blocks& b, at::ScalarType dt, RedOp op, int rsSteps,
                    int agSteps, bool wire, const OpContext& ctx) {
  const int n = size(), r = me_;
  if (n == 1) return;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t maxLen = *std::max_element(b.len.begin(), b.len.end());
  const int64_t pieceElems = std::max<int64_t>(1, chunkBytes_ / esize);
  const int64_t K = std::max<int64_t>(1, (maxLen + pieceElems - 1) / pieceElems);
  // Reduce-scatter step s sends block r-1-s and reduces the received block
  // r-2-s into its own, so after n-1 steps block r is complete here.
  // All-gather step s forwards block r-s and receives block r-1-s; right
  // after a reduce-scatter its first step sends the block just completed.
  auto pieceOf = [&](int step, bool sending, int64_t j) {
    const int shift = step < rsSteps ? 1 : 0;
    const int s = step < rsSteps ? step : step - rsSteps;
    const int blk = mod(sending ? r - shift - s : r - shift - 1 - s, n);
    Piece p;
    p.off = b.off[blk] + j * pieceElems;
    p.len = std::max<int64_t>(0, std::min(pieceElems, b.len[blk] - j * pieceElems));
    return p;
  };
  auto bytesOf = [&](int64_t len) { return wire ? wire_.bytes(len) : len * esize; };
  // Received pieces land in staging slots unless an all-gather can take them
  // in place; coded pieces are staged both ways.
  const bool stageRecv = rsSteps > 0 || wire;
  const int64_t slotBytes = bytesOf(pieceElems);
  char* recvSlots = scratch(kWindow * slotBytes * ((stageRecv ? 1 : 0) + (wire ? 1 : 0)));
  char* sendSlots = recvSlots + (stageRecv ? kWindow * slotBytes : 0);
  auto prepare = [&](int step, const Piece& p, int64_t slot) -> const void* {
    if (!wire) return data + p.off * esize;
    char* s = sendSlots + slot * slotBytes;
    wire_.encode(floats(data) + p.off, p.len, s);
    // The owner of a finished block keeps it as the wire carries it (a scale
    // covers one piece), so every rank ends with the same values.
    if (rsSteps > 0 && step == rsSteps) wire_.decode(s, p.len, floats(data) + p.off);
    return s;
  };
  auto process = [&](int step, const Piece& p, int64_t slot, bool postOnly) -> void* {
    char* d = data + p.off * esize;
    const bool reduce = step < rsSteps;
    if (!reduce && !wire) return d;  // all-gather: received in place
    char* s = recvSlots + slot * slotBytes;
    if (postOnly) return s;
    if (!reduce) {
      wire_.decode(s, p.len, floats(d));
    } else if (wire) {
      wire_.decodeAdd(s, p.len, floats(d));
    } else {
      const void* ins[2] = {d, s};
      reduceInto(d, ins, 2, p.len, dt, op, 1);
    }
    return nullptr;
  };
  ringPipeline(transport_, conns_[mod(r - 1, n)], conns_[mod(r + 1, n)], rsSteps + agSteps, K,
               pieceOf, bytesOf, prepare, process, ctx);
  if (wire && rsSteps > 0 && agSteps == 0) {
    // A reduce-scatter alone rounds its block the same way, in the same pieces.
    for (int64_t j = 0; j * pieceElems < b.len[r]; ++j) {
      const int64_t len = std::min(pieceElems, b.len[r] - j * pieceElems);
      wire_.round(floats(data) + b.off[r] + j * pieceElems, len, sendSlots);
    }
  }
}

void RingComm::allreduce(void* data, int64_t count, at::ScalarType dt, RedOp op,
                         const OpContext& ctx) {
  TORCH_INTERNAL_ASSERT(op != RedOp::Avg, "RingComm::allreduce: the caller divides for AVG");
  const int n = size();
  if (n == 1 || count == 0) return;
  // Blocks of whole cache lines where possible, so pieces stay aligned.
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t line = std::max<int64_t>(1, 64 / esize);
  const int64_t per = (count + n - 1) / n;
  const int64_t blockLen = per >= line ? (per + line - 1) / line * line : per;
  Blocks b;
  for (int i = 0; i < n; ++i) {
    const int64_t off = std::min<int64_t>(count, i * blockLen);
    b.off.push_back(off);
    b.len.push_back(std::min<int64_t>(count, off + blockLen) - off);
  }
  const bool wire = useWire(dt, op);
  named(ctx, [&] { pass(static_cast<char*>(data), b, dt, op, size() - 1, size() - 1, wire, ctx); });
}

void RingComm::exchange(int peer, const void* sendBuf, void* recvBuf, int64_t bytes,
                        const OpContext& ctx) {
  transport::Connection* c = conns_[peer];
  std::unique_ptr<transport::Request> recv, send;
  if (recvBuf) recv = c->irecv(recvBuf, bytes, nullptr);
  if (sendBuf) send = c->isend(sendBuf, bytes, nullptr);
  TORCH_INTERNAL_ASSERT((!recvBuf || recv) && (!sendBuf || send),
                        "fastcomm: the transport refused a first request");
  // `&`, not `&&`: both requests are tested (and retired) on every pass.
  while (!(done(recv) & done(send))) {
    if (ctx.expired()) failTimeout(ctx, {c->peer()});
    transport_.waitForProgress(kProgressSleep);
  }
}

void RingComm::allreduceSmall(void* data, int64_t count, at::ScalarType dt, RedOp op,
                              const OpContext& ctx) {
  TORCH_INTERNAL_ASSERT(op != RedOp::Avg, "RingComm::allreduceSmall: the caller divides for AVG");
  const int n = size();
  if (n == 1 || count == 0) return;
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const int extra = n - p2;  // members p2.. fold into members 0..extra-1 first
  const bool wire = useWire(dt, op);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t wbytes = wire ? wire_.bytes(count) : count * esize;
  char* d = static_cast<char*>(data);
  char* mineW = scratch(2 * wbytes);  // this rank's data as sent (wire only)
  char* theirs = mineW + wbytes;
  auto outgoing = [&]() -> const void* {
    if (!wire) return d;
    wire_.encode(floats(d), count, mineW);
    return mineW;
  };
  // Both partners compute op(mine, theirs) from the same two operands (with a
  // wire: both coded), and the ops commute, so they end bit-identical.
  auto combine = [&] {
    if (wire) {
      wire_.decode(mineW, count, floats(d));
      wire_.decodeAdd(theirs, count, floats(d));
    } else {
      const void* ins[2] = {d, theirs};
      reduceInto(d, ins, 2, count, dt, op, 1);
    }
  };
  named(ctx, [&] {
    if (me_ >= p2) {
      exchange(me_ - p2, outgoing(), nullptr, wbytes, ctx);
      exchange(me_ - p2, nullptr, wire ? theirs : d, wbytes, ctx);
      if (wire) wire_.decode(theirs, count, floats(d));
      return;
    }
    if (me_ < extra) {
      exchange(me_ + p2, nullptr, theirs, wbytes, ctx);
      if (wire) outgoing();
      combine();
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
      exchange(me_ ^ mask, outgoing(), theirs, wbytes, ctx);
      combine();
    }
    // Round the result as the wire would, so the folded members, which
    // receive it coded, hold the same values.
    if (wire) wire_.round(floats(d), count, mineW);
    if (me_ < extra) exchange(me_ + p2, outgoing(), nullptr, wbytes, ctx);
  });
}

void RingComm::reduceScatter(void* data, int64_t blockCount, at::ScalarType dt, RedOp op,
                             const OpContext& ctx) {
  TORCH_INTERNAL_ASSERT(op != RedOp::Avg, "RingComm::reduceScatter: the caller divides for AVG");
  if (size() == 1 || blockCount == 0) return;
  Blocks b;
  for (int i = 0; i < size(); ++i) {
    b.off.push_back(i * blockCount);
    b.len.push_back(blockCount);
  }
  named(ctx,
        [&] { pass(static_cast<char*>(data), b, dt, op, size() - 1, 0, useWire(dt, op), ctx); });
}

void RingComm::allgather(void* data, int64_t blockBytes, const OpContext& ctx) {
  if (size() == 1 || blockBytes == 0) return;
  Blocks b;
  for (int i = 0; i < size(); ++i) {
    b.off.push_back(i * blockBytes);
    b.len.push_back(blockBytes);
  }
  named(ctx, [&] {
    pass(static_cast<char*>(data), b, at::kByte, RedOp::Sum, 0, size() - 1, /*wire=*/false, ctx);
  });
}

void RingComm::broadcast(void* data, int64_t bytes, int root, const OpContext& ctx) {
  named(ctx, [&] {
    const int n = size();
    if (n == 1 || bytes == 0) return;
    const int pos = mod(me_ - root, n);  // distance from the root along the chain
    transport::Connection* left = conns_[mod(me_ - 1, n)];
    transport::Connection* right = conns_[mod(me_ + 1, n)];
    const bool receives = pos != 0, forwards = pos != n - 1;
    char* p = static_cast<char*>(data);
    const int64_t K = (bytes + chunkBytes_ - 1) / chunkBytes_;
    auto piece = [&](int64_t k) { return std::min(chunkBytes_, bytes - k * chunkBytes_); };
    std::vector<std::unique_ptr<transport::Request>> sends(kWindow), recvs(kWindow);
    int64_t sendPosted = 0, sendDone = 0, recvPosted = 0, arrived = 0;
    const int64_t sendTotal = forwards ? K : 0, recvTotal = receives ? K : 0;
    while (arrived < recvTotal || sendDone < sendTotal) {
      bool progressed = false;
      while (sendDone < sendPosted && done(sends[sendDone % kWindow]))
        ++sendDone, progressed = true;
      while (sendPosted < sendTotal && sendPosted - sendDone < kWindow &&
             (!receives || sendPosted < arrived)) {
        auto req = right->isend(p + sendPosted * chunkBytes_, piece(sendPosted), nullptr);
        if (!req) break;
        sends[sendPosted % kWindow] = std::move(req);
        ++sendPosted, progressed = true;
      }
      while (recvPosted < recvTotal && recvPosted - arrived < kWindow) {
        auto req = left->irecv(p + recvPosted * chunkBytes_, piece(recvPosted), nullptr);
        if (!req) break;
        recvs[recvPosted % kWindow] = std::move(req);
        ++recvPosted, progressed = true;
      }
      while (arrived < recvPosted && done(recvs[arrived % kWindow])) ++arrived, progressed = true;
      if (progressed) continue;
      if (ctx.expired()) {
        std::vector<int> pending;
        if (arrived < recvTotal) pending.push_back(left->peer());
        if (sendDone < sendTotal) pending.push_back(right->peer());
        failTimeout(ctx, pending);
      }
      transport_.waitForProgress(kProgressSleep);
    }
  });
}

void RingComm::gatherTo(void* data, int64_t blockBytes, int root, const OpContext& ctx) {
  if (size() == 1 || blockBytes == 0) return;
  char* d = static_cast<char*>(data);
  named(ctx, [&] {
    // Piece by piece; within a piece every sender's transfer runs at once
    // (each on its own connection), so the root's link stays busy.
    for (int64_t at = 0; at < blockBytes; at += chunkBytes_) {
      const int64_t n = std::min(chunkBytes_, blockBytes - at);
      if (me_ != root) {
        exchange(root, d + me_ * blockBytes + at, nullptr, n, ctx);
        continue;
      }
      std::vector<std::unique_ptr<transport::Request>> recvs(size());
      for (int i = 0; i < size(); ++i) {
        if (i == me_) continue;
        recvs[i] = conns_[i]->irecv(d + i * blockBytes + at, n, nullptr);
        TORCH_INTERNAL_ASSERT(recvs[i], "fastcomm: the transport refused a first request");
      }
      for (;;) {
        std::vector<int> pending;
        for (int i = 0; i < size(); ++i)
          if (!done(recvs[i])) pending.push_back(conns_[i]->peer());
        if (pending.empty()) break;
        if (ctx.expired()) failTimeout(ctx, pending);
        transport_.waitForProgress(kProgressSleep);
      }
    }
  });
}

void RingComm::barrier(const OpContext& ctx) {
  // An all-gather of one byte each: nobody leaves before everyone arrived.
  std::vector<char> bytes(size(), 1);
  allgather(bytes.data(), 1, ctx);
}

}  // namespace fastcomm
