// Skinny products, M <= kSkinnyMaxM rows (decode-time linear layers, small
// batches): C[M, N] = act(A[M, K] @ B[K, N] + bias) with B K-major (the
// weight of F.linear, [N, K] contiguous) is a matrix-vector product per row
// of A, bound by reading B once from memory, where a tensor-core tile of 64+
// rows would compute mostly padding.
//
// B K-major: one warp reduces COLS output columns (1 or 2) for every row of A: each lane loads
// 16 bytes of B's row n at a time (the warp reads 512 contiguous bytes, bypassing L1
// so that A stays cached there), multiplies them with the same 8 elements
// of every row of A (read through the read-only cache: every warp reads all
// of A) and accumulates in float32. Where N alone gives too few warps to
// keep enough loads in flight, `splits` warps of a block share a column,
// each taking every splits-th 256-element stretch of K, and their sums are
// added in a fixed order through shared memory: results do not depend on
// timing. Lane m then applies bias and activation for row m and stores once.
// With two columns per warp (the default for M >= 2) each 16-byte fragment of
// A read from L1 serves both columns: at M = 8 the L1 reads of A are 8x the
// bytes of B with one column, 4x with two, which otherwise caps the stream
// of B below the memory's rate.
//
// B N-major (matmul's b [K, N] as it is): a lane owns 8 adjacent columns
// (one 16-byte load per row of B), a block 256 columns, and its 8 warps take
// interleaved rows of a stretch of K; the warps' sums meet in shared memory
// in a fixed order. Where the column groups alone give too few warps, the
// blocks of a group split K (grid.y) and write float32 partial sums that a
// second kernel adds in split order before bias, activation and the store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "matmul_api.h"
#include "matmul_device.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace {

using namespace detail;

constexpr int kWarps = 8;          // per block
constexpr int kLoadsInFlight = 4;  // 16-byte loads of B per lane per step

struct SkinnyParams {
  const void* a;
  int64_t sam;
  const void* b;
  int64_t sb;  // B's stride between rows (K-major: of n; N-major: of k)
  const void* bias;
  void* c;
  int64_t ldc;
  int M, N, K;
  int splits;  // K-major: warps per column (1, 2, 4, 8); N-major: blocks per column group
};

constexpr int kGroupCols = 256;  // N-major: columns per block, 8 per lane

__device__ __forceinline__ uint4 load_streaming(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return __ldg(static_cast<const uint4*>(p));
#endif
}

// Eight 16-bit values (one 16-byte load) as four float pairs.
template <typename T>
__device__ __forceinline__ float2 pair_of(uint32_t bits);
template <>
__device__ __forceinline__ float2 pair_of<__half>(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
template <>
__device__ __forceinline__ float2 pair_of<__nv_bfloat16>(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

template <typename T>
__device__ __forceinline__ float dot8(float acc, uint4 x, const float2 (&w)[4]) {
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 xv = pair_of<T>(xs[j]);
    acc = fmaf(xv.x, w[j].x, acc);
    acc = fmaf(xv.y, w[j].y, acc);
  }
  return acc;
}

template <typename T>
__device__ __forceinline__ void unpack(uint4 v, float2 (&w)[4]) {
  w[0] = pair_of<T>(v.x);
  w[1] = pair_of<T>(v.y);
  w[2] = pair_of<T>(v.z);
  w[3] = pair_of<T>(v.w);
}

// COLS: output columns per warp (1 or 2). The warps of a block cover
// kWarps / splits groups of COLS adjacent columns.
template <typename T, Act ACT, int COLS>
__global__ void __launch_bounds__(kWarps * 32) skinny_kmajor(SkinnyParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = kWarps / p.splits;
  const int group = warp / p.splits, part = warp % p.splits;
  const int64_t n0 = (int64_t{blockIdx.x} * groups + group) * COLS;
  const T* A = static_cast<const T*>(p.a);
  float acc[COLS][kSkinnyMaxM];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
#pragma unroll
    for (int m = 0; m < kSkinnyMaxM; ++m) acc[c][m] = 0.0f;
  }
  if (n0 < p.N) {
    // Columns past N (the last group's second one) re-read column N - 1
    // and are not stored: no branch in the loop.
    const T* w[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int64_t n = n0 + c < p.N ? n0 + c : p.N - 1;
      w[c] = static_cast<const T*>(p.b) + n * p.sb;
    }
    // This lane's 8 elements of stretch s of K are at s * 256 + lane * 8.
    const int64_t step = int64_t{p.splits} * 256;
    int64_t k = int64_t{part} * 256 + lane * 8;
    // All COLS x kLoadsInFlight loads of B go out before the first use.
    auto consume = [&](const uint4(&wv)[COLS], int64_t kk) {
      float2 wf[COLS][4];
#pragma unroll
      for (int c = 0; c < COLS; ++c) unpack<T>(wv[c], wf[c]);
#pragma unroll
      for (int m = 0; m < kSkinnyMaxM; ++m) {
        if (m < p.M) {
          const uint4 x = __ldg(reinterpret_cast<const uint4*>(A + m * p.sam + kk));
#pragma unroll
          for (int c = 0; c < COLS; ++c) acc[c][m] = dot8<T>(acc[c][m], x, wf[c]);
        }
      }
    };
    for (; k + (kLoadsInFlight - 1) * step < p.K; k += kLoadsInFlight * step) {
      uint4 wv[kLoadsInFlight][COLS];
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) {
#pragma unroll
        for (int c = 0; c < COLS; ++c) wv[i][c] = load_streaming(w[c] + k + i * step);
      }
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) consume(wv[i], k + i * step);
    }
    for (; k < p.K; k += step) {
      uint4 wv[COLS];
#pragma unroll
      for (int c = 0; c < COLS; ++c) wv[c] = load_streaming(w[c] + k);
      consume(wv, k);
    }
  }
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
#pragma unroll
    for (int m = 0; m < kSkinnyMaxM; ++m) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        acc[c][m] += __shfl_xor_sync(0xffffffffu, acc[c][m], off);
      }
    }
  }
  __shared__ float sums[kWarps][COLS][kSkinnyMaxM];
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
#pragma unroll
      for (int m = 0; m < kSkinnyMaxM; ++m) sums[warp][c][m] = acc[c][m];
    }
  }
  __syncthreads();
  if (part != 0 || lane >= p.M) return;
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int64_t n = n0 + c;
    if (n >= p.N) break;
    float v = 0.0f;
    for (int s = 0; s < p.splits; ++s) v += sums[warp + s][c][lane];
    if (p.bias != nullptr) v += load_as_float(static_cast<const T*>(p.bias) + n);
    static_cast<T*>(p.c)[lane * p.ldc + n] = from_acc<T, float>(activate<ACT, true>(v));
  }
}

