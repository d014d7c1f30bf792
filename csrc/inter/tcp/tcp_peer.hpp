// One connection of the tcp transport: its requests (Op), its sockets with
// their control frame queues (Sock), and the per-peer protocol state (Peer):
// message numbers, CTS matching, the stripes waiting to be sent, size
// mismatches, failure. The progress threads (worker.hpp) move the bytes; Peer
// decides where they go.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "inter/notifier.hpp"
#include "inter/request.hpp"
#include "inter/tcp/socket.hpp"
#include "inter/tcp/wire.hpp"
#include "inter/transport.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

struct Op {
  Op(bool send, char* data, int64_t bytes, uint64_t seq)
      : isSend(send), data(data), bytes(bytes), seq(seq), framesLeft(stripeCount(bytes)) {}

  const bool isSend;
  char* const data;
  const int64_t bytes;
  const uint64_t seq;
  std::atomic<int64_t> framesLeft;
  std::atomic<OpStatus> status{OpStatus::Pending};
  std::string error;  // written before status becomes Failed, never after

  // Guarded by the peer's mutex. `pins` counts progress threads inside a
  // syscall on this buffer: a failure waits for them (deferredError) so the
  // caller never frees a buffer the kernel still writes into.
  int pins = 0;
  std::string deferredError;
};

using TcpRequest = OpRequest<Op>;

class Peer;
class Worker;

struct OutFrame {
  FrameHeader hdr{};
  std::shared_ptr<Op> op;  // DATA: the send whose buffer `payload` points into
  const char* payload = nullptr;
  size_t sent = 0;  // bytes of header + payload already written
};

struct Sock {
  Peer* peer = nullptr;
  Worker* worker = nullptr;
  int index = 0;
  Fd fd;

  // Only the owning worker thread touches these.
  bool registered = false;  // in the worker's epoll set
  bool eof = false;         // the peer closed its end (read side drained)
  bool wantOut = false;     // EPOLLOUT requested
  FrameHeader rhdr{};
  size_t rgot = 0;          // header bytes read so far
  std::shared_ptr<Op> rop;  // receive the current DATA payload lands in
  char* rdst = nullptr;
  size_t rleft = 0;
  OutFrame cur;  // the frame being written
  bool hasCur = false;
  uint64_t ackedAtRate = 0;  // the flow's acknowledged bytes at its last rate sample

  std::atomic<int64_t> dataFrames{0};  // DATA frames fully written (counters)

  // Guarded by mu: control frames (CTS, MISMATCH) queued by any thread. They
  // go before the next stripe, so that this direction's data does not delay
  // the other direction's flow control.
  std::mutex mu;
  std::deque<OutFrame> ctrl;

  bool dirty = false;  // guarded by the worker's mutex: in its dirty list

  // Drops the frame being received and every frame not yet written.
  void dropFrames() {
    rop.reset();
    cur = OutFrame{};
    hasCur = false;
    std::lock_guard<std::mutex> lock(mu);
    ctrl.clear();
  }
};

// The state of one connection: its sockets and the requests of both directions.
class Peer {
 public:
  // `sockets`: how many sockets the connection has (added through socks()).
  Peer(int rank, std::string addr, std::shared_ptr<Notifier> notifier, int sockets)
      : rank_(rank),
        addr_(std::move(addr)),
        notifier_(std::move(notifier)),
        activeSockets_(sockets),
        idle_(sockets >= 64 ? ~uint64_t{0} : (uint64_t{1} << sockets) - 1) {}

  int rank() const { return rank_; }
  const std::string& addr() const { return addr_; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::vector<std::unique_ptr<Sock>>& socks() { return socks_; }

  std::string describe() const {
    return "tcp connection to rank " + std::to_string(rank_) + " (" + addr_ + ")";
  }

  std::unique_ptr<Request> post(bool send, char* data, int64_t bytes);

  // The receiver posted receive #seq of `posted` bytes.
  void onCts(uint64_t seq, uint64_t posted);

  // The sender of message #seq sent `size` bytes, which did not match.
  void onMismatch(uint64_t seq, uint64_t size);

  // The receive a DATA frame lands in; null (and the connection failed) when
  // the frame fits no posted receive.
  std::shared_ptr<Op> dataTarget(const FrameHeader& h);

  // Marks `op`'s buffer in use by a syscall; false when the op is over.
  bool pin(const std::shared_ptr<Op>& op);
  void unpin(const std::shared_ptr<Op>& op);

  // One frame of `op` was fully written or read.
  void frameDone(const std::shared_ptr<Op>& op);

  // The next DATA frame to write, for socket `sockIndex` that has nothing
  // left to write; false when no stripe waits or the socket was not asked to
  // carry one.
  bool nextStripe(int sockIndex, OutFrame* out);

  // Socket `sockIndex` wrote its DATA frame to the kernel. Called before the
  // frame counts as done, so that a send posted once its request completes
  // already finds the socket free.
  void stripeWritten(int sockIndex);

  // The peer closed socket `sockIndex`: it carries no more stripes.
  void dataSocketClosed(int sockIndex);

  // A data socket's flow delivered `bytesPerSecond` while it had data to
  // send (Worker's deliveryRate, the kernel's measure); decides how many
  // sockets carry data.
  void flowRate(double bytesPerSecond);

  // How many sockets carry data now.
  int dataSockets() {
    std::lock_guard<std::mutex> lock(stripeMu_);
    return activeSockets_;
  }

  // One more socket reached a clean end of stream; true when all did.
  bool socketEof() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++eofSockets_ == socks_.size();
  }

