// Hopper (sm_90a) GEMM for float16 / bfloat16 and for float32 as TF32: TMA
// loads, wgmma, a multi-stage shared-memory pipeline, warp-specialised
// producer / consumers, persistent tile scheduling, and the epilogue (bias,
// activation, cast) fused into the store. Included only by the instantiation
// files kernels/matmul_sm90_{coop,pingpong}_{bf16,f16,tf32}.cu; the dispatcher is
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
//  * Tiles: 128 x 256 (4 stages of 48 KB), 128 x 128 (6 stages of 32 KB) or,
//    cooperative only, 128 x 192 (4 stages of 40 KB; 16-bit types: where its
//    tiles fit the SMs in fewer rounds, e.g. 256 x 11008 in one wave of 116)
//    and 128 x 64 (8 stages of 24 KB; for products of few rows, where 64-wide
//    tiles give the SMs work without a K split). BK = one 128-byte swizzle row: 64 elements of
//    a 16-bit type, 32 of float32. Tile order: groups of 2048 rows (raster by rows) or 2048
//    columns (raster by columns), the dispatcher picking the one that
//    re-reads fewer bytes from DRAM.
//  * float32 (T = float): the tensor cores multiply the operands as TF32
//    (wgmma .tf32, m64nBNk8, four per K-slice as the 16-bit types' four k16
//    steps), float32 accumulation, float32 output. PTX takes 32-bit operands
//    in shared memory K-major only: B is K-major, and A K-major or, in the
//    cooperative kernel, M-major, read from 32 x 32 boxes into registers for
//    the register-A (RS) form of wgmma (kRS; the dispatcher runs matmul(a, b)
//    with b N-major as the transposed product C^T = B^T A^T there, and the
//    epilogue stores the transposed tile: matmul_sm90_epilogue.cuh). The
//    epilogue stores from registers (direct, or split K's float32 sums): the
//    TMA and offload epilogues stage 16-bit chunks.
//  * Layouts: K-major operands are one TMA box per tile (128B swizzle, the
//    canonical K-major wgmma layout, descriptor advanced by 32 bytes per
//    k16 step). M-/N-major operands (e.g. b of matmul(a, b) with b [K, N]
//    row-major) are loaded as 64-wide boxes along M/N and consumed with the
//    wgmma transpose flag (canonical MN-major 128B-swizzle layout: LBO = 8 KB
//    between 64-element M/N chunks, SBO = 1 KB between 8-row K groups).
//  * Work: each CTA walks a list (matmul_sm90_work.cuh) of whole tiles, split
//    K's units, or, where the tiles fill two or more rounds and leave the last
//    one part-full, whole tiles and then a stream-K range of K-slices over
//    the last round plus the remainder, two CTAs per shared tile adding their
//    float32 sums through a workspace.
//  * Edges: TMA zero-fills out-of-range rows / columns of a box (any M, N,
//    K); the direct epilogue masks its stores, TMA stores clip at the edges.
#pragma once

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <mutex>
#include <type_traits>

#include "common/logging.hpp"
#include "matmul_device.cuh"
#include "matmul_sm90_launch.h"
#include "matmul_sm90_epilogue.cuh"
#include "matmul_sm90_ptx.cuh"
#include "matmul_sm90_work.cuh"
#include "matmul_wgmma_ops.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

using namespace detail;

