// Device helpers shared by the fastcomm matmul kernels (kernels/matmul_*.cu):
// element conversions, the fused epilogue (bias + activation + cast + store)
// and the tile order used for L2 reuse.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "dependent_launch.cuh"
#include "matmul_api.h"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace detail {

// Whether a pointer is 16-byte aligned (vector loads, TMA; host side).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A yes / no question about the current device asked once per device (host
// side): `probe(dev)` answers kYes or kNo, or kUnknown where the query failed,
// which is not kept. A caller holds one of these per question.
class PerDeviceAnswer {
 public:
  enum Answer { kUnknown = 0, kYes = 1, kNo = 2 };

  template <typename Probe>
  bool get(Probe probe) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
      cudaGetLastError();
      return false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (known_[dev] == kUnknown) known_[dev] = probe(dev);
    return known_[dev] == kYes;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::mutex mu_;
  Answer known_[kMaxDevices] = {};
};

// ---- conversions -----------------------------------------------------------

template <typename Acc>
__device__ __forceinline__ Acc to_acc(float v) {
  return static_cast<Acc>(v);
}

__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

template <typename Acc, typename T>
__device__ __forceinline__ Acc load_acc(const T* p) {
  return static_cast<Acc>(load_as_float(p));
}
template <>
__device__ __forceinline__ double load_acc<double, double>(const double* p) {
  return *p;
}

template <typename T, typename Acc>
__device__ __forceinline__ T from_acc(Acc v);
template <>
__device__ __forceinline__ float from_acc<float, float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ double from_acc<double, double>(double v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_acc<__half, float>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}

// Two adjacent outputs as one 4-byte (16-bit types) or 8-byte (float) store.
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float v0, float v1);
template <>
__device__ __forceinline__ void store_pair<__half>(__half* p, float v0, float v1) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v0, v1);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float v0, float v1) {
  *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

// float32 bits rounded to TF32 (to nearest, ties away), as a TF32 operand register.
__device__ __forceinline__ uint32_t to_tf32(uint32_t bits) {
  uint32_t y = bits;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(__uint_as_float(bits)));
#endif
  return y;
}

// ---- activations -------------------------------------------------------------

// x * sigmoid(2 u) == 0.5 x (1 + tanh(u)): one hardware exp2 and one
// approximate division instead of the library tanhf / expf paths, which cost
// several times more per element in the epilogue (measured on the H200:
// tanhf made the fused gelu_tanh epilogue 17% of a 4096^3 GEMM). Relative
// error ~1e-6, far below the 16-bit output rounding; exp overflow for very
// negative arguments gives x / inf = -0, the correct limit.
__device__ __forceinline__ float mul_sigmoid(float x, float z) {
  return __fdividef(x, 1.0f + __expf(-z));
}

// 0.5 x (1 + erf(x / sqrt(2))) through erfc(|x| / sqrt(2)) from Abramowitz &
// Stegun 7.1.26 (absolute error <= 1.5e-7): one exp2, one approximate
// division and five FMAs, with few temporaries. The library erff unrolled
// over a 128 x 256 tile's accumulators pushed the epilogue over the register
// budget (spills); this form does not. For x < 0 it returns x erfc / 2 directly,
// so the error stays below 6e-7 absolute, 2e-4 relative even in the far
// negative tail: far under the rounding of a 16-bit output.
__device__ __forceinline__ float gelu_erf_fast(float x) {
  const float z = fabsf(x) * 0.70710678118654752f;
  const float t = __fdividef(1.0f, fmaf(0.3275911f, z, 1.0f));
  float poly = fmaf(1.061405429f, t, -1.453152027f);
  poly = fmaf(poly, t, 1.421413741f);
  poly = fmaf(poly, t, -0.284496736f);
  poly = fmaf(poly, t, 0.254829592f);
  const float erfc_z = poly * t * __expf(-z * z);
  return 0.5f * x * (x >= 0.0f ? 2.0f - erfc_z : erfc_z);
}

