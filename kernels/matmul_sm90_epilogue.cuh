// Epilogues of the Hopper (sm_90a) GEMM: bias, activation and cast fused into
// the store of a tile, from registers (direct), through shared memory and TMA
// stores (tma), or handed to the producer warpgroup's idle warps (offload).
// Included by matmul_sm90_kernel.cuh.
#pragma once

#include "matmul_device.cuh"
#include "matmul_sm90_launch.h"
#include "matmul_sm90_ptx.cuh"
#include "matmul_sm90_work.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

using namespace detail;

constexpr int kBM = 128;  // tile rows
// K per stage: one 128-byte swizzle row, 64 elements of a 16-bit type or 32
// of float32 (TF32): the same shared-memory bytes per stage for every type.
template <typename T>
constexpr int kBKFor = 128 / static_cast<int>(sizeof(T));
constexpr int kThreads = 384;                // producer + 2 consumer warpgroups
constexpr int kEpiChunkBytes = 64 * 64 * 2;  // TMA-store epilogue: 64 x 64 output chunks

// ---- epilogues -------------------------------------------------------------------------
//
// Accumulator layout of wgmma m64nNk16 (float32): in warp w of the
// warpgroup, lane l holds for each 8-column block j the elements
// (16w + l/4, 8j + 2(l%4) + {0,1}) in d[4j], d[4j+1] and the same two
// columns of row 16w + l/4 + 8 in d[4j+2], d[4j+3]. Sub-tile mi of a
// ping-pong accumulator covers rows 64 mi .. 64 mi + 63.

// The thread's bias pairs for the epilogues that take them from registers
// (TMA, offload, and the cooperative kernel's direct one): the two columns
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

// The direct epilogue's activation of an element before its cast to T: the
// lean forms for 16-bit outputs (ODD: the second element of a pair, see
// activate_lean); float32 (TF32) outputs take activate<ACT, true>, whose
// GELU's 2e-4 relative error in the far negative tail is below the 2^-11
// rounding of TF32 operands.
template <typename T, Act ACT, bool ODD>
__device__ __forceinline__ float activate_direct(float v) {
  if constexpr (kHalfType<T>) {
    return activate_lean<ACT, ODD>(v);
  } else {
    return activate<ACT, true>(v);
  }
}

// Straight from registers: bias + activation + cast, paired 4-byte stores.
// block_row / n0: the first row and column of the warpgroup's block in C;
// wtid: the thread's index in the warpgroup. `interior`: the whole block lies
// inside C, stores and bias loads may be paired; then one unmasked path with
// constant offsets runs, small enough to stay in the instruction cache. Edge
// blocks take the masked path, which checks every pair. BIAS_IN_REGS: the
// bias pairs are in bw (prefetch_bias, 16-bit types: loaded under the last
// MMAs, for kernels where no later main loop hides their latency); otherwise
// they are loaded here, once per column pair.
template <typename T, Act ACT, int MSUB, int BN, bool BIAS_IN_REGS>
__device__ __forceinline__ void epilogue_direct(const GemmArgs& p, const float (&acc)[MSUB][BN / 2],
                                                const uint32_t (&bw)[BN / 8], int block_row, int n0,
                                                int wtid, bool interior, bool pair_ok,
                                                bool bias_paired) {
  static_assert(!BIAS_IN_REGS || kHalfType<T>, "prefetch_bias packs 16-bit pairs");
  const T* bias = static_cast<const T*>(p.bias);
  // The bias pair of 8-column block j at column col (`two`: col + 1 exists).
  auto bias_pair = [&](int j, int col, bool two, bool paired, float& b0, float& b1) {
    b0 = 0.0f;
    b1 = 0.0f;
    if constexpr (BIAS_IN_REGS) {
      unpack_pair<T>(bw[j], b0, b1);  // zero past N
    } else if (bias != nullptr) {
      load_bias_pair<T>(bias, col, two, paired, b0, b1);
    }
  };
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
      float b0, b1;
      bias_pair(j, col0 + 8 * j, true, true, b0, b1);
#pragma unroll
      for (int mi = 0; mi < MSUB; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          store_pair<T>(c + (8 * mi + h) * ld8 + 8 * j,
                        activate_direct<T, ACT, false>(acc[mi][4 * j + 2 * h] + b0),
                        activate_direct<T, ACT, true>(acc[mi][4 * j + 2 * h + 1] + b1));
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
      // One bias pair per column pair, shared by the 2 (or 4) rows below.
      float b0, b1;
      bias_pair(j, col, two, bias_paired, b0, b1);
#pragma unroll
      for (int mi = 0; mi < MSUB; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + 64 * mi + 8 * h;
          if (row < p.M) {
            store_out_pair<T, Act::kNone>(
                p, row, col, activate_direct<T, ACT, false>(acc[mi][4 * j + 2 * h] + b0),
                activate_direct<T, ACT, true>(acc[mi][4 * j + 2 * h + 1] + b1), two, pair_ok);
          }
        }
      }
    }
  }
}

