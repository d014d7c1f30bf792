#include "nvlink_collectives.hpp"

#include "dependent_launch.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace fastcomm {
namespace nvlk {
namespace {

// Most blocks of a call (measured on 2 H200s): one-shot sends each unit to
// every peer and is fastest with half the blocks that two-shot, which sends
// each unit once, needs to keep enough stores in flight.
constexpr int kOneShotMaxBlocks = kMaxBlocks / 2;
constexpr int kTwoShotMaxBlocks = kMaxBlocks;
// Two-shot's block shape (measured on 2 and 4 H200s): narrow blocks on more
// SMs move a partition of 256 KiB-4 MiB faster than wide blocks on fewer,
// while a thread that walks more than 4 units of a partition falls behind.
constexpr int kTwoShotMinThreads = 128;
constexpr int kTwoShotUnitsPerThread = 4;
// The low-latency one-shot: a thread per unit, in blocks of 32 threads, so
// that more SMs issue the stores (measured on 2 and 4 H100s against 64 and
// 128: alike on 4 GPUs, the fastest on 2).
constexpr int kLowLatencyThreads = 32;
// Spins between looks at the host control block: reading mapped host memory
// costs a PCIe round trip, which a wait that is about to succeed must not pay.
constexpr uint32_t kPollEvery = 1024;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("fastcomm: NVLink collective: ") + what + ": " +
                             cudaGetErrorString(e));
  }
}

struct State {
  unsigned long long epoch;  // calls completed by this rank
  unsigned int done;         // blocks of the running call that finished
};

// Element bits and their float accumulator.
template <Elem E>
struct Num;
template <>
struct Num<Elem::F32> {
  using Raw = uint32_t;
  static __device__ __forceinline__ float load(Raw r) { return __uint_as_float(r); }
  static __device__ __forceinline__ Raw store(float v) { return __float_as_uint(v); }
};
template <>
struct Num<Elem::F16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float load(Raw r) { return __half2float(__ushort_as_half(r)); }
  static __device__ __forceinline__ Raw store(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};
template <>
struct Num<Elem::BF16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float load(Raw r) {
    return __bfloat162float(__ushort_as_bfloat16(r));
  }
  static __device__ __forceinline__ Raw store(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};

template <typename Raw>
union UnitOf {
  uint4 v;
  Raw e[kUnitBytes / sizeof(Raw)];
};

// NaN wins, as in torch's amin / amax.
template <Op O>
__device__ __forceinline__ float apply(float a, float b) {
  if constexpr (O == Op::Sum) {
    return a + b;
  } else if constexpr (O == Op::Min) {
    return (b < a || isnan(b)) ? b : a;
  } else {
    return (b > a || isnan(b)) ? b : a;
  }
}

// One unit's values, accumulated in float.
template <Elem E>
struct Acc {
  using N = Num<E>;
  using Raw = typename N::Raw;
  static constexpr int V = kUnitBytes / sizeof(Raw);
  float x[V];

  __device__ __forceinline__ void set(uint4 v) {
    UnitOf<Raw> u;
    u.v = v;
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = N::load(u.e[j]);
  }
  template <Op O>
  __device__ __forceinline__ void add(uint4 v) {
    UnitOf<Raw> u;
    u.v = v;
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = apply<O>(x[j], N::load(u.e[j]));
  }
  __device__ __forceinline__ uint4 get(float divisor) const {
    UnitOf<Raw> u;
#pragma unroll
    for (int j = 0; j < V; ++j) u.e[j] = N::store(divisor > 0.f ? x[j] / divisor : x[j]);
    return u.v;
  }
};

// Unit u (elements u * V .. u * V + V - 1 of n) of a caller's tensor: one
// 16-byte access where aligned and whole, else element by element (the
// missing tail of the last unit reads as zeros and is never stored).
template <typename Raw>
__device__ __forceinline__ uint4 loadUnit(const Raw* p, int64_t u, int64_t n, bool vec) {
  constexpr int V = kUnitBytes / sizeof(Raw);
  const int64_t first = u * V;
  if (vec && first + V <= n) return *reinterpret_cast<const uint4*>(p + first);
  UnitOf<Raw> x;
  x.v = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (first + j < n) x.e[j] = p[first + j];
  return x.v;
}

