// Generic tiled GEMM on CUDA cores: the float32 / float64 kernel, and the
// fallback for float16 / bfloat16 on GPUs without the tensor-core paths.
//
// Two tilings. Both read A and B through their strides, so any layout
// (transposed, sliced, expanded) is read in place; out-of-range elements read
// as zero, so any M, N, K works. Accumulation in float32 (float64 for
// double); bias, activation and the output cast are fused into the store.
//
// - 64x64 output tile per block of 256 threads, 4x4 outputs per thread
//   (strided so that shared-memory reads and global stores are conflict-free
//   and coalesced), K walked 16 at a time; the next K-slice is fetched into
//   registers while the current one is multiplied out of shared memory. Small
//   problems (more blocks for the SMs) and double.
// - The wide kernel: 128x128 output tile per block of 256 threads, 8x8
//   outputs per thread, K walked 8 at a time through two shared-memory
//   buffers (one barrier per slice). 4x4 outputs per thread spend one
//   shared-memory load per two FMAs, which caps the 64x64 kernel at about a
//   third of cuBLAS's float32 rate on Hopper; 8x8 outputs read as four
//   16-byte vectors spend one load per 16. Up to 64 rows of A it takes tiles
//   of 64 or 32 rows (the 128-row tile would mostly compute padding), and
//   where its tiles are too few for the SMs K is split over blocks (the
//   grid's y), each writing float32 sums that splitk_finish adds in split
//   order before bias and activation.
#include <algorithm>
#include <climits>
#include <type_traits>

#include "dependent_launch.cuh"
#include "matmul_device.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace {

using namespace detail;

// Blocks of a launch with BM x BN output tiles (one block per tile).
int64_t output_tiles(const GemmArgs& p, int bm, int bn) {
  return ((p.M + bm - 1) / bm) * ((p.N + bn - 1) / bn);
}

// This block's output tile: grouped order, 8 tile rows at a time, so that
// neighbouring blocks share operand panels in L2.
template <int BM, int BN>
__device__ __forceinline__ void block_tile_origin(int M, int N, int& m0, int& n0) {
  int tm, tn;
  grouped_tile(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, 8, tm, tn);
  m0 = tm * BM;
  n0 = tn * BN;
}

// Whether consecutive threads should walk A along M (else along K) and B
// along N (else along K): the operand's unit-stride dimension.
__host__ __device__ __forceinline__ bool m_is_fast(const GemmArgs& p) {
  return p.sam == 1 && p.sak != 1;
}
__host__ __device__ __forceinline__ bool n_is_fast(const GemmArgs& p) {
  return !(p.sbk == 1 && p.sbn != 1);
}

// Thread output (i, j) is C[row0 + i * TY][col0 + j * TX].
template <typename T, typename Acc, Act ACT, int TM, int TN, int TX, int TY>
__device__ __forceinline__ void simt_epilogue(const GemmArgs& p, const Acc (&acc)[TM][TN], int row0,
                                              int col0) {
  const T* bias = static_cast<const T*>(p.bias);
  T* C = static_cast<T*>(p.c);
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int row = row0 + i * TY;
    if (row >= p.M) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int col = col0 + j * TX;
      if (col >= p.N) continue;
      Acc v = acc[i][j];
      if (bias != nullptr) v += load_acc<Acc>(bias + col);
      C[static_cast<int64_t>(row) * p.ldc + col] = from_acc<T, Acc>(activate<ACT>(v));
    }
  }
}

