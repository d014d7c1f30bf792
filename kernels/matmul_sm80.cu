// Tensor-core GEMM on sm_80 and later (mma.sync): float16 / bfloat16, and
// float32 as TF32.
//
// The tiled fallback of the fastcomm matmul on every GPU from Ampere on; on
// Hopper the TF32 form takes small-M products whose B (or A) is not K-major,
// which the wgmma kernel would first have to copy K-major.
//
//  * Block tile BM x BN x BK (128x128 with 8 warps, or 64x64 with 4 warps for
//    problems too small to fill the GPU with large tiles; BK = 64 bytes of K);
//    each warp owns a (BM/WARPS_M) x (BN/WARPS_N) piece of C in registers as
//    m16n8 accumulators (float32): m16n8k16 for the 16-bit types, m16n8k8
//    for TF32, both 32 bytes of K per step with the same fragment registers.
//  * A STAGES-deep shared-memory ring filled with 16-byte cp.async copies;
//    the copy of K-slice kb+STAGES-1 is in flight while slice kb is
//    multiplied.
//  * Operands may be K-major or M/N-major (template flags A_K / B_K): the
//    tile is stored in shared memory as it lies in global memory and the
//    fragments are read with ldmatrix (K-major; .trans for M/N-major 16-bit
//    tiles) or, for M/N-major float32 tiles (no 32-bit transpose in
//    ldmatrix), one 4-byte load per fragment register. Rows are padded by 16
//    bytes (32 for M/N-major float32: a row stride of 8 banks mod 32 puts the
//    fragment's 4 K rows x 8 columns in 32 different banks), which keeps both
//    the fragment loads and the copies free of bank conflicts.
//  * TF32: each fragment value is rounded to TF32 (cvt.rna) before the MMA,
//    which would otherwise drop its low 13 mantissa bits.
//  * Edges: 16-byte chunks that lie wholly inside the matrix are copied with
//    cp.async, chunks that straddle its end are copied element by element,
//    chunks outside are zero-filled; so any M, N, K works. A warp whose rows
//    all lie past M (small M) issues no MMAs.
//  * Epilogue: bias + activation + cast fused into the register -> global
//    store (paired stores of two adjacent outputs).
//  * Split K: where the output tiles are too few to occupy the SMs (small M:
//    batch x tokens), gridDim.y blocks share each tile, each multiplying a
//    contiguous range of K-slices and writing float32 sums; splitk_finish
//    adds them in order and applies the epilogue.
//  * On sm_90+ both kernels are programmatic dependent launches: each one's
//    blocks are scheduled under the previous kernel's tail and wait in
//    griddep_wait before touching memory; the product kernel lets
//    splitk_finish start once its loads are done.
#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "matmul_device.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace {

using namespace detail;

// ---- PTX wrappers (sm_80+) ---------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
  }
#endif
}