template <typename Raw>
__device__ __forceinline__ void storeUnit(Raw* p, int64_t u, int64_t n, bool vec, uint4 v) {
  constexpr int V = kUnitBytes / sizeof(Raw);
  const int64_t first = u * V;
  if (vec && first + V <= n) {
    *reinterpret_cast<uint4*>(p + first) = v;
    return;
  }
  UnitOf<Raw> x;
  x.v = v;
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (first + j < n) p[first + j] = x.e[j];
}

__device__ __forceinline__ uint64_t loadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void storeRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t globalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t* padSlot(void* buf, int64_t pad, int block, int from) {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(buf) + pad) + block * kMaxRanks + from;
}

__device__ __forceinline__ State* stateOf(void* buf) {
  return reinterpret_cast<State*>(static_cast<char*>(buf) + kStateOffset);
}

// Rank `from`'s slot number in rank `to`'s buffer for call `epoch`: slots
// are numbered by distance, so each rank's world - 1 peers have one in each
// of the two sets that calls alternate between.
__device__ __forceinline__ int64_t slotIndex(uint64_t epoch, int world, int from, int to) {
  const int64_t set = (epoch & 1) != 0 ? int64_t{world - 1} : 0;
  return set + (from - to + world) % world - 1;
}

__device__ __forceinline__ uint4* slotOf(void* buf, uint64_t epoch, const Args& a, int world,
                                         int from, int to) {
  return reinterpret_cast<uint4*>(static_cast<char*>(buf) + kDataOffset +
                                  slotIndex(epoch, world, from, to) * a.slotBytes);
}

// Rank `from`'s low-latency slot in rank `to`'s buffer, as 16-byte lines:
// unit u of the message is lines 2u and 2u + 1.
__device__ __forceinline__ uint4* lowLatencySlotOf(void* buf, uint64_t epoch, const Args& a,
                                                   int world, int from, int to) {
  return reinterpret_cast<uint4*>(static_cast<char*>(buf) + kDataOffset +
                                  2 * int64_t{world - 1} * a.slotBytes +
                                  slotIndex(epoch, world, from, to) * kLowLatencySlotBytes);
}

// The flag of call `epoch` in a low-latency line: never 0, so zeroed memory
// holds no call's data; it repeats after 2^32 - 1 calls.
__device__ __forceinline__ uint32_t lowLatencyFlag(uint64_t epoch) {
  return static_cast<uint32_t>(epoch % 0xffffffffULL) + 1;
}

// One line: two 8-byte words, each 4 bytes of data and the flag, stored and
// loaded as one 16-byte access (each 8-byte half arrives whole).
__device__ __forceinline__ void storeLine(uint4* p, uint32_t d0, uint32_t d1, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag),
               "r"(d1), "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 loadLine(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Waits until *slot >= target. False when it gave up: the host aborted the
// group, another wait already reported a timeout, or this one timed out (and
// reports it).
__device__ bool waitFor(const uint64_t* slot, uint64_t target, const Args& a, int peer) {
  if (loadAcquire(slot) >= target) return true;
  volatile HostCtl* ctl = a.ctl;
  const uint64_t start = globalTimer();
  for (uint32_t spins = 1;; ++spins) {
    if (loadAcquire(slot) >= target) return true;
    if (spins % kPollEvery == 0) {
      if (ctl->abort != 0 || ctl->report != 0) return false;
      if (globalTimer() - start > a.timeoutNs) {
        ctl->report = encodeReport(a.seq, a.captured != 0, a.collective, peer);
        __threadfence_system();
        return false;
      }
    }
  }
}

// Waits until the two lines of unit u from every peer carry `flag`, then puts
// peer r's unit in v[r] and `mine` in v[rank]. It polls all peers at once:
// lines that are already there cost one local round trip, not one per peer.
// False when it gave up, as waitFor (the report names the lowest peer still
// missing).
template <int W>
__device__ __forceinline__ bool waitLines(const Args& a, int world, uint64_t epoch, int64_t u,
                                          uint32_t flag, uint4 mine,
                                          uint4 (&v)[W > 0 ? W : kMaxRanks]) {
  constexpr int kR = W > 0 ? W : kMaxRanks;
  uint32_t pending = 0;
#pragma unroll
  for (int r = 0; r < kR; ++r)
    if ((W > 0 || r < world) && r != a.rank) pending |= 1u << r;
  volatile HostCtl* ctl = a.ctl;
  uint64_t start = 0;
  uint4 lo[kR], hi[kR];
  for (uint32_t spins = 0;; ++spins) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      if ((pending >> r) & 1u) {
        const uint4* lines = lowLatencySlotOf(a.bufs[a.rank], epoch, a, world, r, a.rank) + 2 * u;
        lo[r] = loadLine(lines);
        hi[r] = loadLine(lines + 1);
      }
    }