template <typename T, Act ACT>
__device__ __forceinline__ void store_out(const SkinnyParams& p, int m, int64_t n, float v) {
  if (p.bias != nullptr) v += load_as_float(static_cast<const T*>(p.bias) + n);
  static_cast<T*>(p.c)[m * p.ldc + n] = from_acc<T, float>(activate<ACT, true>(v));
}

template <typename T, Act ACT>
__global__ void __launch_bounds__(kWarps * 32) skinny_nmajor(SkinnyParams p, float* partial) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n0 = int64_t{blockIdx.x} * kGroupCols + lane * 8;
  const int64_t chunk = (p.K + gridDim.y - 1) / gridDim.y;
  const int64_t k_begin = blockIdx.y * chunk;
  const int64_t k_end = k_begin + chunk < p.K ? k_begin + chunk : p.K;
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  float acc[kSkinnyMaxM][8];
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[m][j] = 0.0f;
  }
  auto accumulate = [&](uint4 bv, int64_t k) {
    float2 b[4];
    unpack<T>(bv, b);
#pragma unroll
    for (int m = 0; m < kSkinnyMaxM; ++m) {
      if (m < p.M) {
        const float x = load_as_float(A + m * p.sam + k);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[m][2 * j] = fmaf(x, b[j].x, acc[m][2 * j]);
          acc[m][2 * j + 1] = fmaf(x, b[j].y, acc[m][2 * j + 1]);
        }
      }
    }
  };
  if (n0 < p.N) {
    int64_t k = k_begin + warp;
    for (; k + (kLoadsInFlight - 1) * kWarps < k_end; k += kLoadsInFlight * kWarps) {
      uint4 bv[kLoadsInFlight];
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) {
        bv[i] = load_streaming(B + (k + i * kWarps) * p.sb + n0);
      }
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) accumulate(bv[i], k + i * kWarps);
    }
    for (; k < k_end; k += kWarps) accumulate(load_streaming(B + k * p.sb + n0), k);
  }
  __shared__ float sums[kWarps][kGroupCols];
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) {
    if (m >= p.M) break;
#pragma unroll
    for (int j = 0; j < 8; ++j) sums[warp][lane * 8 + j] = acc[m][j];
    __syncthreads();
    if (warp == 0 && n0 < p.N) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += sums[w][lane * 8 + j];
        if (gridDim.y == 1) {
          store_out<T, ACT>(p, m, n0 + j, v);
        } else {
          partial[(int64_t{blockIdx.y} * p.M + m) * p.N + n0 + j] = v;
        }
      }
    }
    __syncthreads();
  }
}

// The N-major split's second pass: the splits' partial sums in order.
template <typename T, Act ACT>
__global__ void skinny_reduce(SkinnyParams p, const float* partial) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= int64_t{p.M} * p.N) return;
  const int m = static_cast<int>(i / p.N);
  const int64_t n = i % p.N;
  float v = 0.0f;
  for (int s = 0; s < p.splits; ++s) v += partial[(int64_t{s} * p.M + m) * p.N + n];
  store_out<T, ACT>(p, m, n, v);
}