  // Fails every pending and future request of this connection.
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    failLocked(why);
  }

  // Transport::close(): from now on no request touches the sockets or the
  // workers (which are about to stop).
  void markClosed() {
    std::lock_guard<std::mutex> lock(mu_);
    failLocked(describe() + " was closed by this rank (the transport was closed)");
  }

  void closeSockets();

 private:
  // Where control frames go: the lowest socket with no stripe to write, so
  // that they neither wait behind a stripe nor wake an idle flow.
  Sock* controlSocket(uint64_t seq);

  std::unique_ptr<Request> failedRequest(bool send, char* data, int64_t bytes);
  void startSendLocked(const std::shared_ptr<Op>& op, int64_t posted);
  void queueControlLocked(Sock* s, OutFrame f);
  void finishLocked(const std::shared_ptr<Op>& op, OpStatus st, const std::string& err);
  void failLocked(const std::string& why);

  const int rank_;
  const std::string addr_;
  std::shared_ptr<Notifier> notifier_;
  std::vector<std::unique_ptr<Sock>> socks_;

  std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::string error_;
  uint64_t sendSeq_ = 0;
  uint64_t recvSeq_ = 0;
  std::map<uint64_t, std::shared_ptr<Op>> sends_;
  std::map<uint64_t, std::shared_ptr<Op>> recvs_;
  std::map<uint64_t, int64_t> earlyCts_;  // CTS that came before their isend
  size_t eofSockets_ = 0;

  // The stripes of cleared sends, in message and offset order. A data socket
  // takes the next one when it has written its last (Worker::handleWrite),
  // so a socket that the link or the kernel serves faster carries more.
  //
  // A socket with no stripe to write is idle. New stripes go to the lowest
  // idle sockets, one woken per stripe (dispatchLocked); busy sockets pull
  // more as they finish. So a lone small message rides socket 0, whose flow
  // stays warm, and a lost tail of it is recovered from the next message's
  // segments instead of waiting for a loss probe on an idle flow.
  //
  // Sockets [0, activeSockets_) carry data, the others only control frames.
  // Every socket carries data at first, which fills a fast link. Flows that
  // share a slow bottleneck are unfair at any instant and restart slowly
  // after idling, and a message over several of them ends with its slowest,
  // so sockets are shed when the flows in use deliver, while they have data
  // to send, less in total than kSocketRateToShed for each socket that one
  // fewer would have; one comes back whenever each delivers at least
  // kSocketRateToGrow (flowRate: the rates of kRateSamples samples).
  // Guarded by stripeMu_ (taken after mu_, never before).
  static constexpr int kRateSamples = 16;
  static constexpr double kSocketRateToShed = 0.25e9;  // bytes per second
  static constexpr double kSocketRateToGrow = 1e9;
  struct Stripe {
    std::shared_ptr<Op> op;
    int64_t off;
    int64_t len;
  };
  // Claims the lowest idle data sockets, one per queued stripe that no woken
  // socket will take; returns them as a mask to wake (wakeSockets, after
  // stripeMu_ is released).
  uint64_t dispatchLocked();
  void wakeSockets(uint64_t mask);

  std::mutex stripeMu_;
  std::deque<Stripe> stripes_;
  int activeSockets_;
  uint64_t idle_;        // bit k: socket k has no stripe to write and was not woken for one
  uint64_t woken_ = 0;   // woken for a stripe, not yet taken one
  uint64_t closed_ = 0;  // closed by the peer
  int rateSamples_ = 0;
  std::array<double, kRateSamples> rates_{};
};

class TcpConnection : public Connection {
 public:
  explicit TcpConnection(std::shared_ptr<Peer> peer) : peer_(std::move(peer)) {}
  int peer() const override { return peer_->rank(); }
  std::unique_ptr<Request> isend(const void* data, int64_t bytes, const MemoryRegion* mr) override {
    // The buffer is only read; Op keeps one pointer type for both directions.
    return peer_->post(true, static_cast<char*>(const_cast<void*>(data)), bytes);
  }
  std::unique_ptr<Request> irecv(void* data, int64_t bytes, const MemoryRegion* mr) override {
    return peer_->post(false, static_cast<char*>(data), bytes);
  }

 private:
  std::shared_ptr<Peer> peer_;
};

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