#pragma unroll
    for (int r = 0; r < kR; ++r)
      if (((pending >> r) & 1u) && lo[r].y == flag && lo[r].w == flag && hi[r].y == flag &&
          hi[r].w == flag)
        pending &= ~(1u << r);
    if (pending == 0) break;
    if (spins == 0) start = globalTimer();
    if (spins % kPollEvery == kPollEvery - 1) {
      if (ctl->abort != 0 || ctl->report != 0) return false;
      if (globalTimer() - start > a.timeoutNs) {
        ctl->report = encodeReport(a.seq, a.captured != 0, a.collective, __ffs(pending) - 1);
        __threadfence_system();
        return false;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kR; ++r)
    v[r] = r == a.rank ? mine : make_uint4(lo[r].x, lo[r].z, hi[r].x, hi[r].z);
  return true;
}

// Called by every thread of the block: tells the blocks of the same index on
// every peer that this block reached `pad` in call `epoch`, then waits until
// each of them did. The barrier orders this block's earlier writes before the
// peers' reads after it, and theirs before ours: the release store follows
// the block's writes (__syncthreads), the block's reads follow the acquire
// loads (__syncthreads_and). False in every thread when the block gives up.
__device__ bool barrier(const Args& a, int64_t pad, uint64_t epoch, int world) {
  __syncthreads();
  bool ok = true;
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < world && peer != a.rank) {
    storeRelease(padSlot(a.bufs[peer], pad, blockIdx.x, a.rank), epoch + 1);
    ok = waitFor(padSlot(a.bufs[a.rank], pad, blockIdx.x, peer), epoch + 1, a, peer);
  }
  return __syncthreads_and(ok ? 1 : 0) != 0;
}

__device__ __forceinline__ uint64_t readEpoch(const Args& a) {
  return *reinterpret_cast<volatile unsigned long long*>(&stateOf(a.bufs[a.rank])->epoch);
}

// The last block to finish advances the call counter: every block read it
// before it counted itself done.
__device__ void finish(const Args& a, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    State* s = stateOf(a.bufs[a.rank]);
    if (atomicAdd(&s->done, 1u) == gridDim.x - 1) {
      *reinterpret_cast<volatile unsigned int*>(&s->done) = 0;
      *reinterpret_cast<volatile unsigned long long*>(&s->epoch) = epoch + 1;
    }
  }
}

__device__ __forceinline__ bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kUnitBytes == 0;
}

// What every thread of a call starts from: the group size (W > 0: a
// compile-time constant), the call counter, the units of `unitElems`
// elements the call covers (each rank's part, or its partition's source),
// and this thread's first unit and stride through them.
struct Share {
  int world;
  uint64_t epoch;
  int64_t units, first, stride;
};

// Every collective kernel is a programmatic dependent of the kernel ahead of
// it on the stream (launchAfter): it waits here for that kernel's memory
// (the call counter, the caller's input) and lets the next collective's
// blocks start at once, to wait in turn.
template <int W>
__device__ __forceinline__ Share shareOf(const Args& a, int unitElems) {
  griddep_wait();
  griddep_launch_dependents();
  return Share{W > 0 ? W : a.world, readEpoch(a), (a.n + unitElems - 1) / unitElems,
               int64_t{blockIdx.x} * blockDim.x + threadIdx.x, int64_t{gridDim.x} * blockDim.x};
}

// Every rank's unit v[r], reduced in rank order.
template <Elem E, Op O, int W>
__device__ __forceinline__ uint4 combine(const uint4 (&v)[W > 0 ? W : kMaxRanks], int world,
                                         float divisor) {
  constexpr int kR = W > 0 ? W : kMaxRanks;
  Acc<E> acc;
  acc.set(v[0]);
#pragma unroll
  for (int r = 1; r < kR; ++r)
    if (W > 0 || r < world) acc.template add<O>(v[r]);
  return acc.get(divisor);
}