template <typename T, typename Acc, int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN)) gemm_simt_kernel(const GemmArgs p) {
  constexpr int TX = BN / TN;  // threads along N
  constexpr int TY = BM / TM;  // threads along M
  constexpr int THREADS = TX * TY;
  constexpr int A_PER = BM * BK / THREADS;
  constexpr int B_PER = BK * BN / THREADS;
  static_assert(A_PER * THREADS == BM * BK && B_PER * THREADS == BK * BN, "tile / thread mismatch");

  __shared__ Acc As[BK][BM];
  __shared__ Acc Bs[BK][BN];

  const T* __restrict__ A = static_cast<const T*>(p.a);
  const T* __restrict__ B = static_cast<const T*>(p.b);
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  const int tid = threadIdx.x;
  const int tx = tid % TX, ty = tid / TX;

  int m0, n0;
  block_tile_origin<BM, BN>(M, N, m0, n0);

  // Consecutive threads walk the operand's unit-stride dimension.
  const bool a_m_fast = m_is_fast(p), b_n_fast = n_is_fast(p);

  Acc ra[A_PER], rb[B_PER];
  auto a_index = [&](int i, int& mm, int& kk) {
    const int idx = tid + i * THREADS;
    if (a_m_fast) {
      mm = idx % BM;
      kk = idx / BM;
    } else {
      kk = idx % BK;
      mm = idx / BK;
    }
  };
  auto b_index = [&](int i, int& kk, int& nn) {
    const int idx = tid + i * THREADS;
    if (b_n_fast) {
      nn = idx % BN;
      kk = idx / BN;
    } else {
      kk = idx % BK;
      nn = idx / BK;
    }
  };
  auto fetch = [&](int k0) {
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      int mm, kk;
      a_index(i, mm, kk);
      const int gm = m0 + mm, gk = k0 + kk;
      ra[i] = (gm < M && gk < K) ? load_acc<Acc>(A + gm * p.sam + gk * p.sak) : Acc(0);
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      int kk, nn;
      b_index(i, kk, nn);
      const int gk = k0 + kk, gn = n0 + nn;
      rb[i] = (gk < K && gn < N) ? load_acc<Acc>(B + gk * p.sbk + gn * p.sbn) : Acc(0);
    }
  };

  Acc acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = Acc(0);

  if (K > 0) fetch(0);
  for (int k0 = 0; k0 < K; k0 += BK) {
    __syncthreads();  // everyone is done reading the previous slice
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
      int mm, kk;
      a_index(i, mm, kk);
      As[kk][mm] = ra[i];
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
      int kk, nn;
      b_index(i, kk, nn);
      Bs[kk][nn] = rb[i];
    }
    __syncthreads();
    if (k0 + BK < K) fetch(k0 + BK);  // in flight during the products below
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      Acc av[TM], bv[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) av[i] = As[kk][ty + i * TY];
#pragma unroll
      for (int j = 0; j < TN; ++j) bv[j] = Bs[kk][tx + j * TX];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += av[i] * bv[j];
    }
  }

  FASTCOMM_DISPATCH_ACT(p.act,
                        (simt_epilogue<T, Acc, kAct, TM, TN, TX, TY>(p, acc, m0 + ty, n0 + tx)));
}

template <typename T, typename Acc>
cudaError_t launch_simt(const GemmArgs& p, cudaStream_t stream) {
  constexpr int BM = 64, BN = 64, BK = 16, TM = 4, TN = 4;
  const int64_t tiles = output_tiles(p, BM, BN);
  if (tiles > INT_MAX) return cudaErrorInvalidValue;
  gemm_simt_kernel<T, Acc, BM, BN, BK, TM, TN>
      <<<static_cast<unsigned>(tiles), (BM / TM) * (BN / TN), 0, stream>>>(p);
  return cudaGetLastError();
}

// BM x 128 tiles (BM = 128, 64 or 32: rows of A in tens take a tile of their
// size instead of mostly padding), TM x 8 outputs per thread (TM = 8, or 4
// for 32 rows), accumulation in float. Thread (tx, ty) owns rows ty*4 +
// {0..3} (and BM/2 + ty*4 + {0..3} with TM = 8), columns tx*4 + {0..3} and
// 64 + tx*4 + {0..3}: each group of 4 is one 16-byte shared-memory vector. A
// warp covers 8 tx x 4 ty, so a vector load touches 128 bytes of B and 64 of
// A: one wavefront each. Rows of the shared tiles are padded by 4 floats so
// that the K-major stores of the fetch (8 consecutive threads on consecutive
// k) hit 32 distinct banks, while rows stay 16-byte aligned for the vector
// loads.
template <int BM>
struct WideTile {
  static constexpr int kTM = BM == 32 ? 4 : 8;            // rows per thread
  static constexpr int kThreads = BM / kTM * 16;          // 16 threads along N
  static constexpr int kBlocksPerSm = BM == 128 ? 2 : 4;  // the launch bounds
};

