// Kernels of the collectives over peer memory inside a node
// (intra/nvlink/): all_reduce, all_gather and reduce_scatter; every rank of the group owns one
// registered device buffer that every other rank has mapped, and a kernel reads and writes the
// peers' buffers directly over NVLink. Host-callable launchers with plain types, so this header
// needs no ATen.
//
// One call = one kernel, and every access to a peer is a store: a store goes
// out without waiting for an answer, where a load over NVLink waits a round
// trip. A rank's buffer holds, per call, one slot per peer that only that
// peer writes. Each block pushes its share of the input into the peers'
// slots, tells every peer's same-numbered block that its share is there (a
// signal pad slot, st.release.sys) and waits for theirs (ld.acquire.sys); then
// - one-shot: reduces its own input and the peers' slots into the output;
//   up to lowLatencyMaxBytes(world) it sends no signal at all: each 8-byte word
//   it stores into a peer's low-latency slot holds 4 bytes of data beside
//   the call's flag, so a reader that sees the flag in both words of a
//   16-byte line has the data (NCCL's LL protocol), and a call costs one
//   NVLink crossing instead of the store-release-acquire round trip;
// - two-shot: pushes only partition q of the input to rank q, reduces this
//   rank's partition (1/world of the elements), stores the result into the
//   output and into every peer's slot, signals again, and copies the peers'
//   reduced partitions from its own slots into the output (a thread loads
//   its unit of every peer before it stores any);
// - all_gather: copies its own input and the peers' slots into the output;
// - reduce_scatter: pushes chunk q of the input to rank q and reduces its own
//   chunk and the peers' slots into the output.
// Every rank sums in rank order, so all hold the same bits. Shares are
// 16-byte units dealt to blocks and threads by index alone, so the units a
// block pushes are the units the same block index reads on the peer,
// whatever the alignment of the caller's tensors.
//
// Signals are counters: call e writes e + 1 and waits for a value >= e + 1,
// so no slot is ever reset or written with overlapping stores. The call
// counter (epoch) lives in the buffer's private state, read by every block
// and advanced by the last block to finish: a CUDA graph replays the same
// kernel and still advances it. Calls alternate between two sets of slots: a
// rank can be at most one call ahead of a peer (each call's first signal
// waits for every peer to have started it, and a rank's calls run one after
// another), so the slots it writes are never ones a peer still reads.
//
// A wait that outlasts `timeoutNs` writes the op's sequence number and the
// peer it waited for into the mapped host control block and gives up; every
// wait also gives up once the host set `abort` or any report is there.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#ifdef __CUDACC__
#define FASTCOMM_NVLK_HD __host__ __device__
#else
#define FASTCOMM_NVLK_HD
#endif

