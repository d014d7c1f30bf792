// Hopper (sm_90a) GEMM for float16 / bfloat16: TMA loads, wgmma, a multi-stage
// shared-memory pipeline, warp-specialised producer / consumers, persistent
// tile scheduling, and the epilogue (bias, activation, cast) fused into the
// store. Included only by the instantiation files
// kernels/matmul_sm90_{coop,pingpong}_{bf16,f16}.cu; the dispatcher is
// kernels/matmul_sm90.cu, the design and measurements are in docs/matmul.md.
//
// One CTA per SM, 384 threads = 3 warpgroups:
//  * warpgroup 0, the producer: gives registers back (setmaxnreg.dec) and one
//    thread walks the CTA's tiles and K-slices in order, waiting for a free
//    stage ("empty" mbarrier) and issuing the TMA copies of the slice's A and
//    B tiles into it, which complete the stage's "full" mbarrier with their
//    byte count;
//  * warpgroups 1 and 2, the consumers (setmaxnreg.inc), in one of two
//    schedules (template parameter S):
//    - cooperative (Sched::kCoop): both work on the same 128 x BN tile, 64
//      rows each (BN/2 float32 accumulators per thread, one m64nBNk16 per k16
//      step); per K-slice they wait for "full", issue the MMAs, and release
//      the previous slice's stage once the wgmma reading it has retired
//      (wgmma.wait_group 1: one batch always in flight). The epilogue stores
//      straight from registers, or (tma_store) through two 8 KB staging
//      buffers per warpgroup and TMA stores, so that the global writes drain
//      while the next tile's MMAs run;
//    - ping-pong (Sched::kPingpong): each warpgroup owns a whole 128 x 128
//      tile (two m64n128k16 per k16 step, 128 accumulators per thread), and
//      the two take the CTA's tiles in turn. An "order" mbarrier pair hands the
//      tensor cores from one to the other once a warpgroup has issued its
//      last MMA, so one warpgroup's epilogue (bias, activation, stores) runs
//      under the other one's main loop instead of stalling the tensor cores.
//  * Tiles: 128 x 256 (4 stages of 48 KB) or 128 x 128 (6 stages of 32 KB),
//    BK = 64 (one 128-byte swizzle row). Tile order: groups of 2048 rows
//    (raster by rows) or 2048 columns (raster by columns), the dispatcher
//    picking the one that re-reads fewer bytes from DRAM.
//  * Layouts: K-major operands are one TMA box per tile (128B swizzle, the
//    canonical K-major wgmma layout, descriptor advanced by 32 bytes per
//    k16 step). M-/N-major operands (e.g. b of matmul(a, b) with b [K, N]
//    row-major) are loaded as 64-wide boxes along M/N and consumed with the
//    wgmma transpose flag (canonical MN-major 128B-swizzle layout: LBO = 8 KB
//    between 64-element M/N chunks, SBO = 1 KB between 8-row K groups).
//  * Edges: TMA zero-fills out-of-range rows / columns of a box (any M, N,
//    K); the direct epilogue masks its stores, TMA stores clip at the edges.
#pragma once

#include <cuda.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <mutex>
#include <type_traits>

#include "common/logging.hpp"
#include "matmul_device.cuh"
#include "matmul_sm90_launch.h"
#include "matmul_wgmma_ops.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FASTCOMM_SM90A_DEVICE 1
#else
#define FASTCOMM_SM90A_DEVICE 0
#endif

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

using namespace detail;

constexpr int kBM = 128;                     // tile rows
constexpr int kBK = 64;                      // K per stage: 64 x 2 bytes = one 128-byte swizzle row
constexpr int kThreads = 384;                // producer + 2 consumer warpgroups
constexpr int kEpiChunkBytes = 64 * 64 * 2;  // TMA-store epilogue: 64 x 64 output chunks

// OFFLOAD: the cooperative 128 x 256 kernel with the "offload" epilogue
// (epilogue_offload_write / epilogue_warps_offload below): 3 stages and one
// whole-tile output buffer instead of 4 stages and 4 chunk buffers.
template <Sched S, int BN, bool OFFLOAD = false>
struct Cfg {
  static_assert(BN == 256 || BN == 128, "BN must be 128 or 256");
  static_assert(S == Sched::kCoop || BN == 128, "the ping-pong tile is 128 x 128");
  static_assert(!OFFLOAD || (S == Sched::kCoop && BN == 256),
                "the offload epilogue exists for the cooperative 128 x 256 kernel only");
  static constexpr bool PINGPONG = S == Sched::kPingpong;
  static constexpr int BM = kBM;
  // 4 x 48 KB (cooperative 128 x 256), 6 x 32 KB (128 x 128); 3 x 48 KB with
  // the offload epilogue, whose 64 KB tile buffer takes the fourth stage's
  // place.
  static constexpr int STAGES = OFFLOAD ? 3 : BN == 256 ? 4 : 6;
  static constexpr int A_BYTES = BM * kBK * 2;  // 16 KB
  static constexpr int B_BYTES = BN * kBK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  // Staging of the TMA-store epilogue (cooperative only): two chunk buffers
  // per consumer warpgroup, so that one chunk is written while the previous
  // one is being stored.
  // Offload: the whole 128 x 256 output tile, 8 chunks of 64 x 64 (chunk
  // 4 w + c holds rows 64 w.., columns 64 c.. of the tile), so that the
  // consumers can hand a tile over and go on while the epilogue warps finish it.
  static constexpr int EPI_BYTES = OFFLOAD    ? 8 * kEpiChunkBytes
                                   : PINGPONG ? 0
                                              : 2 * 2 * kEpiChunkBytes;
  // + 1 KB slack for the 1024-byte alignment of 128B-swizzled tiles
  // (offload: 1 + 3 x 48 + 64 = 209 KB).
  static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + EPI_BYTES;
  // The static part (the mbarriers, padded by the 1024-byte alignment of the
  // dynamic array) reads 2 KB in cuobjdump's resource usage: the cooperative
  // kernels fill the 227 KB per block exactly.
  static_assert(SMEM_BYTES + 2048 <= 227 * 1024, "over the sm_90 shared-memory limit per block");
  static constexpr int BOX_BYTES = 64 * 64 * 2;  // one 64 x 64 box (M/N-major operands)
  // Warps that read a stage and arrive on its "empty" barrier: both consumer
  // warpgroups (cooperative) or the one that owns the tile (ping-pong).
  static constexpr int STAGE_READERS = PINGPONG ? 4 : 8;
  // m64 sub-tiles in a consumer warpgroup's accumulator: 64 rows (cooperative)
  // or the whole 128-row tile (ping-pong).
  static constexpr int MSUB = PINGPONG ? BM / 64 : 1;
  // Warpgroup 0 (the producer thread, and with OFFLOAD the epilogue warps).
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;  // 128 x (40 + 2 x 232) <= 64K registers
  static_assert(128 * (PRODUCER_REGS + 2 * CONSUMER_REGS) <= 65536, "register file");
};