template <int BM>
__device__ __forceinline__ int wide_row(int i, int ty) {
  return (i / 4) * (BM / 2) + ty * 4 + i % 4;
}
__device__ __forceinline__ int wide_col(int j, int tx) { return (j / 4) * 64 + tx * 4 + j % 4; }

// fn(i, j, row, col) for each output (i, j) of the thread that lies in C.
template <int BM, int TM, typename Fn>
__device__ __forceinline__ void for_each_wide_output(const GemmArgs& p, int m0, int n0, int tx,
                                                     int ty, Fn&& fn) {
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int row = m0 + wide_row<BM>(i, ty);
    if (row >= p.M) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = n0 + wide_col(j, tx);
      if (col < p.N) fn(i, j, row, col);
    }
  }
}

template <typename T, Act ACT, int BM, int TM>
__device__ __forceinline__ void wide_epilogue(const GemmArgs& p, const float (&acc)[TM][8], int m0,
                                              int n0, int tx, int ty) {
  const T* bias = static_cast<const T*>(p.bias);
  T* C = static_cast<T*>(p.c);
  for_each_wide_output<BM, TM>(p, m0, n0, tx, ty, [&](int i, int j, int row, int col) {
    float v = acc[i][j];
    if (bias != nullptr) v += load_acc<float>(bias + col);
    C[static_cast<int64_t>(row) * p.ldc + col] = from_acc<T, float>(activate<ACT>(v));
  });
}

// K split over blocks: block (x, y) takes K-slices [y * k_per_split, ...) of
// tile x; with more than one split it stores float32 sums to
// partial[y][row][col] instead of C.
struct SimtSplit {
  int splits = 1;
  int k_per_split = 0;  // a multiple of the wide kernel's BK
  float* partial = nullptr;
};

// Raw sums of one split (no bias, no activation), for splitk_finish.
template <int BM, int TM>
__device__ __forceinline__ void wide_store_partial(const GemmArgs& p, const SimtSplit& sp,
                                                   const float (&acc)[TM][8], int m0, int n0,
                                                   int tx, int ty) {
  float* out = sp.partial + int64_t{blockIdx.y} * p.M * p.N;
  for_each_wide_output<BM, TM>(p, m0, n0, tx, ty, [&](int i, int j, int row, int col) {
    out[int64_t{row} * p.N + col] = acc[i][j];
  });
}

// The 16-byte fetch of one operand's slice: N loads `step` apart from `ptr`
// into r[4 N].
template <int N>
__device__ __forceinline__ void fetch16(const float* ptr, int64_t step, float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(ptr + i * step));
    r[4 * i] = v.x;
    r[4 * i + 1] = v.y;
    r[4 * i + 2] = v.z;
    r[4 * i + 3] = v.w;
  }
}

// Those 4 N values into the slice's shared tile S[k][x]: where x (the
// tile's fast dimension) is the operand's unit stride, piece i as one 16-byte
// store at row k + i * ds; else its 4 values down k at column x + i * ds.
template <int N, int R, int W>
__device__ __forceinline__ void stash16(float (&S)[R][W], const float* r, bool x_fast, int k, int x,
                                        int ds) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (x_fast) {
      *reinterpret_cast<float4*>(&S[k + i * ds][x]) =
          make_float4(r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) S[k + c][x + i * ds] = r[4 * i + c];
    }
  }
}

