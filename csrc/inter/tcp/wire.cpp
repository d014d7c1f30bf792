#include "inter/tcp/wire.hpp"

#include <sstream>

namespace fastcomm {
namespace transport {
namespace tcp {

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

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