// Activation of a float32 accumulator. HALF_OUT: the result is rounded to a
// 16-bit type next, so the exact GELU may use gelu_erf_fast; float32 outputs
// take the library erfcf as x erfc(-x / sqrt 2) / 2, which equals
// x (1 + erf(x / sqrt 2)) / 2 but without its cancellation in the negative
// tail (there 1 + erff loses digits: a lone output of 1x1x1 linear+gelu was
// off by 2.5e-5 relative against float64).
template <Act ACT, bool HALF_OUT = false>
__device__ __forceinline__ float activate(float v) {
  if constexpr (ACT == Act::kRelu) {
    return fmaxf(v, 0.0f);
  } else if constexpr (ACT == Act::kGelu) {
    if constexpr (HALF_OUT) {
      return gelu_erf_fast(v);
    } else {
      return 0.5f * v * erfcf(v * -0.70710678118654752f);
    }
  } else if constexpr (ACT == Act::kGeluTanh) {
    // 0.5 v (1 + tanh(k (v + 0.044715 v^3))), k = sqrt(2 / pi)
    const float u = 0.79788456080286536f * v * fmaf(0.044715f * v, v, 1.0f);
    return mul_sigmoid(v, 2.0f * u);
  } else if constexpr (ACT == Act::kSilu) {
    return mul_sigmoid(v, v);
  } else {
    return v;
  }
}

// ---- lean activations (the TMA epilogues of the Hopper kernel) ---------------
//
// The same functions as activate<ACT, true> in fewer instructions, for 16-bit
// outputs only. The epilogue math of a 128 x 256 tile runs on the
// special-function unit (MUFU: 16 results per clock per SM on sm_90) while the
// tensor cores wait, so what counts is MUFU ops per element:
//  * gelu_tanh: one hardware tanh (tanh.approx.f32, as CUTLASS's GELU_taylor
//    uses), 0.5 v (1 + tanh(u)) as one FMA: error / max(|y|, 1) 5.5e-6 over
//    [-20, 20] (benchmarks/tools/gelu_math_probe.cu, H100), absolute in the
//    negative tail where 1 + tanh cancels (an output near -1e-3 is off by
//    ~4e-6); the ex2 + rcp form that silu keeps takes 1.6x its time per
//    element (same probe).
//  * silu: ex2 and rcp (ftz forms, no denormal fix-ups), with a software
//    reciprocal on the FMA pipe for every other element (3 MUFU ops per pair
//    instead of 4): accurate in the tail, where silu decays slowly.
//  * gelu (erf): Abramowitz & Stegun through one ex2 and one rcp.
// Error against float64 over [-20, 20] for silu / gelu: error / max(|y|, 1)
// ~3e-7 (one float32 ulp of x at |x| near 20), against the 2^-9 (bf16) and
// 2^-12 (fp16) relative rounding of the output.

__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / d for d >= 1 (or +inf) on the FMA pipe: an integer first guess
// (relative error <= 12%) and three Newton steps (error 12% -> 1.5e-2 ->
// 2.2e-4 -> 5e-8, then float32 rounding). d is clamped to 2^126 first so
// that the guess stays a positive float (1 / 2^126 is below every result that
// is not rounded away by the final multiply).
__device__ __forceinline__ float rcp_soft(float d) {
  d = fminf(d, 8.50705917e37f);  // 2^126
  float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
  for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.0f), r);
  return r;
}

// x * sigmoid(x * a) (silu: a = -log2(e)): ex2 of the negated, log2e-scaled
// argument, then x / (1 + e) with the hardware (SOFT = false) or the software
// reciprocal.
template <bool SOFT>
__device__ __forceinline__ float mul_sigmoid_lean(float x, float arg_log2) {
  const float d = 1.0f + ex2_ftz(arg_log2);  // +inf for very negative x: x * 0 = -0
  return x * (SOFT ? rcp_soft(d) : rcp_ftz(d));
}

