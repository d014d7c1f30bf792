#include "inter/tcp/worker.hpp"

#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <chrono>
#include <string>
#include <system_error>
#include <mutex>
#include <thread>

#include "common/thread_name.hpp"
#include "common/logging.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

thread_local Worker* Worker::tlsWorker_ = nullptr;

namespace {

// The rate at which the socket's flow delivers, as the kernel measured it
// over its last acknowledged round trip; false when the flow had too little
// to send then (app-limited: a lower bound only), or when it acknowledged
// less than a stripe since the last rate taken (the kernel's figure would
// repeat a stale sample).
bool deliveryRate(Sock* s, double* bytesPerSecond) {
  tcp_info ti{};
  socklen_t len = sizeof ti;
  if (::getsockopt(s->fd.get(), IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return false;
  if (len < offsetof(tcp_info, tcpi_delivery_rate) + sizeof ti.tcpi_delivery_rate) return false;
  if (ti.tcpi_bytes_acked < s->ackedAtRate + static_cast<uint64_t>(kStripeBytes)) return false;
  s->ackedAtRate = ti.tcpi_bytes_acked;
  if (ti.tcpi_delivery_rate_app_limited || ti.tcpi_delivery_rate == 0) return false;
  *bytesPerSecond = static_cast<double>(ti.tcpi_delivery_rate);
  return true;
}

}  // namespace

Worker::Worker(int id) : id_(id) {
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

void Worker::add(Sock* s) {
  epoll_event e{};
  e.events = EPOLLIN | EPOLLRDHUP;
  e.data.ptr = s;
  if (epoll_ctl(ep_.get(), EPOLL_CTL_ADD, s->fd.get(), &e) != 0) {
    throw std::system_error(errno, std::generic_category(), "fastcomm: tcp epoll_ctl");
  }
  s->registered = true;
}

void Worker::wake(Sock* s) {
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

void Worker::signal() {
  uint64_t one = 1;
  // EAGAIN only when the counter is saturated, i.e. a wake is pending anyway.
  ssize_t r = ::write(ev_.get(), &one, sizeof one);
  (void)r;
}

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
  s->dropFrames();
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
    owed = owed || !s->ctrl.empty();
  }
  if (owed || s->peer->socketEof()) {
    socketFailed(s, 0, "recv");
  } else {
    s->peer->dataSocketClosed(s->index);
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
  if (s->eof) {
    // The peer closed this socket: a control frame for it fails the
    // connection; stripes go to the other sockets (all of them ending fails
    // the connection too, socketEof).
    bool owed;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      owed = !s->ctrl.empty();
    }
    if (owed) {
      socketFailed(s, 0, "send");
    } else {
      p->dataSocketClosed(s->index);
    }
    return;
  }
  for (int iter = 0; iter < 32; ++iter) {
    if (!s->hasCur) {
      {
        std::lock_guard<std::mutex> lock(s->mu);
        if (!s->ctrl.empty()) {
          s->cur = std::move(s->ctrl.front());
          s->ctrl.pop_front();
          s->hasCur = true;
        }
      }
      if (!s->hasCur) s->hasCur = p->nextStripe(s->index, &s->cur);
      if (!s->hasCur) {
        setWantOut(s, false);
        return;
      }
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
      const bool data = f.hdr.type == kData;
      s->cur = OutFrame{};
      s->hasCur = false;
      if (data) {
        s->dataFrames.fetch_add(1, std::memory_order_relaxed);
        double rate;
        if (deliveryRate(s, &rate)) p->flowRate(rate);
        p->stripeWritten(s->index);
      }
      if (op) p->frameDone(op);
    }
  }
  // Budget spent with more to write: EPOLLOUT (level-triggered) brings us back
  // after the other sockets had their turn.
  setWantOut(s, true);
}

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
