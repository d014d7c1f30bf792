// The tcp transport's wire format: the frames every socket carries, the hello
// that opens each socket, and the address record each rank publishes in the
// store (tcp_transport.hpp describes the protocol).
#pragma once

#include <cstdint>
#include <string>

#include "inter/tcp/socket.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

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

inline int64_t stripeCount(int64_t bytes) {
  // A zero-byte message still sends one (empty) frame, so the receive completes
  // only once the matching send exists.
  return bytes <= 0 ? 1 : (bytes + kStripeBytes - 1) / kStripeBytes;
}

// What a rank publishes under storeKey(rank): where it listens.
struct PeerHandle {
  SockAddr addr;
  uint64_t nonce = 0;
  int sockets = 0;
};

std::string encodeHandle(const SockAddr& a, uint64_t nonce, int sockets);
bool decodeHandle(const std::string& text, PeerHandle* out);
std::string storeKey(int rank);

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