// OFFLOAD: the cooperative 128 x 256 or 128 x 128 kernel with the "offload"
// epilogue (epilogue_offload_write / epilogue_warps_offload below): one
// whole-tile output buffer instead of the 4 chunk buffers, 3 stages instead
// of 4 (128 x 256; the 128 x 128 tile's buffer is the chunk buffers' 32 KB,
// so it keeps its 6 stages).
// SMALL_A: the cooperative 128 x 64 tile for products of at most 64 rows:
// stages hold 64 rows of A instead of 128 (the tile's other 64 rows are past
// M and never loaded), so the same shared memory takes 11 stages instead of
// 8 (13 for TF32, which has no TMA epilogue) and keeps that much more of B,
// the operand that streams from DRAM, in flight.
template <typename T, Sched S, int BN, bool OFFLOAD = false, bool SMALL_A = false>
struct Cfg {
  static_assert(BN == 256 || BN == 192 || BN == 128 || BN == 64, "BN must be 64, 128, 192 or 256");
  static_assert(BN != 192 || sizeof(T) == 2, "the 128 x 192 tile is for 16-bit types");
  static_assert(sizeof(T) == 2 || !OFFLOAD, "the offload epilogue stages 16-bit outputs");
  static_assert(S == Sched::kCoop || BN == 128, "the ping-pong tile is 128 x 128");
  // The TMA-store epilogue (16-bit outputs) alternates two 64-wide chunk
  // buffers per consumer warpgroup.
  static constexpr bool TMA_EPI = S == Sched::kCoop && sizeof(T) == 2;
  static_assert(!OFFLOAD || (S == Sched::kCoop && (BN == 256 || BN == 128)),
                "the offload epilogue exists for the cooperative 128 x 256 and 128 x 128 kernels");
  static_assert(!SMALL_A || (S == Sched::kCoop && BN == 64 && !OFFLOAD),
                "64 rows of A per stage: the cooperative 128 x 64 kernel only");
  static constexpr bool PINGPONG = S == Sched::kPingpong;
  static constexpr int BM = kBM;
  // 4 x 48 KB (cooperative 128 x 256), 4 x 40 KB (128 x 192), 6 x 32 KB
  // (128 x 128), 8 x 24 KB (128 x 64; 11 x 16 KB with SMALL_A, 13 without
  // the TMA epilogue's 32 KB: TF32); 3 x 48 KB with the offload epilogue on
  // 128 x 256, whose 64 KB tile buffer takes the fourth stage's place.
  static constexpr int STAGES = OFFLOAD && BN == 256 ? 3
                                : BN >= 192          ? 4
                                : BN == 128          ? 6
                                : SMALL_A            ? (TMA_EPI ? 11 : 13)
                                                     : 8;
  static constexpr int BK = kBKFor<T>;              // 128 bytes of K
  static constexpr int A_ROWS = SMALL_A ? 64 : BM;  // rows of A a stage holds
  static constexpr int A_BYTES = A_ROWS * BK * static_cast<int>(sizeof(T));  // 16 KB (8 KB)
  static constexpr int B_BYTES = BN * BK * static_cast<int>(sizeof(T));
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  // Staging of the TMA-store epilogue (cooperative only): two chunk buffers
  // per consumer warpgroup, so that one chunk is written while the previous
  // one is being stored.
  // Offload: the whole output tile, 2 x BN / 64 chunks of 64 x 64 (chunk
  // (BN / 64) w + c holds rows 64 w.., columns 64 c.. of the tile), so that
  // the consumers can hand a tile over and go on while the epilogue warps
  // finish it.
  static constexpr int EPI_BYTES = OFFLOAD   ? 2 * (BN / 64) * kEpiChunkBytes
                                   : TMA_EPI ? 2 * 2 * kEpiChunkBytes
                                             : 0;
  // + 1 KB slack for the 1024-byte alignment of 128B-swizzled tiles
  // (offload: 1 + 3 x 48 + 64 = 209 KB).
  static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES + EPI_BYTES;
  // The static part (the mbarriers, padded by the 1024-byte alignment of the
  // dynamic array) reads 2 KB in cuobjdump's resource usage: the cooperative
  // kernels fill the 227 KB per block exactly.
  static_assert(SMEM_BYTES + 2048 <= 227 * 1024, "over the sm_90 shared-memory limit per block");
  // One box of an M/N-major operand: BK x BK (64 x 64 of a 16-bit type, 32 x
  // 32 of float32), one swizzle row wide.
  static constexpr int BOX_BYTES = BK * BK * static_cast<int>(sizeof(T));
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
  // Split K: each tile's K-slices are shared by `splits` work units, unit u
  // taking tile u / splits and the u % splits-th of the slices (an even share,
  // at least one each); with splits > 1 every unit stores its float32 sums
  // to partial[split][row][col] (M x N per split) and the bias, activation
  // and cast are left to splitk_finish. tma_store is 0 then.
  int splits = 1;
  float* partial = nullptr;
  // Stream-K (cooperative, splits == 1): the last sk_tiles tiles are shared
  // out by K-slices (WorkList); a head's sums go to fixup slot `cta`
  // (kFixupSlotFloats<BN / 2> floats each), flagged in fixup_flags (2 per
  // CTA, zeroed before the launch).
  int sk_tiles = 0;
  float* fixup = nullptr;
  int* fixup_flags = nullptr;
  // Rows of A a tile loads: BM, or for a product of fewer rows than a tile
  // (one tile row, m0 = 0) M rounded up to 8. The A box then covers only
  // those (a 1-row product moved 16 KB of zero fill per K-slice), and an m64
  // sub-tile with no row below a_rows issues no MMAs: its rows are past M
  // and never stored, whatever stale shared memory they would multiply.
  int a_rows = kBM;
};

