// Hopper (sm_90a) GEMM for float16 / bfloat16: TMA loads, wgmma, a multi-stage
// shared-memory pipeline, warp-specialised producer / consumers, persistent
// tile scheduling, and the epilogue (bias, activation, cast) fused into the
// store.
//
// STATUS: compiled for sm_90a only, and NOT YET VALIDATED ON A GPU. The
// dispatcher (csrc/ops/cuda/matmul_cuda.cpp) selects it only on an sm_90
// device and only when FASTCOMM_MATMUL_WGMMA=1 is set (or when forced with
// FASTCOMM_MATMUL_IMPL=wgmma). Make it the default once
// tests/test_ops.py::test_cuda_wgmma_kernel passes on the GPU machine.
//
// Structure (one CTA per SM, 384 threads = 3 warpgroups):
//  * warpgroup 0, the producer: gives registers back (setmaxnreg.dec) and one
//    thread walks the CTA's tiles and K-slices, waiting for a free stage
//    ("empty" mbarrier) and issuing the TMA copies of the A and B tiles of the
//    slice into it, which signal the stage's "full" mbarrier with their byte
//    count;
//  * warpgroups 1 and 2, the consumers (setmaxnreg.inc): each owns 64 rows of
//    the 128 x BN tile in registers (BN/2 float32 per thread); per K-slice
//    they wait for "full", issue 4 wgmma m64nBNk16 on the stage, and release
//    the stage of the previous slice once the wgmma reading it has retired
//    (wgmma.wait_group 1), so one wgmma batch is always in flight; after the
//    last slice they apply bias + activation and store to global memory while
//    the producer already fills the stages with the next tile's slices.
//  * Tiles: 128 x 256 (4 stages of 48 KB) or 128 x 128 (6 stages of 32 KB),
//    BK = 64 (one 128-byte swizzle row); tile order grouped by 8 tile rows
//    for L2 reuse; grid = min(#tiles, #SMs), each CTA strides over tiles.
//  * Layouts: K-major operands are one TMA box per tile (128B swizzle, the
//    canonical K-major wgmma layout, descriptor advanced by 32 bytes per
//    k16 step). M-/N-major operands (e.g. b of matmul(a, b) with b [K, N]
//    row-major) are loaded as 64-wide boxes along M/N and consumed with the
//    wgmma transpose flag (canonical MN-major 128B-swizzle layout: LBO = 8 KB
//    between 64-element M/N chunks, SBO = 1 KB between 8-row K groups).
//  * Edges: TMA zero-fills out-of-range rows / columns of a box (so any M, N,
//    K), the epilogue masks stores outside C.
//  * Optional clusters of 2 CTAs (FASTCOMM_MATMUL_CLUSTER=2): vertically
//    adjacent tiles share the B tile, each CTA loading half of it with a TMA
//    multicast to both (see the CLUSTER template parameter).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <climits>
#include <mutex>
#include <type_traits>

#include "matmul_device.cuh"
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

constexpr int kBM = 128;       // tile rows (2 consumer warpgroups x 64)
constexpr int kBK = 64;        // K per stage: 64 x 2 bytes = one 128-byte swizzle row
constexpr int kThreads = 384;  // producer + 2 consumer warpgroups

template <int BN>
struct Cfg {
  static constexpr int STAGES = BN == 256 ? 4 : 6;
  static constexpr int A_BYTES = kBM * kBK * 2;  // 16 KB
  static constexpr int B_BYTES = BN * kBK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SMEM_BYTES = 1024 + STAGES * STAGE_BYTES;  // + slack for 1024-byte alignment
  static constexpr int BOX_BYTES = 64 * 64 * 2;  // one 64 x 64 box (M/N-major operands)
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;  // 128 x (40 + 2 x 232) <= 64K registers
};

// ---- PTX wrappers (sm_90a) ---------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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

// Blocks until the phase of `bar` with the given parity has completed.
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
// into shared memory at dst, completing `bytes` on the mbarrier bar.
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

// Same, multicast to the CTAs of the cluster in cta_mask: the box lands at
// the same shared-memory offset in each and completes on each one's mbarrier
// at the same offset.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int c0,
                                                      int c1, uint32_t bar, uint16_t cta_mask) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::"
      "cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
#endif
}

// Arrives on the mbarrier at the same shared-memory offset in CTA `cta` of
// the cluster.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar, uint32_t cta) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
#endif
}

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r = 0;
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}