// Exact GELU x * Phi(x) through Abramowitz & Stegun 7.1.26 for
// erfc(|x| / sqrt(2)) (as gelu_erf_fast), with 1/2, 1/sqrt(2) and log2(e)
// folded into the constants: h = erfc(|x| / sqrt 2) / 2 = t q(t) 2^(-x^2 log2(e) / 2),
// Phi = 1 - h (x >= 0) or h (x < 0).
__device__ __forceinline__ float gelu_erf_lean(float x) {
  const float t = rcp_ftz(fmaf(0.2316418883f, fabsf(x), 1.0f));  // 0.3275911 / sqrt(2)
  float q = fmaf(0.5307027145f, t, -0.7265760135f);              // A&S a5..a1, halved
  q = fmaf(q, t, 0.7107068705f);
  q = fmaf(q, t, -0.142248368f);
  q = fmaf(q, t, 0.127414796f);
  const float e = ex2_ftz((x * x) * -0.72134752044448170f);  // exp(-x^2 / 2)
  const float h = (q * t) * e;
  return x * (x >= 0.0f ? 1.0f - h : h);
}

// Whether an activation is math worth placing (gelu, gelu_tanh, silu: MUFU
// and FMA work per element), as against none / relu, which ride along with
// the bias add and the cast.
__host__ __device__ constexpr bool act_has_math(Act act) {
  return act == Act::kGelu || act == Act::kGeluTanh || act == Act::kSilu;
}

// Activation of a float32 accumulator whose result is rounded to a 16-bit
// type next. ODD: the second element of a pair (takes the software
// reciprocal for silu).
template <Act ACT, bool ODD>
__device__ __forceinline__ float activate_lean(float v) {
  if constexpr (ACT == Act::kRelu) {
    return fmaxf(v, 0.0f);
  } else if constexpr (ACT == Act::kGelu) {
    return gelu_erf_lean(v);
  } else if constexpr (ACT == Act::kGeluTanh) {
    // 0.5 v (1 + tanh(u)), u = sqrt(2 / pi) (v + 0.044715 v^3)
    constexpr float k = 0.79788456080286536f, k3 = k * 0.044715f;
    const float h = 0.5f * v;
    return fmaf(h, tanh_approx(v * fmaf(k3, v * v, k)), h);
  } else if constexpr (ACT == Act::kSilu) {
    return mul_sigmoid_lean<ODD>(v, v * -1.4426950408889634f);
  } else {
    return v;
  }
}

// True for the 16-bit output types.
template <typename T>
constexpr bool kHalfType = std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value;

template <Act ACT>
__device__ __forceinline__ double activate(double v) {
  if constexpr (ACT == Act::kRelu) {
    return v > 0.0 ? v : 0.0;
  } else if constexpr (ACT == Act::kGelu) {
    return 0.5 * v * erfc(v * -0.70710678118654752440);
  } else if constexpr (ACT == Act::kGeluTanh) {
    return v / (1.0 + exp(-2.0 * 0.79788456080286535588 * (v + 0.044715 * v * v * v)));
  } else if constexpr (ACT == Act::kSilu) {
    return v / (1.0 + exp(-v));
  } else {
    return v;
  }
}

