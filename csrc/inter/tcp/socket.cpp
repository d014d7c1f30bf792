#include "inter/tcp/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <string.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <system_error>
#include <type_traits>
#include <vector>

namespace fastcomm {
namespace transport {
namespace tcp {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int SockAddr::port() const {
  if (family() == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  }
  if (family() == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  }
  return 0;
}

void SockAddr::setPort(int port) {
  if (family() == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(static_cast<uint16_t>(port));
  } else if (family() == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(static_cast<uint16_t>(port));
  }
}

std::string SockAddr::host() const {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof buf);
  } else if (family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf,
              sizeof buf);
  } else {
    return "?";
  }
  return buf;
}

std::string SockAddr::toString() const {
  if (family() == AF_INET6) return "[" + host() + "]:" + std::to_string(port());
  return host() + ":" + std::to_string(port());
}

bool SockAddr::parse(const std::string& host, int port, SockAddr* out) {
  SockAddr a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    a.len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    a.len = sizeof(sockaddr_in6);
  } else {
    return false;
  }
  a.setPort(port);
  *out = a;
  return true;
}

namespace {

SockAddr fromIfaddr(const ifaddrs* ifa) {
  SockAddr a;
  a.len = ifa->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  std::memcpy(&a.storage, ifa->ifa_addr, a.len);
  a.setPort(0);
  return a;
}

bool usable(const ifaddrs* ifa) {
  if (ifa->ifa_addr == nullptr || !(ifa->ifa_flags & IFF_UP)) return false;
  int fam = ifa->ifa_addr->sa_family;
  if (fam != AF_INET && fam != AF_INET6) return false;
  if (fam == AF_INET6) {
    // Link-local IPv6 addresses need a scope id that the peers cannot know.
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr);
    if (IN6_IS_ADDR_LINKLOCAL(&v6->sin6_addr)) return false;
  }
  return true;
}

}  // namespace

SockAddr chooseListenAddress(const std::string& ifname, std::string* chosenIf) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw std::system_error(errno, std::generic_category(), "fastcomm: getifaddrs");
  }
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, freeifaddrs);

  // One pass per preference, best first: IPv4 is preferred because it is what
  // clusters route; IPv6 is the fallback of an interface that has only that.
  auto pick = [&](auto&& accept) -> const ifaddrs* {
    for (int fam : {AF_INET, AF_INET6}) {
      for (const ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
        if (usable(ifa) && ifa->ifa_addr->sa_family == fam && accept(ifa)) return ifa;
      }
    }
    return nullptr;
  };

  const ifaddrs* found = nullptr;
  if (!ifname.empty()) {
    // An exact name wins over a prefix match (eth1 must not pick eth10).
    found = pick([&](const ifaddrs* ifa) { return ifname == ifa->ifa_name; });
    if (found == nullptr) {
      found = pick([&](const ifaddrs* ifa) {
        return std::strncmp(ifa->ifa_name, ifname.c_str(), ifname.size()) == 0;
      });
    }
    if (found == nullptr) {
      std::vector<std::string> names;
      for (const ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
        if (!usable(ifa)) continue;
        bool seen = false;
        for (const auto& n : names) seen = seen || n == ifa->ifa_name;
        if (!seen) names.emplace_back(ifa->ifa_name);
      }
      std::string have;
      for (const auto& n : names) have += (have.empty() ? "" : ", ") + n;
      throw std::invalid_argument("fastcomm: FASTCOMM_SOCKET_IFNAME=" + ifname +
                                  " matches no up interface with an address (have: " +
                                  (have.empty() ? "none" : have) + ")");
    }
  } else {
    found = pick([](const ifaddrs* ifa) {
      return ifa->ifa_addr->sa_family == AF_INET && !(ifa->ifa_flags & IFF_LOOPBACK);
    });
  }
  if (found != nullptr) {
    if (chosenIf != nullptr) *chosenIf = found->ifa_name;
    return fromIfaddr(found);
  }
  // Nothing but loopback: a single machine, which is all loopback can serve.
  SockAddr a;
  SockAddr::parse("127.0.0.1", 0, &a);
  if (chosenIf != nullptr) *chosenIf = "lo";
  return a;
}

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw std::system_error(errno, std::generic_category(), "fastcomm: fcntl(O_NONBLOCK)");
  }
}

std::string errnoText(int err) {
  char buf[256];
  // The GNU strerror_r returns the message (maybe not in buf); the XSI one fills buf.
  auto r = strerror_r(err, buf, sizeof buf);
  if constexpr (std::is_same_v<decltype(r), char*>) {
    return r;
  } else {
    return r == 0 ? std::string(buf) : "error " + std::to_string(err);
  }
}

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
