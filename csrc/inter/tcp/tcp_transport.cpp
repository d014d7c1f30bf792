#include "inter/tcp/tcp_transport.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "common/thread_name.hpp"
#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "inter/notifier.hpp"
#include "inter/request.hpp"
#include "inter/tcp/socket.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {
namespace {

// ----------------------------------------------------------------------------- wire format
//
// Both ends run the same build on the same architecture, so headers travel in
// host byte order (as in NCCL's and Gloo's socket transports).

constexpr int64_t kStripeBytes = 512 << 10;
constexpr uint16_t kFrameMagic = 0xFC0C;
enum FrameType : uint16_t { kCts = 1, kData = 2, kMismatch = 3 };

struct FrameHeader {
  uint16_t magic;
  uint16_t type;
  uint32_t len;  // payload bytes that follow (DATA only)
  uint64_t seq;  // message number in its direction
  uint64_t arg;  // CTS: posted size; DATA: offset; MISMATCH: the sender's size
};
static_assert(sizeof(FrameHeader) == 24, "the header is part of the wire format");

constexpr uint64_t kHelloMagic = 0x6d6d6f6374736166ULL;  // "fastcomm"
constexpr uint32_t kProtocolVersion = 1;

struct Hello {
  uint64_t magic;
  uint32_t version;
  int32_t rank;     // the connecting rank
  int32_t index;    // socket index within the pair
  int32_t sockets;  // the connector's sockets per pair
  uint64_t nonce;   // the acceptor's nonce, as published in the store
};
static_assert(sizeof(Hello) == 32, "the hello is part of the wire format");

int64_t stripeCount(int64_t bytes) {
  // A zero-byte message still sends one (empty) frame, so the receive completes
  // only once the matching send exists.
  return bytes <= 0 ? 1 : (bytes + kStripeBytes - 1) / kStripeBytes;
}

// ----------------------------------------------------------------------------- requests

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

class TcpMemoryRegion : public MemoryRegion {
 public:
  TcpMemoryRegion(void* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  int64_t bytes_;
};

// ----------------------------------------------------------------------------- sockets

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

  // Guarded by mu: frames queued by any thread. Control frames (CTS,
  // MISMATCH) go before queued data so that a large send on this socket does
  // not delay the other direction's flow control.
  std::mutex mu;
  std::deque<OutFrame> ctrl;
  std::deque<OutFrame> data;

  bool dirty = false;  // guarded by the worker's mutex: in its dirty list
};

// One progress thread: an epoll set of its sockets plus an eventfd.
class Worker {
 public:
  explicit Worker(int id) : id_(id) {
    ep_.reset(epoll_create1(EPOLL_CLOEXEC));
    ev_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!ep_.valid() || !ev_.valid()) {
      throw std::system_error(errno, std::generic_category(), "fastcomm: tcp epoll/eventfd");
    }
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.ptr = nullptr;  // the eventfd
    if (epoll_ctl(ep_.get(), EPOLL_CTL_ADD, ev_.get(), &e) != 0) {
      throw std::system_error(errno, std::generic_category(), "fastcomm: tcp epoll_ctl");
    }
  }

  void add(Sock* s) {
    epoll_event e{};
    e.events = EPOLLIN | EPOLLRDHUP;
    e.data.ptr = s;
    if (epoll_ctl(ep_.get(), EPOLL_CTL_ADD, s->fd.get(), &e) != 0) {
      throw std::system_error(errno, std::generic_category(), "fastcomm: tcp epoll_ctl");
    }
    s->registered = true;
  }

  void start() {
    thread_ = std::thread([this] { run(); });
  }

  void stop() {
    stop_.store(true);
    signal();
    if (thread_.joinable()) thread_.join();
  }

  // Asks the worker to write `s`'s queued frames.
  void wake(Sock* s) {
    bool first;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (s->dirty) return;
      s->dirty = true;
      first = dirty_.empty();
      dirty_.push_back(s);
    }
    // The worker itself drains its list before it sleeps again.
    if (first && tlsWorker_ != this) signal();
  }

 private:
  void signal() {
    uint64_t one = 1;
    // EAGAIN only when the counter is saturated, i.e. a wake is pending anyway.
    ssize_t r = ::write(ev_.get(), &one, sizeof one);
    (void)r;
  }

  void run();
  void drainDirty();
  void handleRead(Sock* s);
  void handleWrite(Sock* s);
  void setWantOut(Sock* s, bool want);
  void deregister(Sock* s);
  bool dispatch(Sock* s);
  void socketFailed(Sock* s, int err, const char* what);
  void socketEof(Sock* s);

  static thread_local Worker* tlsWorker_;

  int id_;
  Fd ep_;
  Fd ev_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<Sock*> dirty_;
};