// Run-time options of one launch (by value, in the kernel parameters).
struct KernelOpts {
  int raster_n = 0;  // tile order: groups of columns (1) or of rows (0)
  // Tile columns (raster n) or tile rows (raster m) per group.
  int group_tiles = 1;
  // Cooperative epilogue through TMA stores (tma_c is valid): 1
  // epilogue_tma, 2 the offload epilogue (set for, and only for, the
  // kernels instantiated with OFFLOAD).
  int tma_store = 0;
};

// ---- PTX wrappers (sm_90a) ---------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void mbar_init_fence() {
#if FASTCOMM_SM90A_DEVICE
  // Makes the initialised barriers visible to the async proxy (TMA).
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// Blocks until the phase of `bar` with the given parity has completed. A
// freshly initialised barrier counts as having completed the phase of
// parity 1, so waiting for parity 1 passes at once.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if FASTCOMM_SM90A_DEVICE
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// 2-D TMA copy of the box at (c0 = inner coordinate, c1 = outer coordinate)
// into shared memory at dst, completing its bytes on the mbarrier bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}

// 2-D TMA store of the box at (c0, c1) from shared memory at src; elements
// outside the tensor are not written. Tracked by this thread's bulk groups.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(src)
      : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit_group() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's bulk store groups are still reading
// their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}

// Waits until all of this thread's bulk store groups have completed.
__device__ __forceinline__ void bulk_wait_all() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Makes this thread's ordinary shared-memory writes visible to the async
// proxy (the TMA engine that reads them next).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Barrier among `count` threads on hardware barrier `id` (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ void ld_shared_v4(uint32_t addr, uint32_t (&v)[4]) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
#endif
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, const uint32_t (&v)[4]) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]), "r"(v[1]),
               "r"(v[2]), "r"(v[3])
               : "memory");
#endif
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

// Keeps the compiler from moving accumulator reads / writes across the
// asynchronous wgmma (the registers are in use until wgmma.wait_group).
template <int MS, int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[MS][N]) {
#pragma unroll
  for (int m = 0; m < MS; ++m) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[m][i])::"memory");
  }
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle, kept as its two
// 32-bit halves so that the main loop moves it over stages and k16 steps with
// one 32-bit add to `lo` (desc_advance) instead of rebuilding it per wgmma:
//   lo bits  0-13: start address >> 4
//   lo bits 16-29: leading-dimension byte offset >> 4
//   hi bits  0-13: stride-dimension byte offset >> 4
//   hi bits 30-31: swizzle mode (1 = 128B)
struct DescPair {
  uint32_t lo, hi;
};

__device__ __forceinline__ DescPair smem_desc_pair(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return {((addr & 0x3FFFFu) >> 4) | (((lbo & 0x3FFFFu) >> 4) << 16),
          ((sbo & 0x3FFFFu) >> 4) | (1u << 30)};
}

// `d` advanced by `bytes` (a multiple of 16). Only the 14-bit start-address
// field changes: a CTA's shared-memory addresses lie below 2^18 (228 KB), so
// start + bytes / 16 never carries into the offset field above it.
__device__ __forceinline__ DescPair desc_advance(DescPair d, uint32_t bytes) {
  return {d.lo + (bytes >> 4), d.hi};
}

__device__ __forceinline__ uint64_t desc_u64(DescPair d) {
  return (static_cast<uint64_t>(d.hi) << 32) | d.lo;
}

// x through a volatile move: the compiler cannot hoist or share what is
// computed from it, so values derived from it are recomputed where used.
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float v0, float v1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// ---- epilogues -------------------------------------------------------------------------
//
// Accumulator layout of wgmma m64nNk16 (float32): in warp w of the
// warpgroup, lane l holds for each 8-column block j the elements
// (16w + l/4, 8j + 2(l%4) + {0,1}) in d[4j], d[4j+1] and the same two
// columns of row 16w + l/4 + 8 in d[4j+2], d[4j+3]. Sub-tile mi of a
// ping-pong accumulator covers rows 64 mi .. 64 mi + 63.

