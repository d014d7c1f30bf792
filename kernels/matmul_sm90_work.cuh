// The work of one persistent CTA of the Hopper GEMM, in the order that its
// producer, consumers and (offload) epilogue warps all walk it, and the
// stream-K fix-up between two CTAs that share a tile. Included by
// matmul_sm90_kernel.cuh.
//
// Data-parallel units: unit u of the first `dp_units` is tile u / splits,
// split u % splits (an even share of the K-slices), taken by CTA u % ctas.
//
// Stream-K: where whole tiles would leave the last round mostly empty
// (2048 x 11008 in 128 x 256 tiles is 5.2 rounds on 132 SMs), the last
// `sk_tiles` tiles (one round plus the remainder) are shared out by K-slices
// instead: their slices, tile after tile, are cut into `ctas` even ranges, one
// per CTA. With at least one round of them, a range is at least one tile's
// K long, so a tile is shared by at most two CTAs: the range of CTA c ends
// in the first part of a tile (a "head"), whose other part begins the range
// of CTA c + 1 (a "tail"). Each CTA walks its range from the top tile down:
// its head comes first and its tail last, so the head's float32 sums, stored
// to the CTA's fix-up slot, are long written when CTA c + 1 reaches the tail,
// adds them and stores the tile. A CTA waits only for a CTA of lower index
// (dispatched before it), and the sums are added in one fixed order, so the
// result is deterministic.
#pragma once

#include <cstdint>

#include "matmul_sm90_ptx.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

// One item of a CTA's work: K-slices [kb_lo, kb_hi) of a tile.
struct WorkItem {
  int tile;   // index in the tile order (grouped_tile)
  int split;  // split K: the unit's split (its slab of the float32 sums)
  int kb_lo, kb_hi;
  bool head;  // stream-K: the tile's first slices; the sums go to the CTA's slot
  bool tail;  // stream-K: its last slices; the previous CTA's slot is added
};

// 32-bit arithmetic throughout (the dispatcher keeps a stream-K launch's
// slices below 2^31), and no division on the path of whole tiles: the items
// are computed before the first load of every CTA.
struct WorkList {
  int cta, ctas;
  int num_kb;     // K-slices of a tile
  int splits;     // split K (1: none)
  int dp_units;   // data-parallel units (tiles x splits, or the tiles before stream-K)
  int first_sk;   // the first stream-K tile
  int n_dp = 0;   // this CTA's data-parallel units (with stream-K)
  int sk_lo = 0;  // this CTA's stream-K slices [sk_lo, sk_hi), counted from the
  int sk_hi = 0;  // first slice of the first stream-K tile
  int top = 0;    // its top stream-K tile
  int n_sk = 0;   // its stream-K items

  __device__ __forceinline__ WorkList(int cta_, int ctas_, int num_tiles, int num_kb_, int splits_,
                                      int sk_tiles)
      : cta(cta_), ctas(ctas_), num_kb(num_kb_), splits(splits_) {
    first_sk = num_tiles - sk_tiles;
    dp_units = first_sk * splits;
    if (sk_tiles > 0) {
      n_dp = cta < dp_units ? (dp_units - 1 - cta) / ctas + 1 : 0;
      // CTA c's range starts at c x slices / ctas, as c q + c r / ctas.
      const unsigned slices = static_cast<unsigned>(sk_tiles) * static_cast<unsigned>(num_kb);
      const unsigned q = slices / static_cast<unsigned>(ctas);
      const unsigned r = slices % static_cast<unsigned>(ctas);
      auto start = [&](unsigned c) { return c * q + c * r / static_cast<unsigned>(ctas); };
      sk_lo = static_cast<int>(start(static_cast<unsigned>(cta)));
      sk_hi = static_cast<int>(start(static_cast<unsigned>(cta) + 1));
      if (sk_hi > sk_lo) {
        top = first_sk + (sk_hi - 1) / num_kb;
        n_sk = top - (first_sk + sk_lo / num_kb) + 1;
      }
    }
  }