// Reduces unit u of this rank's input with unit `at` of the peers' slots,
// in rank order.
template <Elem E, Op O, int W>
__device__ __forceinline__ uint4 reduceUnit(const Args& a, int world, uint64_t epoch,
                                            const typename Acc<E>::Raw* in, bool inVec, int64_t u,
                                            int64_t at) {
  constexpr int kR = W > 0 ? W : kMaxRanks;
  void* mine = a.bufs[a.rank];
  uint4 v[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    if (W == 0 && r >= world) continue;
    v[r] = r == a.rank ? loadUnit(in, u, a.n, inVec) : slotOf(mine, epoch, a, world, r, a.rank)[at];
  }
  return combine<E, O, W>(v, world, a.divisor);
}

// One unit per peer q: load(q, v) fetches it (false: q has none), store(q,
// v) writes it. Every load is issued before the first store: the compiler
// cannot tell a store from a later load's source, so a loop of load-store
// pairs would wait out each load's latency in turn.
template <int W, typename Load, typename Store>
__device__ __forceinline__ void forEachPeer(int world, int rank, Load load, Store store) {
  constexpr int kR = W > 0 ? W : kMaxRanks;
  uint4 v[kR];
  bool has[kR];
#pragma unroll
  for (int q = 0; q < kR; ++q) has[q] = (W > 0 || q < world) && q != rank && load(q, v[q]);
#pragma unroll
  for (int q = 0; q < kR; ++q)
    if (has[q]) store(q, v[q]);
}

// W > 0: the world size as a constant; 0: a.world (at most kMaxRanks).
template <Elem E, Op O, int W>
__global__ void __launch_bounds__(kThreads) oneShot(Args a) {
  using Raw = typename Acc<E>::Raw;
  constexpr int V = Acc<E>::V;
  const auto [world, epoch, units, first, stride] = shareOf<W>(a, V);
  const Raw* in = static_cast<const Raw*>(a.in);
  const bool inVec = aligned(a.in), outVec = aligned(a.out);
  for (int64_t u = first; u < units; u += stride) {
    const uint4 v = loadUnit(in, u, a.n, inVec);
    for (int q = 0; q < world; ++q)
      if (q != a.rank) slotOf(a.bufs[q], epoch, a, world, a.rank, q)[u] = v;
  }
  if (barrier(a, kArrivePadOffset, epoch, world)) {
    for (int64_t u = first; u < units; u += stride)
      storeUnit(static_cast<Raw*>(a.out), u, a.n, outVec,
                reduceUnit<E, O, W>(a, world, epoch, in, inVec, u, u));
  }
  finish(a, epoch);
}

// One-shot up to lowLatencyMaxBytes(world): no barrier; a thread's unit goes to
// every peer as two flagged lines, and the thread reduces as soon as every
// peer's lines for the same unit carry this call's flag. A rank is at most
// one call ahead of a peer here too: it cannot finish a call before every
// peer has sent that call's lines, which each peer does only after it
// finished the call before.
template <Elem E, Op O, int W>
__global__ void __launch_bounds__(kThreads) oneShotLowLatency(Args a) {
  using Raw = typename Acc<E>::Raw;
  constexpr int V = Acc<E>::V;
  constexpr int kR = W > 0 ? W : kMaxRanks;
  const auto [world, epoch, units, first, stride] = shareOf<W>(a, V);
  const uint32_t flag = lowLatencyFlag(epoch);
  const Raw* in = static_cast<const Raw*>(a.in);
  const bool inVec = aligned(a.in), outVec = aligned(a.out);
  for (int64_t u = first; u < units; u += stride) {
    const uint4 v = loadUnit(in, u, a.n, inVec);
    for (int q = 0; q < world; ++q) {
      if (q == a.rank) continue;
      uint4* lines = lowLatencySlotOf(a.bufs[q], epoch, a, world, a.rank, q) + 2 * u;
      storeLine(lines, v.x, v.y, flag);
      storeLine(lines + 1, v.z, v.w, flag);
    }
  }
  for (int64_t u = first; u < units; u += stride) {
    uint4 v[kR];
    if (!waitLines<W>(a, world, epoch, u, flag, loadUnit(in, u, a.n, inVec), v)) break;
    storeUnit(static_cast<Raw*>(a.out), u, a.n, outVec, combine<E, O, W>(v, world, a.divisor));
  }
  finish(a, epoch);
}