// Runs the statements in __VA_ARGS__ with kAct, a compile-time constant equal
// to the run-time activation `act`, so that epilogue loops are specialised
// (no switch per element). C++17-compatible (no templated lambdas).
#define FASTCOMM_DISPATCH_ACT(act, ...)                                                  \
  switch (act) {                                                                         \
    case ::fastcomm::ops::cuda::Act::kRelu: {                                            \
      constexpr ::fastcomm::ops::cuda::Act kAct = ::fastcomm::ops::cuda::Act::kRelu;     \
      __VA_ARGS__;                                                                       \
      break;                                                                             \
    }                                                                                    \
    case ::fastcomm::ops::cuda::Act::kGelu: {                                            \
      constexpr ::fastcomm::ops::cuda::Act kAct = ::fastcomm::ops::cuda::Act::kGelu;     \
      __VA_ARGS__;                                                                       \
      break;                                                                             \
    }                                                                                    \
    case ::fastcomm::ops::cuda::Act::kGeluTanh: {                                        \
      constexpr ::fastcomm::ops::cuda::Act kAct = ::fastcomm::ops::cuda::Act::kGeluTanh; \
      __VA_ARGS__;                                                                       \
      break;                                                                             \
    }                                                                                    \
    case ::fastcomm::ops::cuda::Act::kSilu: {                                            \
      constexpr ::fastcomm::ops::cuda::Act kAct = ::fastcomm::ops::cuda::Act::kSilu;     \
      __VA_ARGS__;                                                                       \
      break;                                                                             \
    }                                                                                    \
    default: {                                                                           \
      constexpr ::fastcomm::ops::cuda::Act kAct = ::fastcomm::ops::cuda::Act::kNone;     \
      __VA_ARGS__;                                                                       \
      break;                                                                             \
    }                                                                                    \
  }

// bias[col], bias[col + 1] as floats (0 where a column does not exist): one
// paired load when `paired` (col even and the pointer aligned for it).
template <typename T>
__device__ __forceinline__ void load_bias_pair(const T* bias, int col, bool two, bool paired,
                                               float& b0, float& b1) {
  if constexpr (std::is_same<T, __half>::value) {
    if (two && paired) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(bias + col));
      b0 = f.x;
      b1 = f.y;
      return;
    }
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if (two && paired) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col));
      b0 = f.x;
      b1 = f.y;
      return;
    }
  }
  b0 = load_as_float(bias + col);
  b1 = two ? load_as_float(bias + col + 1) : 0.0f;
}

using fastcomm::dependent_launch_supported;
using fastcomm::griddep_launch_dependents;
using fastcomm::griddep_wait;
using fastcomm::programmatic_dependent_launch;

// Whether C takes store_out_pair's paired stores (its `pair_ok`): an even
// row stride and a base aligned to a pair (2 x 16 bits or 2 x 32 bits).
template <typename T>
__device__ __forceinline__ bool pair_stores_ok(const GemmArgs& p) {
  return (p.ldc % 2 == 0) && ((reinterpret_cast<uintptr_t>(p.c) & (2 * sizeof(T) - 1)) == 0);
}

// Activation, cast and store of outputs (row, col) and (row, col + 1) of a
// 16-bit or float C, the bias already added; `two` says whether col + 1
// exists, `pair_ok` whether one paired store is aligned.
template <typename T, Act ACT>
__device__ __forceinline__ void store_out_pair(const GemmArgs& p, int row, int col, float v0,
                                               float v1, bool two, bool pair_ok) {
  T* c = static_cast<T*>(p.c) + static_cast<int64_t>(row) * p.ldc + col;
  v0 = activate<ACT, kHalfType<T>>(v0);
  v1 = activate<ACT, kHalfType<T>>(v1);
  if (two && pair_ok) {
    store_pair<T>(c, v0, v1);
  } else {
    c[0] = from_acc<T, float>(v0);
    if (two) c[1] = from_acc<T, float>(v1);
  }
}

// Epilogue for two horizontally adjacent accumulators (row, col) and
// (row, col + 1) of a 16-bit or float output: bias, activation, cast and a
// paired store when both columns exist and the address allows it.
template <typename T, Act ACT>
__device__ __forceinline__ void epilogue_pair(const GemmArgs& p, int row, int col, float v0,
                                              float v1, bool pair_ok) {
  if (row >= p.M || col >= p.N) return;
  const bool two = col + 1 < p.N;
  if (p.bias != nullptr) {
    float b0, b1;
    load_bias_pair<T>(static_cast<const T*>(p.bias), col, two, false, b0, b1);
    v0 += b0;
    v1 += b1;
  }
  store_out_pair<T, ACT>(p, row, col, v0, v1, two, pair_ok);
}