// VEC (float32, whole tiles, K a multiple of BK, each operand 16-byte
// aligned with a unit stride and the other a multiple of 4): each operand's
// slice is fetched as 16-byte loads along its unit-stride dimension, with no
// bounds checks.
template <typename T, int BM, bool SPLIT, bool VEC>
__global__ void __launch_bounds__(WideTile<BM>::kThreads, WideTile<BM>::kBlocksPerSm)
    gemm_simt_wide_kernel(const GemmArgs p, SimtSplit sp) {
  constexpr int BN = 128, BK = 8, PAD = 4;
  constexpr int TM = WideTile<BM>::kTM, THREADS = WideTile<BM>::kThreads;
  static_assert(THREADS % BN == 0 && THREADS % BM == 0, "whole rows per fetch step");
  constexpr int A_PER = BM * BK / THREADS, B_PER = BK * BN / THREADS;
  __shared__ __align__(16) float As[2][BK][BM + PAD];
  __shared__ __align__(16) float Bs[2][BK][BN + PAD];

  const T* __restrict__ A = static_cast<const T*>(p.a);
  const T* __restrict__ B = static_cast<const T*>(p.b);
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tx = (warp % 2) * 8 + lane % 8;  // 0..15
  const int ty = (warp / 2) * 4 + lane / 8;  // 0..BM/TM-1

  int m0, n0;
  block_tile_origin<BM, BN>(M, N, m0, n0);

  // Consecutive threads walk the operand's unit-stride dimension. A thread's
  // A_PER elements of a slice are one step apart (rows, or k), so one
  // pointer and one step per operand address them: fewer registers than an
  // address per element, which keeps the kernel at its blocks per SM.
  const bool a_m_fast = m_is_fast(p), b_n_fast = n_is_fast(p);
  const int a_mm = a_m_fast ? tid % BM : tid / BK, a_kk = a_m_fast ? tid / BM : tid % BK;
  const int a_dm = a_m_fast ? 0 : THREADS / BK, a_dk = a_m_fast ? THREADS / BM : 0;
  const int b_nn = b_n_fast ? tid % BN : tid / BK, b_kk = b_n_fast ? tid / BN : tid % BK;
  const int b_dn = b_n_fast ? 0 : THREADS / BK, b_dk = b_n_fast ? THREADS / BN : 0;
  const int64_t a_step = a_dm * p.sam + a_dk * p.sak, b_step = b_dk * p.sbk + b_dn * p.sbn;
  // This block's K-slices: [k_begin, k_end), whole slices but for the last
  // split's end at K.
  const int k_begin = SPLIT ? static_cast<int>(blockIdx.y) * sp.k_per_split : 0;
  const int k_end = SPLIT ? min(K, k_begin + sp.k_per_split) : K;
  const T* a_ptr = A + (m0 + a_mm) * p.sam + (k_begin + a_kk) * p.sak;
  const T* b_ptr = B + (k_begin + b_kk) * p.sbk + (n0 + b_nn) * p.sbn;

  float ra[A_PER], rb[B_PER];
  // VEC: 16-byte pieces along the unit-stride dimension, `cq` per row of the
  // slice; thread t takes piece t of each THREADS, whose row ("slow") steps
  // by THREADS / cq.
  constexpr int A4 = A_PER / 4, B4 = B_PER / 4;
  const int a_cq = a_m_fast ? BM / 4 : BK / 4, b_cq = b_n_fast ? BN / 4 : BK / 4;
  const int va_m = a_m_fast ? tid % a_cq * 4 : tid / a_cq;
  const int va_k = a_m_fast ? tid / a_cq : tid % a_cq * 4;
  const int vb_n = b_n_fast ? tid % b_cq * 4 : tid / b_cq;
  const int vb_k = b_n_fast ? tid / b_cq : tid % b_cq * 4;
  const int va_ds = THREADS / a_cq, vb_ds = THREADS / b_cq;
  const int64_t va_step = va_ds * (a_m_fast ? p.sak : p.sam);
  const int64_t vb_step = vb_ds * (b_n_fast ? p.sbk : p.sbn);
  const float* va_ptr =
      reinterpret_cast<const float*>(A) + (m0 + va_m) * p.sam + (k_begin + va_k) * p.sak;
  const float* vb_ptr =
      reinterpret_cast<const float*>(B) + (k_begin + vb_k) * p.sbk + (n0 + vb_n) * p.sbn;
  auto fetch = [&](int k0) {
    if constexpr (VEC) {
      fetch16<A4>(va_ptr, va_step, ra);
      fetch16<B4>(vb_ptr, vb_step, rb);
      va_ptr += BK * p.sak;
      vb_ptr += BK * p.sbk;
    } else {
#pragma unroll
      for (int i = 0; i < A_PER; ++i) {
        const bool in = m0 + a_mm + i * a_dm < M && k0 + a_kk + i * a_dk < K;
        ra[i] = in ? load_acc<float>(a_ptr + i * a_step) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < B_PER; ++i) {
        const bool in = k0 + b_kk + i * b_dk < K && n0 + b_nn + i * b_dn < N;
        rb[i] = in ? load_acc<float>(b_ptr + i * b_step) : 0.f;
      }
      a_ptr += BK * p.sak;
      b_ptr += BK * p.sbk;
    }
  };
  auto stash = [&](int buf) {
    if constexpr (VEC) {
      stash16<A4>(As[buf], ra, a_m_fast, va_k, va_m, va_ds);
      stash16<B4>(Bs[buf], rb, b_n_fast, vb_k, vb_n, vb_ds);
    } else {
#pragma unroll
      for (int i = 0; i < A_PER; ++i) As[buf][a_kk + i * a_dk][a_mm + i * a_dm] = ra[i];
#pragma unroll
      for (int i = 0; i < B_PER; ++i) Bs[buf][b_kk + i * b_dk][b_nn + i * b_dn] = rb[i];
    }
  };

  float acc[TM][8];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  if (k_begin < k_end) {
    fetch(k_begin);
    stash(0);
  }
  __syncthreads();
  int buf = 0;
  for (int k0 = k_begin; k0 < k_end; k0 += BK, buf ^= 1) {
    const bool more = k0 + BK < k_end;
    if (more) fetch(k0 + BK);  // in flight during the products below
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float av[TM];
      const float4 a_lo = *reinterpret_cast<const float4*>(&As[buf][kk][ty * 4]);
      av[0] = a_lo.x;
      av[1] = a_lo.y;
      av[2] = a_lo.z;
      av[3] = a_lo.w;
      if constexpr (TM == 8) {
        const float4 a_hi = *reinterpret_cast<const float4*>(&As[buf][kk][BM / 2 + ty * 4]);
        av[4] = a_hi.x;
        av[5] = a_hi.y;
        av[6] = a_hi.z;
        av[7] = a_hi.w;
      }
      const float4 b_lo = *reinterpret_cast<const float4*>(&Bs[buf][kk][tx * 4]);
      const float4 b_hi = *reinterpret_cast<const float4*>(&Bs[buf][kk][64 + tx * 4]);
      const float bv[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] += av[i] * bv[j];
    }
    // The other buffer was last read in the previous slice, before the
    // barrier that ended it: safe to overwrite while this one is read.
    if (more) stash(buf ^ 1);
    __syncthreads();
  }
  // No griddep_launch_dependents here: its memory clobber makes the compiler
  // drop the read-only (ld.global.nc) loads of A and B, which slowed the
  // kernel down; splitk_finish starts once this grid is done.
  if constexpr (SPLIT) {
    wide_store_partial<BM, TM>(p, sp, acc, m0, n0, tx, ty);
  } else {
    FASTCOMM_DISPATCH_ACT(p.act, (wide_epilogue<T, kAct, BM, TM>(p, acc, m0, n0, tx, ty)));
  }
}