// One m16n8 MMA over 32 bytes of K: m16n8k16 for the 16-bit types, m16n8k8
// TF32 for float (the same 4 + 2 fragment registers).
template <typename T>
__device__ __forceinline__ void mma_step(float (&c)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

__device__ __forceinline__ uint32_t lds32(const float* p) { return __float_as_uint(*p); }

// ---- configuration -------------------------------------------------------------

// BK is 64 bytes of K (32 elements of a 16-bit type, 16 of float32).
template <typename T, int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_, bool A_K_,
          bool B_K_>
struct MmaConfig {
  static constexpr int BM = BM_, BN = BN_, BK = 64 / static_cast<int>(sizeof(T));
  static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
  static constexpr bool A_K = A_K_, B_K = B_K_;
  static constexpr int THREADS = WARPS_M * WARPS_N * 32;
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte copy
  static constexpr int KSTEP = 2 * VEC;                         // K per MMA (32 bytes)
  // Padding per shared-memory row: 16 bytes, 32 for M/N-major float32 tiles
  // (read by 4-byte loads, see the top of the file).
  static constexpr int PAD_K = VEC;
  static constexpr int PAD_MN = sizeof(T) == 4 ? 2 * VEC : VEC;
  // Shared tiles as they lie in global memory: [rows][cols + PAD].
  static constexpr int A_ROWS = A_K ? BM : BK;
  static constexpr int A_COLS = A_K ? BK : BM;
  static constexpr int A_LD = A_COLS + (A_K ? PAD_K : PAD_MN);
  static constexpr int B_ROWS = B_K ? BN : BK;
  static constexpr int B_COLS = B_K ? BK : BN;
  static constexpr int B_LD = B_COLS + (B_K ? PAD_K : PAD_MN);
  static constexpr int A_STAGE = A_ROWS * A_LD;  // elements
  static constexpr int B_STAGE = B_ROWS * B_LD;
  static constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * static_cast<int>(sizeof(T));
  static constexpr int WTM = BM / WARPS_M;  // warp tile
  static constexpr int WTN = BN / WARPS_N;
  static constexpr int MT = WTM / 16;  // m16 fragments per warp
  static constexpr int NT = WTN / 8;   // n8 fragments per warp
  static_assert(BK % KSTEP == 0 && WTM % 16 == 0 && WTN % 16 == 0, "bad tile");
  static_assert((A_ROWS * A_COLS / VEC) % THREADS == 0 || A_ROWS * A_COLS / VEC < THREADS,
                "A's tile copies must split evenly over the threads");
  static_assert((B_ROWS * B_COLS / VEC) % THREADS == 0, "B's tile copies must split evenly");
};

// Copies the ROWS x COLS tile whose element (r, c) is g[(row0 + r) * ld + col0 + c]
// into shared memory s[r * LD + c]; elements with row0 + r >= row_lim or
// col0 + c >= col_lim become zero.
template <typename T, int ROWS, int COLS, int LD, int THREADS>
__device__ __forceinline__ void load_tile(T* s, const T* __restrict__ g, int64_t ld, int row0,
                                          int row_lim, int col0, int col_lim, int tid) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  // Raw bit patterns for the element-wise edge copies (0 is +0.0 for every type).
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  constexpr int CHUNKS_PER_ROW = COLS / VEC;
  constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
  constexpr int ITERS = (CHUNKS + THREADS - 1) / THREADS;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int chunk = tid + i * THREADS;
    if (CHUNKS % THREADS != 0 && chunk >= CHUNKS) break;  // a tile of fewer chunks than threads
    const int r = chunk / CHUNKS_PER_ROW;
    const int c = (chunk % CHUNKS_PER_ROW) * VEC;
    const int gr = row0 + r, gc = col0 + c;
    T* dst = s + r * LD + c;
    if (gr < row_lim && gc + VEC <= col_lim) {
      cp_async_16(smem_addr(dst), g + static_cast<int64_t>(gr) * ld + gc);
    } else if (gr < row_lim && gc < col_lim) {
      const Bits* src = reinterpret_cast<const Bits*>(g + static_cast<int64_t>(gr) * ld + gc);
      Bits* d = reinterpret_cast<Bits*>(dst);
#pragma unroll
      for (int e = 0; e < VEC; ++e) d[e] = (gc + e < col_lim) ? src[e] : static_cast<Bits>(0);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Epilogue: accumulator (mt, nt, e) sits at row lane/4 (+8 for e >= 2),
// column 2 * (lane % 4) + (e & 1) of its 16x8 fragment.
template <typename T, Act ACT, int MT, int NT>
__device__ __forceinline__ void mma_epilogue(const GemmArgs& p, const float (&acc)[MT][NT][4],
                                             int row0, int col0, int lane, bool pair_ok) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row = row0 + mt * 16 + (lane >> 2);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = col0 + nt * 8 + (lane & 3) * 2;
      epilogue_pair<T, ACT>(p, row, col, acc[mt][nt][0], acc[mt][nt][1], pair_ok);
      epilogue_pair<T, ACT>(p, row + 8, col, acc[mt][nt][2], acc[mt][nt][3], pair_ok);
    }
  }
}

