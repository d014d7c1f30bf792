// Generic tiled GEMM on CUDA cores: the float32 / float64 kernel, and the
// fallback for float16 / bfloat16 on GPUs without the tensor-core paths.
//
// 64x64 output tile per block of 256 threads, 4x4 outputs per thread (strided
// so that shared-memory reads and global stores are conflict-free and
// coalesced), K walked 16 at a time. The next K-slice is fetched into
// registers while the current one is multiplied out of shared memory. Loads
// go through the operands' strides, so any layout (transposed, sliced,
// expanded) is read in place; out-of-range elements read as zero, so any M,
// N, K works. Accumulation in float32 (float64 for double); bias, activation
// and the output cast are fused into the store.
#include <climits>

#include "matmul_device.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace {

using namespace detail;

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

  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  int tm, tn;
  grouped_tile<8>(blockIdx.x, tiles_m, tiles_n, tm, tn);
  const int m0 = tm * BM, n0 = tn * BN;

  // Consecutive threads walk the operand's unit-stride dimension.
  const bool a_m_fast = p.sam == 1 && p.sak != 1;
  const bool b_n_fast = !(p.sbk == 1 && p.sbn != 1);

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
  const int64_t tiles = ((p.M + BM - 1) / BM) * ((p.N + BN - 1) / BN);
  if (tiles > INT_MAX) return cudaErrorInvalidValue;
  gemm_simt_kernel<T, Acc, BM, BN, BK, TM, TN>
      <<<static_cast<unsigned>(tiles), (BM / TM) * (BN / TN), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gemm_simt(const GemmArgs& p, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return cudaSuccess;
  if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX) return cudaErrorInvalidValue;
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
