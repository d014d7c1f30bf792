// Skinny products, M <= kSkinnyMaxM rows (decode-time linear layers, and
// float32 products of a few rows): C[M, N] = act(A[M, K] @ B[K, N] + bias).
// Such a product reads B once and does 2 flops per element of it per row of
// A, so it is bound by reading B from memory, where a tensor-core tile of 64+
// rows would compute mostly padding. Two layouts of B, each streamed once at
// the memory's rate, accumulating in float32 (exact float32 FMAs for float32
// operands, under every matmul precision):
//
// B K-major (the weight of F.linear, [N, K] contiguous; float16, bfloat16,
// float32): one warp reduces one output column for every row of A. Each lane
// loads 16 bytes of B's row n at a time (the warp reads 512 contiguous bytes,
// bypassing L1 so that A stays cached there), multiplies them with the same
// elements of every row of A (read through the read-only cache: every warp
// reads all of A) and accumulates. Where N alone gives too few warps to keep
// enough loads in flight, `splits` warps of a block share a column, each
// taking every splits-th 512-byte stretch of K, and their sums are added in a
// fixed order through shared memory. Lane m then applies bias and activation
// for row m and stores once.
//
// B N-major (matmul's b, [K, N] row-major; float32): a block takes 128
// columns, each lane 4 adjacent ones, so a warp reads 512 contiguous bytes of
// a row of B per 16-byte load; the block's kNmajorWarps warps split its rows
// in groups of 4 (warp w takes groups w, w + kNmajorWarps, ...), reading
// A[m, k..k+3] as one 16-byte load that all lanes of a warp share, and add
// their sums in warp order through shared memory. K is split over blocks too
// (the grid's y) where the column blocks are too few for about three blocks
// per SM, each writing float32 sums that splitk_finish adds in split order,
// applying bias and activation (a programmatic dependent launch on sm_90).
// With 32 columns per block instead (a warp reading 128-byte pieces of each
// row) the same product streamed B at about half the memory's rate.
//
// Both are deterministic: no atomics, sums in an order fixed by the launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "dependent_launch.cuh"
#include "matmul_api.h"
#include "matmul_device.cuh"
#include "matmul_sm90_ptx.cuh"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace {

using namespace detail;

constexpr int kWarps = 8;          // per block of the K-major kernel
constexpr int kLoadsInFlight = 4;  // 16-byte loads of B per lane per step (K-major)
constexpr int kNmajorWarps = 8;    // N-major: warps of a block, splitting its rows
constexpr int kNmajorCols = 128;   // N-major: columns of B per block, 4 per lane

struct SkinnyParams {
  const void* a;
  int64_t sam;
  const void* b;
  int64_t sb;  // B's stride between columns (K-major) or rows (N-major)
  const void* bias;
  void* c;
  int64_t ldc;
  int M, N, K;
  int splits;              // K-major: warps per column (1, 2, 4, 8); N-major: blocks along K
  int64_t rows_per_split;  // N-major: rows of B per block along K, a multiple of 4
  float* partial;          // N-major with splits > 1: [splits][M][N] float32 sums
  int blocks;              // K-major bulk kernel: its persistent grid (the SMs)
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

__device__ __forceinline__ float load_streaming_f32(const float* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  float v;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#else
  return __ldg(p);
#endif
}

// The elements of one 16-byte load as floats.
template <typename T>
constexpr int kPerLoad = 16 / static_cast<int>(sizeof(T));

template <typename T>
__device__ __forceinline__ void unpack(uint4 v, float (&f)[kPerLoad<T>]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      f[j] = __uint_as_float(w[j]);
    } else if constexpr (std::is_same_v<T, __half>) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
      f[2 * j] = p.x;
      f[2 * j + 1] = p.y;
    } else {
      const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
      f[2 * j] = p.x;
      f[2 * j + 1] = p.y;
    }
  }
}