// Straight from registers: bias + activation + cast, paired 4-byte stores.
// block_row / n0: the first row and column of the warpgroup's block in C;
// wtid: the thread's index in the warpgroup. `interior`: the whole block lies
// inside C, stores and bias loads may be paired; then one unmasked path with
// constant offsets runs, small enough to stay in the instruction cache. Edge
// blocks take the masked path, which checks every pair.
template <typename T, Act ACT, int MSUB, int BN>
__device__ __forceinline__ void epilogue_direct(const GemmArgs& p, const float (&acc)[MSUB][BN / 2],
                                                int block_row, int n0, int wtid, bool interior,
                                                bool pair_ok, bool bias_paired) {
  const T* bias = static_cast<const T*>(p.bias);
  // The thread's offsets derive from an opaque copy of its index, inside each
  // activation's instance of this function: otherwise the compiler hoists
  // them (and the addresses built on them) out of the activation switch and
  // the tile loop, and keeps them live across the main loop next to the
  // accumulators (spills).
  const int et = static_cast<int>(opaque_u32(static_cast<uint32_t>(wtid)));
  const int row0 = block_row + (et / 32) * 16 + ((et % 32) >> 2);
  const int col0 = n0 + (et & 3) * 2;
  if (interior) {
    T* const c = static_cast<T*>(p.c) + static_cast<int64_t>(row0) * p.ldc + col0;
    const int64_t ld8 = 8 * p.ldc;  // rows r0 + 8 h + 64 mi are (h + 8 mi) ld8 apart
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      float b0 = 0.0f, b1 = 0.0f;
      if (bias != nullptr) load_bias_pair<T>(bias, col0 + 8 * j, true, true, b0, b1);
#pragma unroll
      for (int mi = 0; mi < MSUB; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          store_pair<T>(c + (8 * mi + h) * ld8 + 8 * j,
                        activate<ACT, true>(acc[mi][4 * j + 2 * h] + b0),
                        activate<ACT, true>(acc[mi][4 * j + 2 * h + 1] + b1));
        }
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = col0 + 8 * j;
    if (col < p.N) {
      const bool two = col + 1 < p.N;
      // One bias load per column pair, shared by the 2 (or 4) rows below.
      float b0 = 0.0f, b1 = 0.0f;
      if (bias != nullptr) load_bias_pair<T>(bias, col, two, bias_paired, b0, b1);
#pragma unroll
      for (int mi = 0; mi < MSUB; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + 64 * mi + 8 * h;
          if (row < p.M) {
            store_out_pair<T, ACT>(p, row, col, acc[mi][4 * j + 2 * h] + b0,
                                   acc[mi][4 * j + 2 * h + 1] + b1, two, pair_ok);
          }
        }
      }
    }
  }
}

// The thread's bias pairs for the lean TMA epilogue: the two columns
// n0 + 8 j + 2 (l % 4) + {0, 1} of each 8-column block j, as the packed
// 16-bit pair (zero where there is no bias or the column is outside C).
// Called after the tile's last MMAs are issued and before waiting for them,
// so that the loads' latency hides under the last MMA batch, once per tile
// instead of once per 64-column chunk behind the chunk's barrier.
template <typename T, int BN>
__device__ __forceinline__ void prefetch_bias(const GemmArgs& p, int n0, int wtid, bool bias_paired,
                                              uint32_t (&bw)[BN / 8]) {
  const T* bias = static_cast<const T*>(p.bias);
  const int et = static_cast<int>(opaque_u32(static_cast<uint32_t>(wtid)));
  const int col0 = n0 + 2 * (et & 3);
  if (bias == nullptr) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) bw[j] = 0u;
  } else if (n0 + BN <= p.N && bias_paired) {
    const unsigned int* b = reinterpret_cast<const unsigned int*>(bias + col0);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) bw[j] = __ldg(b + 4 * j);  // 8 columns = 4 words apart
  } else {
    const unsigned short* b = reinterpret_cast<const unsigned short*>(bias);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = col0 + 8 * j;
      const uint32_t lo = col < p.N ? __ldg(b + col) : 0u;
      const uint32_t hi = col + 1 < p.N ? __ldg(b + col + 1) : 0u;
      bw[j] = lo | (hi << 16);
    }
  }
}

// A packed 16-bit pair as two floats.
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t w, float& lo, float& hi) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x;
    hi = f.y;
  }
}

// Where a consumer thread's accumulator pairs go in a 64 x 64 output chunk
// staged with the 128B swizzle (epilogue_tma's layout): rows r0 and r0 + 8 of
// the warpgroup's 64, two columns of each 8-column (16-byte) unit. Derived
// from an opaque copy of the thread index, as in epilogue_tma, so nothing is
// hoisted out of the tile loop next to the accumulators.
struct EpiFragment {
  uint32_t row_off;  // byte offset of the thread's pair in row r0
  uint32_t swz;      // the row's swizzle (r0 % 8, the same for r0 + 8)

  __device__ __forceinline__ explicit EpiFragment(int wtid) {
    const int et = static_cast<int>(opaque_u32(static_cast<uint32_t>(wtid)));
    const int warp = et / 32, lane = et % 32;
    const int r0 = 16 * warp + (lane >> 2);
    row_off = static_cast<uint32_t>(r0 * 128 + ((lane & 3) << 2));
    swz = static_cast<uint32_t>(r0 & 7);
  }
  // The pair of 16-byte unit jj in row r0 (h = 0) or r0 + 8 (h = 1) of the
  // chunk at `chunk`.
  __device__ __forceinline__ uint32_t addr(uint32_t chunk, int jj, int h) const {
    return chunk + row_off + 1024u * static_cast<uint32_t>(h) +
           ((static_cast<uint32_t>(jj) ^ swz) << 4);
  }
};

// The consumer thread's part of output chunk c (columns 64 c.. of its
// warpgroup's block) into the 64 x 64 chunk buffer at `chunk`: acc + bias,
// each pair through `finish(v0, v1)` (an activation, relu or nothing; v1 is
// the odd column), rounded to T. Shared by the lean TMA epilogue and the
// offload epilogue's hand-over; the caller fences and synchronises.
template <typename T, int BN, typename Finish>
__device__ __forceinline__ void write_chunk(const float (&acc)[1][BN / 2],
                                            const uint32_t (&bw)[BN / 8], int c, uint32_t chunk,
                                            const EpiFragment& frag, const Finish& finish) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const int j = 8 * c + jj;
    float b0, b1;
    unpack_pair<T>(bw[j], b0, b1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v0 = acc[0][4 * j + 2 * h] + b0;
      float v1 = acc[0][4 * j + 2 * h + 1] + b1;
      finish(v0, v1);
      st_shared_b32(frag.addr(chunk, jj, h), pack_pair<T>(v0, v1));
    }
  }
}

