// The shared memory of the emulated RC device (emu_device.hpp has the model):
// each opened device is a POSIX shared-memory segment holding a header and one
// inbound wire (a byte ring of packets) per queue pair, named after the
// process so that a peer finds it from the GID alone.
#pragma once

#include <sys/mman.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "inter/ib/device.hpp"

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSegMagic = 0x756d656269636166ULL;  // "fcibemu"
constexpr uint32_t kVersion = 1;
constexpr int kLanes = 128;                 // QPs per emulated device
constexpr uint64_t kLaneBytes = 1 << 20;    // wire bytes per QP
constexpr uint32_t kMaxPayload = 64 << 10;  // payload per packet
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kLaneHeaderBytes = 256;
constexpr int kActiveMtu = 4096;
constexpr const char* kDeviceName = "fcemu0";

enum PktKind : uint32_t { kWrite = 1, kWrap = 2 };
constexpr uint32_t kFirst = 1, kLast = 2, kImm = 4;  // packet flags

struct Pkt {
  uint32_t kind;
  uint32_t flags;
  uint64_t msn;     // work request number on the sending QP, from 1
  uint64_t raddr;   // where this packet's payload goes
  uint64_t wrAddr;  // where the whole write goes (checked on the first packet)
  uint32_t rkey;
  uint32_t len;    // payload bytes in this packet
  uint32_t total;  // bytes of the whole write
  uint32_t imm;
  uint64_t pad;
};
static_assert(sizeof(Pkt) == 56, "packet header layout");
constexpr uint64_t kPktHeader = 64;

enum LaneState : uint32_t { kLaneFree = 0, kLaneAlive = 1, kLaneError = 2 };

struct SegHeader {
  uint64_t magic;
  uint32_t version;
  int32_t pid;
  uint64_t startTime;  // the owner's start time, so a reused pid is not taken for it
  uint32_t ctx;
  uint32_t lanes;
  uint64_t laneBytes;
  alignas(64) std::atomic<uint32_t> bell;
  alignas(64) std::atomic<uint32_t> sleepers;
  alignas(64) std::atomic<uint32_t> closed;
};

struct LaneHeader {
  // Written by the owner (the consumer).
  alignas(64) std::atomic<uint64_t> head;
  std::atomic<uint64_t> acked;      // last message number fully processed
  std::atomic<uint32_t> qpn;        // the QP that owns the lane now (0: none)
  std::atomic<uint32_t> state;      // LaneState
  std::atomic<uint32_t> nakStatus;  // WcStatus + 1 of a NAK, 0: none
  std::atomic<uint64_t> nakMsn;
  // Written by the producer (the peer QP's HCA).
  alignas(64) std::atomic<uint64_t> tail;
};
static_assert(sizeof(LaneHeader) <= kLaneHeaderBytes, "lane header layout");

constexpr uint64_t segmentBytes() {
  return kHeaderBytes + kLanes * kLaneHeaderBytes + kLanes * kLaneBytes;
}

inline uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout);
void futexWakeAll(std::atomic<uint32_t>* word);

// The inode of this process's pid namespace: part of every segment name.
uint32_t pidNamespace();
// Field 22 of /proc/<pid>/stat (start time in clock ticks), and whether the
// process is a zombie; 0 when the process does not exist.
uint64_t processStart(int pid, bool* zombie);
std::string segmentName(uint32_t ns, int pid, uint32_t ctx);
// GID layout of an emulated port: prefix (2 bytes), 0, pid namespace, pid, ctx.
Gid makeGid(uint16_t prefix, uint32_t ns, int pid, uint32_t ctx);
// Removes segments whose owner died without unlinking them (killed).
void removeStaleSegments(uint32_t ns);

// A mapped port segment, ours or a peer's.
class Segment {
 public:
  Segment(std::string name, void* base) : name_(std::move(name)), base_(base) {}
  ~Segment() { munmap(base_, segmentBytes()); }

  SegHeader* hdr() const { return static_cast<SegHeader*>(base_); }
  LaneHeader* lane(int i) const {
    return reinterpret_cast<LaneHeader*>(static_cast<char*>(base_) + kHeaderBytes +
                                         i * kLaneHeaderBytes);
  }
  char* laneData(int i) const {
    return static_cast<char*>(base_) + kHeaderBytes + kLanes * kLaneHeaderBytes + i * kLaneBytes;
  }
  const std::string& name() const { return name_; }

  void ring() {
    hdr()->bell.fetch_add(1, std::memory_order_seq_cst);
    if (hdr()->sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&hdr()->bell);
  }

  // Whether the owner still answers: its device is open and its process
  // lives. Checked at most every 50 ms.
  bool ownerAlive();

 private:
  std::string name_;
  void* base_;
  std::mutex mu_;
  Clock::time_point nextCheck_{};
  bool alive_ = true;
  bool unlinked_ = false;
};

// Peer segments are mapped once per process and shared by every QP that
// talks to that port.
std::shared_ptr<Segment> mapPeer(const Gid& gid);

}  // namespace emu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