// Partition q holds units [q * part, min(units, (q + 1) * part)); a block
// handles the same offsets i inside every partition. A peer's slot holds, at
// [0, part), its partition of this rank's input and, at [part, 2 part), its
// reduced partition.
template <Elem E, Op O, int W>
__global__ void __launch_bounds__(kThreads) twoShot(Args a) {
  using Raw = typename Acc<E>::Raw;
  constexpr int V = Acc<E>::V;
  // Named copies: lambdas capture no structured bindings in C++17.
  const Share sh = shareOf<W>(a, V);
  const int world = sh.world;
  const uint64_t epoch = sh.epoch;
  const int64_t units = sh.units, first = sh.first, stride = sh.stride;
  const int64_t part = (units + world - 1) / world;
  const Raw* in = static_cast<const Raw*>(a.in);
  Raw* out = static_cast<Raw*>(a.out);
  const bool inVec = aligned(a.in), outVec = aligned(a.out);
  auto has = [part, units](int q, int64_t i) { return q * part + i < units; };
  // Partition q of the input to rank q.
  for (int64_t i = first; i < part; i += stride) {
    forEachPeer<W>(
        world, a.rank,
        [&](int q, uint4& v) {
          if (!has(q, i)) return false;
          v = loadUnit(in, q * part + i, a.n, inVec);
          return true;
        },
        [&](int q, const uint4& v) { slotOf(a.bufs[q], epoch, a, world, a.rank, q)[i] = v; });
  }
  bool ok = barrier(a, kArrivePadOffset, epoch, world);
  if (ok) {
    // This rank's partition, reduced, to the output and to every peer.
    const int64_t base = a.rank * part;
    for (int64_t i = first; i < part && has(a.rank, i); i += stride) {
      const uint4 res = reduceUnit<E, O, W>(a, world, epoch, in, inVec, base + i, i);
      storeUnit(out, base + i, a.n, outVec, res);
      for (int q = 0; q < world; ++q)
        if (q != a.rank) slotOf(a.bufs[q], epoch, a, world, a.rank, q)[part + i] = res;
    }
    ok = barrier(a, kReducedPadOffset, epoch, world);
  }
  if (ok) {
    // The peers' reduced partitions from this rank's slots to the output.
    for (int64_t i = first; i < part; i += stride) {
      forEachPeer<W>(
          world, a.rank,
          [&](int q, uint4& v) {
            if (!has(q, i)) return false;
            v = slotOf(a.bufs[a.rank], epoch, a, world, q, a.rank)[part + i];
            return true;
          },
          [&](int q, const uint4& v) { storeUnit(out, q * part + i, a.n, outVec, v); });
    }
  }
  finish(a, epoch);
}

// Rank q's chunk of the input goes to rank q; each rank reduces its own.
template <Elem E, Op O, int W>
__global__ void __launch_bounds__(kThreads) reduceScatter(Args a) {
  using Raw = typename Acc<E>::Raw;
  constexpr int V = Acc<E>::V;
  const auto [world, epoch, units, first, stride] = shareOf<W>(a, V);
  const Raw* in = static_cast<const Raw*>(a.in);
  for (int q = 0; q < world; ++q) {
    if (q == a.rank) continue;
    const Raw* chunk = in + q * a.n;
    const bool vec = aligned(chunk);
    uint4* theirs = slotOf(a.bufs[q], epoch, a, world, a.rank, q);
    for (int64_t u = first; u < units; u += stride) theirs[u] = loadUnit(chunk, u, a.n, vec);
  }
  if (barrier(a, kArrivePadOffset, epoch, world)) {
    const Raw* own = in + a.rank * a.n;
    const bool ownVec = aligned(own), outVec = aligned(a.out);
    for (int64_t u = first; u < units; u += stride)
      storeUnit(static_cast<Raw*>(a.out), u, a.n, outVec,
                reduceUnit<E, O, W>(a, world, epoch, own, ownVec, u, u));
  }
  finish(a, epoch);
}