namespace fastcomm {
namespace nvlk {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 128;  // signal slots per pad and peer
constexpr int kThreads = 512;
constexpr int kUnitBytes = 16;

// Offsets in a rank's registered buffer. Pads: uint64 slots
// [block][sending rank], written by the peers.
constexpr int64_t kArrivePadOffset = 0;
constexpr int64_t kReducedPadOffset = int64_t{kMaxBlocks} * kMaxRanks * 8;
// This rank's own state (call counter, finished blocks); peers never touch it.
constexpr int64_t kStateOffset = 2 * kReducedPadOffset;
// One uint64 per writing rank, written once at set-up to prove peer access.
constexpr int64_t kProbeOffset = kStateOffset + 256;
constexpr int64_t kDataOffset = 65536;
static_assert(kProbeOffset + kMaxRanks * 8 <= kDataOffset, "buffer header overlaps its data");

// One-shot all_reduces up to lowLatencyMaxBytes(world) use the low-latency
// slots: half of each line is flags, so a slot holds twice the message. The
// flags double what a rank sends to world - 1 peers, so beyond the 2 and 4
// GPUs measured (H100, H200) the range is halved.
constexpr int64_t kLowLatencyMaxBytes = 64 * 1024;
constexpr int64_t kLowLatencySlotBytes = 2 * kLowLatencyMaxBytes;
inline int64_t lowLatencyMaxBytes(int world) {
  return world <= 4 ? kLowLatencyMaxBytes : kLowLatencyMaxBytes / 2;
}

// Bytes of one registered buffer of a group of `world` ranks with slots of
// `slotBytes` (a multiple of kUnitBytes): two sets of world - 1 slots, then
// two sets of world - 1 low-latency slots (used by nothing else, so a stale
// line holds a flag of an earlier call, never another kernel's data).
inline int64_t bufferBytes(int world, int64_t slotBytes) {
  return kDataOffset + 2 * int64_t{world - 1} * (slotBytes + kLowLatencySlotBytes);
}

// The largest all_reduce of each kernel in slots of `slotBytes`: one-shot
// keeps a peer's whole input in its slot, two-shot a peer's share of this
// rank's partition beside that peer's reduced partition.
inline int64_t oneShotMaxBytes(int64_t slotBytes) { return slotBytes; }
inline int64_t twoShotMaxBytes(int world, int64_t slotBytes) {
  return int64_t{world} * (slotBytes / (2 * kUnitBytes)) * kUnitBytes;
}

enum class Elem : int { F32, F16, BF16 };
enum class Op : int { Sum, Min, Max };
// The reduction kernels (all_gather copies bytes and has one kernel).
enum class Algo : int { OneShot, TwoShot, ReduceScatter };

// Mapped pinned host memory shared by the host and this group's kernels.
struct HostCtl {
  uint64_t abort;   // nonzero: waiting kernels give up (the group was aborted)
  uint64_t report;  // 0, or the first wait that timed out: encodeReport()
};

// The collective a kernel runs, as named in a timeout report.
enum class Collective : int { AllReduce, AllGather, ReduceScatter };

// A report: the op's sequence number, whether it was captured into a CUDA
// graph, the collective and the rank that was waited for.
FASTCOMM_NVLK_HD inline uint64_t encodeReport(uint64_t seq, bool captured, int collective,
                                              int peer) {
  return (seq << 16) | (static_cast<uint64_t>(collective) << 9) | (captured ? 0x100u : 0u) |
         static_cast<uint64_t>(peer + 1);
}
inline uint64_t reportSeq(uint64_t report) { return report >> 16; }
inline bool reportCaptured(uint64_t report) { return (report & 0x100u) != 0; }
inline Collective reportCollective(uint64_t report) {
  return static_cast<Collective>((report >> 9) & 0x3u);
}
inline int reportPeer(uint64_t report) { return static_cast<int>(report & 0xffu) - 1; }

// all_reduce: `in` and `out` hold n elements. all_gather: `in` holds n
// bytes, `out` world x n. reduce_scatter: `in` holds world x n elements,
// `out` n. Any alignment; `out` may overlap `in` where this rank's own part
// of the larger one is the smaller one (or, for all_reduce, is `in`).
struct Args {
  void* bufs[kMaxRanks];  // every rank's registered buffer, as mapped here
  const void* in;
  void* out;
  int64_t n;
  int64_t slotBytes;  // bytes of each slot (n fits it: oneShotMaxBytes, twoShotMaxBytes)
  int rank;
  int world;      // 2..kMaxRanks
  float divisor;  // > 0: the sum is divided by it (AVG)
  HostCtl* ctl;   // device address of the control block
  uint64_t seq;   // reported on a timeout
  uint64_t timeoutNs;
  int captured;    // reported on a timeout
  int collective;  // Collective, reported on a timeout
};

// The grid the kernel of `algo` runs for `n` elements of `esize` bytes over
// `world` ranks (a function of these alone: every rank launches the same grid).
struct Grid {
  int blocks;
  int threads;
};
Grid gridFor(Algo algo, int64_t n, int esize, int world);

// Issues the all_reduce (OneShot, TwoShot) or reduce_scatter on `stream`.
// Throws std::runtime_error when the launch fails.
void reduce(Elem elem, Op op, Algo algo, const Args& args, cudaStream_t stream);

// Issues the all_gather of args.n bytes per rank on `stream`. Throws
// std::runtime_error when the launch fails.
void allgather(const Args& args, cudaStream_t stream);

// Writes tokens[r] into rank r's probe slot of this rank (every r but
// args.rank) through the mappings in args.bufs, with system-scope release
// stores, on `stream`. Throws std::runtime_error when the launch fails.
void writeProbes(const Args& args, const uint64_t (&tokens)[kMaxRanks], cudaStream_t stream);

// Loads every kernel above into the current device's context (no lazy
// loading at a first launch inside a graph capture). Throws
// std::runtime_error.
void preload();

}  // namespace nvlk
}  // namespace fastcomm