// The TMA-store epilogue (cooperative schedule), in few instructions and barriers: the
// bias comes from registers (prefetch_bias), the activations are the lean
// ones (activate_lean), and each 64 x 64 chunk takes one named barrier:
// before the barrier that hands chunk c to the storing
// thread, that thread waits until every earlier store has read its staging
// buffer (the one chunk c + 1 writes next was read by the store of chunk c - 1,
// issued a whole chunk earlier, so this wait is normally already satisfied).
// The parity of the buffers carries over from tile to tile (BN / 64 chunks, an
// even count), and the store of the previous tile's last chunk is covered by
// the wait before chunk 0's barrier.
template <typename T, Act ACT, int BN>
__device__ __forceinline__ void epilogue_tma(const GemmArgs& p, const CUtensorMap* map_c,
                                                  const float (&acc)[1][BN / 2],
                                                  const uint32_t (&bw)[BN / 8], uint32_t stage,
                                                  int row_base, int n0, int wtid, int bar_id) {
  static_assert((BN / 64) % 2 == 0, "the staging buffers alternate across tiles");
  const EpiFragment frag(wtid);
#pragma unroll
  for (int c = 0; c < BN / 64; ++c) {
    const uint32_t buf = stage + static_cast<uint32_t>(c & 1) * kEpiChunkBytes;
    write_chunk<T, BN>(acc, bw, c, buf, frag, [](float& v0, float& v1) {
      v0 = activate_lean<ACT, false>(v0);
      v1 = activate_lean<ACT, true>(v1);
    });
    fence_proxy_async_smem();
    if (wtid == 0) bulk_wait_read<0>();
    named_barrier_sync(bar_id, 128);
    if (wtid == 0) {
      if (row_base < p.M && n0 + 64 * c < p.N) tma_store_2d(map_c, buf, n0 + 64 * c, row_base);
      bulk_commit_group();
    }
  }
}

// ---- the offload epilogue (FASTCOMM_MATMUL_EPI=offload) ---------------------------------
//
// With bias + gelu / gelu_tanh / silu, the lean epilogue's math (~32K
// activations per 128 x 256 tile, MUFU ex2 / rcp and ~10 FMA-pipe ops each,
// ~3 us) runs while the tensor cores wait. The offload form moves it to the
// three warps of warpgroup 0 that the producer leaves idle (warps 1-3; thread
// 0 of warp 0 keeps issuing the TMA loads), so that it runs under the next
// tile's main loop:
//  * the consumers, after the tile's last MMAs, write acc + bias rounded to T
//    (relu applied, which commutes with the rounding) into a whole-tile
//    output buffer (8 chunks of 64 x 64, 128B-swizzled like the chunk
//    buffers of epilogue_tma, so that the C tensor map stores them),
//    signal "tile_full" and go straight on to the next tile;
//  * the epilogue warps apply the activation in place (16-byte vectors,
//    activate_lean) and one of their threads stores the chunks with TMA,
//    waits until the stores have read the buffer and signals "tile_empty".
// Numerics: the activation sees the pre-activation already rounded to T, as
// in the unfused F.gelu(F.linear(x, w, b)); the fused lean TMA epilogue activates
// the float32 value. The extra rounding is one 16-bit ulp of the input, far
// below the tolerance of a 16-bit output.
// Cost: 3 pipeline stages instead of 4 (the 64 KB buffer takes the fourth
// stage's shared memory), and the consumers still wait for tile j - 1's stores
// to have read the buffer before writing tile j (normally long done: the
// epilogue warps had tile j's whole main loop for it).
//
// Barriers (mbarriers in shared memory, after the stage and order ones):
//   tile_full:  8 arrivals per phase (lane 0 of each consumer warp, after
//               __syncwarp: the warp's buffer writes are done);
//   tile_empty: 1 arrival per phase (the storing thread, after
//               cp.async.bulk.wait_group.read 0: the stores have read the buffer).
// The j-th tile of the CTA (j = 0, 1, ...) completes phase j of each.
// Parity rule: after k completed phases a barrier is in phase k, and a wait
// for parity P passes iff (k & 1) != P (a fresh barrier, k = 0, passes P = 1).
// With E, F the completed phases of tile_empty, tile_full:
//  * consumers at tile j need E >= j (tile j - 1's stores have read the
//    buffer) and wait P = (j & 1) ^ 1, which passes iff (E & 1) == (j & 1);
//  * epilogue warps at tile j need F >= j + 1 (all 8 consumer warps have
//    written tile j) and wait P = j & 1, which passes iff (F & 1) != (j & 1).
// Exact because neither barrier can be two phases off from its waiter:
//  * consumers at tile j see E in {j - 1, j}: E >= j - 1 since they passed
//    the wait of tile j - 1, and E = j + 1 needs the epilogue's stores of
//    tile j, which need these consumers' tile_full arrival after this wait;
//  * epilogue threads at tile j see F in {j, j + 1}: F >= j since they
//    passed the wait of tile j - 1 (F = j: the first j tiles), and F = j + 2
//    needs the consumers' arrival for tile j + 1, after their wait for
//    E = j + 1, which the storing thread signals after the last named
//    barrier of tile j, which every epilogue thread reaches only after its
//    wait of tile j.
// Trace:
//   j = 0: consumers wait E, P = 1: E = 0 passes; write; arrive: F = 1.
//          epilogue waits F, P = 0: F = 0 blocks, F = 1 passes; math,
//          stores, wait.read; arrive: E = 1.
//   j = 1: consumers wait E, P = 0: E = 0 blocks, E = 1 passes; F = 2.
//          epilogue waits F, P = 1: F = 1 blocks, F = 2 passes; E = 2.
//   j = 2: consumers wait E, P = 1: E = 1 blocks, E = 2 passes; F = 3.
//          epilogue waits F, P = 0: F = 2 blocks, F = 3 passes; E = 3.
// Without math (none / relu) no named barrier keeps the other epilogue
// threads in step, so only the storing thread waits on tile_full (the
// others have nothing to do and leave at once).

// Named barrier of the epilogue warps (0 is __syncthreads, 1 and 2 the
// consumer warpgroups' in the other TMA epilogues).
constexpr int kOffloadBarId = 3;
constexpr int kOffloadThreads = 96;  // warps 1-3 of warpgroup 0