thread_local Worker* Worker::tlsWorker_ = nullptr;

// ----------------------------------------------------------------------------- peer

// The state of one connection: its sockets and the requests of both directions.
class Peer {
 public:
  Peer(int rank, std::string addr, std::shared_ptr<Notifier> notifier)
      : rank_(rank), addr_(std::move(addr)), notifier_(std::move(notifier)) {}

  int rank() const { return rank_; }
  const std::string& addr() const { return addr_; }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::vector<std::unique_ptr<Sock>>& socks() { return socks_; }

  std::string describe() const {
    return "tcp connection to rank " + std::to_string(rank_) + " (" + addr_ + ")";
  }

  std::unique_ptr<Request> post(bool send, char* data, int64_t bytes) {
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

  // The receiver posted receive #seq of `posted` bytes.
  void onCts(uint64_t seq, uint64_t posted) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load(std::memory_order_relaxed)) return;
    auto it = sends_.find(seq);
    if (it == sends_.end()) {
      if (seq < sendSeq_ || earlyCts_.count(seq)) {
        failLocked(describe() + ": protocol error: a second CTS for message " +
                   std::to_string(seq));
        return;
      }
      earlyCts_[seq] = static_cast<int64_t>(posted);
      return;
    }
    startSendLocked(it->second, static_cast<int64_t>(posted));
  }

  // The sender of message #seq sent `size` bytes, which did not match.
  void onMismatch(uint64_t seq, uint64_t size) {
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

  // The receive a DATA frame lands in; null (and the connection failed) when
  // the frame fits no posted receive.
  std::shared_ptr<Op> dataTarget(const FrameHeader& h) {
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

  // Marks `op`'s buffer in use by a syscall; false when the op is over.
  bool pin(const std::shared_ptr<Op>& op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.load(std::memory_order_relaxed) ||
        op->status.load(std::memory_order_relaxed) != OpStatus::Pending ||
        !op->deferredError.empty()) {
      return false;
    }
    ++op->pins;
    return true;
  }

  void unpin(const std::shared_ptr<Op>& op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--op->pins == 0 && !op->deferredError.empty()) {
      std::string err = std::move(op->deferredError);
      op->deferredError.clear();
      finishLocked(op, OpStatus::Failed, err);
    }
  }

  // One frame of `op` was fully written or read.
  void frameDone(const std::shared_ptr<Op>& op) {
    if (op->framesLeft.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      finishLocked(op, OpStatus::Done, "");
    }
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

  void closeSockets() {
    for (auto& s : socks_) {
      s->fd.reset();
      s->rop.reset();
      s->cur = OutFrame{};
      s->hasCur = false;
      std::lock_guard<std::mutex> lock(s->mu);
      s->ctrl.clear();
      s->data.clear();
    }
  }

 private:
  Sock* sockFor(uint64_t seq) { return socks_[seq % socks_.size()].get(); }

  std::unique_ptr<Request> failedRequest(bool send, char* data, int64_t bytes) {
    auto op = std::make_shared<Op>(send, data, bytes, 0);
    op->error = error_;
    op->status.store(OpStatus::Failed, std::memory_order_release);
    return std::make_unique<TcpRequest>(std::move(op), rank_);
  }

  void startSendLocked(const std::shared_ptr<Op>& op, int64_t posted) {
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

  void queueLocked(Sock* s, OutFrame f, bool control) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      (control ? s->ctrl : s->data).push_back(std::move(f));
    }
    s->worker->wake(s);
  }

  void finishLocked(const std::shared_ptr<Op>& op, OpStatus st, const std::string& err) {
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

  void failLocked(const std::string& why) {
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

// ----------------------------------------------------------------------------- worker loop

void Worker::run() {
  tlsWorker_ = this;
  nameThisThread("fc-tcp" + std::to_string(id_));
  constexpr int kMaxEvents = 64;
  epoll_event evs[kMaxEvents];
  while (!stop_.load(std::memory_order_acquire)) {
    int n = epoll_wait(ep_.get(), evs, kMaxEvents, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      FASTCOMM_LOG(Warn, "tcp progress thread " << id_ << ": epoll_wait: " << errnoText(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    for (int i = 0; i < n; ++i) {
      auto* s = static_cast<Sock*>(evs[i].data.ptr);
      if (s == nullptr) {
        uint64_t v;
        ssize_t r = ::read(ev_.get(), &v, sizeof v);
        (void)r;
        continue;
      }
      if (!s->registered) continue;  // dropped earlier in this batch
      if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP)) handleRead(s);
      if (s->registered && (evs[i].events & EPOLLOUT)) handleWrite(s);
    }
    drainDirty();
  }
  tlsWorker_ = nullptr;
}

void Worker::drainDirty() {
  for (;;) {
    std::vector<Sock*> list;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (dirty_.empty()) return;
      list.swap(dirty_);
      for (Sock* s : list) s->dirty = false;
    }
    for (Sock* s : list) {
      if (s->registered || s->eof) handleWrite(s);
    }
  }
}

void Worker::setWantOut(Sock* s, bool want) {
  if (s->wantOut == want || !s->registered) return;
  epoll_event e{};
  e.events = EPOLLIN | EPOLLRDHUP | (want ? EPOLLOUT : 0u);
  e.data.ptr = s;
  if (epoll_ctl(ep_.get(), EPOLL_CTL_MOD, s->fd.get(), &e) == 0) s->wantOut = want;
}

void Worker::deregister(Sock* s) {
  if (s->registered) {
    epoll_ctl(ep_.get(), EPOLL_CTL_DEL, s->fd.get(), nullptr);
    s->registered = false;
    s->wantOut = false;
  }
  s->rop.reset();
  s->cur = OutFrame{};
  s->hasCur = false;
  std::lock_guard<std::mutex> lock(s->mu);
  s->ctrl.clear();
  s->data.clear();
}

void Worker::socketFailed(Sock* s, int err, const char* what) {
  Peer* p = s->peer;
  std::string why;
  if (err == 0) {
    why = "closed by the peer (end of stream)";
  } else if (err == ECONNRESET) {
    why = "closed by the peer (connection reset)";
  } else if (err == EPIPE) {
    why = "closed by the peer (broken pipe)";
  } else {
    why = std::string("failed: ") + what + ": " + errnoText(err);
  }
  p->fail("fastcomm: " + p->describe() + " " + why + " (socket " + std::to_string(s->index) + ")");
  deregister(s);
}

// A clean end of stream on one socket. The peer's other sockets may still
// hold data it sent before closing (a send completes once the kernel has
// the bytes, and the sender may close right after), so the connection
// fails only once every socket ended, or at once when this one still owed
// us the rest of a frame or has frames of ours left to write.
void Worker::socketEof(Sock* s) {
  s->eof = true;
  bool owed = s->rop != nullptr || s->rgot > 0 || s->hasCur;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    owed = owed || !s->ctrl.empty() || !s->data.empty();
  }
  if (owed || s->peer->socketEof()) {
    socketFailed(s, 0, "recv");
  } else {
    deregister(s);  // level-triggered EPOLLIN would fire forever
  }
}

// Reads frames until the socket runs dry (level-triggered epoll brings us
// back) or a budget is spent, so that one busy socket does not starve others.
void Worker::handleRead(Sock* s) {
  Peer* p = s->peer;
  if (p->failed()) {
    deregister(s);
    return;
  }
  // A recv() that returned n <= 0 (not EINTR): nothing more for now, the
  // peer closed, or the socket broke.
  auto recvEnded = [&](ssize_t n, int err) {
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK)) return;
    if (n == 0) {
      socketEof(s);
    } else {
      socketFailed(s, err, "recv");
    }
  };
  for (int iter = 0; iter < 32; ++iter) {
    if (!s->rop) {
      char* dst = reinterpret_cast<char*>(&s->rhdr) + s->rgot;
      ssize_t n = ::recv(s->fd.get(), dst, sizeof(FrameHeader) - s->rgot, 0);
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        recvEnded(n, errno);
        return;
      }
      s->rgot += static_cast<size_t>(n);
      if (s->rgot < sizeof(FrameHeader)) continue;
      s->rgot = 0;
      if (!dispatch(s)) {
        deregister(s);
        return;
      }
    } else {
      if (!p->pin(s->rop)) {
        deregister(s);
        return;
      }
      ssize_t n = ::recv(s->fd.get(), s->rdst, s->rleft, 0);
      int err = errno;
      p->unpin(s->rop);
      if (n <= 0) {
        if (n < 0 && err == EINTR) continue;
        recvEnded(n, err);
        return;
      }
      s->rdst += n;
      s->rleft -= static_cast<size_t>(n);
      if (s->rleft == 0) {
        std::shared_ptr<Op> op = std::move(s->rop);
        s->rop.reset();
        p->frameDone(op);
      }
    }
  }
}