constexpr int kWideBK = 8;
// Each split takes at least this much of K, so that its sums' round trip
// through memory stays small beside its products.
constexpr int64_t kMinSplitK = 256;
constexpr int kMaxSplits = 16;

// The wide kernel's tile rows for M rows of A: the fewest of 32, 64 and 128
// that hold them, 128 beyond.
int wide_rows(int64_t M) { return M <= 32 ? 32 : M <= 64 ? 64 : 128; }
int wide_blocks_per_sm(int bm) {
  return bm == 128  ? WideTile<128>::kBlocksPerSm
         : bm == 64 ? WideTile<64>::kBlocksPerSm
                    : WideTile<32>::kBlocksPerSm;
}

int64_t wide_slices(const GemmArgs& p) { return (p.K + kWideBK - 1) / kWideBK; }

// K-slices of the wide kernel per split when K is cut into `splits` parts;
// the split count is then ceil(slices / that), which may be fewer.
int64_t slices_per_split(const GemmArgs& p, int splits) {
  return (wide_slices(p) + splits - 1) / splits;
}

// The K split of the wide kernel, from a model of its rounds: `s` splits run
// ceil(tiles x s / slots) rounds of the SMs' block slots, each as long as K /
// s plus a block's fixed cost (kBlockCostK, in K-elements); the count of the
// fewest modelled time, taken where it models at least 10% below no split,
// each split at least kMinSplitK of K (so a part-full round of tiles is
// filled with more, shorter blocks: 32 tiles of 32 x 128 take 16 splits, 172
// of 128 x 128 take 3). Forced (>= 1): clamped to K's slices and to
// kMaxSplits. Returns the count the launch runs.
constexpr int64_t kBlockCostK = 32;
int wide_splits(const GemmArgs& p, int num_sms, int forced) {
  if (p.dtype == DType::kF64 || p.K <= 0) return 1;
  int64_t want = forced;
  if (forced < 1) {
    const int bm = wide_rows(p.M);
    const int64_t tiles = std::max<int64_t>(1, output_tiles(p, bm, 128));
    const int64_t slots = int64_t{num_sms} * wide_blocks_per_sm(bm);
    auto modelled = [&](int64_t s) {
      return (tiles * s + slots - 1) / slots * ((p.K + s - 1) / s + kBlockCostK);
    };
    want = 1;
    const int64_t unsplit = modelled(1);
    int64_t best = unsplit;
    // From two rounds of tiles on, the last round's idle slots are at most a
    // third of the time, and the splits' float32 sums (splits x M x N) would
    // be several times the output: no split there.
    const int64_t most = tiles >= 2 * slots ? 1 : std::min<int64_t>(kMaxSplits, p.K / kMinSplitK);
    for (int64_t s = 2; s <= most; ++s) {
      const int64_t t = modelled(s);
      if (t < best && t * 10 <= unsplit * 9) {
        best = t;
        want = s;
      }
    }
  }
  want = std::clamp<int64_t>(want, 1, kMaxSplits);
  const int64_t per = slices_per_split(p, static_cast<int>(want));
  return static_cast<int>((wide_slices(p) + per - 1) / per);
}