// K split over gridDim.y blocks per tile: their float32 sums go to
// partial[blockIdx.y][row][col] (null when gridDim.y == 1).
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, (Cfg::THREADS == 256 ? 2 : 3))
    gemm_mma_kernel(const GemmArgs p, float* partial) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
  constexpr int MT = Cfg::MT, NT = Cfg::NT;
  constexpr bool A_K = Cfg::A_K, B_K = Cfg::B_K;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sA = reinterpret_cast<T*>(smem_raw);
  T* sB = sA + STAGES * Cfg::A_STAGE;
  griddep_wait();  // as a dependent launch: the previous kernel's writes are visible

  const T* __restrict__ A = static_cast<const T*>(p.a);
  const T* __restrict__ B = static_cast<const T*>(p.b);
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  const int64_t lda = A_K ? p.sam : p.sak;
  const int64_t ldb = B_K ? p.sbn : p.sbk;

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wm0 = (warp / Cfg::WARPS_N) * Cfg::WTM;
  const int wn0 = (warp % Cfg::WARPS_N) * Cfg::WTN;

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  int tm, tn;
  grouped_tile(blockIdx.x, tiles_m, tiles_n, 8, tm, tn);
  const int m0 = tm * BM, n0 = tn * BN;

  auto load_stage = [&](int stage, int kb) {
    const int k0 = kb * BK;
    T* a_dst = sA + stage * Cfg::A_STAGE;
    T* b_dst = sB + stage * Cfg::B_STAGE;
    if constexpr (A_K) {
      load_tile<T, BM, BK, Cfg::A_LD, Cfg::THREADS>(a_dst, A, lda, m0, M, k0, K, tid);
    } else {
      load_tile<T, BK, BM, Cfg::A_LD, Cfg::THREADS>(a_dst, A, lda, k0, K, m0, M, tid);
    }
    if constexpr (B_K) {
      load_tile<T, BN, BK, Cfg::B_LD, Cfg::THREADS>(b_dst, B, ldb, n0, N, k0, K, tid);
    } else {
      load_tile<T, BK, BN, Cfg::B_LD, Cfg::THREADS>(b_dst, B, ldb, k0, K, n0, N, tid);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // This block's K-slices: [kb_begin, kb_begin + num_kb).
  const int total_kb = (K + BK - 1) / BK;
  const int per_split = (total_kb + gridDim.y - 1) / gridDim.y;
  const int kb_begin = blockIdx.y * per_split;
  const int num_kb = kb_begin < total_kb ? min(per_split, total_kb - kb_begin) : 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_kb) load_stage(s, kb_begin + s);
    cp_async_commit();
  }

  constexpr int VEC = Cfg::VEC, KSTEP = Cfg::KSTEP;
  constexpr bool TF32 = sizeof(T) == 4;
  // A warp whose rows all lie past M (small M) has nothing to multiply.
  const bool warp_live = m0 + wm0 < M;
  const int li = lane & 7, lj = lane >> 3;  // ldmatrix: row within a matrix, matrix index
  const int g = lane >> 2, t = lane & 3;    // MMA fragment: row group, thread in group
  for (int kb = 0; kb < num_kb; ++kb) {
    cp_async_wait<STAGES - 2>();  // slice kb has landed (this thread's copies)
    __syncthreads();              // ... everyone's; and slice kb-1 is no longer read
    {
      const int next = kb + STAGES - 1;
      if (next < num_kb) load_stage(next % STAGES, kb_begin + next);
      cp_async_commit();
    }
    if (!warp_live) continue;
    const T* a_s = sA + (kb % STAGES) * Cfg::A_STAGE;
    const T* b_s = sB + (kb % STAGES) * Cfg::B_STAGE;
#pragma unroll
    for (int kk = 0; kk < BK; kk += KSTEP) {
      uint32_t af[MT][4];
      uint32_t bf[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (A_K) {
          // [m][k]: matrices (m 0-7|8-15) x (the first|second 16 bytes of K), m fastest
          const T* addr = a_s + (wm0 + mt * 16 + (lane & 15)) * Cfg::A_LD + kk + (lane >> 4) * VEC;
          ldmatrix_x4<false>(smem_addr(addr), af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
        } else if constexpr (!TF32) {  // [k][m], transposed on load
          const T* addr =
              a_s + (kk + li + (lj >> 1) * 8) * Cfg::A_LD + wm0 + mt * 16 + (lj & 1) * 8;
          ldmatrix_x4<true>(smem_addr(addr), af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
        } else {  // [k][m] float32: a0 (m g, k t), a1 (m g+8, k t), a2 / a3 at k t+4
          const T* col = a_s + (kk + t) * Cfg::A_LD + wm0 + mt * 16 + g;
          af[mt][0] = lds32(col);
          af[mt][1] = lds32(col + 8);
          af[mt][2] = lds32(col + 4 * Cfg::A_LD);
          af[mt][3] = lds32(col + 4 * Cfg::A_LD + 8);
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        if constexpr (B_K) {
          // [n][k]: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi)
          const T* addr =
              b_s + (wn0 + np * 16 + li + (lj >> 1) * 8) * Cfg::B_LD + kk + (lj & 1) * VEC;
          ldmatrix_x4<false>(smem_addr(addr), bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0],
                             bf[2 * np + 1][1]);
        } else if constexpr (!TF32) {  // [k][n], transposed on load, same matrix order
          const T* addr =
              b_s + (kk + li + (lj & 1) * 8) * Cfg::B_LD + wn0 + np * 16 + (lj >> 1) * 8;
          ldmatrix_x4<true>(smem_addr(addr), bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0],
                            bf[2 * np + 1][1]);
        } else {  // [k][n] float32: b0 (k t, n g), b1 (k t+4, n g)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const T* col = b_s + (kk + t) * Cfg::B_LD + wn0 + np * 16 + h * 8 + g;
            bf[2 * np + h][0] = lds32(col);
            bf[2 * np + h][1] = lds32(col + 4 * Cfg::B_LD);
          }
        }
      }
      if constexpr (TF32) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) af[mt][e] = to_tf32(af[mt][e]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) bf[nt][e] = to_tf32(bf[nt][e]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_step<T>(acc[mt][nt], af[mt], bf[nt]);
    }
  }
  cp_async_wait<0>();
  // Every load is done: splitk_finish (which waits for this whole grid) may
  // start its blocks.
  griddep_launch_dependents();

  if (partial != nullptr) {
    float* out = partial + int64_t{blockIdx.y} * M * N;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = m0 + wm0 + mt * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
          const int col = n0 + wn0 + nt * 8 + (lane & 3) * 2 + (e & 1);
          if (row < M && col < N) out[int64_t{row} * N + col] = acc[mt][nt][e];
        }
      }
    }
    return;
  }
  const bool pair_ok = pair_stores_ok<T>(p);  // 16-bit T: a 4-byte aligned pair
  FASTCOMM_DISPATCH_ACT(p.act,
                        (mma_epilogue<T, kAct, MT, NT>(p, acc, m0 + wm0, n0 + wn0, lane, pair_ok)));