// Bytes: this rank's input to every peer, then every rank's part into place.
__global__ void __launch_bounds__(kThreads) allGather(Args a) {
  const auto [world, epoch, units, first, stride] = shareOf<0>(a, kUnitBytes);
  const auto* in = static_cast<const uint8_t*>(a.in);
  const bool inVec = aligned(a.in);
  for (int64_t u = first; u < units; u += stride) {
    const uint4 v = loadUnit(in, u, a.n, inVec);
    for (int q = 0; q < world; ++q)
      if (q != a.rank) slotOf(a.bufs[q], epoch, a, world, a.rank, q)[u] = v;
  }
  if (barrier(a, kArrivePadOffset, epoch, world)) {
    for (int q = 0; q < world; ++q) {
      uint8_t* dst = static_cast<uint8_t*>(a.out) + q * a.n;
      const bool vec = aligned(dst);
      const uint4* theirs = slotOf(a.bufs[a.rank], epoch, a, world, q, a.rank);
      for (int64_t u = first; u < units; u += stride)
        storeUnit(dst, u, a.n, vec, q == a.rank ? loadUnit(in, u, a.n, inVec) : theirs[u]);
    }
  }
  finish(a, epoch);
}

struct Tokens {
  uint64_t v[kMaxRanks];
};

__global__ void probeKernel(Args a, Tokens t) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < a.world && peer != a.rank) {
    storeRelease(
        reinterpret_cast<uint64_t*>(static_cast<char*>(a.bufs[peer]) + kProbeOffset) + a.rank,
        t.v[peer]);
  }
}

template <Elem E>
constexpr int esizeOf() {
  return static_cast<int>(sizeof(typename Num<E>::Raw));
}

// Launches kernel(a) as a programmatic dependent of the kernel ahead of it
// on the stream, so that its launch overlaps that kernel's tail; in plain
// stream order before compute capability 9.0, which has no such launches
// (the kernels' griddepcontrol instructions are compiled out there).
void launchAfter(void (*kernel)(Args), const Grid& g, cudaStream_t s, const Args& a) {
  bool pdl_ok = false;
  check(dependent_launch_supported(&pdl_ok), "compute capability of the current device");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(g.blocks));
  config.blockDim = dim3(static_cast<unsigned>(g.threads));
  config.stream = s;
  cudaLaunchAttribute pdl = programmatic_dependent_launch();
  config.attrs = &pdl;
  config.numAttrs = pdl_ok ? 1 : 0;
  // As after a <<<>>> launch, a failed launch is read (and so cleared) as the
  // thread's last error: it must not surface at someone else's next check.
  static_cast<void>(cudaLaunchKernelEx(&config, kernel, a));
  check(cudaGetLastError(), "kernel launch");
}

template <Elem E, Op O, int W>
void launchWorld(Algo algo, const Args& a, cudaStream_t s) {
  const Grid g = gridFor(algo, a.n, esizeOf<E>(), a.world);
  switch (algo) {
    case Algo::OneShot:
      if (a.n * esizeOf<E>() <= lowLatencyMaxBytes(a.world))
        return launchAfter(oneShotLowLatency<E, O, W>, g, s, a);
      return launchAfter(oneShot<E, O, W>, g, s, a);
    case Algo::TwoShot:
      return launchAfter(twoShot<E, O, W>, g, s, a);
    case Algo::ReduceScatter:
      return launchAfter(reduceScatter<E, O, W>, g, s, a);
  }
}

template <Elem E, Op O>
void launchOp(Algo algo, const Args& a, cudaStream_t s) {
  switch (a.world) {
    case 2:
      return launchWorld<E, O, 2>(algo, a, s);
    case 4:
      return launchWorld<E, O, 4>(algo, a, s);
    case 8:
      return launchWorld<E, O, 8>(algo, a, s);
    default:
      return launchWorld<E, O, 0>(algo, a, s);
  }
}

template <Elem E>
void launchElem(Op op, Algo algo, const Args& a, cudaStream_t s) {
  switch (op) {
    case Op::Sum:
      return launchOp<E, Op::Sum>(algo, a, s);
    case Op::Min:
      return launchOp<E, Op::Min>(algo, a, s);
    case Op::Max:
      return launchOp<E, Op::Max>(algo, a, s);
  }
}