// Whether the wide kernel's 16-byte fetch (VEC) can run the problem.
bool wide_vector_fetch(const GemmArgs& p, int bm) {
  if (p.dtype != DType::kF32 || bm == 32 || p.M % bm != 0 || p.N % 128 != 0 || p.K % kWideBK != 0 ||
      !aligned16(p.a) || !aligned16(p.b)) {
    return false;
  }
  // The kernel's fetch runs along the dimension m_is_fast / n_is_fast name:
  // it must have stride 1, the other a multiple of 4.
  const bool a_ok = m_is_fast(p) ? p.sak % 4 == 0 : (p.sak == 1 && p.sam % 4 == 0);
  const bool b_ok = n_is_fast(p) ? (p.sbn == 1 && p.sbk % 4 == 0) : p.sbn % 4 == 0;
  return a_ok && b_ok;
}

template <typename T, int BM>
cudaError_t launch_wide_tile(const GemmArgs& p, const SimtSplit& sp, cudaStream_t stream) {
  const int64_t tiles = output_tiles(p, BM, 128);
  if (tiles > INT_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(sp.splits));
  constexpr int kThreads = WideTile<BM>::kThreads;
  auto launch = [&](auto vec) {
    if (sp.splits > 1) {
      gemm_simt_wide_kernel<T, BM, true, decltype(vec)::value>
          <<<grid, kThreads, 0, stream>>>(p, sp);
    } else {
      gemm_simt_wide_kernel<T, BM, false, decltype(vec)::value>
          <<<grid, kThreads, 0, stream>>>(p, sp);
    }
    return cudaGetLastError();
  };
  if constexpr (std::is_same_v<T, float> && BM != 32) {
    if (wide_vector_fetch(p, BM)) return launch(std::true_type{});
  }
  return launch(std::false_type{});
}