#endif
}

// pdl: launch the product kernel and splitk_finish as programmatic dependent
// launches (sm_90+), each scheduled under its predecessor's tail.
template <typename T, typename Cfg>
cudaError_t launch_cfg(const GemmArgs& p, int splits, float* partial, bool pdl,
                       cudaStream_t stream) {
  const int64_t tiles = ((p.M + Cfg::BM - 1) / Cfg::BM) * ((p.N + Cfg::BN - 1) / Cfg::BN);
  if (tiles > INT_MAX) return cudaErrorInvalidValue;
  auto kernel = gemm_mma_kernel<T, Cfg>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
  launch.blockDim = dim3(Cfg::THREADS);
  launch.dynamicSmemBytes = Cfg::SMEM_BYTES;
  launch.stream = stream;
  cudaLaunchAttribute attr = programmatic_dependent_launch();
  if (pdl) {
    launch.attrs = &attr;
    launch.numAttrs = 1;
  }
  err = cudaLaunchKernelEx(&launch, kernel, p, splits > 1 ? partial : nullptr);
  if (err != cudaSuccess || splits == 1) return err;
  return launch_splitk_finish<T>(p, partial, splits, stream, pdl);
}

// Block tiles: 128 x 128 (8 warps, 64 x 32 each), 64 x 64 (4 warps, 32 x 32
// each), and for TF32 at M <= 64 a row of BM x 128 (BM = 16, 32 or 64: M
// rounded up; 4 warps, BM x 32 each, 5 stages). Such a product streams B
// from memory with little math per byte: its tile computes no padding rows
// beyond the next 16, and the deeper ring keeps more of B in flight.
struct TileShape {
  int bm, bn;
};