template <Elem E, Op O, int W>
void loadWorld() {
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, oneShot<E, O, W>), "loading the one-shot kernel");
  check(cudaFuncGetAttributes(&attr, oneShotLowLatency<E, O, W>),
        "loading the low-latency one-shot kernel");
  check(cudaFuncGetAttributes(&attr, twoShot<E, O, W>), "loading the two-shot kernel");
  check(cudaFuncGetAttributes(&attr, reduceScatter<E, O, W>), "loading the reduce_scatter kernel");
}

template <Elem E, Op O>
void loadOp() {
  loadWorld<E, O, 2>();
  loadWorld<E, O, 4>();
  loadWorld<E, O, 8>();
  loadWorld<E, O, 0>();
}

template <Elem E>
void loadElem() {
  loadOp<E, Op::Sum>();
  loadOp<E, Op::Min>();
  loadOp<E, Op::Max>();
}

void checkArgs(const Args& args) {
  if (args.world < 2 || args.world > kMaxRanks || args.n <= 0) {
    throw std::runtime_error("fastcomm: NVLink collective: bad arguments (world " +
                             std::to_string(args.world) + ", " + std::to_string(args.n) +
                             " elements)");
  }
}

}  // namespace

Grid gridFor(Algo algo, int64_t n, int esize, int world) {
  const int64_t units = (n * esize + kUnitBytes - 1) / kUnitBytes;
  if (algo == Algo::OneShot && n * esize <= lowLatencyMaxBytes(world)) {
    const int64_t blocks = (units + kLowLatencyThreads - 1) / kLowLatencyThreads;
    return {static_cast<int>(std::clamp<int64_t>(blocks, 1, kMaxBlocks)), kLowLatencyThreads};
  }
  if (algo != Algo::TwoShot) {
    // One-shot, all_gather and reduce_scatter send each unit to every peer
    // (or their own chunk of it) with no second phase.
    const int64_t blocks = (units + kThreads - 1) / kThreads;
    return {static_cast<int>(std::clamp<int64_t>(blocks, 1, kOneShotMaxBlocks)), kThreads};
  }
  // Two-shot spreads a partition over as many SMs as it has blocks before
  // it widens them: blocks of kTwoShotMinThreads until every block is in use,
  // then wider blocks so that no thread walks more than kTwoShotUnitsPerThread
  // units of a partition.
  const int64_t part = (units + world - 1) / world;
  const int64_t perWidth = int64_t{kTwoShotMaxBlocks} * kTwoShotUnitsPerThread * kTwoShotMinThreads;
  const int64_t threads =
      std::clamp<int64_t>((part + perWidth - 1) / perWidth, 1, kThreads / kTwoShotMinThreads) *
      kTwoShotMinThreads;
  const int64_t blocks = (part + threads - 1) / threads;
  return {static_cast<int>(std::clamp<int64_t>(blocks, 1, kTwoShotMaxBlocks)),
          static_cast<int>(threads)};
}

void reduce(Elem elem, Op op, Algo algo, const Args& args, cudaStream_t stream) {
  checkArgs(args);
  switch (elem) {
    case Elem::F32:
      launchElem<Elem::F32>(op, algo, args, stream);
      break;
    case Elem::F16:
      launchElem<Elem::F16>(op, algo, args, stream);
      break;
    case Elem::BF16:
      launchElem<Elem::BF16>(op, algo, args, stream);
      break;
  }
}

void allgather(const Args& args, cudaStream_t stream) {
  checkArgs(args);
  const Grid g = gridFor(Algo::OneShot, args.n, 1, args.world);
  launchAfter(allGather, g, stream, args);
}

void writeProbes(const Args& args, const uint64_t (&tokens)[kMaxRanks], cudaStream_t stream) {
  Tokens t;
  for (int r = 0; r < kMaxRanks; ++r) t.v[r] = tokens[r];
  probeKernel<<<1, kMaxRanks, 0, stream>>>(args, t);
  check(cudaGetLastError(), "probe kernel launch");
}

void preload() {
  loadElem<Elem::F32>();
  loadElem<Elem::F16>();
  loadElem<Elem::BF16>();
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, probeKernel), "loading the probe kernel");
  check(cudaFuncGetAttributes(&attr, allGather), "loading the all_gather kernel");
}

}  // namespace nvlk
}  // namespace fastcomm