// Handles the header just read; false when the connection failed.
bool Worker::dispatch(Sock* s) {
  Peer* p = s->peer;
  const FrameHeader& h = s->rhdr;
  if (h.magic != kFrameMagic) {
    p->fail("fastcomm: " + p->describe() + ": protocol error: bad frame header on socket " +
            std::to_string(s->index));
    return false;
  }
  switch (h.type) {
    case kCts:
      p->onCts(h.seq, h.arg);
      return !p->failed();
    case kMismatch:
      p->onMismatch(h.seq, h.arg);
      return true;
    case kData: {
      std::shared_ptr<Op> op = p->dataTarget(h);
      if (!op) return false;
      if (h.len == 0) {
        p->frameDone(op);
      } else {
        s->rdst = op->data + h.arg;
        s->rleft = h.len;
        s->rop = std::move(op);
      }
      return true;
    }
    default:
      p->fail("fastcomm: " + p->describe() + ": protocol error: unknown frame type " +
              std::to_string(h.type));
      return false;
  }
}

void Worker::handleWrite(Sock* s) {
  Peer* p = s->peer;
  if (p->failed()) {
    deregister(s);
    return;
  }
  if (s->eof) {  // a frame for a socket the peer has closed
    socketFailed(s, 0, "send");
    return;
  }
  for (int iter = 0; iter < 32; ++iter) {
    if (!s->hasCur) {
      std::lock_guard<std::mutex> lock(s->mu);
      auto& q = !s->ctrl.empty() ? s->ctrl : s->data;
      if (q.empty()) {
        setWantOut(s, false);
        return;
      }
      s->cur = std::move(q.front());
      q.pop_front();
      s->hasCur = true;
    }
    OutFrame& f = s->cur;
    const size_t hdrBytes = sizeof(FrameHeader);
    const size_t total = hdrBytes + f.hdr.len;
    iovec iov[2];
    int niov = 0;
    if (f.sent < hdrBytes) {
      iov[niov++] = {reinterpret_cast<char*>(&f.hdr) + f.sent, hdrBytes - f.sent};
      if (f.hdr.len > 0) iov[niov++] = {const_cast<char*>(f.payload), f.hdr.len};
    } else {
      iov[niov++] = {const_cast<char*>(f.payload) + (f.sent - hdrBytes), total - f.sent};
    }
    const bool pinned = f.op && f.hdr.len > 0;
    if (pinned && !p->pin(f.op)) {  // the send failed meanwhile: drop the frame
      s->cur = OutFrame{};
      s->hasCur = false;
      continue;
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(niov);
    ssize_t n = ::sendmsg(s->fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    int err = errno;
    if (pinned) p->unpin(f.op);
    if (n < 0) {
      if (err == EAGAIN || err == EWOULDBLOCK) {
        setWantOut(s, true);
        return;
      }
      if (err == EINTR) continue;
      socketFailed(s, err, "sendmsg");
      return;
    }
    f.sent += static_cast<size_t>(n);
    if (f.sent == total) {
      std::shared_ptr<Op> op = std::move(f.op);
      s->cur = OutFrame{};
      s->hasCur = false;
      if (op) p->frameDone(op);
    }
  }
  // Budget spent with more to write: EPOLLOUT (level-triggered) brings us back
  // after the other sockets had their turn.
  setWantOut(s, true);
}

// ----------------------------------------------------------------------------- transport

struct PeerHandle {
  SockAddr addr;
  uint64_t nonce = 0;
  int sockets = 0;
};

std::string encodeHandle(const SockAddr& a, uint64_t nonce, int sockets) {
  std::ostringstream os;
  os << "fastcomm-tcp " << kProtocolVersion << " " << a.host() << " " << a.port() << " " << std::hex
     << nonce << std::dec << " " << sockets;
  return os.str();
}

bool decodeHandle(const std::string& text, PeerHandle* out) {
  std::istringstream is(text);
  std::string tag, host;
  uint32_t version = 0;
  int port = 0;
  is >> tag >> version >> host >> port >> std::hex >> out->nonce >> std::dec >> out->sockets;
  return !is.fail() && tag == "fastcomm-tcp" && version == kProtocolVersion &&
         SockAddr::parse(host, port, &out->addr);
}

std::string storeKey(int rank) { return "tcp/" + std::to_string(rank); }

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(const Config& cfg)
      : sockets_(std::max(1, cfg.tcpSocketsPerPeer)),
        threads_(std::max(1, cfg.tcpThreads)),
        bufferBytes_(static_cast<int>(cfg.tcpSocketBufferBytes)),
        notifier_(std::make_shared<Notifier>()) {
    spinMicros_ =
        cfg.spinMicros >= 0 ? cfg.spinMicros : (std::thread::hardware_concurrency() >= 8 ? 20 : 0);
    if (cfg.tcpSocketsPerPeer > 64) {
      throw std::invalid_argument("fastcomm: FASTCOMM_TCP_SOCKETS=" +
                                  std::to_string(cfg.tcpSocketsPerPeer) + " is above 64");
    }
    std::string ifname;
    listenAddr_ = chooseListenAddress(cfg.socketIfname, &ifname);
    listen_.reset(::socket(listenAddr_.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!listen_.valid()) throwSys("socket");
    if (::bind(listen_.get(), listenAddr_.get(), listenAddr_.len) != 0) {
      throwSys("bind to " + listenAddr_.toString() + " (" + ifname + ")");
    }
    if (::listen(listen_.get(), SOMAXCONN) != 0) throwSys("listen");
    socklen_t len = sizeof(listenAddr_.storage);
    if (::getsockname(listen_.get(), listenAddr_.get(), &len) != 0) throwSys("getsockname");
    listenAddr_.len = len;
    std::random_device rd;
    nonce_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
             static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^
             (static_cast<uint64_t>(::getpid()) << 16);
    FASTCOMM_LOG(Info, "tcp transport listening on " << listenAddr_.toString() << " (" << ifname
                                                     << "), " << sockets_ << " socket(s) per peer, "
                                                     << threads_ << " progress thread(s)");
  }

  ~TcpTransport() override { close(); }

  std::string name() const override { return "tcp"; }

  std::unique_ptr<MemoryRegion> registerMemory(void* data, int64_t bytes) override {
    return std::make_unique<TcpMemoryRegion>(data, bytes);  // plain memory will do
  }

  std::vector<std::unique_ptr<Connection>> connect(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size,
                                                   const std::vector<int>& peers,
                                                   const OpContext& ctx) override;

  void waitForProgress(std::chrono::microseconds max) override {
    notifier_->wait(max, spinMicros_);
  }

  void close() override {
    std::lock_guard<std::mutex> lock(closeMu_);
    if (closed_) return;
    closed_ = true;
    // Order matters: first no request may reach a worker, then the workers
    // stop (no syscall touches a buffer any more), then fds go.
    for (auto& p : peers_) p->markClosed();
    for (auto& w : workers_) w->stop();
    for (auto& p : peers_) p->closeSockets();
    workers_.clear();
    peers_.clear();
    listen_.reset();
    notifier_->notify();
  }

 private:
  [[noreturn]] static void throwSys(const std::string& what) {
    throw std::system_error(errno, std::generic_category(), "fastcomm: tcp transport: " + what);
  }

  // Opens and sorts the sockets of every pair; see connect() below.
  std::vector<std::vector<Fd>> handshake(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                         const std::vector<int>& peers, const OpContext& ctx);

  const int sockets_;
  const int threads_;
  const int bufferBytes_;  // SO_SNDBUF / SO_RCVBUF, 0: the kernel's autotuning
  int64_t spinMicros_ = 0;
  std::shared_ptr<Notifier> notifier_;
  SockAddr listenAddr_;
  Fd listen_;
  uint64_t nonce_ = 0;
  bool connected_ = false;
  std::vector<std::shared_ptr<Peer>> peers_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex closeMu_;
  bool closed_ = false;
};

std::vector<std::unique_ptr<Connection>> TcpTransport::connect(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::vector<int>& peers,
    const OpContext& ctx) {
  if (connected_ || closed_) {
    throw std::logic_error("fastcomm: tcp transport: connect() may be called once, before close()");
  }
  connected_ = true;
  checkPeerList("tcp", rank, size, peers);

  store->set(storeKey(rank), [&] {
    std::string h = encodeHandle(listenAddr_, nonce_, sockets_);
    return std::vector<uint8_t>(h.begin(), h.end());
  }());

  std::vector<std::vector<Fd>> fds = handshake(store, rank, peers, ctx);
  listen_.reset();  // every expected socket is in; nobody else may come

  const int total = static_cast<int>(peers.size()) * sockets_;
  const int nworkers = std::min(threads_, std::max(total, 1));
  if (!peers.empty()) {
    for (int w = 0; w < nworkers; ++w) workers_.push_back(std::make_unique<Worker>(w));
  }
  std::vector<std::unique_ptr<Connection>> conns;
  int g = 0;
  for (size_t i = 0; i < peers.size(); ++i) {
    SockAddr remote;
    socklen_t len = sizeof(remote.storage);
    std::string addr = "?";
    if (::getpeername(fds[i][0].get(), remote.get(), &len) == 0) {
      remote.len = len;
      addr = remote.toString();
    }
    auto peer = std::make_shared<Peer>(peers[i], addr, notifier_);
    for (int k = 0; k < sockets_; ++k, ++g) {
      auto s = std::make_unique<Sock>();
      s->peer = peer.get();
      s->index = k;
      s->fd = std::move(fds[i][k]);
      int one = 1;
      // Latency of small frames matters more than segment count.
      setsockopt(s->fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      if (bufferBytes_ > 0) {
        // Bounds the bytes each socket holds in the kernel. Set after the
        // handshake: the window scale, negotiated from the kernel's limits
        // (tcp_rmem), already covers any size allowed here.
        for (int opt : {SO_SNDBUF, SO_RCVBUF}) {
          if (setsockopt(s->fd.get(), SOL_SOCKET, opt, &bufferBytes_, sizeof bufferBytes_) != 0)
            throwSys(opt == SO_SNDBUF ? "setsockopt(SO_SNDBUF)" : "setsockopt(SO_RCVBUF)");
        }
      }
      s->worker = workers_[static_cast<size_t>(g % nworkers)].get();
      s->worker->add(s.get());
      peer->socks().push_back(std::move(s));
    }
    peers_.push_back(peer);
    conns.push_back(std::make_unique<TcpConnection>(std::move(peer)));
  }
  for (auto& w : workers_) w->start();
  return conns;
}

std::vector<std::vector<Fd>> TcpTransport::handshake(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, const std::vector<int>& peers,
                                                     const OpContext& ctx) {
  const auto retryDelay = std::chrono::milliseconds(20);
  std::map<int, size_t> position;  // rank -> index in `peers`
  for (size_t i = 0; i < peers.size(); ++i) position[peers[i]] = i;
  std::vector<std::vector<Fd>> result(peers.size());
  for (auto& v : result) v.resize(static_cast<size_t>(sockets_));

  // Outgoing: this rank is the lower one of the pair.
  enum class St { NeedHandle, Idle, Connecting, Hello, Done };
  struct Out {
    Out(int p, int k) : peer(p), index(k) {}
    int peer;
    int index;
    St st = St::NeedHandle;
    Fd fd;
    Clock::time_point retryAt{};
    Hello hello{};
    size_t sent = 0;
    std::string lastError;
  };
  std::vector<Out> outs;
  std::map<int, PeerHandle> handles;
  int expectedIn = 0;
  for (int p : peers) {
    if (p > rank) {
      for (int k = 0; k < sockets_; ++k) outs.emplace_back(p, k);
    } else {
      expectedIn += sockets_;
    }
  }
  // Incoming: accepted, hello not complete yet.
  struct In {
    explicit In(int fd) : fd(fd) {}
    Fd fd;
    Hello hello{};
    size_t got = 0;
  };
  std::vector<In> pendingIn;
  int gotIn = 0;
  auto nextStoreCheck = Clock::now();

  auto failDeadline = [&] {
    std::vector<int> missing;
    std::string details;
    for (int p : peers) {
      bool complete = true;
      for (auto& fd : result[position[p]]) complete = complete && fd.valid();
      if (complete) continue;
      missing.push_back(p);
      std::string d;
      if (p > rank) {
        if (!handles.count(p)) {
          d = "never published its address (store key " + storeKey(p) + ")";
        } else {
          std::string err;
          for (auto& o : outs) {
            if (o.peer == p && !o.lastError.empty()) err = o.lastError;
          }
          d = "did not accept at " + handles[p].addr.toString() +
              (err.empty() ? "" : " (last error: " + err + ")");
        }
      } else {
        d = "did not connect to " + listenAddr_.toString();
      }
      details += "; rank " + std::to_string(p) + " " + d;
    }
    throwCommError("fastcomm: " + ctx.describe() + ": tcp transport of rank " +
                   std::to_string(rank) + " could not connect to rank(s) " + formatRanks(missing) +
                   " within the timeout of " + std::to_string(ctx.timeout.count()) + " ms" +
                   details);
  };

  auto startConnect = [&](Out& o) {
    const PeerHandle& h = handles[o.peer];
    o.fd.reset(::socket(h.addr.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!o.fd.valid()) throwSys("socket");
    o.hello = Hello{kHelloMagic, kProtocolVersion, rank, o.index, sockets_, h.nonce};
    o.sent = 0;
    if (::connect(o.fd.get(), h.addr.get(), h.addr.len) == 0) {
      o.st = St::Hello;
    } else if (errno == EINPROGRESS) {
      o.st = St::Connecting;
    } else {
      // ECONNREFUSED and friends: the peer may not listen yet; retry until the deadline.
      o.lastError = errnoText(errno);
      o.fd.reset();
      o.st = St::Idle;
      o.retryAt = Clock::now() + retryDelay;
    }
  };

  auto retryLater = [&](Out& o, int err) {
    o.lastError = errnoText(err);
    o.fd.reset();
    o.st = St::Idle;
    o.retryAt = Clock::now() + retryDelay;
  };

  auto sendHello = [&](Out& o) {
    while (o.sent < sizeof(Hello)) {
      ssize_t n = ::send(o.fd.get(), reinterpret_cast<const char*>(&o.hello) + o.sent,
                         sizeof(Hello) - o.sent, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        retryLater(o, errno);
        return;
      }
      o.sent += static_cast<size_t>(n);
    }
    o.st = St::Done;
    result[position[o.peer]][static_cast<size_t>(o.index)] = std::move(o.fd);
  };

  // Validates a complete hello; places the socket or drops it with a warning.
  auto acceptHello = [&](In& in) {
    const Hello& h = in.hello;
    std::string bad;
    if (h.magic != kHelloMagic || h.version != kProtocolVersion) {
      bad = "not a fastcomm tcp hello of this version";
    } else if (h.nonce != nonce_) {
      bad = "meant for another listener (stale address in the store?)";
    } else if (!position.count(h.rank) || h.rank >= rank || h.index < 0 || h.index >= sockets_) {
      bad = "unexpected rank " + std::to_string(h.rank) + " / socket " + std::to_string(h.index);
    } else if (result[position[h.rank]][static_cast<size_t>(h.index)].valid()) {
      bad = "duplicate socket " + std::to_string(h.index) + " of rank " + std::to_string(h.rank);
    }
    if (!bad.empty()) {
      FASTCOMM_LOG(Warn,
                   "tcp transport of rank " << rank << ": dropped an incoming connection: " << bad);
      in.fd.reset();
      return;
    }
    if (h.sockets != sockets_) {
      throwCommError("fastcomm: " + ctx.describe() + ": rank " + std::to_string(h.rank) +
                     " uses FASTCOMM_TCP_SOCKETS=" + std::to_string(h.sockets) + " but rank " +
                     std::to_string(rank) + " uses " + std::to_string(sockets_) +
                     "; it must be the same on every rank");
    }
    result[position[h.rank]][static_cast<size_t>(h.index)] = std::move(in.fd);
    ++gotIn;
  };

  for (;;) {
    bool outsDone =
        std::all_of(outs.begin(), outs.end(), [](const Out& o) { return o.st == St::Done; });
    if (outsDone && gotIn == expectedIn) break;
    auto now = Clock::now();
    if (now >= ctx.deadline) failDeadline();

    // Addresses of the peers this rank connects to, as they appear.
    if (now >= nextStoreCheck) {
      std::vector<int> absent;  // asked this round already (one store round trip per peer)
      for (auto& o : outs) {
        if (o.st != St::NeedHandle) continue;
        if (!handles.count(o.peer)) {
          if (std::find(absent.begin(), absent.end(), o.peer) != absent.end()) continue;
          const std::string key = storeKey(o.peer);
          if (!store->check({key})) {
            absent.push_back(o.peer);
            continue;
          }
          const std::string text = storeGet(store, key);
          PeerHandle h;
          if (!decodeHandle(text, &h)) {
            throwCommError("fastcomm: " + ctx.describe() + ": tcp transport: the address of rank " +
                           std::to_string(o.peer) + " in the store (" + key +
                           ") is not readable: '" + text + "'");
          }
          if (h.sockets != sockets_) {
            throwCommError("fastcomm: " + ctx.describe() + ": rank " + std::to_string(o.peer) +
                           " uses FASTCOMM_TCP_SOCKETS=" + std::to_string(h.sockets) +
                           " but rank " + std::to_string(rank) + " uses " +
                           std::to_string(sockets_) + "; it must be the same on every rank");
          }
          handles[o.peer] = h;
        }
        o.st = St::Idle;
      }
      nextStoreCheck = now + std::chrono::milliseconds(10);
    }
    for (auto& o : outs) {
      if (o.st == St::Idle && now >= o.retryAt) startConnect(o);
      if (o.st == St::Hello) sendHello(o);
    }

    std::vector<pollfd> pfds;
    std::vector<std::pair<int, size_t>> what;  // (0 listen | 1 out | 2 in, index)
    if (gotIn < expectedIn) {
      pfds.push_back({listen_.get(), POLLIN, 0});
      what.emplace_back(0, 0);
    }
    bool waitingOnTimer = false;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].st == St::Connecting || outs[i].st == St::Hello) {
        pfds.push_back({outs[i].fd.get(), POLLOUT, 0});
        what.emplace_back(1, i);
      } else if (outs[i].st == St::NeedHandle || outs[i].st == St::Idle) {
        waitingOnTimer = true;
      }
    }
    for (size_t i = 0; i < pendingIn.size(); ++i) {
      pfds.push_back({pendingIn[i].fd.get(), POLLIN, 0});
      what.emplace_back(2, i);
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(ctx.deadline - now);
    int timeout = static_cast<int>(std::min<int64_t>(waitingOnTimer ? 10 : 100, left.count() + 1));
    int n = ::poll(pfds.data(), pfds.size(), std::max(timeout, 1));
    if (n < 0) {
      if (errno == EINTR) continue;
      throwSys("poll");
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      auto [kind, idx] = what[i];
      if (kind == 0) {
        for (;;) {
          int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) break;  // EAGAIN, or a connection that died in the queue
          pendingIn.emplace_back(fd);
        }
      } else if (kind == 1) {
        Out& o = outs[idx];
        if (o.st == St::Connecting) {
          int err = 0;
          socklen_t len = sizeof err;
          getsockopt(o.fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          if (err != 0) {
            retryLater(o, err);
            continue;
          }
          o.st = St::Hello;
        }
        if (o.st == St::Hello) sendHello(o);
      } else {
        In& in = pendingIn[idx];
        // Exactly the hello: what follows is the data stream of the connection.
        ssize_t r = ::recv(in.fd.get(), reinterpret_cast<char*>(&in.hello) + in.got,
                           sizeof(Hello) - in.got, 0);
        if (r > 0) {
          in.got += static_cast<size_t>(r);
          if (in.got == sizeof(Hello)) acceptHello(in);
        } else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          in.fd.reset();  // gone before saying hello
        }
      }
    }
    pendingIn.erase(std::remove_if(pendingIn.begin(), pendingIn.end(),
                                   [](const In& in) { return !in.fd.valid(); }),
                    pendingIn.end());
  }
  return result;
}

}  // namespace

std::unique_ptr<Transport> createTcpTransport(const Config& cfg) {
  return std::make_unique<TcpTransport>(cfg);
}

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