  // Item i of the CTA's list into w; false past its end.
  __device__ __forceinline__ bool item(int i, WorkItem& w) const {
    const int unit = cta + i * ctas;
    w.head = false;
    w.tail = false;
    if (unit < dp_units) {
      if (splits == 1) {
        w.tile = unit;
        w.split = 0;
        w.kb_lo = 0;
        w.kb_hi = num_kb;
      } else {
        w.tile = unit / splits;
        w.split = unit % splits;
        w.kb_lo = w.split * num_kb / splits;
        w.kb_hi = (w.split + 1) * num_kb / splits;
      }
      return true;
    }
    const int k = i - n_dp;
    if (k >= n_sk) return false;
    w.tile = top - k;
    w.split = 0;
    const int base = (w.tile - first_sk) * num_kb;
    w.kb_lo = max(sk_lo, base) - base;
    w.kb_hi = min(sk_hi, base + num_kb) - base;
    w.head = w.kb_hi < num_kb;
    w.tail = w.kb_lo > 0;
    return true;
  }
};

// ---- the stream-K fix-up -----------------------------------------------------------
//
// Slot c (CTA c's head) holds, per consumer warpgroup, each thread's
// accumulators in the order of its registers, 16 bytes per thread side by
// side (a warp's store covers 512 contiguous bytes); flags[2 c + warpgroup]
// turns 1 once that warpgroup's part is written (the flags are zeroed before
// the launch).

// Float32 words of one slot: two warpgroups of 128 threads x N accumulators.
template <int N>
constexpr int64_t kFixupSlotFloats = 2 * 128 * int64_t{N};

// The thread's first 16-byte group in slot `slot`, counted in float4 from
// the first slot (its group g is 128 further on per g).
template <int N>
__device__ __forceinline__ int64_t fixup_part(int slot, int cw, int wtid) {
  return kFixupSlotFloats<N> / 4 * slot + cw * (N / 4) * 128 + wtid;
}

__device__ __forceinline__ void flag_release(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
}

__device__ __forceinline__ int flag_acquire(const int* flag) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  return v;
}

// A head: the warpgroup's sums into the CTA's slot, then its flag (after
// the warpgroup's named barrier `bar_id`: every thread's stores are issued
// before the one thread's release, which is cumulative over them).
template <int N>
__device__ __forceinline__ void fixup_store(const float (&acc)[N], float* slots, int* flags,
                                            int slot, int cw, int wtid, int bar_id) {
  float4* dst = reinterpret_cast<float4*>(slots) + fixup_part<N>(slot, cw, wtid);
#pragma unroll
  for (int g = 0; g < N / 4; ++g) {
    __stcg(dst + 128 * g, make_float4(acc[4 * g], acc[4 * g + 1], acc[4 * g + 2], acc[4 * g + 3]));
  }
  named_barrier_sync(bar_id, 128);
  if (wtid == 0) {
    __threadfence();
    flag_release(flags + 2 * slot + cw);
  }
}

// A tail: waits for the previous CTA's head, then adds its sums (acc +=
// slot: one order for every run).
template <int N>
__device__ __forceinline__ void fixup_add(float (&acc)[N], const float* slots, const int* flags,
                                          int slot, int cw, int wtid, int bar_id) {
  if (wtid == 0) {
    while (flag_acquire(flags + 2 * slot + cw) == 0) __nanosleep(64);
  }
  named_barrier_sync(bar_id, 128);
  const float4* src = reinterpret_cast<const float4*>(slots) + fixup_part<N>(slot, cw, wtid);
#pragma unroll
  for (int g = 0; g < N / 4; ++g) {
    const float4 v = __ldcg(src + 128 * g);
    acc[4 * g] += v.x;
    acc[4 * g + 1] += v.y;
    acc[4 * g + 2] += v.z;
    acc[4 * g + 3] += v.w;
  }
}

}  // namespace sm90
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