template <typename T, Act ACT>
__device__ __forceinline__ void store_output(const SkinnyParams& p, int m, int64_t n, float v) {
  if (p.bias != nullptr) v += load_as_float(static_cast<const T*>(p.bias) + n);
  static_cast<T*>(p.c)[m * p.ldc + n] =
      from_acc<T, float>(activate<ACT, !std::is_same_v<T, float>>(v));
}

// B K-major. The warps of a block cover kWarps / splits adjacent columns.
template <typename T, Act ACT>
__global__ void __launch_bounds__(kWarps * 32) skinny_kmajor(SkinnyParams p) {
  constexpr int E = kPerLoad<T>;
  constexpr int kStretch = 32 * E;  // elements of K one warp reads per load
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int columns = kWarps / p.splits;
  const int column = warp / p.splits, part = warp % p.splits;
  const int64_t n = int64_t{blockIdx.x} * columns + column;
  const T* A = static_cast<const T*>(p.a);
  float acc[kSkinnyMaxM];
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) acc[m] = 0.0f;
  if (n < p.N) {
    const T* w = static_cast<const T*>(p.b) + n * p.sb;
    // This lane's E elements of stretch s of K are at s * kStretch + lane * E.
    const int64_t step = int64_t{p.splits} * kStretch;
    int64_t k = int64_t{part} * kStretch + lane * E;
    auto consume = [&](uint4 wv, int64_t kk) {
      float wf[E];
      unpack<T>(wv, wf);
#pragma unroll
      for (int m = 0; m < kSkinnyMaxM; ++m) {
        if (m < p.M) {
          float xf[E];
          unpack<T>(__ldg(reinterpret_cast<const uint4*>(A + m * p.sam + kk)), xf);
#pragma unroll
          for (int j = 0; j < E; ++j) acc[m] = fmaf(xf[j], wf[j], acc[m]);
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
  store_output<T, ACT>(p, lane, n, v);
}

// B K-major float32 on sm_90a, at most kBulkMaxM rows of A: a persistent block per
// SM streams a contiguous range of B's rows (output columns) through shared
// memory with bulk copies. A stage holds one piece of kBulkPieceBytes of
// kBulkWarps consecutive rows of B and the same piece of every row of A; the
// producer warp's one thread fills the stages in order (an mbarrier each way),
// and consumer warp w reduces row w of each stage: its lanes read 16 bytes of
// B and of each row of A from shared memory at a time and accumulate over the
// row's pieces, then add across lanes and lane m stores row m's output. The
// block's long, in-order bulk reads keep more of the memory busy than a warp
// per column reading its row with ordinary loads. The stages fill a fixed
// budget of shared memory: 5 of them with one row of A, 3 with eight (two
// stages in flight measured as fast as four). Half types stay on the warp
// form, which measured faster for them: a byte of B holds twice the
// elements to convert and multiply for the eight consumer warps.
constexpr int kBulkWarps = 8;           // consumer warps, one row of B each per stage
constexpr int kBulkMaxM = kSkinnyMaxM;  // rows of A
constexpr int kBulkPieceBytes = 4096;   // bytes of one row per stage
constexpr int kBulkSmemBytes = 3 * (kBulkWarps + kBulkMaxM) * kBulkPieceBytes;
constexpr int kBulkMaxStages = kBulkSmemBytes / ((kBulkWarps + 1) * kBulkPieceBytes);

// The stages of a problem with m rows of A.
__host__ __device__ constexpr int bulk_stages(int m) {
  return kBulkSmemBytes / ((kBulkWarps + m) * kBulkPieceBytes);
}
static_assert(bulk_stages(kBulkMaxM) >= 2 && bulk_stages(1) == kBulkMaxStages,
              "the bulk form keeps two stages in flight at the most rows");

template <Act ACT>
__global__ void __launch_bounds__((kBulkWarps + 1) * 32, 1) skinny_kmajor_bulk(SkinnyParams p) {
#if FASTCOMM_SM90A_DEVICE
  using namespace sm90;
  using T = float;
  constexpr int E = kPerLoad<T>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full[kBulkMaxStages], empty[kBulkMaxStages];
  const int num_stages = bulk_stages(p.M);
  const uint32_t stage_bytes = static_cast<uint32_t>((kBulkWarps + p.M) * kBulkPieceBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n0 = int64_t{p.N} * blockIdx.x / gridDim.x;
  const int64_t n1 = int64_t{p.N} * (blockIdx.x + 1) / gridDim.x;
  const int64_t slabs = (n1 - n0 + kBulkWarps - 1) / kBulkWarps;
  const int64_t row_bytes = int64_t{p.K} * static_cast<int64_t>(sizeof(T));
  const int pieces = static_cast<int>((row_bytes + kBulkPieceBytes - 1) / kBulkPieceBytes);
  const uint32_t stages = smem_u32(smem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < num_stages; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), kBulkWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp == kBulkWarps) {
    if (lane != 0) return;
    const char* b = static_cast<const char*>(p.b);
    const char* a = static_cast<const char*>(p.a);
    int64_t it = 0;
    for (int64_t slab = 0; slab < slabs; ++slab) {
      const int64_t first = n0 + slab * kBulkWarps;
      const int rows = static_cast<int>(min(int64_t{kBulkWarps}, n1 - first));
      for (int piece = 0; piece < pieces; ++piece, ++it) {
        const int s = static_cast<int>(it % num_stages);
        const uint32_t round = static_cast<uint32_t>(it / num_stages);
        mbar_wait(smem_u32(&empty[s]), (round & 1) ^ 1);  // a fresh barrier passes parity 1
        const int64_t off = int64_t{piece} * kBulkPieceBytes;
        const uint32_t bytes =
            static_cast<uint32_t>(min(int64_t{kBulkPieceBytes}, row_bytes - off));
        const uint32_t bar = smem_u32(&full[s]), dst = stages + s * stage_bytes;
        mbar_arrive_expect_tx(bar, bytes * (rows + p.M));
        for (int r = 0; r < rows; ++r) {
          bulk_load_1d(dst + r * kBulkPieceBytes, b + ((first + r) * p.sb) * sizeof(T) + off, bytes,
                       bar);
        }
        for (int m = 0; m < p.M; ++m) {
          bulk_load_1d(dst + (kBulkWarps + m) * kBulkPieceBytes, a + (m * p.sam) * sizeof(T) + off,
                       bytes, bar);
        }
      }
    }
    return;
  }
  int64_t it = 0;
  for (int64_t slab = 0; slab < slabs; ++slab) {
    const int64_t n = n0 + slab * kBulkWarps + warp;
    const bool mine = n < n1;
    float acc[kBulkMaxM];
#pragma unroll
    for (int m = 0; m < kBulkMaxM; ++m) acc[m] = 0.0f;
    for (int piece = 0; piece < pieces; ++piece, ++it) {
      const int s = static_cast<int>(it % num_stages);
      const uint32_t round = static_cast<uint32_t>(it / num_stages);
      mbar_wait(smem_u32(&full[s]), round & 1);
      if (mine) {
        const int bytes = static_cast<int>(
            min(int64_t{kBulkPieceBytes}, row_bytes - int64_t{piece} * kBulkPieceBytes));
        const uint32_t stage = stages + s * stage_bytes;
        const uint32_t row = stage + warp * kBulkPieceBytes;
#pragma unroll 4
        for (int at = lane * 16; at < bytes; at += 32 * 16) {
          uint32_t wv[4];
          ld_shared_v4(row + at, wv);
          float wf[E];
          unpack<T>(make_uint4(wv[0], wv[1], wv[2], wv[3]), wf);
#pragma unroll
          for (int m = 0; m < kBulkMaxM; ++m) {
            if (m < p.M) {
              uint32_t xv[4];
              ld_shared_v4(stage + (kBulkWarps + m) * kBulkPieceBytes + at, xv);
              float xf[E];
              unpack<T>(make_uint4(xv[0], xv[1], xv[2], xv[3]), xf);
#pragma unroll
              for (int j = 0; j < E; ++j) acc[m] = fmaf(xf[j], wf[j], acc[m]);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
    }
    if (!mine) continue;
    float out = 0.0f;
#pragma unroll
    for (int m = 0; m < kBulkMaxM; ++m) {
      float v = acc[m];
#pragma unroll
      for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == m) out = v;
    }
    if (lane < p.M) store_output<T, ACT>(p, lane, n, out);
  }
#endif
}

__device__ __forceinline__ float4 load_streaming_f4(const float* p) {
  const uint4 v = load_streaming(p);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                     __uint_as_float(v.w));
}

// Columns n..n+3 of one row of B: one 16-byte load where rows are 16-byte
// aligned (VEC) and all 4 columns exist, else one load per column there is.
template <bool VEC>
__device__ __forceinline__ float4 load_b4(const float* row, int64_t n, int64_t N) {
  if (VEC && n + 3 < N) return load_streaming_f4(row + n);
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (n < N) v.x = load_streaming_f32(row + n);
  if (n + 1 < N) v.y = load_streaming_f32(row + n + 1);
  if (n + 2 < N) v.z = load_streaming_f32(row + n + 2);
  if (n + 3 < N) v.w = load_streaming_f32(row + n + 3);
  return v;
}

__device__ __forceinline__ void fma4(float4& acc, float a, const float4& b) {
  acc.x = fmaf(a, b.x, acc.x);
  acc.y = fmaf(a, b.y, acc.y);
  acc.z = fmaf(a, b.z, acc.z);
  acc.w = fmaf(a, b.w, acc.w);
}

// B N-major, float32: block (x, y) takes columns x * kNmajorCols.. and rows
// y * rows_per_split.. of B.
template <Act ACT, bool VEC>
__global__ void __launch_bounds__(kNmajorWarps * 32) skinny_nmajor(SkinnyParams p) {
  __shared__ float4 sums[kNmajorWarps - 1][kSkinnyMaxM][32];
  griddep_wait();  // launched as a dependent of the kernel before it (sm_90)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n = int64_t{blockIdx.x} * kNmajorCols + lane * 4;
  const int64_t k0 = int64_t{blockIdx.y} * p.rows_per_split;
  const int64_t rows = min(int64_t{p.K} - k0, p.rows_per_split);
  const float* A = static_cast<const float*>(p.a) + k0;
  const float* B = static_cast<const float*>(p.b) + k0 * p.sb;
  float4 acc[kSkinnyMaxM];
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) acc[m] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const int64_t groups = rows / 4;
  for (int64_t g = warp; g < groups; g += kNmajorWarps) {
    float4 bv[4];  // rows 4g..4g+3, all loads out before the first use
#pragma unroll
    for (int r = 0; r < 4; ++r) bv[r] = load_b4<VEC>(B + (4 * g + r) * p.sb, n, p.N);
#pragma unroll
    for (int m = 0; m < kSkinnyMaxM; ++m) {
      if (m < p.M) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(A + m * p.sam + 4 * g));
        fma4(acc[m], x.x, bv[0]);
        fma4(acc[m], x.y, bv[1]);
        fma4(acc[m], x.z, bv[2]);
        fma4(acc[m], x.w, bv[3]);
      }
    }
  }
  // The last rows % 4 rows (the last split only): the warp whose turn the next group would be.
  if (warp == groups % kNmajorWarps) {
    for (int64_t k = 4 * groups; k < rows; ++k) {
      const float4 bk = load_b4<false>(B + k * p.sb, n, p.N);
#pragma unroll
      for (int m = 0; m < kSkinnyMaxM; ++m) {
        if (m < p.M) fma4(acc[m], __ldg(A + m * p.sam + k), bk);
      }
    }
  }
  griddep_launch_dependents();  // every load is done: splitk_finish may start its blocks
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < kSkinnyMaxM; ++m) {
      if (m < p.M) sums[warp - 1][m][lane] = acc[m];
    }
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int m = 0; m < kSkinnyMaxM; ++m) {
    if (m >= p.M) continue;
    float v[4] = {acc[m].x, acc[m].y, acc[m].z, acc[m].w};
    for (int w = 0; w < kNmajorWarps - 1; ++w) {  // in warp order
      const float4 o = sums[w][m][lane];
      v[0] += o.x;
      v[1] += o.y;
      v[2] += o.z;
      v[3] += o.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (n + j >= p.N) break;
      if (p.splits > 1) {
        p.partial[(int64_t{blockIdx.y} * p.M + m) * p.N + n + j] = v[j];
      } else {
        store_output<float, ACT>(p, m, n + j, v[j]);
      }
    }
  }
}