// All threads of all CTAs of the cluster (also a CTA-wide barrier).
__device__ __forceinline__ void cluster_sync() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
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
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle.
//   bits  0-13: start address >> 4
//   bits 16-29: leading-dimension byte offset >> 4
//   bits 32-45: stride-dimension byte offset >> 4
//   bits 62-63: swizzle mode (1 = 128B)
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

template <typename T, int BN, int TA, int TB>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], uint64_t da, uint64_t db) {
  if constexpr (BN == 256) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      wgmma_m64n256k16_bf16<TA, TB>(d, da, db, 1);
    } else {
      wgmma_m64n256k16_f16<TA, TB>(d, da, db, 1);
    }
  } else {
    static_assert(BN == 128, "BN must be 128 or 256");
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
      wgmma_m64n128k16_bf16<TA, TB>(d, da, db, 1);
    } else {
      wgmma_m64n128k16_f16<TA, TB>(d, da, db, 1);
    }
  }
}

// Accumulator layout of wgmma m64nNk16 (float32): in warp w of the
// warpgroup, lane l holds for each 8-column block j the elements
// (16w + l/4, 8j + 2(l%4) + {0,1}) in d[4j], d[4j+1] and the same two
// columns of row 16w + l/4 + 8 in d[4j+2], d[4j+3].
template <typename T, Act ACT, int BN>
__device__ __forceinline__ void wgmma_epilogue(const GemmArgs& p, const float (&acc)[BN / 2],
                                               int row, int col0, bool pair_ok) {
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = col0 + 8 * j;
    epilogue_pair<T, ACT>(p, row, col, acc[4 * j], acc[4 * j + 1], pair_ok);
    epilogue_pair<T, ACT>(p, row + 8, col, acc[4 * j + 2], acc[4 * j + 3], pair_ok);
  }
}

