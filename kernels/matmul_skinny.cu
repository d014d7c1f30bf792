// Skinny products, M <= kSkinnyMaxM rows (decode-time linear layers):
// C[M, N] = act(A[M, K] @ B[K, N] + bias) with B K-major (the weight of
// F.linear, [N, K] contiguous) is a matrix-vector product per row of A, bound
// by reading B once from memory, where a tensor-core tile of 64+ rows would
// compute mostly padding.
//
// One warp reduces one output column for every row of A: each lane loads 16
// bytes of B's row n at a time (the warp reads 512 contiguous bytes, bypassing
// L1 so that A stays cached there), multiplies them with the same 8 elements
// of every row of A (read through the read-only cache: every warp reads all
// of A) and accumulates in float32. Where N alone gives too few warps to
// keep enough loads in flight, `splits` warps of a block share a column,
// each taking every splits-th 256-element stretch of K, and their sums are
// added in a fixed order through shared memory: results do not depend on
// timing. Lane m then applies bias and activation for row m and stores once.
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
  int64_t sbn;  // B's stride between columns (rows of the weight)
  const void* bias;
  void* c;
  int64_t ldc;
  int M, N, K;
  int splits;  // warps per column (1, 2, 4, 8)
};

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

// The warps of a block cover kWarps / splits adjacent columns.
template <typename T, Act ACT>
__global__ void __launch_bounds__(kWarps * 32) skinny_kmajor(SkinnyParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int columns = kWarps / p.splits;
  const int column = warp / p.splits, part = warp % p.splits;
  const int64_t n = int64_t{blockIdx.x} * columns + column;
  const T* A = static_cast<const T*>(p.a);
  float acc[kSkinnyMaxM];
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) acc[m] = 0.0f;
  if (n < p.N) {
    const T* w = static_cast<const T*>(p.b) + n * p.sbn;
    // This lane's 8 elements of stretch s of K are at s * 256 + lane * 8.
    const int64_t step = int64_t{p.splits} * 256;
    int64_t k = int64_t{part} * 256 + lane * 8;
    auto consume = [&](uint4 wv, int64_t kk) {
      float2 wf[4];
      unpack<T>(wv, wf);
#pragma unroll
      for (int m = 0; m < kSkinnyMaxM; ++m) {
        if (m < p.M) {
          const uint4 x = __ldg(reinterpret_cast<const uint4*>(A + m * p.sam + kk));
          acc[m] = dot8<T>(acc[m], x, wf);
        }
      }
    };
    // All kLoadsInFlight loads of B go out before the first use.
    for (; k + (kLoadsInFlight - 1) * step < p.K; k += kLoadsInFlight * step) {
      uint4 wv[kLoadsInFlight];
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) wv[i] = load_streaming(w + k + i * step);
#pragma unroll
      for (int i = 0; i < kLoadsInFlight; ++i) consume(wv[i], k + i * step);
    }
    for (; k < p.K; k += step) consume(load_streaming(w + k), k);
  }
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
  }
  __shared__ float sums[kWarps][kSkinnyMaxM];
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < kSkinnyMaxM; ++m) sums[warp][m] = acc[m];
  }
  __syncthreads();
  if (part != 0 || lane >= p.M || n >= p.N) return;
  float v = 0.0f;
  for (int s = 0; s < p.splits; ++s) v += sums[warp + s][lane];
  if (p.bias != nullptr) v += load_as_float(static_cast<const T*>(p.bias) + n);
  static_cast<T*>(p.c)[lane * p.ldc + n] = from_acc<T, float>(activate<ACT, true>(v));
}

template <typename T>
void launch_act(Act act, const SkinnyParams& p, cudaStream_t stream) {
  const dim3 block(kWarps * 32);
  const int per_block = kWarps / p.splits;
  const dim3 grid(static_cast<unsigned>((p.N + per_block - 1) / per_block));
  switch (act) {
    case Act::kNone:
      return skinny_kmajor<T, Act::kNone><<<grid, block, 0, stream>>>(p);
    case Act::kRelu:
      return skinny_kmajor<T, Act::kRelu><<<grid, block, 0, stream>>>(p);
    case Act::kGelu:
      return skinny_kmajor<T, Act::kGelu><<<grid, block, 0, stream>>>(p);
    case Act::kGeluTanh:
      return skinny_kmajor<T, Act::kGeluTanh><<<grid, block, 0, stream>>>(p);
    case Act::kSilu:
      return skinny_kmajor<T, Act::kSilu><<<grid, block, 0, stream>>>(p);
  }
}

}  // namespace

bool gemm_skinny_supported(const GemmArgs& args) {
  const bool half = args.dtype == DType::kF16 || args.dtype == DType::kBF16;
  auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  return half && args.M >= 1 && args.M <= kSkinnyMaxM && args.K >= 8 && args.K % 8 == 0 &&
         args.sak == 1 && args.sam % 8 == 0 && args.sbk == 1 && args.sbn % 8 == 0 &&
         aligned16(args.a) && aligned16(args.b);
}

int gemm_skinny_splits(const GemmArgs& args, int num_sms) {
  // About 32 warps per SM keep enough 16-byte loads in flight to stream B at
  // the memory's rate; no more warps per column than K has 256-element
  // stretches.
  const int64_t wanted = int64_t{num_sms} * 32;
  const int64_t stretches = (args.K + 255) / 256;
  int splits = 1;
  while (splits < kWarps && args.N * splits < wanted && splits * 2 <= stretches) splits *= 2;
  return splits;
}

cudaError_t launch_gemm_skinny(const GemmArgs& args, int num_sms, cudaStream_t stream) {
  SkinnyParams p{args.a,
                 args.sam,
                 args.b,
                 args.sbn,
                 args.bias,
                 args.c,
                 args.ldc,
                 static_cast<int>(args.M),
                 static_cast<int>(args.N),
                 static_cast<int>(args.K),
                 gemm_skinny_splits(args, num_sms)};
  if (args.dtype == DType::kF16) {
    launch_act<__half>(args.act, p, stream);
  } else {
    launch_act<__nv_bfloat16>(args.act, p, stream);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