// Split K: the warpgroup's float32 sums of its K range, as they are, into
// partial[row][col] (row stride N; the split's slab of the workspace that
// splitk_finish adds up in split order and finishes with bias, activation and
// the cast). Paired 8-byte stores where N is even (then every pair is
// aligned), masked at the edges of C. Offsets derive from an opaque copy of
// the thread index, as in epilogue_direct, so that nothing is hoisted out of
// the tile loop next to the accumulators.
template <int MSUB, int BN>
__device__ __forceinline__ void epilogue_partial(const float (&acc)[MSUB][BN / 2],
                                                 float* __restrict__ partial, int block_row, int n0,
                                                 int wtid, int M, int N) {
  const int et = static_cast<int>(opaque_u32(static_cast<uint32_t>(wtid)));
  const int row0 = block_row + (et / 32) * 16 + ((et % 32) >> 2);
  const int col0 = n0 + (et & 3) * 2;
  const bool paired = (N % 2) == 0;
#pragma unroll
  for (int mi = 0; mi < MSUB; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 64 * mi + 8 * h;
      if (row >= M) continue;
      float* const out = partial + static_cast<int64_t>(row) * N;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = col0 + 8 * j;
        const float v0 = acc[mi][4 * j + 2 * h], v1 = acc[mi][4 * j + 2 * h + 1];
        if (paired && col + 1 < N) {
          *reinterpret_cast<float2*>(out + col) = make_float2(v0, v1);
        } else {
          if (col < N) out[col] = v0;
          if (col + 1 < N) out[col + 1] = v1;
        }
      }
    }
  }
}

// ---- TF32 with A M-major (the RS form) ----------------------------------------
//
// The kernel then computes the transposed product C^T = B^T A^T of a caller's
// matmul(a, b) with b N-major: its A is the caller's b, read from 32 x 32
// float32 boxes (M-major, 128B swizzle) into registers for wgmma. A
// warpgroup's 64 rows are permuted among its fragment rows so that each
// thread's two rows of a k-column (fragment rows g and g + 8) are adjacent in
// shared memory and in the caller's C: thread l of warp w holds rows
// 32 (w / 2) + 2 p and + 1, p = (g & 3) + 8 (g >> 2) + 4 (w & 1), g = l / 4.
// A warp's ld.shared.v2 of one k-column pair then touches each bank twice
// (the least for 256 bytes), and the epilogue stores row pairs as float2.

// First of the thread's two rows within the warpgroup's 64.
__device__ __forceinline__ int rs_row_pair(int wtid) {
  const int warp = wtid / 32, g = (wtid % 32) >> 2;
  const int p = (g & 3) + 8 * (g >> 2) + 4 * (warp & 1);
  return 32 * (warp >> 1) + 2 * p;
}

// Byte offsets, within a stage's A (from the warpgroup's first box), of the
// thread's k-columns l % 4 (q = 0) and l % 4 + 4 (q = 1) of the first k8 step
// at its row pair; step kk is 1024 kk bytes further (8 rows of 128 B).
__device__ __forceinline__ void rs_fragment_offsets(int wtid, uint32_t (&off)[2]) {
  const int row = rs_row_pair(wtid);  // 32 (w / 2) + 2 p
  const uint32_t box = static_cast<uint32_t>(row >> 5), p = static_cast<uint32_t>((row & 31) >> 1);
  const uint32_t t = static_cast<uint32_t>(wtid & 3);
#pragma unroll
  for (uint32_t q = 0; q < 2; ++q) {
    const uint32_t k = t + 4 * q;  // the row of the box; its swizzle is k % 8 = k
    off[q] = box * 4096u + k * 128u + ((((p >> 1) ^ k) & 7u) << 4) + (p & 1u) * 8u;
  }
}

