// The progress threads of the tcp transport: each owns a subset of the
// sockets in an epoll set, reads frames into the receives Peer names and
// writes the frames queued on its sockets.
#pragma once

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "inter/tcp/socket.hpp"
#include "inter/tcp/tcp_peer.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

// One progress thread: an epoll set of its sockets plus an eventfd.
class Worker {
 public:
  explicit Worker(int id);

  void add(Sock* s);

  void start() {
    thread_ = std::thread([this] { run(); });
  }

  void stop() {
    stop_.store(true);
    signal();
    if (thread_.joinable()) thread_.join();
  }

  // Asks the worker to write `s`'s queued frames.
  void wake(Sock* s);

 private:
  void signal();
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

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