// ---- the kernel ------------------------------------------------------------------------

// A_K: A is K-major ([M][K], lda = sam), else M-major ([K][M], lda = sak).
// B_K: B is K-major ([N][K], ldb = sbn), else N-major ([K][N], ldb = sbk).
// OFFLOAD: the offload epilogue (cooperative 128 x 256 and 128 x 128; opts.tma_store
// is 2 and tma_c valid).
template <typename T, Sched S, int BN, bool A_K, bool B_K, bool OFFLOAD = false,
          bool SMALL_A = false>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tma_a,
                      const __grid_constant__ CUtensorMap tma_b,
                      const __grid_constant__ CUtensorMap tma_c, const GemmArgs p,
                      const KernelOpts opts) {
#if FASTCOMM_SM90A_DEVICE
  using C = Cfg<T, S, BN, OFFLOAD, SMALL_A>;
  // float32 runs as TF32, whose wgmma reads shared-memory operands K-major only.
  constexpr bool kTF32 = std::is_same<T, float>::value;
  // TF32 with A M-major: A's slices go through registers (the RS wgmma form).
  constexpr bool kRS = kTF32 && !A_K;
  static_assert(!kTF32 || B_K, "TF32: B must be K-major");
  static_assert(!kRS || (S == Sched::kCoop && !OFFLOAD),
                "TF32 with A M-major: the cooperative kernel, direct epilogue");
  constexpr int kBK = C::BK;
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
  // The CTA's work: data-parallel units (tiles, or split K's tiles x
  // splits), then its stream-K range (matmul_sm90_work.cuh).
  const int splits = opts.splits;
  const WorkList work(static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), tiles_m * tiles_n,
                      num_kb, splits, PINGPONG ? 0 : opts.sk_tiles);
  // Tile order for L2 reuse: groups of opts.group_tiles tile rows walked
  // column by column, or of tile columns walked row by row.
  auto tile_origin = [&](int tile, int& m0, int& n0) {
    int tm, tn;
    if (opts.raster_n) {
      grouped_tile(tile, tiles_n, tiles_m, opts.group_tiles, tn, tm);
    } else {
      grouped_tile(tile, tiles_m, tiles_n, opts.group_tiles, tm, tn);
    }
    m0 = tm * BM;
    n0 = tn * BN;
  };
  // K-slices of item i (0 past the end of the list).
  auto item_num_kb = [&](int i) {
    WorkItem w;
    return work.item(i, w) ? w.kb_hi - w.kb_lo : 0;
  };

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), 1);                  // the producer's arrive.expect_tx (+ TMA bytes)
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
      // Launched as a programmatic dependent (launch_kernel): the setup above
      // ran under the previous kernel's tail; every global access of the CTA
      // follows these loads, which wait for that kernel to complete.
      griddep_wait();
      // Bytes of A per K-slice: a_rows rows of 128 B (K-major), or the
      // kBK-row boxes that hold them (M-major).
      const int a_bytes = A_K ? opts.a_rows * kBK * static_cast<int>(sizeof(T))
                              : (opts.a_rows + kBK - 1) / kBK * C::BOX_BYTES;
      int s = 0;
      uint32_t phase = 0;
      WorkItem w;
      for (int i = 0; work.item(i, w); ++i) {
        int m0, n0;
        tile_origin(w.tile, m0, n0);
        for (int kb = w.kb_lo; kb < w.kb_hi; ++kb) {
          // First round passes at once.
          mbar_wait(empty_bar(s), phase ^ 1);
          mbar_arrive_expect_tx(full_bar(s), a_bytes + C::B_BYTES);
          const int k0 = kb * kBK;
          const uint32_t a_dst = sA + s * C::A_BYTES;
          const uint32_t b_dst = sB + s * C::B_BYTES;
          if constexpr (A_K) {
            tma_load_2d(a_dst, &tma_a, k0, m0, full_bar(s));  // box {64 k, a_rows m}
          } else {
#pragma unroll
            for (int j = 0; j < C::A_ROWS / kBK; ++j) {
              if (kBK * j >= opts.a_rows) break;
              tma_load_2d(a_dst + j * C::BOX_BYTES, &tma_a, m0 + kBK * j, k0,
                          full_bar(s));  // box {kBK m, kBK k}
            }
          }
          if constexpr (B_K) {
            tma_load_2d(b_dst, &tma_b, k0, n0, full_bar(s));  // box {64 k, BN n}
          } else {
#pragma unroll
            for (int j = 0; j < BN / kBK; ++j) {
              tma_load_2d(b_dst + j * C::BOX_BYTES, &tma_b, n0 + kBK * j, k0,
                          full_bar(s));  // box {kBK n, kBK k}
            }
          }
          if (++s == STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      }
      // Every load is issued: a kernel launched as our programmatic
      // dependent (split K's splitk_finish) may be scheduled; it waits for
      // this grid to complete before it reads the sums.
      griddep_launch_dependents();
    }
    if constexpr (OFFLOAD) {
      if (tid >= 32) {
        // ---------------- epilogue warps (offload) ----------------
        // Warps 1-3, idle in the other forms: the tile's activation and
        // stores, under the consumers' next main loop.
        FASTCOMM_DISPATCH_ACT(p.act, (epilogue_warps_offload<T, kAct, BN>(
                                         p, &tma_c, sEpi, tile_full_bar, tile_empty_bar, tid - 32,
                                         work, tile_origin)));
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<C::CONSUMER_REGS>();
    const int cw = wg - 1;            // consumer warpgroup 0 or 1
    const int wtid = tid - 128 * wg;  // thread within the warpgroup
    const int lane = tid % 32;
    // Paired stores: 2 x 16 bits or 2 x 32 bits, aligned to their size.
    const bool pair_ok = pair_stores_ok<T>(p);
    const bool bias_paired = (reinterpret_cast<uintptr_t>(p.bias) & 3) == 0;
    // Descriptor geometry (bytes): K-major: rows of 128 B, 8-row groups 1 KB
    // apart, k16 step = 32 B within the swizzled row. M/N-major: 64-element
    // chunks 8 KB apart (LBO), 8-k groups 1 KB apart (SBO), k16 step = 2 KB.
    // TF32: K-major, k8 step = 32 B (8 x 4 bytes), the same geometry.
    constexpr uint32_t kAStepK = A_K ? 32u : 2048u;
    constexpr uint32_t kBStepK = B_K ? 32u : 2048u;
    constexpr uint32_t kALbo = A_K ? 16u : static_cast<uint32_t>(C::BOX_BYTES);
    constexpr uint32_t kBLbo = B_K ? 16u : static_cast<uint32_t>(C::BOX_BYTES);
    // A rows of this warpgroup's first m64 sub-tile: 64 rows = 8 KB into a
    // K-major tile, or the second 64-wide box of an M-major one: 8 KB either
    // way (cooperative, warpgroup 1); ping-pong warpgroups read all 128 rows.
    // With SMALL_A warpgroup 1 has no rows of A and issues no MMAs.
    const uint32_t a_off = (PINGPONG || SMALL_A) ? 0u : static_cast<uint32_t>(cw) * 8192u;
    // Stage 0, k16 step 0; desc_advance moves them.
    const DescPair a_desc0 = smem_desc_pair(sA + a_off, kALbo, 1024u);
    const DescPair b_desc0 = smem_desc_pair(sB, kBLbo, 1024u);
    auto release = [&](int s) {
      if (lane == 0) mbar_arrive(empty_bar(s));
    };
    // This warpgroup's items: all of the CTA's (cooperative), or every other
    // one starting at the cw-th (ping-pong).
    const int first = PINGPONG ? cw : 0;
    const int stride = PINGPONG ? 2 : 1;
    // The m64 sub-tiles of this warpgroup that hold rows of A
    // (KernelOpts::a_rows), a prefix of its MSUB: uniform over the warpgroup.
    const int live_sub = PINGPONG ? (opts.a_rows + 63) / 64 : (64 * cw < opts.a_rows ? 1 : 0);

    // kRS: where the thread's A fragments lie in a stage (rs_fragment_offsets).
    uint32_t rs_off[2] = {0u, 0u};
    if constexpr (kRS) rs_fragment_offsets(wtid, rs_off);

    float acc[MSUB][BN / 2];
    int j = 0;       // items this warpgroup has done
    int stored = 0;  // ... of which it stored the tile (all but stream-K heads)
    // Where the item's first K-slice sits in the producer's stage sequence:
    // the K-slices of the CTA's earlier items (ping-pong: of both
    // warpgroups' items, which alternate).
    int64_t it0 = (PINGPONG && cw == 1) ? item_num_kb(0) : 0;
    WorkItem w;
    for (int i = first; work.item(i, w); i += stride, ++j) {
      int m0, n0;
      tile_origin(w.tile, m0, n0);
      const int num_kb_unit = w.kb_hi - w.kb_lo;
      int s = static_cast<int>(it0 % STAGES);
      uint32_t phase = static_cast<uint32_t>((it0 / STAGES) & 1);
      it0 += num_kb_unit;
      if constexpr (PINGPONG) it0 += item_num_kb(i + 1);
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
      // The K loop over the first LIVE sub-tiles. Its count is a template
      // constant so that each loop is straight-line wgmma: a branch around
      // an MMA makes ptxas split the batch (extra fences and waits in the
      // hot loop). LIVE = 0 only follows the stages.
      auto k_loop = [&](auto live) {
        constexpr int LIVE = decltype(live)::value;
        for (int kb = 0; kb < num_kb_unit; ++kb) {
          mbar_wait(full_bar(s), phase);
          if constexpr (LIVE > 0) {
            // The slice's descriptors, moved by one add per k16 step.
            DescPair da = desc_advance(a_desc0, static_cast<uint32_t>(s) * C::A_BYTES);
            DescPair db = desc_advance(b_desc0, static_cast<uint32_t>(s) * C::B_BYTES);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBK * static_cast<int>(sizeof(T)) / 32; ++kk) {
#pragma unroll
              for (int mi = 0; mi < LIVE; ++mi) {
                wgmma_m64<BN, T, A_K ? 0 : 1, B_K ? 0 : 1>(
                    acc[mi], desc_u64(desc_advance(da, mi * 8192u)), desc_u64(db), 1);
              }
              da = desc_advance(da, kAStepK);
              db = desc_advance(db, kBStepK);
            }
            wgmma_commit();
            wgmma_wait<1>();  // the batch of slice kb-1 has retired: free its stage
          }
          if (kb > 0) release(prev_s);
          prev_s = s;
          if (++s == STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      };
      // kRS: the K loop with A from registers. Each k8 step of a slice is a
      // wgmma group of its own, whose 4 A words per thread are read from the
      // stage (2 ld.shared.v2, rounded to TF32 to nearest) into one of
      // kFragSets register sets once the group that used that set last has
      // retired (at most kFragSets - 1 groups in flight), so that the loads'
      // latency hides under the queued groups.
      constexpr int kFragSets = 4;
      auto k_loop_rs = [&](auto live) {
        constexpr bool LIVE = decltype(live)::value;
        uint32_t frag[kFragSets][4];
        for (int kb = 0; kb < num_kb_unit; ++kb) {
          mbar_wait(full_bar(s), phase);
          if constexpr (LIVE) {
            const uint32_t a_stage = sA + a_off + static_cast<uint32_t>(s) * C::A_BYTES;
            DescPair db = desc_advance(b_desc0, static_cast<uint32_t>(s) * C::B_BYTES);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
              uint32_t(&f)[4] = frag[kk % kFragSets];
              wgmma_wait<kFragSets - 1>();
#pragma unroll
              for (int q = 0; q < 2; ++q) {
                ld_shared_v2(a_stage + rs_off[q] + 1024u * kk, f[2 * q], f[2 * q + 1]);
              }
#pragma unroll
              for (int e = 0; e < 4; ++e) f[e] = to_tf32(f[e]);
              wgmma_fence();
              wgmma_m64_tf32_rs<BN>(acc[0], f, desc_u64(db), 1);
              wgmma_commit();
              db = desc_advance(db, kBStepK);
            }
          }
          // Slice kb-1's groups have retired (the wait before step 3): its stage is free.
          if (kb > 0) release(prev_s);
          prev_s = s;
          if (++s == STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      };
      // The tile's last MMAs have retired: the accumulators may be read and
      // the last stage goes back to the producer.
      auto retire_mmas = [&] {
        wgmma_wait<0>();
        fence_accumulators(acc);
        if (num_kb_unit > 0) release(prev_s);
      };
      if constexpr (kRS) {
        if (live_sub > 0) {
          k_loop_rs(std::true_type{});
        } else {
          k_loop_rs(std::false_type{});
        }
      } else if (live_sub >= MSUB) {
        k_loop(std::integral_constant<int, MSUB>{});
      } else if (MSUB > 1 && live_sub > 0) {
        k_loop(std::integral_constant<int, 1>{});
      } else {
        k_loop(std::integral_constant<int, 0>{});
      }
      if constexpr (!PINGPONG) {
        // Stream-K: a head's sums go to this CTA's fix-up slot (the tile is
        // stored by the next CTA); a tail adds the previous CTA's first.
        if (w.head) {
          retire_mmas();
          fixup_store<BN / 2>(acc[0], opts.fixup, opts.fixup_flags, work.cta, cw, wtid, 1 + cw);
          continue;
        }
        if (w.tail) {
          // The accumulators are read; the stage goes back in the epilogue.
          wgmma_wait<0>();
          fence_accumulators(acc);
          fixup_add<BN / 2>(acc[0], opts.fixup, opts.fixup_flags, work.cta - 1, cw, wtid, 1 + cw);
        }
      }
      [[maybe_unused]] const int sj = stored++;  // tiles this warpgroup stored before this one
      if constexpr (kRS) {
        // The tile of C^T goes to C (or split K's sums, in C's orientation).
        retire_mmas();
        const int block_row = m0 + 64 * cw;
        if (splits > 1) {
          epilogue_rs<Act::kNone, BN>(acc[0], opts.partial + static_cast<int64_t>(w.split) * M * N,
                                      M, nullptr, block_row, n0, wtid, M, N);
        } else {
          FASTCOMM_DISPATCH_ACT(
              p.act, (epilogue_rs<kAct, BN>(acc[0], static_cast<float*>(p.c), p.ldc,
                                            static_cast<const float*>(p.bias), block_row, n0, wtid,
                                            M, N)));
        }
        continue;
      }
      if constexpr (OFFLOAD) {
        // Offload epilogue: the bias loads go out under the last MMAs, as in
        // the lean one; then the tile goes into the tile buffer as acc + bias
        // (relu applied), and the epilogue warps do the rest.
        uint32_t bw[BN / 8];
        prefetch_bias<T, BN>(p, n0, wtid, bias_paired, bw);
        retire_mmas();
        // The stores of the tile stored before (sj - 1) have read the buffer
        // (the first passes at once; the protocol is traced above
        // epilogue_offload_write, with j counting stored tiles).
        mbar_wait(tile_empty_bar, static_cast<uint32_t>(sj & 1) ^ 1u);
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
        if (!act_has_math(p.act)) fence_proxy_async_smem();
        // The warp's writes (and fences) are done before lane 0 releases them.
        __syncwarp();
        if (lane == 0) mbar_arrive(tile_full_bar);
        continue;
      }
      if constexpr (PINGPONG) {
        // All our MMAs are issued: the other warpgroup may start its tile.
        if (lane == 0) mbar_arrive(order_bar(cw ^ 1));
      } else if constexpr (!kTF32 && C::TMA_EPI) {
        if (opts.tma_store == 1) {
          // Lean TMA epilogue: the bias loads go out under the last MMAs.
          uint32_t bw[BN / 8];
          prefetch_bias<T, BN>(p, n0, wtid, bias_paired, bw);
          retire_mmas();
          const uint32_t stage = sEpi + static_cast<uint32_t>(cw) * 2u * kEpiChunkBytes;
          // The chunks stored so far alternate the two buffers: with an odd
          // count per tile (128 x 192) the next tile starts on the other one.
          const uint32_t first_buf = static_cast<uint32_t>(sj * (BN / 64)) & 1u;
          FASTCOMM_DISPATCH_ACT(
              p.act, (epilogue_tma<T, kAct, BN>(p, &tma_c, acc, bw, stage, first_buf, m0 + 64 * cw,
                                                n0, wtid, 1 + cw)));
          continue;
        }
      }
      if constexpr (!kTF32 && !PINGPONG) {
        if (splits == 1) {
          // Direct stores: the bias loads go out under the last MMAs, as in
          // the TMA epilogue.
          uint32_t bw[BN / 8];
          prefetch_bias<T, BN>(p, n0, wtid, bias_paired, bw);
          retire_mmas();
          const int block_row = m0 + 64 * cw;
          const bool interior = block_row + 64 <= M && n0 + BN <= N && pair_ok;
          FASTCOMM_DISPATCH_ACT(
              p.act, (epilogue_direct<T, kAct, MSUB, BN, true>(p, acc, bw, block_row, n0, wtid,
                                                               interior, pair_ok, bias_paired)));
          continue;
        }
      }
      retire_mmas();
      const int block_row = m0 + (PINGPONG ? 0 : 64 * cw);  // first row of our 64 * MSUB
      if (splits > 1) {
        // Split K: the float32 sums into this split's slab of the workspace.
        epilogue_partial<MSUB, BN>(acc, opts.partial + static_cast<int64_t>(w.split) * M * N,
                                   block_row, n0, wtid, M, N);
        continue;
      }
      const bool interior = block_row + 64 * MSUB <= M && n0 + BN <= N && pair_ok &&
                            (p.bias == nullptr || bias_paired);
      const uint32_t no_bias_regs[BN / 8] = {};
      FASTCOMM_DISPATCH_ACT(
          p.act, (epilogue_direct<T, kAct, MSUB, BN, false>(p, acc, no_bias_regs, block_row, n0,
                                                            wtid, interior, pair_ok, bias_paired)));
    }
    if constexpr (!PINGPONG && !OFFLOAD) {
      // The staging buffers must outlive the stores that read them.
      if (opts.tma_store && wtid == 0) bulk_wait_all();
    }
  }
#endif
}

// ---- host side -----------------------------------------------------------------------

template <typename T, Sched S, int BN, bool A_K, bool B_K, bool OFFLOAD, bool SMALL_A>
cudaError_t launch_kernel(const GemmArgs& p, const Plan& plan, cudaStream_t stream) {
  using C = Cfg<T, S, BN, OFFLOAD, SMALL_A>;
  if (SMALL_A && p.M > C::A_ROWS) return cudaErrorInvalidValue;
  constexpr int kBK = C::BK;
  CUtensorMap ma, mb, mc;
  // A product of fewer rows than a tile loads only its rows (KernelOpts::a_rows).
  const int a_rows = p.M < C::BM ? static_cast<int>((p.M + 7) / 8 * 8) : C::BM;
  const bool ok_a = A_K ? make_map(&ma, p.dtype, p.a, p.K, p.M, p.sam, kBK, a_rows)
                        : make_map(&ma, p.dtype, p.a, p.M, p.K, p.sak, kBK, kBK);
  const bool ok_b = B_K ? make_map(&mb, p.dtype, p.b, p.K, p.N, p.sbn, kBK, BN)
                        : make_map(&mb, p.dtype, p.b, p.N, p.K, p.sbk, kBK, kBK);
  if (!ok_a || !ok_b) return cudaErrorInvalidValue;
  KernelOpts opts;
  opts.a_rows = a_rows;
  opts.raster_n = plan.raster_n ? 1 : 0;
  opts.splits = plan.splits;
  opts.partial = plan.partial;
  if (plan.splits > 1 && (plan.partial == nullptr || plan.tma_store || OFFLOAD)) {
    return cudaErrorInvalidValue;
  }
  const int64_t tiles = ((p.M + C::BM - 1) / C::BM) * ((p.N + BN - 1) / BN);
  if (plan.sk_tiles > 0) {
    // The fix-up slots are one per CTA of a full persistent grid, and a CTA's
    // range spans at least one tile's K (at most two CTAs per tile).
    if (S != Sched::kCoop || plan.splits > 1 || plan.fixup == nullptr ||
        plan.fixup_flags == nullptr || plan.sk_tiles > tiles || plan.sk_tiles < plan.num_sms ||
        tiles < plan.num_sms) {
      return cudaErrorInvalidValue;
    }
    opts.sk_tiles = plan.sk_tiles;
    opts.fixup = plan.fixup;
    opts.fixup_flags = plan.fixup_flags;
  }
  opts.group_tiles = std::max(1, plan.raster_n ? plan.group / BN : plan.group / C::BM);
  if constexpr (OFFLOAD) {
    opts.tma_store = 2;  // the dispatcher picks OFFLOAD only where C takes TMA stores
  } else {
    opts.tma_store = (C::TMA_EPI && plan.tma_store) ? 1 : 0;
  }
  if (std::is_same<T, float>::value && opts.tma_store) return cudaErrorInvalidValue;
  if (opts.tma_store) {
    // C [M][N] row-major, 64 x 64 boxes (one swizzle row wide).
    if (!make_map(&mc, p.dtype, p.c, p.N, p.M, p.ldc, 64, 64)) return cudaErrorInvalidValue;
  } else {
    mc = mb;  // unused by the kernel; any valid map
  }
  const int64_t units = tiles * plan.splits;
  if (units > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = gemm_wgmma_kernel<T, S, BN, A_K, B_K, OFFLOAD, SMALL_A>;

  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  // The shared-memory opt-in, once per kernel and device; a failure is
  // returned, not kept: the next call tries again.
  static std::atomic<bool> ready[64];
  if (!ready[dev].load(std::memory_order_acquire)) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[dev].load(std::memory_order_relaxed)) {
      err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
      if (err != cudaSuccess) return err;
      ready[dev].store(true, std::memory_order_release);
      // (FASTCOMM_LOG=INFO) the persistent grid decides how well the tiles
      // spread over the SMs.
      FASTCOMM_LOG(Info, "matmul wgmma kernel "
                             << (S == Sched::kPingpong ? "ping-pong" : "cooperative")
                             << (OFFLOAD ? " offload" : "") << " " << C::BM << "x" << BN
                             << (SMALL_A ? " (64 rows of A per stage)" : "") << " layout "
                             << (A_K ? "K" : "M") << (B_K ? "K" : "N") << " on device " << dev
                             << ": " << C::SMEM_BYTES << " B shared memory, " << plan.num_sms
                             << " SMs");
    }
  }

  const int64_t grid = units < plan.num_sms ? units : plan.num_sms;
  // The launch's own status (not cudaGetLastError, which would also report an
  // earlier, unrelated failure of this thread as this launch's).
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(static_cast<unsigned>(grid));
  launch.blockDim = dim3(kThreads);
  launch.dynamicSmemBytes = C::SMEM_BYTES;
  launch.stream = stream;
  // Programmatic dependent launch: the CTAs may start (barrier setup, tensor
  // map prefetch) while the kernel before them on the stream finishes; the
  // producer waits for it before the first load (griddep_wait).
  cudaLaunchAttribute pdl = programmatic_dependent_launch();
  launch.attrs = &pdl;
  launch.numAttrs = 1;
  return cudaLaunchKernelEx(&launch, kernel, ma, mb, mc, p, opts);
}

template <typename T, Sched S, int BN, bool OFFLOAD = false, bool SMALL_A = false>
cudaError_t launch_layout(const GemmArgs& p, const Plan& plan, cudaStream_t stream) {
  const bool a_k = p.sak == 1, b_k = p.sbk == 1;
  if constexpr (std::is_same<T, float>::value) {
    // TF32: B K-major; A K-major, or M-major in the cooperative kernel (the
    // transposed product of kernels/matmul_sm90.cu).
    if (!b_k) return cudaErrorInvalidValue;
    if (a_k) return launch_kernel<T, S, BN, true, true, false, SMALL_A>(p, plan, stream);
    if constexpr (S == Sched::kCoop) {
      return launch_kernel<T, S, BN, false, true, false, SMALL_A>(p, plan, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  } else {
    if (a_k && b_k) return launch_kernel<T, S, BN, true, true, OFFLOAD, SMALL_A>(p, plan, stream);
    if (a_k) return launch_kernel<T, S, BN, true, false, OFFLOAD, SMALL_A>(p, plan, stream);
    if (b_k) return launch_kernel<T, S, BN, false, true, OFFLOAD, SMALL_A>(p, plan, stream);
    return launch_kernel<T, S, BN, false, false, OFFLOAD, SMALL_A>(p, plan, stream);
  }
}

template <typename T, Sched S>
cudaError_t launch_sched(const GemmArgs& p, const Plan& plan, cudaStream_t stream) {
  if constexpr (S == Sched::kPingpong) {
    return launch_layout<T, S, 128>(p, plan, stream);
  } else {
    if (plan.bn == 256) {
      if (plan.epi_offload) {  // 3 stages + the tile buffer: separate kernels
        if constexpr (sizeof(T) == 2) {
          return launch_layout<T, S, 256, true>(p, plan, stream);
        } else {
          return cudaErrorInvalidValue;  // 16-bit outputs only
        }
      }
      return launch_layout<T, S, 256>(p, plan, stream);
    }
    if (plan.bn == 192) {
      if constexpr (sizeof(T) == 2) {
        return launch_layout<T, S, 192>(p, plan, stream);
      } else {
        return cudaErrorInvalidValue;  // 16-bit types only (choose_plan)
      }
    }
    if (plan.bn == 64) {
      // At most 64 rows: the stages hold 64 rows of A and are deeper (SMALL_A).
      if (p.M <= 64) return launch_layout<T, S, 64, false, true>(p, plan, stream);
      return launch_layout<T, S, 64>(p, plan, stream);
    }
    if (plan.epi_offload) {
      if constexpr (sizeof(T) == 2) {
        return launch_layout<T, S, 128, true>(p, plan, stream);
      } else {
        return cudaErrorInvalidValue;  // 16-bit outputs only
      }
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