// ---- split K -------------------------------------------------------------------

// The second pass of a product whose K was split over `splits` blocks per
// output tile, each of which wrote its float32 sums to
// partial[split][row][col]: C = act(the splits' sums added in split order +
// bias), so the result does not depend on which block finished first.
// COLS consecutive outputs of a row per thread: 4 where N % 4 == 0 (one
// 16-byte load per split, paired stores; a pass of one output per thread
// moved 1.4 TB/s), else 1.
//
// On sm_90 it may be launched as a programmatic dependent of the product
// kernel (launch_splitk_finish's `early`): its blocks are then scheduled
// while the product's last CTAs still run, and wait in griddep_wait until
// that grid has completed and its sums are visible.
template <typename T, int COLS>
__global__ void splitk_finish(const GemmArgs p, const float* __restrict__ partial, int splits) {
  griddep_wait();
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t groups = p.N / COLS;  // COLS divides N
  if (i >= p.M * groups) return;
  const int row = static_cast<int>(i / groups), col = static_cast<int>(i % groups) * COLS;
  float v[COLS] = {};
  for (int s = 0; s < splits; ++s) {
    const float* src = partial + (int64_t{s} * p.M + row) * p.N + col;
    if constexpr (COLS == 4) {
      const float4 q = *reinterpret_cast<const float4*>(src);
      v[0] += q.x;
      v[1] += q.y;
      v[2] += q.z;
      v[3] += q.w;
    } else {
      v[0] += src[0];
    }
  }
  if (p.bias != nullptr) {
    const T* bias = static_cast<const T*>(p.bias);
#pragma unroll
    for (int j = 0; j < COLS; ++j) v[j] += load_as_float(bias + col + j);
  }
  if constexpr (COLS == 4) {
    const bool pair_ok = pair_stores_ok<T>(p);
    FASTCOMM_DISPATCH_ACT(p.act,
                          (store_out_pair<T, kAct>(p, row, col, v[0], v[1], true, pair_ok),
                           store_out_pair<T, kAct>(p, row, col + 2, v[2], v[3], true, pair_ok)));
  } else {
    FASTCOMM_DISPATCH_ACT(p.act, (store_out_pair<T, kAct>(p, row, col, v[0], 0.0f, false, false)));
  }
}

// early: launch as a programmatic dependent of the kernel before it on the
// stream (sm_90 and later only), which hides this launch's latency under the
// product kernel's tail.
template <typename T>
cudaError_t launch_splitk_finish(const GemmArgs& p, const float* partial, int splits,
                                 cudaStream_t stream, bool early = false) {
  const bool four = p.N % 4 == 0;
  const int64_t threads = p.M * (four ? p.N / 4 : p.N);
  cudaLaunchConfig_t launch{};  // the launch's own status, as launch_kernel's
  launch.gridDim = dim3(static_cast<unsigned>((threads + 255) / 256));
  launch.blockDim = dim3(256);
  launch.stream = stream;
  cudaLaunchAttribute pdl = programmatic_dependent_launch();
  if (early) {
    launch.attrs = &pdl;
    launch.numAttrs = 1;
  }
  return four ? cudaLaunchKernelEx(&launch, splitk_finish<T, 4>, p, partial, splits)
              : cudaLaunchKernelEx(&launch, splitk_finish<T, 1>, p, partial, splits);
}

// ---- tile order --------------------------------------------------------------

// Linear tile index -> (tile row, tile column), walking group_m tile rows
// together so that concurrently running tiles share rows of A and columns of
// B in L2.
__device__ __forceinline__ void grouped_tile(int tile, int tiles_m, int tiles_n, int group_m,
                                             int& tm, int& tn) {
  const int per_group = group_m * tiles_n;
  const int group = tile / per_group;
  const int first_m = group * group_m;
  const int rows = min(tiles_m - first_m, group_m);
  const int r = tile - group * per_group;
  tm = first_m + r % rows;
  tn = r / rows;
}

}  // namespace detail
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