template <typename T, bool A_K, bool B_K>
cudaError_t launch_layout(const GemmArgs& p, TileShape t, int splits, float* partial, bool pdl,
                          cudaStream_t stream) {
  if (t.bm == 128) {
    return launch_cfg<T, MmaConfig<T, 128, 128, 2, 4, 4, A_K, B_K>>(p, splits, partial, pdl,
                                                                    stream);
  }
  if constexpr (sizeof(T) == 4) {
    if (t.bn == 128) {
      if (t.bm == 16) {
        return launch_cfg<T, MmaConfig<T, 16, 128, 1, 4, 5, A_K, B_K>>(p, splits, partial, pdl,
                                                                       stream);
      }
      if (t.bm == 32) {
        return launch_cfg<T, MmaConfig<T, 32, 128, 1, 4, 5, A_K, B_K>>(p, splits, partial, pdl,
                                                                       stream);
      }
      return launch_cfg<T, MmaConfig<T, 64, 128, 1, 4, 5, A_K, B_K>>(p, splits, partial, pdl,
                                                                     stream);
    }
  }
  return launch_cfg<T, MmaConfig<T, 64, 64, 2, 2, 4, A_K, B_K>>(p, splits, partial, pdl, stream);
}

template <typename T>
cudaError_t launch_type(const GemmArgs& p, TileShape t, int splits, float* partial, bool pdl,
                        cudaStream_t stream) {
  const bool a_k = p.sak == 1;
  const bool b_k = p.sbk == 1;
  if (a_k && b_k) return launch_layout<T, true, true>(p, t, splits, partial, pdl, stream);
  if (a_k) return launch_layout<T, true, false>(p, t, splits, partial, pdl, stream);
  if (b_k) return launch_layout<T, false, true>(p, t, splits, partial, pdl, stream);
  return launch_layout<T, false, false>(p, t, splits, partial, pdl, stream);
}

// K per shared-memory slice (64 bytes), in elements of the problem's type.
int64_t slice_k(const GemmArgs& p) { return p.dtype == DType::kF32 ? 16 : 32; }

}  // namespace

bool gemm_mma_supported(const GemmArgs& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16 && p.dtype != DType::kF32) return false;
  if (p.M <= 0 || p.N <= 0 || p.K <= 0 || p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    return false;
  if (!detail::aligned16(p.a) || !detail::aligned16(p.b)) return false;
  const int64_t v = p.dtype == DType::kF32 ? 4 : 8;  // elements per 16 bytes
  const bool a_ok = (p.sak == 1 && p.sam % v == 0) || (p.sam == 1 && p.sak % v == 0);
  const bool b_ok = (p.sbk == 1 && p.sbn % v == 0) || (p.sbn == 1 && p.sbk % v == 0);
  return a_ok && b_ok;
}