// N-major: the split of K over blocks. Enough blocks for about three per SM,
// each taking at least kMinSplitRows rows of B.
constexpr int64_t kMinSplitRows = 64;
void nmajor_split(const GemmArgs& args, int num_sms, int* splits, int64_t* rows_per_split) {
  const int64_t column_blocks = (args.N + kNmajorCols - 1) / kNmajorCols;
  const int64_t wanted = std::max<int64_t>(1, 3 * int64_t{num_sms} / column_blocks);
  int64_t rows = (args.K + wanted - 1) / wanted;
  rows = std::max(kMinSplitRows, (rows + 3) / 4 * 4);
  *rows_per_split = rows;
  *splits = static_cast<int>((args.K + rows - 1) / rows);
}

bool b_kmajor(const GemmArgs& args) { return args.sbk == 1; }

// Whether skinny_kmajor_bulk<ACT> runs on the current device: its sm_90a
// code is in the build (its barriers are static shared memory, which the
// empty body of other targets lacks) and it may take its shared memory. Asked
// once per device and instantiation.
template <Act ACT>
bool bulk_kernel_ready() {
  static detail::PerDeviceAnswer ready;
  return ready.get([](int dev) {
    int major = 0, minor = 0;
    cudaFuncAttributes attr{};
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&attr, skinny_kmajor_bulk<ACT>) != cudaSuccess) {
      cudaGetLastError();  // a failed query says nothing of the device or the build
      return detail::PerDeviceAnswer::kUnknown;
    }
    const bool ok =
        major == 9 && minor == 0 && attr.binaryVersion >= 90 && attr.sharedSizeBytes > 0 &&
        cudaFuncSetAttribute(skinny_kmajor_bulk<ACT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kBulkSmemBytes) == cudaSuccess;
    cudaGetLastError();
    return ok ? detail::PerDeviceAnswer::kYes : detail::PerDeviceAnswer::kNo;
  });
}

