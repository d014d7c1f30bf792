// Small socket helpers of the tcp transport: an owning fd, socket addresses
// as text, and the choice of the address to listen on.
#pragma once

#include <sys/socket.h>

#include <string>

namespace fastcomm {
namespace transport {
namespace tcp {

// Owns one file descriptor; closes it when destroyed.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;

  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  sockaddr* get() { return reinterpret_cast<sockaddr*>(&storage); }
  int family() const { return storage.ss_family; }
  int port() const;
  void setPort(int port);
  std::string host() const;      // numeric address, without the port
  std::string toString() const;  // "10.0.0.2:41234" or "[fe80::1]:41234"
  // Parses a numeric host and a port; false if `host` is not an address.
  static bool parse(const std::string& host, int port, SockAddr* out);
};

// The address to listen on: that of interface `ifname` (an exact name or a
// prefix, like NCCL_SOCKET_IFNAME) when given, else the first up, non-loopback
// IPv4 interface, else loopback. Port 0. `chosenIf` receives the interface's
// name. Throws std::invalid_argument when `ifname` matches no usable interface.
SockAddr chooseListenAddress(const std::string& ifname, std::string* chosenIf);

// Sets O_NONBLOCK; throws std::system_error on failure.
void setNonBlocking(int fd);

// strerror for `err` as a std::string (thread-safe).
std::string errnoText(int err);

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