// A_K: A is K-major ([M][K], lda = sam), else M-major ([K][M], lda = sak).
// B_K: B is K-major ([N][K], ldb = sbn), else N-major ([K][N], ldb = sbk).
// CLUSTER: 1, or 2 for pairs of CTAs that compute vertically adjacent tiles
// (same columns of B): each CTA loads half of the B tile and multicasts it
// to both, which cuts the L2 -> shared-memory traffic per CTA by a third.
template <typename T, int BN, bool A_K, bool B_K, int CLUSTER>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tma_a,
                      const __grid_constant__ CUtensorMap tma_b, const GemmArgs p) {
#if FASTCOMM_SM90A_DEVICE
  static_assert(CLUSTER == 1 || CLUSTER == 2, "cluster of 1 or 2 CTAs");
  using C = Cfg<BN>;
  constexpr int STAGES = C::STAGES;
  // Static shared memory only in the real kernel: gemm_wgmma_compiled() reads
  // its size to tell this build from an empty one (plain sm_90 target).
  __shared__ __align__(8) uint64_t bars[2 * STAGES];  // full[0..S), empty[S..2S)

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 128B-swizzled tiles must start on 1024-byte boundaries.
  const uint32_t smem_base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sA = smem_base;
  const uint32_t sB = smem_base + STAGES * C::A_BYTES;
  const uint32_t bar0 = smem_u32(bars);
  auto full_bar = [&](int s) { return bar0 + 8u * s; };
  auto empty_bar = [&](int s) { return bar0 + 8u * (STAGES + s); };

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  const int tiles_m = (M + kBM - 1) / kBM;
  const int tiles_n = (N + BN - 1) / BN;
  const int num_kb = (K + kBK - 1) / kBK;
  // Work units: single tiles, or vertical pairs of tiles for a cluster of 2.
  const int units_m = (tiles_m + CLUSTER - 1) / CLUSTER;
  const int num_units = units_m * tiles_n;
  const int first_unit = blockIdx.x / CLUSTER;
  const int unit_stride = gridDim.x / CLUSTER;
  const uint32_t rank = CLUSTER == 2 ? cluster_ctarank() : 0u;
  auto unit_tile = [&](int unit, int& m0, int& n0) {
    int um, tn;
    grouped_tile<8 / CLUSTER>(unit, units_m, tiles_n, um, tn);
    m0 = (um * CLUSTER + static_cast<int>(rank)) * kBM;
    n0 = tn * BN;
  };

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), 1);             // the producer's arrive.expect_tx (+ TMA bytes)
      mbar_init(empty_bar(s), 8 * CLUSTER);  // one arrival per consumer warp of the cluster
    }
    mbar_init_fence();
  }
  if constexpr (CLUSTER == 2) {
    cluster_sync();  // the peer's barriers are initialised before anyone signals them
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    // ---------------- producer ----------------
    setmaxnreg_dec<C::PRODUCER_REGS>();
    if (tid == 0) {
      tma_prefetch_map(&tma_a);
      tma_prefetch_map(&tma_b);
      int it = 0;
      for (int unit = first_unit; unit < num_units; unit += unit_stride) {
        int m0, n0;
        unit_tile(unit, m0, n0);
        for (int kb = 0; kb < num_kb; ++kb, ++it) {
          const int s = it % STAGES;
          const uint32_t phase = (it / STAGES) & 1;
          // First round passes at once. With a cluster, this also waits for
          // the peer's consumers: our multicast writes into their stage too.
          mbar_wait(empty_bar(s), phase ^ 1);
          mbar_arrive_expect_tx(full_bar(s), C::STAGE_BYTES);
          const int k0 = kb * kBK;
          const uint32_t a_dst = sA + s * C::A_BYTES;
          const uint32_t b_dst = sB + s * C::B_BYTES;
          if constexpr (A_K) {
            tma_load_2d(a_dst, &tma_a, k0, m0, full_bar(s));  // box {64 k, 128 m}
          } else {
#pragma unroll
            for (int j = 0; j < kBM / 64; ++j) {
              tma_load_2d(a_dst + j * C::BOX_BYTES, &tma_a, m0 + 64 * j, k0,
                          full_bar(s));  // box {64 m, 64 k}
            }
          }
          if constexpr (CLUSTER == 1) {
            if constexpr (B_K) {
              tma_load_2d(b_dst, &tma_b, k0, n0, full_bar(s));  // box {64 k, BN n}
            } else {
#pragma unroll
              for (int j = 0; j < BN / 64; ++j) {
                tma_load_2d(b_dst + j * C::BOX_BYTES, &tma_b, n0 + 64 * j, k0,
                            full_bar(s));  // box {64 n, 64 k}
              }
            }
          } else {
            // This CTA's half of the B tile, to both CTAs.
            if constexpr (B_K) {
              const int half = static_cast<int>(rank) * (BN / 2);  // box {64 k, BN/2 n}
              tma_load_2d_multicast(b_dst + half * 128, &tma_b, k0, n0 + half, full_bar(s), 0x3);
            } else {
#pragma unroll
              for (int jj = 0; jj < BN / 128; ++jj) {
                const int j = static_cast<int>(rank) * (BN / 128) + jj;
                tma_load_2d_multicast(b_dst + j * C::BOX_BYTES, &tma_b, n0 + 64 * j, k0,
                                      full_bar(s), 0x3);
              }
            }
          }
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    setmaxnreg_inc<C::CONSUMER_REGS>();
    const int cw = wg - 1;  // rows [64 cw, 64 cw + 64) of the tile
    const int warp = (tid % 128) / 32, lane = tid % 32;
    const bool pair_ok = (p.ldc % 2 == 0) && ((reinterpret_cast<uintptr_t>(p.c) & 3) == 0);
    // Descriptor geometry (bytes): K-major: rows of 128 B, 8-row groups 1 KB
    // apart, k16 step = 32 B within the swizzled row. M/N-major: 64-element
    // chunks 8 KB apart (LBO), 8-k groups 1 KB apart (SBO), k16 step = 2 KB.
    constexpr uint32_t kAStepK = A_K ? 32u : 2048u;
    constexpr uint32_t kBStepK = B_K ? 32u : 2048u;
    constexpr uint32_t kALbo = A_K ? 16u : static_cast<uint32_t>(C::BOX_BYTES);
    constexpr uint32_t kBLbo = B_K ? 16u : static_cast<uint32_t>(C::BOX_BYTES);
    // This warpgroup's 64 rows of A: 64 x 128 B = 8 KB into a K-major tile,
    // or the second 64-wide box of an M-major one: 8 KB either way.
    const uint32_t a_off = static_cast<uint32_t>(cw) * 8192u;
    auto release = [&](int s) {
      if (lane == 0) {
        mbar_arrive(empty_bar(s));
        if constexpr (CLUSTER == 2) mbar_arrive_remote(empty_bar(s), rank ^ 1u);
      }
    };

    float acc[BN / 2];
    int it = 0;
    for (int unit = first_unit; unit < num_units; unit += unit_stride) {
      int m0, n0;
      unit_tile(unit, m0, n0);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
      fence_accumulators(acc);
      int prev_s = 0;
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const int s = it % STAGES;
        mbar_wait(full_bar(s), (it / STAGES) & 1);
        const uint32_t a_base = sA + s * C::A_BYTES + a_off;
        const uint32_t b_base = sB + s * C::B_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = smem_desc(a_base + kk * kAStepK, kALbo, 1024u);
          const uint64_t db = smem_desc(b_base + kk * kBStepK, kBLbo, 1024u);
          wgmma_k16<T, BN, A_K ? 0 : 1, B_K ? 0 : 1>(acc, da, db);
        }
        wgmma_commit();
        wgmma_wait<1>();  // the batch of slice kb-1 has retired: free its stage
        if (kb > 0) release(prev_s);
        prev_s = s;
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (num_kb > 0) release(prev_s);

      const int row = m0 + cw * 64 + warp * 16 + (lane >> 2);
      const int col0 = n0 + (lane & 3) * 2;
      FASTCOMM_DISPATCH_ACT(p.act, (wgmma_epilogue<T, kAct, BN>(p, acc, row, col0, pair_ok)));
    }
  }
  if constexpr (CLUSTER == 2) {
    // No CTA may exit while its peer can still multicast into its shared
    // memory or arrive on its barriers.
    cluster_sync();
  }
#endif
}

// ---- host side -----------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// 2-D map over a [outer][inner] row-major matrix with leading dimension ld
// (elements), boxes of box_inner x box_outer, 128-byte swizzle, zero fill.
bool make_map(CUtensorMap* map, DType dtype, const void* ptr, int64_t inner, int64_t outer,
              int64_t ld, uint32_t box_inner, uint32_t box_outer) {
  auto fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapDataType dt =
      dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = fn(map, dt, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

template <typename T, int BN, bool A_K, bool B_K, int CLUSTER>
cudaError_t launch(const GemmArgs& p, int num_sms, cudaStream_t stream) {
  using C = Cfg<BN>;
  CUtensorMap ma, mb;
  const bool ok_a = A_K ? make_map(&ma, p.dtype, p.a, p.K, p.M, p.sam, kBK, kBM)
                        : make_map(&ma, p.dtype, p.a, p.M, p.K, p.sak, 64, kBK);
  // With a cluster of 2, each CTA loads half of a K-major B tile.
  const bool ok_b = B_K ? make_map(&mb, p.dtype, p.b, p.K, p.N, p.sbn, kBK, BN / CLUSTER)
                        : make_map(&mb, p.dtype, p.b, p.N, p.K, p.sbk, 64, kBK);
  if (!ok_a || !ok_b) return cudaErrorInvalidValue;
  const int64_t tiles_m = (p.M + kBM - 1) / kBM;
  const int64_t units = ((tiles_m + CLUSTER - 1) / CLUSTER) * ((p.N + BN - 1) / BN);
  if (units * CLUSTER > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = gemm_wgmma_kernel<T, BN, A_K, B_K, CLUSTER>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
  if (err != cudaSuccess) return err;
  if constexpr (CLUSTER == 1) {
    const int64_t grid = units < num_sms ? units : num_sms;
    kernel<<<static_cast<unsigned>(grid), kThreads, C::SMEM_BYTES, stream>>>(ma, mb, p);
    return cudaGetLastError();
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = C::SMEM_BYTES;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CLUSTER;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    // Persistent grid: as many clusters as can be resident at once (pairs of
    // SMs of one GPC; fewer than #SMs / 2 when a GPC has an odd SM count).
    static int resident[64] = {0};
    int dev = 0;
    err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
    if (resident[dev] == 0) {
      cfg.gridDim = dim3(static_cast<unsigned>(num_sms / CLUSTER * CLUSTER), 1, 1);
      int n = 0;
      err = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
      if (err != cudaSuccess) return err;
      resident[dev] = n > 0 ? n : 1;
    }
    const int64_t max_units = resident[dev];
    cfg.gridDim =
        dim3(static_cast<unsigned>((units < max_units ? units : max_units) * CLUSTER), 1, 1);
    return cudaLaunchKernelEx(&cfg, kernel, ma, mb, p);
  }
}

template <typename T, int BN, int CLUSTER>
cudaError_t launch_layout(const GemmArgs& p, int num_sms, cudaStream_t stream) {
  const bool a_k = p.sak == 1, b_k = p.sbk == 1;
  if (a_k && b_k) return launch<T, BN, true, true, CLUSTER>(p, num_sms, stream);
  if (a_k) return launch<T, BN, true, false, CLUSTER>(p, num_sms, stream);
  if (b_k) return launch<T, BN, false, true, CLUSTER>(p, num_sms, stream);
  return launch<T, BN, false, false, CLUSTER>(p, num_sms, stream);
}

template <typename T>
cudaError_t launch_type(const GemmArgs& p, int num_sms, bool wide, int cluster,
                        cudaStream_t stream) {
  if (cluster == 2) {
    return wide ? launch_layout<T, 256, 2>(p, num_sms, stream)
                : launch_layout<T, 128, 2>(p, num_sms, stream);
  }
  return wide ? launch_layout<T, 256, 1>(p, num_sms, stream)
              : launch_layout<T, 128, 1>(p, num_sms, stream);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// One operand of the TMA path: unit stride along `inner`, leading dimension
// ld (elements) that TMA accepts (multiple of 16 bytes, not below the row).
bool tma_operand_ok(int64_t inner, int64_t ld) {
  return ld % 8 == 0 && ld >= inner && ld < (int64_t(1) << 36);
}

}  // namespace sm90

bool gemm_wgmma_supported(const GemmArgs& p, bool allow_mn_major) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) return false;
  if (p.M <= 0 || p.N <= 0 || p.K <= 0 || p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    return false;
  if (!sm90::aligned16(p.a) || !sm90::aligned16(p.b)) return false;
  const bool a_ok = (p.sak == 1 && sm90::tma_operand_ok(p.K, p.sam)) ||
                    (allow_mn_major && p.sam == 1 && sm90::tma_operand_ok(p.M, p.sak));
  const bool b_ok = (p.sbk == 1 && sm90::tma_operand_ok(p.K, p.sbn)) ||
                    (allow_mn_major && p.sbn == 1 && sm90::tma_operand_ok(p.N, p.sbk));
  return a_ok && b_ok;
}

bool gemm_wgmma_compiled() {
  static std::mutex mu;
  static int known[64] = {0};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return false;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (known[dev] == 0) {
    cudaFuncAttributes attr{};
    const cudaError_t err =
        cudaFuncGetAttributes(&attr, sm90::gemm_wgmma_kernel<__nv_bfloat16, 256, true, true, 1>);
    // The real kernel has its mbarriers in static shared memory; the empty
    // body of a build without sm_90a has none.
    const bool ok = err == cudaSuccess && attr.binaryVersion >= 90 && attr.sharedSizeBytes > 0;
    if (err != cudaSuccess) cudaGetLastError();
    known[dev] = ok ? 1 : 2;
  }
  return known[dev] == 1;
}

cudaError_t launch_gemm_wgmma_sm90(const GemmArgs& p, int num_sms, Tile tile, int cluster,
                                   cudaStream_t stream) {
  if (!gemm_wgmma_supported(p, true) || num_sms <= 0 || (cluster != 1 && cluster != 2)) {
    return cudaErrorInvalidValue;
  }
  bool wide;
  if (tile == Tile::kAuto) {
    // Compare the wave-quantised cost of 128x256 and 128x128 tiles; the
    // narrower tile is assumed 20% less efficient per FLOP (more shared
    // memory traffic per wgmma).
    const int64_t tm = (p.M + 127) / 128;
    const int64_t waves256 = (tm * ((p.N + 255) / 256) + num_sms - 1) / num_sms;
    const int64_t waves128 = (tm * ((p.N + 127) / 128) + num_sms - 1) / num_sms;
    wide = static_cast<double>(waves256) * 256.0 <= static_cast<double>(waves128) * 128.0 / 0.8;
  } else {
    wide = tile == Tile::kLarge;
  }
  if (p.dtype == DType::kBF16)
    return sm90::launch_type<__nv_bfloat16>(p, num_sms, wide, cluster, stream);
  return sm90::launch_type<__half>(p, num_sms, wide, cluster, stream);
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