// Consumer side: acc + bias of the warpgroup's 64 x BN block (bias pairs from
// prefetch_bias), relu applied if RELU, rounded to T, written into the
// warpgroup's BN / 64 chunks of the tile buffer (chunk c at buf + c x 8 KB)
// with the addressing of epilogue_tma. No barriers: the caller has
// waited for tile_empty and signals tile_full.
template <typename T, bool RELU, int BN>
__device__ __forceinline__ void epilogue_offload_write(const float (&acc)[1][BN / 2],
                                                       const uint32_t (&bw)[BN / 8], uint32_t buf,
                                                       int wtid) {
  const EpiFragment frag(wtid);
#pragma unroll
  for (int c = 0; c < BN / 64; ++c) {
    write_chunk<T, BN>(acc, bw, c, buf + static_cast<uint32_t>(c) * kEpiChunkBytes, frag,
                       [](float& v0, float& v1) {
                         if constexpr (RELU) {
                           v0 = fmaxf(v0, 0.0f);
                           v1 = fmaxf(v1, 0.0f);
                         }
                       });
  }
}

// 8 outputs of the tile buffer (one 16-byte vector at addr) through the
// activation, in place: matmul_device.cuh's lean activations on the rounded
// input, with the hardware reciprocal for every element.
template <typename T, Act ACT>
__device__ __forceinline__ void activate_vec_in_place(uint32_t addr) {
  uint32_t w[4];
  ld_shared_v4(addr, w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float lo, hi;
    unpack_pair<T>(w[i], lo, hi);
    // Both elements take the hardware reciprocal: here the math runs beside
    // the MMAs, not in their way, so what counts is its energy (the GEMM runs
    // at the power limit), i.e. its instruction count, not the MUFU
    // throughput that the software reciprocal of epilogue_tma relieves.
    w[i] = pack_pair<T>(activate_lean<ACT, false>(lo), activate_lean<ACT, false>(hi));
  }
  st_shared_v4(addr, w);
}

// Epilogue side, run by the 96 threads of warps 1-3 of warpgroup 0 (et =
// 0..95) over the CTA's tiles in the consumers' order (unit_tile: unit ->
// m0, n0). Thread 0 issues the TMA stores, clipped like epilogue_tma's
// (a chunk wholly outside C is skipped; TMA clips the rest).
template <typename T, Act ACT, typename TileFn>
__device__ __forceinline__ void epilogue_warps_offload(const GemmArgs& p, const CUtensorMap* map_c,
                                                       uint32_t buf, uint32_t full_bar,
                                                       uint32_t empty_bar, int et, int first_unit,
                                                       int num_units, int unit_stride,
                                                       const TileFn& unit_tile) {
  // none / relu: the consumers wrote the final values; only the stores remain
  // (the consumers' epi_math must agree: without math they fence their writes).
  constexpr bool kMath = ACT == Act::kGelu || ACT == Act::kGeluTanh || ACT == Act::kSilu;
  // Without math the other threads have nothing to do, and they must not
  // wait on tile_full either: nothing would keep them within one phase of
  // the barrier (see the protocol above), so they leave at once.
  if (!kMath && et != 0) return;
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N);
  if (et == 0) tma_prefetch_map(map_c);
  int j = 0;
  for (int unit = first_unit; unit < num_units; unit += unit_stride, ++j) {
    mbar_wait(full_bar, static_cast<uint32_t>(j & 1));
    int m0, n0;
    unit_tile(unit, m0, n0);
    // Chunk q = 4 w + c: rows m0 + 64 w, columns n0 + 64 c.
    auto store_chunks = [&](int q0, int nq) {
      for (int q = q0; q < q0 + nq; ++q) {
        const int row = m0 + 64 * (q >> 2), col = n0 + 64 * (q & 3);
        if (row < M && col < N) {
          tma_store_2d(map_c, buf + static_cast<uint32_t>(q) * kEpiChunkBytes, col, row);
        }
      }
      bulk_commit_group();
    };
    if constexpr (kMath) {
      // Three groups of chunks (3, 3, 2: 1536, 1536, 1024 vectors), each
      // stored as soon as it is done so that the stores drain under the
      // next group's math: 16 + 16 + 11 vectors per thread, the fewest a
      // split of the tile's 4096 vectors over 96 threads allows (43).
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        const int q0 = 3 * g, nq = g < 2 ? 3 : 2;
        const uint32_t base = buf + static_cast<uint32_t>(q0) * kEpiChunkBytes;
        const int nvec = nq * (kEpiChunkBytes / 16);
#pragma unroll 1
        for (int v = et; v < nvec; v += kOffloadThreads) {
          activate_vec_in_place<T, ACT>(base + 16u * static_cast<uint32_t>(v));
        }
        // Each writer orders its shared-memory stores before the TMA reads;
        // the barrier tells the storing thread that all have.
        fence_proxy_async_smem();
        named_barrier_sync(kOffloadBarId, kOffloadThreads);
        if (et == 0) store_chunks(q0, nq);
      }
    } else {
      store_chunks(0, 8);
    }
    if (et == 0) {
      // The buffer is free once the stores have read it (their global writes
      // may still be in flight).
      bulk_wait_read<0>();
      mbar_arrive(empty_bar);
    }
  }
  // Shared memory must outlive the stores that read it.
  if (et == 0) bulk_wait_all();
}

// ---- the kernel ------------------------------------------------------------------------

