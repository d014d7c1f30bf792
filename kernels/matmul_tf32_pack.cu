// K-major copies of float32 operands for the TF32 form of the Hopper kernel,
// which reads its A K-major only (kernels/matmul_sm90_kernel.cuh; matmul's
// N-major b runs as the transposed product instead): dst[r][k] =
// tf32(src[k][r]), for an M-major a (matmul(x.t(), b)).
// Each value is rounded to TF32 on the way (cvt.rna: to nearest, ties away),
// so the tensor cores multiply the rounded value instead of dropping its low
// 13 mantissa bits. A 32 x 32 tile per block of 32 x 8 threads goes through
// shared memory (one padded column against bank conflicts): coalesced reads
// along the source's contiguous dimension and writes along the destination's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "matmul_api.h"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;

__device__ __forceinline__ float round_tf32(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t y;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(x));
  return __uint_as_float(y);
#else
  return x;
#endif
}

// src[k][r] = src[k * ld_src + r] (r contiguous), dst[r][k] = dst[r * ld_dst + k].
// blockIdx.x picks the 32 rows, blockIdx.y the first 32-wide K tile, then
// every gridDim.y-th (the y dimension of a grid ends at 65535 blocks).
__global__ void pack_kmajor_tf32(const float* __restrict__ src, int64_t ld_src,
                                 float* __restrict__ dst, int64_t ld_dst, int64_t rows,
                                 int64_t ks) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = int64_t{blockIdx.x} * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t k0 = int64_t{blockIdx.y} * kTile; k0 < ks; k0 += int64_t{gridDim.y} * kTile) {
#pragma unroll
    for (int i = ty; i < kTile; i += kRowsPerPass) {
      const int64_t k = k0 + i, r = r0 + tx;
      if (k < ks && r < rows) tile[i][tx] = round_tf32(src[k * ld_src + r]);
    }
    __syncthreads();
#pragma unroll
    for (int i = ty; i < kTile; i += kRowsPerPass) {
      const int64_t r = r0 + i, k = k0 + tx;
      if (r < rows && k < ks) dst[r * ld_dst + k] = tile[tx][i];
    }
    __syncthreads();  // the tile is read before the next K tile overwrites it
  }
}

}  // namespace

cudaError_t launch_pack_kmajor_tf32(const float* src, int64_t ld_src, float* dst, int64_t ld_dst,
                                    int64_t rows, int64_t ks, cudaStream_t stream) {
  if (rows <= 0 || ks <= 0) return cudaSuccess;
  const int64_t gx = (rows + kTile - 1) / kTile;
  const int64_t gy = std::min<int64_t>((ks + kTile - 1) / kTile, 65535);
  if (gx > INT32_MAX) return cudaErrorInvalidValue;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  launch.blockDim = dim3(kTile, kRowsPerPass);
  launch.stream = stream;
  return cudaLaunchKernelEx(&launch, pack_kmajor_tf32, src, ld_src, dst, ld_dst, rows, ks);
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