// bulk: gemm_skinny_bulk(args), the one choice of the bulk form.
template <typename T, Act ACT>
cudaError_t launch_kernel(const GemmArgs& args, const SkinnyParams& p, bool kmajor, bool bulk,
                          cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    if (bulk) {
      skinny_kmajor_bulk<ACT><<<p.blocks, (kBulkWarps + 1) * 32, kBulkSmemBytes, stream>>>(p);
      return cudaGetLastError();
    }
  }
  if (kmajor) {
    const int per_block = kWarps / p.splits;
    const dim3 grid(static_cast<unsigned>((p.N + per_block - 1) / per_block));
    skinny_kmajor<T, ACT><<<grid, kWarps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if constexpr (std::is_same_v<T, float>) {
    bool pdl = false;
    cudaError_t err = dependent_launch_supported(&pdl);
    if (err != cudaSuccess) return err;
    cudaLaunchConfig_t launch{};
    launch.gridDim = dim3(static_cast<unsigned>((p.N + kNmajorCols - 1) / kNmajorCols),
                          static_cast<unsigned>(p.splits));
    launch.blockDim = dim3(kNmajorWarps * 32);
    launch.stream = stream;
    cudaLaunchAttribute attr = programmatic_dependent_launch();
    if (pdl) {
      launch.attrs = &attr;
      launch.numAttrs = 1;
    }
    const bool vec = p.sb % 4 == 0 && aligned16(p.b);
    err = vec ? cudaLaunchKernelEx(&launch, skinny_nmajor<ACT, true>, p)
              : cudaLaunchKernelEx(&launch, skinny_nmajor<ACT, false>, p);
    if (err != cudaSuccess || p.splits == 1) return err;
    return launch_splitk_finish<float>(args, p.partial, p.splits, stream, pdl);
  }
  return cudaErrorInvalidValue;  // N-major takes float32 only (gemm_skinny_supported)
}