// A_K: A is K-major ([M][K], lda = sam), else M-major ([K][M], lda = sak).
// B_K: B is K-major ([N][K], ldb = sbn), else N-major ([K][N], ldb = sbk).
// OFFLOAD: the offload epilogue (cooperative 128 x 256 only; opts.tma_store
// is 2 and tma_c valid).
template <typename T, Sched S, int BN, bool A_K, bool B_K, bool OFFLOAD = false>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tma_a,
                      const __grid_constant__ CUtensorMap tma_b,
                      const __grid_constant__ CUtensorMap tma_c, const GemmArgs p,
                      const KernelOpts opts) {
#if FASTCOMM_SM90A_DEVICE
  using C = Cfg<S, BN, OFFLOAD>;
  constexpr int STAGES = C::STAGES;
  constexpr bool PINGPONG = C::PINGPONG;
  constexpr int MSUB = C::MSUB;
  // Static shared memory only in the real kernel: gemm_wgmma_compiled() reads
  // its size to tell this build from an empty one (plain sm_90 target).
  // full[0..S), empty[S..2S), then the ping-pong order barriers, then (offload)
  // tile_full and tile_empty.
  __shared__ __align__(8) uint64_t bars[2 * STAGES + (OFFLOAD ? 4 : 2)];

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 128B-swizzled tiles must start on 1024-byte boundaries.
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sA = smem_base;
  const uint32_t sB = sA + STAGES * C::A_BYTES;
  // TMA-store staging (cooperative), or the tile buffer of the offload epilogue.
  const uint32_t sEpi = sB + STAGES * C::B_BYTES;
  const uint32_t bar0 = smem_u32(bars);
  auto full_bar = [&](int s) { return bar0 + 8u * s; };
  auto empty_bar = [&](int s) { return bar0 + 8u * (STAGES + s); };
  // order_bar(w) completes a phase each time the other consumer warpgroup
  // has issued a tile's MMAs: warpgroup w's turn on the tensor cores.
  auto order_bar = [&](int w) { return bar0 + 8u * (2 * STAGES + w); };
  // Offload epilogue: the tile buffer holds a tile for the epilogue warps
  // (tile_full) / is free for the consumers again (tile_empty).
  const uint32_t tile_full_bar = bar0 + 8u * (2 * STAGES + 2);
  const uint32_t tile_empty_bar = bar0 + 8u * (2 * STAGES + 3);

  const int tid = threadIdx.x;
  // The warpgroup through a shuffle from lane 0: the same value, but the
  // compiler then knows that it is warp-uniform and keeps what derives from
  // it (the consumers' A descriptors) in uniform registers. Computed from the
  // thread index, the descriptors of every wgmma were rebuilt on the vector
  // ALUs and moved over with R2UR: ~40 ALU instructions per K-slice and warp,
  // 6x the ALU instructions of cuBLAS's kernel at 4096^3 (Nsight Compute),
  // energy taken from the MMAs where the GEMM runs at the power limit.
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  constexpr int BM = C::BM;
  const int tiles_m = (M + BM - 1) / BM;
  const int tiles_n = (N + BN - 1) / BN;
  const int num_kb = (K + kBK - 1) / kBK;
  // Work units: the tiles, each CTA taking every gridDim.x-th.
  const int num_units = tiles_m * tiles_n;
  const int first_unit = blockIdx.x;
  const int unit_stride = gridDim.x;
  // Tile order for L2 reuse: groups of opts.group_tiles tile rows walked
  // column by column, or of tile columns walked row by row.
  auto unit_tile = [&](int unit, int& m0, int& n0) {
    int tm, tn;
    if (opts.raster_n) {
      grouped_tile(unit, tiles_n, tiles_m, opts.group_tiles, tn, tm);
    } else {
      grouped_tile(unit, tiles_m, tiles_n, opts.group_tiles, tm, tn);
    }
    m0 = tm * BM;
    n0 = tn * BN;
  };

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), 1);  // the producer's arrive.expect_tx (+ TMA bytes)
      mbar_init(empty_bar(s), C::STAGE_READERS);  // the warps that read the stage
    }
    mbar_init(order_bar(0), 4);  // one arrival per warp of the other warpgroup
    mbar_init(order_bar(1), 4);
    if constexpr (OFFLOAD) {
      mbar_init(tile_full_bar, 8);   // lane 0 of each consumer warp
      mbar_init(tile_empty_bar, 1);  // the thread that stores the tile
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<C::PRODUCER_REGS>();
    if (tid == 0) {
      tma_prefetch_map(&tma_a);
      tma_prefetch_map(&tma_b);
      int s = 0;
      uint32_t phase = 0;
      for (int unit = first_unit; unit < num_units; unit += unit_stride) {
        int m0, n0;
        unit_tile(unit, m0, n0);
        for (int kb = 0; kb < num_kb; ++kb) {
          // First round passes at once.
          mbar_wait(empty_bar(s), phase ^ 1);
          mbar_arrive_expect_tx(full_bar(s), C::STAGE_BYTES);
          const int k0 = kb * kBK;
          const uint32_t a_dst = sA + s * C::A_BYTES;
          const uint32_t b_dst = sB + s * C::B_BYTES;
          if constexpr (A_K) {
            tma_load_2d(a_dst, &tma_a, k0, m0, full_bar(s));  // box {64 k, BM m}
          } else {
#pragma unroll
            for (int j = 0; j < BM / 64; ++j) {
              tma_load_2d(a_dst + j * C::BOX_BYTES, &tma_a, m0 + 64 * j, k0,
                          full_bar(s));  // box {64 m, 64 k}
            }
          }
          if constexpr (B_K) {
            tma_load_2d(b_dst, &tma_b, k0, n0, full_bar(s));  // box {64 k, BN n}
          } else {
#pragma unroll
            for (int j = 0; j < BN / 64; ++j) {
              tma_load_2d(b_dst + j * C::BOX_BYTES, &tma_b, n0 + 64 * j, k0,
                          full_bar(s));  // box {64 n, 64 k}
            }
          }
          if (++s == STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    }
    if constexpr (OFFLOAD) {
      if (tid >= 32) {
        // ---------------- epilogue warps (offload) ----------------
        // Warps 1-3, idle in the other forms: the tile's activation and
        // stores, under the consumers' next main loop.
        FASTCOMM_DISPATCH_ACT(p.act, (epilogue_warps_offload<T, kAct>(
                                         p, &tma_c, sEpi, tile_full_bar, tile_empty_bar, tid - 32,
                                         first_unit, num_units, unit_stride, unit_tile)));
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<C::CONSUMER_REGS>();
    const int cw = wg - 1;            // consumer warpgroup 0 or 1
    const int wtid = tid - 128 * wg;  // thread within the warpgroup
    const int lane = tid % 32;
    const bool pair_ok = (p.ldc % 2 == 0) && ((reinterpret_cast<uintptr_t>(p.c) & 3) == 0);
    const bool bias_paired = (reinterpret_cast<uintptr_t>(p.bias) & 3) == 0;
    // Descriptor geometry (bytes): K-major: rows of 128 B, 8-row groups 1 KB
    // apart, k16 step = 32 B within the swizzled row. M/N-major: 64-element
    // chunks 8 KB apart (LBO), 8-k groups 1 KB apart (SBO), k16 step = 2 KB.
    constexpr uint32_t kAStepK = A_K ? 32u : 2048u;
    constexpr uint32_t kBStepK = B_K ? 32u : 2048u;
    constexpr uint32_t kALbo = A_K ? 16u : static_cast<uint32_t>(C::BOX_BYTES);
    constexpr uint32_t kBLbo = B_K ? 16u : static_cast<uint32_t>(C::BOX_BYTES);
    constexpr bool kBF16 = std::is_same<T, __nv_bfloat16>::value;
    // A rows of this warpgroup's first m64 sub-tile: 64 rows = 8 KB into a
    // K-major tile, or the second 64-wide box of an M-major one: 8 KB either
    // way (cooperative, warpgroup 1); ping-pong warpgroups read all 128 rows.
    const uint32_t a_off = PINGPONG ? 0u : static_cast<uint32_t>(cw) * 8192u;
    // Stage 0, k16 step 0; desc_advance moves them.
    const DescPair a_desc0 = smem_desc_pair(sA + a_off, kALbo, 1024u);
    const DescPair b_desc0 = smem_desc_pair(sB, kBLbo, 1024u);
    auto release = [&](int s) {
      if (lane == 0) mbar_arrive(empty_bar(s));
    };
    // This warpgroup's tiles: all of the CTA's (cooperative), or every other
    // one starting at the cw-th (ping-pong).
    const int first = first_unit + (PINGPONG ? cw * unit_stride : 0);
    const int stride = PINGPONG ? 2 * unit_stride : unit_stride;

    float acc[MSUB][BN / 2];
    int j = 0;  // tiles this warpgroup has done
    for (int unit = first; unit < num_units; unit += stride, ++j) {
      int m0, n0;
      unit_tile(unit, m0, n0);
      // Where the tile's first K-slice sits in the producer's stage sequence.
      const int64_t seq = PINGPONG ? 2 * j + cw : j;
      const int64_t it0 = seq * num_kb;
      int s = static_cast<int>(it0 % STAGES);
      uint32_t phase = static_cast<uint32_t>((it0 / STAGES) & 1);
#pragma unroll
      for (int mi = 0; mi < MSUB; ++mi) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[mi][i] = 0.0f;
      }
      fence_accumulators(acc);
      if constexpr (PINGPONG) {
        // Warpgroup 0 goes first (parity 1 passes on a fresh barrier); after
        // that each waits until the other has issued its tile's MMAs.
        mbar_wait(order_bar(cw), static_cast<uint32_t>(j & 1) ^ (cw == 0 ? 1u : 0u));
      }
      int prev_s = 0;
      for (int kb = 0; kb < num_kb; ++kb) {
        mbar_wait(full_bar(s), phase);
        // The slice's descriptors, moved by one add per k16 step.
        DescPair da = desc_advance(a_desc0, static_cast<uint32_t>(s) * C::A_BYTES);
        DescPair db = desc_advance(b_desc0, static_cast<uint32_t>(s) * C::B_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
#pragma unroll
          for (int mi = 0; mi < MSUB; ++mi) {
            wgmma_m64k16<BN, kBF16, A_K ? 0 : 1, B_K ? 0 : 1>(
                acc[mi], desc_u64(desc_advance(da, mi * 8192u)), desc_u64(db), 1);
          }
          da = desc_advance(da, kAStepK);
          db = desc_advance(db, kBStepK);
        }
        wgmma_commit();
        wgmma_wait<1>();  // the batch of slice kb-1 has retired: free its stage
        if (kb > 0) release(prev_s);
        prev_s = s;
        if (++s == STAGES) {
          s = 0;
          phase ^= 1;
        }
      }
      if constexpr (OFFLOAD) {
        // Offload epilogue: the bias loads go out under the last MMAs, as in
        // the lean one; then the tile goes into the tile buffer as acc + bias
        // (relu applied), and the epilogue warps do the rest.
        uint32_t bw[BN / 8];
        prefetch_bias<T, BN>(p, n0, wtid, bias_paired, bw);
        wgmma_wait<0>();
        fence_accumulators(acc);
        if (num_kb > 0) release(prev_s);
        // Tile j - 1's stores have read the buffer (the first tile passes at
        // once; the protocol is traced above epilogue_offload_write).
        mbar_wait(tile_empty_bar, static_cast<uint32_t>(j & 1) ^ 1u);
        const uint32_t buf = sEpi + static_cast<uint32_t>(cw) * (BN / 64) * kEpiChunkBytes;
        if (p.act == Act::kRelu) {
          epilogue_offload_write<T, true, BN>(acc, bw, buf, wtid);
        } else {
          epilogue_offload_write<T, false, BN>(acc, bw, buf, wtid);
        }
        // none / relu (the epilogue warps' kMath is false): these are the
        // final values and the TMA engine reads them next, so order our
        // writes before its reads; otherwise the epilogue warps rewrite every
        // byte and fence their own writes.
        const bool epi_math = p.act == Act::kGelu || p.act == Act::kGeluTanh || p.act == Act::kSilu;
        if (!epi_math) fence_proxy_async_smem();
        // The warp's writes (and fences) are done before lane 0 releases them.
        __syncwarp();
        if (lane == 0) mbar_arrive(tile_full_bar);
        continue;
      }
      if constexpr (PINGPONG) {
        // All our MMAs are issued: the other warpgroup may start its tile.
        if (lane == 0) mbar_arrive(order_bar(cw ^ 1));
      } else {
        if (opts.tma_store == 1) {
          // Lean TMA epilogue: the bias loads go out under the last MMAs.
          uint32_t bw[BN / 8];
          prefetch_bias<T, BN>(p, n0, wtid, bias_paired, bw);
          wgmma_wait<0>();
          fence_accumulators(acc);
          if (num_kb > 0) release(prev_s);
          const uint32_t stage = sEpi + static_cast<uint32_t>(cw) * 2u * kEpiChunkBytes;
          FASTCOMM_DISPATCH_ACT(
              p.act, (epilogue_tma<T, kAct, BN>(p, &tma_c, acc, bw, stage, m0 + 64 * cw, n0,
                                                     wtid, 1 + cw)));
          continue;
        }
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (num_kb > 0) release(prev_s);
      const int block_row = m0 + (PINGPONG ? 0 : 64 * cw);  // first row of our 64 * MSUB
      const bool interior = block_row + 64 * MSUB <= M && n0 + BN <= N && pair_ok &&
                            (p.bias == nullptr || bias_paired);
      FASTCOMM_DISPATCH_ACT(
          p.act, (epilogue_direct<T, kAct, MSUB, BN>(p, acc, block_row, n0, wtid, interior, pair_ok,
                                                     bias_paired)));
    }
    if constexpr (!PINGPONG && !OFFLOAD) {
      // The staging buffers must outlive the stores that read them.
      if (opts.tma_store && wtid == 0) bulk_wait_all();
    }
  }
#endif
}

// ---- host side -----------------------------------------------------------------------

template <typename T, Sched S, int BN, bool A_K, bool B_K, bool OFFLOAD>
cudaError_t launch_kernel(const GemmArgs& p, const Plan& plan, cudaStream_t stream) {
  using C = Cfg<S, BN, OFFLOAD>;
  CUtensorMap ma, mb, mc;
  const bool ok_a = A_K ? make_map(&ma, p.dtype, p.a, p.K, p.M, p.sam, kBK, C::BM)
                        : make_map(&ma, p.dtype, p.a, p.M, p.K, p.sak, 64, kBK);
  const bool ok_b = B_K ? make_map(&mb, p.dtype, p.b, p.K, p.N, p.sbn, kBK, BN)
                        : make_map(&mb, p.dtype, p.b, p.N, p.K, p.sbk, 64, kBK);
  if (!ok_a || !ok_b) return cudaErrorInvalidValue;
  KernelOpts opts;
  opts.raster_n = plan.raster_n ? 1 : 0;
  opts.group_tiles = std::max(1, plan.raster_n ? plan.group / BN : plan.group / C::BM);
  if constexpr (OFFLOAD) {
    opts.tma_store = 2;  // the dispatcher picks OFFLOAD only where C takes TMA stores
  } else {
    opts.tma_store = (S == Sched::kCoop && plan.tma_store) ? 1 : 0;
  }
  if (opts.tma_store) {
    // C [M][N] row-major, 64 x 64 boxes (one swizzle row wide).
    if (!make_map(&mc, p.dtype, p.c, p.N, p.M, p.ldc, 64, 64)) return cudaErrorInvalidValue;
  } else {
    mc = mb;  // unused by the kernel; any valid map
  }
  const int64_t units = ((p.M + C::BM - 1) / C::BM) * ((p.N + BN - 1) / BN);
  if (units > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = gemm_wgmma_kernel<T, S, BN, A_K, B_K, OFFLOAD>;

  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  static cudaError_t setup[64];
  static std::once_flag once[64];
  std::call_once(once[dev], [&] {
    setup[dev] =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
    // Once per kernel and device (FASTCOMM_LOG=INFO): the persistent grid
    // decides how well the tiles spread over the SMs.
    FASTCOMM_LOG(Info, "matmul wgmma kernel "
                           << (S == Sched::kPingpong ? "ping-pong" : "cooperative")
                           << (OFFLOAD ? " offload" : "") << " " << C::BM << "x" << BN
                           << " layout " << (A_K ? "K" : "M") << (B_K ? "K" : "N") << " on device "
                           << dev << ": " << C::SMEM_BYTES << " B shared memory, " << plan.num_sms
                           << " SMs, setup " << cudaGetErrorString(setup[dev]));
  });
  if (setup[dev] != cudaSuccess) return setup[dev];

  const int64_t grid = units < plan.num_sms ? units : plan.num_sms;
  kernel<<<static_cast<unsigned>(grid), kThreads, C::SMEM_BYTES, stream>>>(ma, mb, mc, p, opts);
  return cudaGetLastError();
}

template <typename T, Sched S, int BN, bool OFFLOAD = false>
cudaError_t launch_layout(const GemmArgs& p, const Plan& plan, cudaStream_t stream) {
  const bool a_k = p.sak == 1, b_k = p.sbk == 1;
  if (a_k && b_k) return launch_kernel<T, S, BN, true, true, OFFLOAD>(p, plan, stream);
  if (a_k) return launch_kernel<T, S, BN, true, false, OFFLOAD>(p, plan, stream);
  if (b_k) return launch_kernel<T, S, BN, false, true, OFFLOAD>(p, plan, stream);
  return launch_kernel<T, S, BN, false, false, OFFLOAD>(p, plan, stream);
}

template <typename T, Sched S>
cudaError_t launch_sched(const GemmArgs& p, const Plan& plan, cudaStream_t stream) {
  if constexpr (S == Sched::kPingpong) {
    return launch_layout<T, S, 128>(p, plan, stream);
  } else {
    if (plan.bn == 256) {
      if (plan.epi_offload) {  // 3 stages + the tile buffer: separate kernels
        return launch_layout<T, S, 256, true>(p, plan, stream);
      }
      return launch_layout<T, S, 256>(p, plan, stream);
    }
    return launch_layout<T, S, 128>(p, plan, stream);
  }
}

template <typename T, Sched S>
cudaError_t kernel_attributes(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, gemm_wgmma_kernel < T, S, S == Sched::kPingpong ? 128 : 256,
                               true, true >);
}

}  // namespace sm90
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm

// Explicit instantiation of one schedule for one type: the body of each
// kernels/matmul_sm90_<schedule>_<type>.cu.
#define FASTCOMM_SM90_INSTANTIATE(TYPE, SCHED)                                                \
  namespace fastcomm {                                                                        \
  namespace ops {                                                                             \
  namespace cuda {                                                                            \
  namespace sm90 {                                                                            \
  template cudaError_t launch_sched<TYPE, SCHED>(const GemmArgs&, const Plan&, cudaStream_t); \
  template cudaError_t kernel_attributes<TYPE, SCHED>(cudaFuncAttributes*);                   \
  }                                                                                           \
  }                                                                                           \
  }                                                                                           \
  }