template <typename T>
cudaError_t launch_simt_wide(const GemmArgs& p, int splits, void* workspace, cudaStream_t stream) {
  SimtSplit sp;
  if (splits > 1) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    sp.splits = splits;  // wide_splits: every split has K-slices
    sp.k_per_split = static_cast<int>(slices_per_split(p, splits) * kWideBK);
    sp.partial = static_cast<float*>(workspace);
  }
  const int bm = wide_rows(p.M);
  cudaError_t err = bm == 32   ? launch_wide_tile<T, 32>(p, sp, stream)
                    : bm == 64 ? launch_wide_tile<T, 64>(p, sp, stream)
                               : launch_wide_tile<T, 128>(p, sp, stream);
  if (err != cudaSuccess || sp.splits == 1) return err;
  bool pdl = false;
  err = dependent_launch_supported(&pdl);
  if (err != cudaSuccess) return err;
  return launch_splitk_finish<T>(p, sp.partial, sp.splits, stream, pdl);
}

}  // namespace

bool gemm_simt_large_tile(const GemmArgs& p, int num_sms, Tile tile) {
  // double keeps the 64x64 kernel: 64 double accumulators per thread would
  // not leave the registers for two blocks per SM.
  if (p.dtype == DType::kF64) return false;
  if (tile != Tile::kAuto) return tile == Tile::kLarge;
  // The wide kernel once its blocks (with K split) cover 40% of the SMs: per
  // busy SM its 128 x 128 tiles run ~2.5x faster than 64x64 ones (H200,
  // float32: 0.79x against 0.32x cuBLAS with the GPU full), so fewer busy
  // SMs still finish first (1024^3, 64 tiles on 132 SMs: 0.48x against 0.41x
  // for 256 small tiles).
  const int64_t blocks = output_tiles(p, wide_rows(p.M), 128) * wide_splits(p, num_sms, 0);
  return blocks * 5 >= static_cast<int64_t>(num_sms) * 2;
}

int gemm_simt_wide_rows(const GemmArgs& p) { return wide_rows(p.M); }

int gemm_simt_splits(const GemmArgs& p, int num_sms, Tile tile, int forced_splits) {
  return gemm_simt_large_tile(p, num_sms, tile) ? wide_splits(p, num_sms, forced_splits) : 1;
}

int64_t gemm_simt_workspace_bytes(const GemmArgs& p, int num_sms, Tile tile, int forced_splits) {
  const int splits = gemm_simt_splits(p, num_sms, tile, forced_splits);
  return splits > 1 ? int64_t{splits} * p.M * p.N * 4 : 0;
}

cudaError_t launch_gemm_simt(const GemmArgs& p, int num_sms, Tile tile, int forced_splits,
                             void* workspace, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return cudaSuccess;
  if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX) return cudaErrorInvalidValue;
  if (gemm_simt_large_tile(p, num_sms, tile)) {
    const int splits = wide_splits(p, num_sms, forced_splits);
    switch (p.dtype) {
      case DType::kF32:
        return launch_simt_wide<float>(p, splits, workspace, stream);
      case DType::kF16:
        return launch_simt_wide<__half>(p, splits, workspace, stream);
      case DType::kBF16:
        return launch_simt_wide<__nv_bfloat16>(p, splits, workspace, stream);
      case DType::kF64:
        break;
    }
    return cudaErrorInvalidValue;
  }
  switch (p.dtype) {
    case DType::kF32:
      return launch_simt<float, float>(p, stream);
    case DType::kF16:
      return launch_simt<__half, float>(p, stream);
    case DType::kBF16:
      return launch_simt<__nv_bfloat16, float>(p, stream);
    case DType::kF64:
      return launch_simt<double, double>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