// The RS form's tile into C: the accumulator's element (row r, column n) is
// C[n][r] of the caller, at dst[n * ld + r]; bias (float32, per row r, may be
// null) and the activation applied. M / N: rows / columns of the kernel's
// (transposed) problem; block_row / n0 its warpgroup's block. Split K's sums
// take it with ACT = kNone, no bias, dst = the split's slab and ld = M.
template <Act ACT, int BN>
__device__ __forceinline__ void epilogue_rs(const float (&acc)[BN / 2], float* __restrict__ dst,
                                            int64_t ld, const float* __restrict__ bias,
                                            int block_row, int n0, int wtid, int M, int N) {
  const int et = static_cast<int>(opaque_u32(static_cast<uint32_t>(wtid)));
  const int r = block_row + rs_row_pair(et);
  if (r >= M) return;
  const bool two = r + 1 < M;
  const bool paired = two && (ld % 2) == 0 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0;
  float b0 = 0.0f, b1 = 0.0f;
  if (bias != nullptr) {
    b0 = __ldg(bias + r);
    if (two) b1 = __ldg(bias + r + 1);
  }
  const int col0 = n0 + 2 * (et & 3);
  float* const out0 = dst + static_cast<int64_t>(col0) * ld + r;
  if (paired && n0 + BN <= N) {
    // Interior: unmasked float2 stores, columns ld apart.
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        *reinterpret_cast<float2*>(out0 + (8 * j + e) * ld) =
            make_float2(activate_direct<float, ACT, false>(acc[4 * j + e] + b0),
                        activate_direct<float, ACT, false>(acc[4 * j + 2 + e] + b1));
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (col0 + 8 * j + e >= N) continue;
      float* const out = out0 + (8 * j + e) * ld;
      const float v0 = activate_direct<float, ACT, false>(acc[4 * j + e] + b0);
      const float v1 = activate_direct<float, ACT, false>(acc[4 * j + 2 + e] + b1);
      if (paired) {
        *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
      } else {
        out[0] = v0;
        if (two) out[1] = v1;
      }
    }
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

// 8 outputs of a 64 x 64 chunk buffer (one 16-byte vector at addr) through
// the activation, in place: matmul_device.cuh's lean activations on the
// rounded input. BALANCED: every other element takes the software
// reciprocal (3 MUFU ops per pair instead of 4), for the TMA epilogue, whose
// math runs while the tensor cores wait; the offload epilogue's runs beside
// the MMAs, where what counts is its energy (the GEMM runs at the power
// limit), i.e. its instruction count, so there both take the hardware one.
template <typename T, Act ACT, bool BALANCED>
__device__ __forceinline__ void activate_vec_in_place(uint32_t addr) {
  uint32_t w[4];
  ld_shared_v4(addr, w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float lo, hi;
    unpack_pair<T>(w[i], lo, hi);
    w[i] = pack_pair<T>(activate_lean<ACT, false>(lo), activate_lean<ACT, BALANCED>(hi));
  }
  st_shared_v4(addr, w);
}

// The TMA-store epilogue (cooperative schedule), in few instructions and barriers: the
// bias comes from registers (prefetch_bias), the activations are the lean
// ones (activate_lean), and each 64 x 64 chunk takes one named barrier:
// before the barrier that hands chunk c to the storing
// thread, that thread waits until every earlier store has read its staging
// buffer (the one chunk c + 1 writes next was read by the store of chunk c - 1,
// issued a whole chunk earlier, so this wait is normally already satisfied).
// The buffers alternate across tiles as well (the tile's first chunk takes
// buffer first_buf: the parity of the chunks stored before it), and the store
// of the previous tile's last chunk is covered by the wait before chunk 0's
// barrier.
//
// A warpgroup block that lies partly past M (small M: a decode step's few
// rows) applies gelu, gelu_tanh and silu in shared memory instead: acc + bias
// is written there rounded to T (the offload epilogue's numerics: one 16-bit
// ulp of the input, far below the output's tolerance), then a rolled loop
// over the chunk's 16-byte vectors activates the rows of C only. Its code is
// a few dozen instructions, where the activation of every accumulator
// register, unrolled, is kilobytes of code that a CTA with one tile runs
// once, cold, for rows that are never stored. Full blocks keep the
// activation in registers: the extra barrier and shared-memory pass per
// chunk cost more there than they save.
template <typename T, Act ACT, int BN>
__device__ __forceinline__ void epilogue_tma(const GemmArgs& p, const CUtensorMap* map_c,
                                             const float (&acc)[1][BN / 2],
                                             const uint32_t (&bw)[BN / 8], uint32_t stage,
                                             uint32_t first_buf, int row_base, int n0, int wtid,
                                             int bar_id) {
  constexpr bool kMath = act_has_math(ACT);
  const EpiFragment frag(wtid);
  auto buffer = [&](int c) {
    return stage + ((first_buf + static_cast<uint32_t>(c)) & 1u) * kEpiChunkBytes;
  };
  // Chunk c is in its buffer: hand it to the storing thread.
  auto store_chunk = [&](int c, uint32_t buf) {
    fence_proxy_async_smem();
    if (wtid == 0) bulk_wait_read<0>();
    named_barrier_sync(bar_id, 128);
    if (wtid == 0) {
      if (row_base < p.M && n0 + 64 * c < p.N) tma_store_2d(map_c, buf, n0 + 64 * c, row_base);
      bulk_commit_group();
    }
  };
  const int live_rows = max(0, min(64, static_cast<int>(p.M) - row_base));
  if (!kMath || live_rows == 64) {
#pragma unroll
    for (int c = 0; c < BN / 64; ++c) {
      const uint32_t buf = buffer(c);
      write_chunk<T, BN>(acc, bw, c, buf, frag, [](float& v0, float& v1) {
        v0 = activate_lean<ACT, false>(v0);
        v1 = activate_lean<ACT, true>(v1);
      });
      store_chunk(c, buf);
    }
  } else {
    // 16-byte vectors of a chunk that hold rows of C (8 per 128-byte row).
    const int live_vecs = 8 * live_rows;
#pragma unroll
    for (int c = 0; c < BN / 64; ++c) {
      const uint32_t buf = buffer(c);
      write_chunk<T, BN>(acc, bw, c, buf, frag, [](float&, float&) {});
      named_barrier_sync(bar_id, 128);  // the chunk's pre-activations are written
#pragma unroll 1
      for (int v = wtid; v < live_vecs; v += 128) {
        activate_vec_in_place<T, ACT, true>(buf + 16u * static_cast<uint32_t>(v));
      }
      store_chunk(c, buf);
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
// The j-th tile the CTA stores (j = 0, 1, ...; stream-K heads store none)
// completes phase j of each.
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

// Epilogue side, run by the 96 threads of warps 1-3 of warpgroup 0 (et =
// 0..95) over the tiles the CTA stores, in the consumers' order (the items
// of `work` but stream-K heads; tile_origin: tile -> m0, n0). Thread 0
// issues the TMA stores, clipped like epilogue_tma's (a chunk wholly outside
// C is skipped; TMA clips the rest).
template <typename T, Act ACT, int BN, typename TileFn>
__device__ __forceinline__ void epilogue_warps_offload(const GemmArgs& p, const CUtensorMap* map_c,
                                                       uint32_t buf, uint32_t full_bar,
                                                       uint32_t empty_bar, int et,
                                                       const WorkList& work,
                                                       const TileFn& tile_origin) {
  // none / relu: the consumers wrote the final values; only the stores remain
  // (the consumers then fence their own writes: act_has_math decides for both sides).
  constexpr bool kMath = act_has_math(ACT);
  // Without math the other threads have nothing to do, and they must not
  // wait on tile_full either: nothing would keep them within one phase of
  // the barrier (see the protocol above), so they leave at once.
  if (!kMath && et != 0) return;
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N);
  if (et == 0) tma_prefetch_map(map_c);
  constexpr int kChunksPerBlock = BN / 64;      // per consumer warpgroup's 64 rows
  constexpr int kChunks = 2 * kChunksPerBlock;  // 8 (128 x 256) or 4 (128 x 128)
  constexpr int kGroups = BN == 256 ? 3 : 2;    // stored as each is done
  constexpr int kGroupChunks = (kChunks + kGroups - 1) / kGroups;
  int j = 0;  // tiles stored
  WorkItem w;
  for (int i = 0; work.item(i, w); ++i) {
    if (w.head) continue;
    mbar_wait(full_bar, static_cast<uint32_t>(j & 1));
    ++j;
    int m0, n0;
    tile_origin(w.tile, m0, n0);
    // Chunk q = (BN / 64) w + c: rows m0 + 64 w, columns n0 + 64 c.
    auto store_chunks = [&](int q0, int nq) {
      for (int q = q0; q < q0 + nq; ++q) {
        const int row = m0 + 64 * (q / kChunksPerBlock), col = n0 + 64 * (q % kChunksPerBlock);
        if (row < M && col < N) {
          tma_store_2d(map_c, buf + static_cast<uint32_t>(q) * kEpiChunkBytes, col, row);
        }
      }
      bulk_commit_group();
    };
    if constexpr (kMath) {
      // Groups of chunks (128 x 256: 3, 3, 2 chunks = 1536, 1536, 1024
      // vectors; 128 x 128: 2, 2), each stored as soon as it is done so that
      // the stores drain under the next group's math: 16 + 16 + 11 vectors
      // per thread, the fewest a split of the tile's 4096 vectors over 96
      // threads allows (43); 11 + 11 of 2048.
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const int q0 = kGroupChunks * g, nq = min(kGroupChunks, kChunks - q0);
        const uint32_t base = buf + static_cast<uint32_t>(q0) * kEpiChunkBytes;
        const int nvec = nq * (kEpiChunkBytes / 16);
#pragma unroll 1
        for (int v = et; v < nvec; v += kOffloadThreads) {
          activate_vec_in_place<T, ACT, false>(base + 16u * static_cast<uint32_t>(v));
        }
        // Each writer orders its shared-memory stores before the TMA reads;
        // the barrier tells the storing thread that all have.
        fence_proxy_async_smem();
        named_barrier_sync(kOffloadBarId, kOffloadThreads);
        if (et == 0) store_chunks(q0, nq);
      }
    } else {
      store_chunks(0, kChunks);
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

}  // namespace sm90
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