template <typename T, Act ACT>
void launch_layout(bool kmajor, int cols, const SkinnyParams& p, float* partial,
                   cudaStream_t stream) {
  const dim3 block(kWarps * 32);
  if (kmajor) {
    const int per_block = kWarps / p.splits * cols;
    const unsigned grid = static_cast<unsigned>((p.N + per_block - 1) / per_block);
    if (cols == 2) {
      skinny_kmajor<T, ACT, 2><<<grid, block, 0, stream>>>(p);
    } else {
      skinny_kmajor<T, ACT, 1><<<grid, block, 0, stream>>>(p);
    }
    return;
  }
  const dim3 grid((p.N + kGroupCols - 1) / kGroupCols, p.splits);
  skinny_nmajor<T, ACT><<<grid, block, 0, stream>>>(p, partial);
  if (p.splits > 1) {
    const int64_t outputs = int64_t{p.M} * p.N;
    skinny_reduce<T, ACT><<<(outputs + 255) / 256, 256, 0, stream>>>(p, partial);
  }
}

template <typename T>
void launch_act(Act act, bool kmajor, int cols, const SkinnyParams& p, float* partial,
                cudaStream_t stream) {
  switch (act) {
    case Act::kNone:
      return launch_layout<T, Act::kNone>(kmajor, cols, p, partial, stream);
    case Act::kRelu:
      return launch_layout<T, Act::kRelu>(kmajor, cols, p, partial, stream);
    case Act::kGelu:
      return launch_layout<T, Act::kGelu>(kmajor, cols, p, partial, stream);
    case Act::kGeluTanh:
      return launch_layout<T, Act::kGeluTanh>(kmajor, cols, p, partial, stream);
    case Act::kSilu:
      return launch_layout<T, Act::kSilu>(kmajor, cols, p, partial, stream);
  }
}

}  // namespace

bool gemm_skinny_supported(const GemmArgs& args) {
  const bool half = args.dtype == DType::kF16 || args.dtype == DType::kBF16;
  auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  const bool kmajor = args.sbk == 1 && args.sbn % 8 == 0;
  const bool nmajor = args.sbn == 1 && args.sbk % 8 == 0 && args.N % 8 == 0;
  return half && args.M >= 1 && args.M <= kSkinnyMaxM && args.K >= 8 && args.K % 8 == 0 &&
         args.sak == 1 && args.sam % 8 == 0 && (kmajor || nmajor) && aligned16(args.a) &&
         aligned16(args.b);
}

namespace {

bool kMajor(const GemmArgs& args) { return args.sbk == 1 && (args.sbn != 1 || args.N == 1); }

}  // namespace

int gemm_skinny_cols(const GemmArgs& args, Tile tile) {
  if (!kMajor(args)) return 1;
  if (tile != Tile::kAuto) return tile == Tile::kLarge ? 2 : 1;
  return args.M >= 2 ? 2 : 1;
}

int gemm_skinny_splits(const GemmArgs& args, int num_sms, Tile tile) {
  // About 32 warps per SM keep enough 16-byte loads in flight to stream B at
  // the memory's rate (two-column warps have twice the loads in flight: 16).
  if (kMajor(args)) {
    const int cols = gemm_skinny_cols(args, tile);
    const int64_t wanted = int64_t{num_sms} * 32 / cols;
    const int64_t groups = (args.N + cols - 1) / cols;
    // No more warps per column than K has 256-element stretches.
    const int64_t stretches = (args.K + 255) / 256;
    int splits = 1;
    while (splits < kWarps && groups * splits < wanted && splits * 2 <= stretches) splits *= 2;
    return splits;
  }
  const int64_t wanted = int64_t{num_sms} * 32;
  // Blocks per column group, each with at least 8 rows of K per warp.
  const int64_t groups = (args.N + kGroupCols - 1) / kGroupCols;
  const int64_t most = args.K / (8 * kWarps) > 1 ? args.K / (8 * kWarps) : 1;
  int64_t splits = (wanted + groups * kWarps - 1) / (groups * kWarps);
  if (splits > most) splits = most;
  if (splits > 64) splits = 64;
  return static_cast<int>(splits < 1 ? 1 : splits);
}

int64_t gemm_skinny_workspace_bytes(const GemmArgs& args, int num_sms) {
  if (kMajor(args)) return 0;
  const int splits = gemm_skinny_splits(args, num_sms, Tile::kAuto);
  return splits > 1 ? int64_t{splits} * args.M * args.N * 4 : 0;
}

cudaError_t launch_gemm_skinny(const GemmArgs& args, int num_sms, Tile tile, void* workspace,
                               cudaStream_t stream) {
  const bool kmajor = kMajor(args);
  const int cols = gemm_skinny_cols(args, tile);
  SkinnyParams p{args.a,
                 args.sam,
                 args.b,
                 kmajor ? args.sbn : args.sbk,
                 args.bias,
                 args.c,
                 args.ldc,
                 static_cast<int>(args.M),
                 static_cast<int>(args.N),
                 static_cast<int>(args.K),
                 gemm_skinny_splits(args, num_sms, tile)};
  float* partial = static_cast<float*>(workspace);
  if (args.dtype == DType::kF16) {
    launch_act<__half>(args.act, kmajor, cols, p, partial, stream);
  } else {
    launch_act<__nv_bfloat16>(args.act, kmajor, cols, p, partial, stream);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