namespace {

// The launch's block tile (see launch_layout).
TileShape mma_tile(const GemmArgs& p, int num_sms, Tile tile) {
  if (p.dtype == DType::kF32 && (tile == Tile::kNarrow || (tile == Tile::kAuto && p.M <= 64))) {
    return {p.M <= 16 ? 16 : p.M <= 32 ? 32 : 64, 128};
  }
  if (tile != Tile::kAuto) return tile == Tile::kLarge ? TileShape{128, 128} : TileShape{64, 64};
  // Large 128x128 tiles once they fill the GPU (two blocks per SM fit),
  // 64x64 tiles otherwise so that more SMs get work.
  const int64_t tiles_large = ((p.M + 127) / 128) * ((p.N + 127) / 128);
  return tiles_large >= static_cast<int64_t>(num_sms) ? TileShape{128, 128} : TileShape{64, 64};
}

}  // namespace

int gemm_mma_splits(const GemmArgs& p, int num_sms, Tile tile, int forced) {
  const int64_t slices = (p.K + slice_k(p) - 1) / slice_k(p);
  if (forced > 0) return static_cast<int>(std::min<int64_t>({forced, slices, 16}));
  const TileShape t = mma_tile(p, num_sms, tile);
  if (t.bm == 128) return 1;
  const int64_t tiles = ((p.M + t.bm - 1) / t.bm) * ((p.N + t.bn - 1) / t.bn);
  // At least 8 K-slices per block, so that the copy pipeline fills; at most
  // 16 splits (the partial sums' traffic).
  const int64_t max_splits = std::min<int64_t>(slices / 8, 16);
  int64_t splits;
  if (t.bn == 128) {
    // TF32 small-M row tiles: as many blocks as fit at once (three per SM),
    // in one wave; B's bytes in flight set the speed. With 32-row tiles two
    // per SM measured faster (fewer partial sums to write and add).
    splits = (t.bm == 32 ? 2 : 3) * int64_t{num_sms} / tiles;
  } else {
    if (tiles >= num_sms) return 1;
    // About two blocks per SM (three fit).
    splits = (2 * int64_t{num_sms} + tiles - 1) / tiles;
  }
  return static_cast<int>(std::max<int64_t>(std::min(splits, max_splits), 1));
}

std::string describe_gemm_mma(const GemmArgs& p, int num_sms, Tile tile, int forced_splits) {
  const TileShape t = mma_tile(p, num_sms, tile);
  const int splits = gemm_mma_splits(p, num_sms, tile, forced_splits);
  return "mma " + std::to_string(t.bm) + "x" + std::to_string(t.bn) +
         (p.dtype == DType::kF32 ? " tf32" : "") +
         (splits > 1 ? " splitk " + std::to_string(splits) : "");
}

int64_t gemm_mma_workspace_bytes(const GemmArgs& p, int num_sms, Tile tile, int forced_splits) {
  const int splits = gemm_mma_splits(p, num_sms, tile, forced_splits);
  return splits > 1 ? int64_t{splits} * p.M * p.N * 4 : 0;
}

cudaError_t launch_gemm_mma_sm80(const GemmArgs& p, int num_sms, Tile tile, int forced_splits,
                                 void* workspace, cudaStream_t stream) {
  if (!gemm_mma_supported(p)) return cudaErrorInvalidValue;
  const TileShape t = mma_tile(p, num_sms, tile);
  const int splits = gemm_mma_splits(p, num_sms, tile, forced_splits);
  if (splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  float* partial = static_cast<float*>(workspace);
  bool pdl = false;
  const cudaError_t err = dependent_launch_supported(&pdl);
  if (err != cudaSuccess) return err;
  if (p.dtype == DType::kBF16)
    return launch_type<__nv_bfloat16>(p, t, splits, partial, pdl, stream);
  if (p.dtype == DType::kF32) return launch_type<float>(p, t, splits, partial, pdl, stream);
  return launch_type<__half>(p, t, splits, partial, pdl, stream);
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
