#include "inter/tcp/tcp_transport.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "inter/notifier.hpp"
#include "inter/tcp/socket.hpp"
#include "inter/tcp/tcp_peer.hpp"
#include "inter/tcp/wire.hpp"
#include "inter/tcp/worker.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

namespace {

class TcpMemoryRegion : public MemoryRegion {
 public:
  TcpMemoryRegion(void* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* data_;
  int64_t bytes_;
};

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(const Config& cfg)
      // `auto` is resolved by the plans (transportConfig); left unresolved,
      // it is one rank's share of a host.
      : sockets_(cfg.tcpSocketsFor(1)),
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

  // data_frames_socket<k>: DATA frames written on socket k of any connection;
  // data_sockets: the sockets carrying data now, summed over the connections.
  std::map<std::string, int64_t> counters() const override {
    std::lock_guard<std::mutex> lock(closeMu_);
    std::map<std::string, int64_t> out;
    out["sockets_per_peer"] = sockets_;
    int64_t dataSockets = 0;
    for (int k = 0; k < sockets_; ++k) out["data_frames_socket" + std::to_string(k)] = 0;
    for (auto& p : peers_) {
      dataSockets += p->dataSockets();
      for (auto& s : p->socks()) {
        out["data_frames_socket" + std::to_string(s->index)] +=
            s->dataFrames.load(std::memory_order_relaxed);
      }
    }
    out["data_sockets"] = dataSockets;
    return out;
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
  mutable std::mutex closeMu_;
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
    auto peer = std::make_shared<Peer>(peers[i], addr, notifier_, sockets_);
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