template <typename T>
cudaError_t launch_act(const GemmArgs& args, const SkinnyParams& p, bool kmajor, bool bulk,
                       cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  FASTCOMM_DISPATCH_ACT(args.act, err = (launch_kernel<T, kAct>(args, p, kmajor, bulk, stream)));
  return err;
}

}  // namespace

bool gemm_skinny_supported(const GemmArgs& args) {
  const bool half = args.dtype == DType::kF16 || args.dtype == DType::kBF16;
  const bool f32 = args.dtype == DType::kF32;
  // A is read in 16-byte loads (K-major) in both layouts.
  const int per_load = f32 ? 4 : 8;
  if (!(half || f32) || args.M < 1 || args.M > kSkinnyMaxM || args.K < 1 || args.sak != 1 ||
      args.sam % per_load != 0 || !aligned16(args.a)) {
    return false;
  }
  if (b_kmajor(args)) {
    return args.K % per_load == 0 && args.sbn % per_load == 0 && aligned16(args.b);
  }
  return f32 && args.sbn == 1 && args.sbk >= 1;
}

bool gemm_skinny_bulk(const GemmArgs& args) {
  if (args.dtype != DType::kF32 || !gemm_skinny_supported(args) || !b_kmajor(args) ||
      args.M > kBulkMaxM) {
    return false;
  }
  bool ready = false;
  FASTCOMM_DISPATCH_ACT(args.act, ready = (bulk_kernel_ready<kAct>()));
  return ready;
}

