// The ib transport's wire format: protocol constants, the immediates and work
// request ids, and the control block each connection registers (its FIFO of
// receive slots). ib_transport.hpp and docs/ib.md describe the protocol.
#pragma once

#include <chrono>
#include <cstdint>

namespace fastcomm {
namespace transport {
namespace ib {

// Both ends run the same build on the same architecture, so control words
// travel in host byte order (as in NCCL's net_ib).

constexpr uint32_t kProtocolVersion = 1;
constexpr int kFifoDepth = 32;                    // slots per connection and direction
constexpr int64_t kPieceBytes = 512 << 10;        // one staging slot
constexpr int64_t kZeroCopyPieceBytes = 8 << 20;  // pieces of registered buffers
constexpr int kStagingSlots = 8;                  // per connection and direction
constexpr int64_t kMinStripeBytes = 64 << 10;     // smaller pieces use one QP
constexpr auto kKeepaliveIdle = std::chrono::milliseconds(1000);
constexpr auto kTimerPeriod = std::chrono::milliseconds(100);
constexpr int kMaxSendWr = 4 * kFifoDepth + 16;
constexpr int kMaxRecvWr = 2 * kFifoDepth + 16;  // bound: see Engine::handle
static_assert(kFifoDepth <= 1024, "the slot travels in 10 bits of the immediate");

// Immediate: type (2 bits) | stripes (7 bits) << 10 | slot (10 bits).
enum ImmType : uint32_t { kImmFifo = 1, kImmData = 2, kImmMismatch = 3 };
inline uint32_t makeImm(ImmType t, int slot, int stripes) {
  return (static_cast<uint32_t>(t) << 30) | (static_cast<uint32_t>(stripes) << 10) |
         static_cast<uint32_t>(slot);
}
inline ImmType immType(uint32_t imm) { return static_cast<ImmType>(imm >> 30); }
inline int immSlot(uint32_t imm) { return static_cast<int>(imm & 0x3ff); }
inline int immStripes(uint32_t imm) { return static_cast<int>((imm >> 10) & 0x7f); }

// Work request ids: kind << 56 | payload.
enum WrKind : uint64_t { kWrFifo = 1, kWrData = 2, kWrMismatch = 3, kWrKeepalive = 4, kWrRecv = 5 };
inline uint64_t wrId(WrKind k, uint64_t payload) {
  return (static_cast<uint64_t>(k) << 56) | (payload & ((1ull << 56) - 1));
}
inline WrKind wrKind(uint64_t id) { return static_cast<WrKind>(id >> 56); }
inline uint64_t wrPayload(uint64_t id) { return id & ((1ull << 56) - 1); }

inline const char* wrWhat(WrKind k) {
  switch (k) {
    case kWrFifo:
      return "a receive-buffer advertisement (RDMA write into the peer's FIFO)";
    case kWrData:
      return "an RDMA write of data";
    case kWrMismatch:
      return "a size-mismatch notice";
    case kWrKeepalive:
      return "a keepalive write";
    case kWrRecv:
      return "a receive";
  }
  return "a work request";
}

// A FIFO slot: where the sender may write one piece of one message.
struct FifoEntry {
  uint64_t addr;
  uint32_t rkey;
  uint32_t len;
  uint64_t seq;       // message number in this direction
  uint64_t offset;    // of the piece within the message
  uint64_t msgBytes;  // the size the receiver posted
  uint64_t idx;       // FIFO index, so a stale slot is recognised
  uint64_t pad[2];
};
static_assert(sizeof(FifoEntry) == 64, "a FIFO slot is part of the wire format");

// Registered per connection; the peer writes into the *In parts.
struct CtrlBlock {
  FifoEntry fifoIn[kFifoDepth];   // slots the peer (as receiver) hands this rank
  FifoEntry fifoOut[kFifoDepth];  // slots this rank hands the peer (write sources)
  uint64_t mmIn[kFifoDepth];      // the peer's message size, when it did not match
  uint64_t mmOut[kFifoDepth];
};

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
