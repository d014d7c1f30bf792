// Device helpers shared by the fastcomm matmul kernels (kernels/matmul_*.cu):
// element conversions, the fused epilogue (bias + activation + cast + store)
// and the tile order used for L2 reuse.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/matmul_api.h"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace detail {

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

// ---- activations -------------------------------------------------------------

template <Act ACT>
__device__ __forceinline__ float activate(float v) {
  if constexpr (ACT == Act::kRelu) {
    return fmaxf(v, 0.0f);
  } else if constexpr (ACT == Act::kGelu) {
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  } else if constexpr (ACT == Act::kGeluTanh) {
    return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  } else if constexpr (ACT == Act::kSilu) {
    return v / (1.0f + expf(-v));
  } else {
    return v;
  }
}

template <Act ACT>
__device__ __forceinline__ double activate(double v) {
  if constexpr (ACT == Act::kRelu) {
    return v > 0.0 ? v : 0.0;
  } else if constexpr (ACT == Act::kGelu) {
    return 0.5 * v * (1.0 + erf(v * 0.70710678118654752440));
  } else if constexpr (ACT == Act::kGeluTanh) {
    return 0.5 * v * (1.0 + tanh(0.79788456080286535588 * (v + 0.044715 * v * v * v)));
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

// Epilogue for two horizontally adjacent accumulators (row, col) and
// (row, col + 1) of a 16-bit or float output: bias, activation, cast and a
// paired store when both columns exist and the address allows it.
template <typename T, Act ACT>
__device__ __forceinline__ void epilogue_pair(const GemmArgs& p, int row, int col, float v0,
                                              float v1, bool pair_ok) {
  if (row >= p.M || col >= p.N) return;
  const T* bias = static_cast<const T*>(p.bias);
  T* c = static_cast<T*>(p.c) + static_cast<int64_t>(row) * p.ldc + col;
  const bool two = col + 1 < p.N;
  if (bias != nullptr) {
    v0 += load_as_float(bias + col);
    if (two) v1 += load_as_float(bias + col + 1);
  }
  v0 = activate<ACT>(v0);
  v1 = activate<ACT>(v1);
  if (two && pair_ok) {
    store_pair<T>(c, v0, v1);
  } else {
    c[0] = from_acc<T, float>(v0);
    if (two) c[1] = from_acc<T, float>(v1);
  }
}

// ---- tile order --------------------------------------------------------------

// Linear tile index -> (tile row, tile column), walking GROUP_M tile rows
// together so that concurrently running tiles share rows of A and columns of
// B in L2.
template <int GROUP_M>
__device__ __forceinline__ void grouped_tile(int tile, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int per_group = GROUP_M * tiles_n;
  const int group = tile / per_group;
  const int first_m = group * GROUP_M;
  const int rows = min(tiles_m - first_m, GROUP_M);
  const int r = tile - group * per_group;
  tm = first_m + r % rows;
  tn = r / rows;
}

}  // namespace detail
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