int gemm_skinny_splits(const GemmArgs& args, int num_sms) {
  if (!b_kmajor(args)) {
    int splits = 1;
    int64_t rows = 0;
    nmajor_split(args, num_sms, &splits, &rows);
    return splits;
  }
  // About 32 warps per SM keep enough 16-byte loads in flight to stream B
  // at the memory's rate; no more warps per column than K has 512-byte
  // stretches.
  const int64_t wanted = int64_t{num_sms} * 32;
  const int64_t stretch = 32 * (args.dtype == DType::kF32 ? 4 : 8);
  const int64_t stretches = (args.K + stretch - 1) / stretch;
  int splits = 1;
  while (splits < kWarps && args.N * splits < wanted && splits * 2 <= stretches) splits *= 2;
  return splits;
}

int64_t gemm_skinny_workspace_bytes(const GemmArgs& args, int num_sms) {
  const int splits = gemm_skinny_splits(args, num_sms);
  return b_kmajor(args) || splits == 1 ? 0 : int64_t{splits} * args.M * args.N * 4;
}

cudaError_t launch_gemm_skinny(const GemmArgs& args, int num_sms, void* workspace,
                               cudaStream_t stream) {
  const bool kmajor = b_kmajor(args);
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
                 1,
                 0,
                 static_cast<float*>(workspace),
                 num_sms};
  if (kmajor) {
    p.splits = gemm_skinny_splits(args, num_sms);
  } else {
    nmajor_split(args, num_sms, &p.splits, &p.rows_per_split);
    if (p.splits > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  }
  const bool bulk = gemm_skinny_bulk(args);
  if (args.dtype == DType::kF16) return launch_act<__half>(args, p, kmajor, bulk, stream);
  if (args.dtype == DType::kBF16) return launch_act<__nv_bfloat16>(args, p, kmajor, bulk, stream);
  return launch_act<float>(args, p, kmajor, bulk, stream);
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
