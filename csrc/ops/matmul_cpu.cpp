// CPU kernels of fastcomm::matmul and fastcomm::linear.
//
// A blocked GEMM: the output is cut into MB x NB tiles that at::parallel_for
// spreads over threads; for each tile, K is walked in KB-deep panels that are
// packed (converted to the accumulation type, made contiguous) into
// thread-local buffers, then a 4-row register-blocked inner kernel whose
// innermost loop runs over contiguous columns (vectorised by the compiler).
// Inputs may have any strides (transposed, sliced, expanded): packing reads
// them through their strides, so nothing is copied up front.
// Accumulation is float32 for float16 / bfloat16 / float32 and float64 for
// float64; bias, activation and the cast to the output dtype are applied once
// per element when the tile is written.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ops/matmul_common.h"

namespace fastcomm {
namespace ops {
namespace {

template <typename Acc>
inline Acc apply_activation(Acc v, Activation act) {
  switch (act) {
    case Activation::kNone:
      return v;
    case Activation::kRelu:
      return v > Acc(0) ? v : Acc(0);
    case Activation::kGelu:
      // erfc(-x / sqrt 2) == 1 + erf(x / sqrt 2) without the latter's
      // cancellation for negative x (kernels/matmul_device.cuh, activate).
      return Acc(0.5) * v * std::erfc(v * Acc(-0.70710678118654752440));
    case Activation::kGeluTanh: {
      // (1 + tanh(u)) / 2 == 1 / (1 + exp(-2u)): no cancellation for
      // negative v; exp overflow there gives v / inf = -0, the limit.
      const Acc inner = Acc(0.79788456080286535588) * (v + Acc(0.044715) * v * v * v);
      return v / (Acc(1) + std::exp(Acc(-2) * inner));
    }
    case Activation::kSilu:
      return v / (Acc(1) + std::exp(-v));
  }
  return v;
}

constexpr int64_t kMB = 64;   // rows of C per tile
constexpr int64_t kNB = 128;  // columns of C per tile
constexpr int64_t kKB = 256;  // depth of a packed panel

template <typename T, typename Acc>
void gemm_cpu_kernel(const T* a, int64_t sam, int64_t sak, const T* b, int64_t sbk, int64_t sbn,
                     const T* bias, T* c, int64_t M, int64_t N, int64_t K, Activation act) {
  const int64_t tiles_m = (M + kMB - 1) / kMB;
  const int64_t tiles_n = (N + kNB - 1) / kNB;
  at::parallel_for(0, tiles_m * tiles_n, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> apack(kMB * kKB);
    std::vector<Acc> bpack(kKB * kNB);
    std::vector<Acc> acc(kMB * kNB);
    for (int64_t t = begin; t < end; ++t) {
      // Consecutive tiles share the same rows of A.
      const int64_t m0 = (t / tiles_n) * kMB;
      const int64_t n0 = (t % tiles_n) * kNB;
      const int64_t mb = std::min(kMB, M - m0);
      const int64_t nb = std::min(kNB, N - n0);
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int64_t k0 = 0; k0 < K; k0 += kKB) {
        const int64_t kb = std::min(kKB, K - k0);
        // Pack A[m0:m0+mb, k0:k0+kb] as apack[i][k], reading along the
        // smaller stride of the source.
        if (sak <= sam) {
          for (int64_t i = 0; i < mb; ++i) {
            const T* src = a + (m0 + i) * sam + k0 * sak;
            Acc* dst = apack.data() + i * kKB;
            for (int64_t k = 0; k < kb; ++k) dst[k] = static_cast<Acc>(src[k * sak]);
          }
        } else {
          for (int64_t k = 0; k < kb; ++k) {
            const T* src = a + m0 * sam + (k0 + k) * sak;
            for (int64_t i = 0; i < mb; ++i) apack[i * kKB + k] = static_cast<Acc>(src[i * sam]);
          }
        }
        // Pack B[k0:k0+kb, n0:n0+nb] as bpack[k][j].
        if (sbn <= sbk) {
          for (int64_t k = 0; k < kb; ++k) {
            const T* src = b + (k0 + k) * sbk + n0 * sbn;
            Acc* dst = bpack.data() + k * kNB;
            for (int64_t j = 0; j < nb; ++j) dst[j] = static_cast<Acc>(src[j * sbn]);
          }
        } else {
          for (int64_t j = 0; j < nb; ++j) {
            const T* src = b + k0 * sbk + (n0 + j) * sbn;
            for (int64_t k = 0; k < kb; ++k) bpack[k * kNB + j] = static_cast<Acc>(src[k * sbk]);
          }
        }
        // acc[i][:] += apack[i][k] * bpack[k][:], four rows at a time so that
        // each loaded row of B feeds four rows of C.
        int64_t i = 0;
        for (; i + 4 <= mb; i += 4) {
          Acc* c0 = acc.data() + (i + 0) * kNB;
          Acc* c1 = acc.data() + (i + 1) * kNB;
          Acc* c2 = acc.data() + (i + 2) * kNB;
          Acc* c3 = acc.data() + (i + 3) * kNB;
          const Acc* a0 = apack.data() + (i + 0) * kKB;
          const Acc* a1 = apack.data() + (i + 1) * kKB;
          const Acc* a2 = apack.data() + (i + 2) * kKB;
          const Acc* a3 = apack.data() + (i + 3) * kKB;
          for (int64_t k = 0; k < kb; ++k) {
            const Acc v0 = a0[k], v1 = a1[k], v2 = a2[k], v3 = a3[k];
            const Acc* __restrict__ brow = bpack.data() + k * kNB;
            for (int64_t j = 0; j < nb; ++j) {
              const Acc bv = brow[j];
              c0[j] += v0 * bv;
              c1[j] += v1 * bv;
              c2[j] += v2 * bv;
              c3[j] += v3 * bv;
            }
          }
        }
        for (; i < mb; ++i) {
          Acc* ci = acc.data() + i * kNB;
          const Acc* ai = apack.data() + i * kKB;
          for (int64_t k = 0; k < kb; ++k) {
            const Acc v = ai[k];
            const Acc* __restrict__ brow = bpack.data() + k * kNB;
            for (int64_t j = 0; j < nb; ++j) ci[j] += v * brow[j];
          }
        }
      }
      // Epilogue: bias, activation, cast, store (C is contiguous, ldc = N).
      for (int64_t i = 0; i < mb; ++i) {
        const Acc* ci = acc.data() + i * kNB;
        T* dst = c + (m0 + i) * N + n0;
        for (int64_t j = 0; j < nb; ++j) {
          Acc v = ci[j];
          if (bias != nullptr) v += static_cast<Acc>(bias[n0 + j]);
          dst[j] = static_cast<T>(apply_activation<Acc>(v, act));
        }
      }
    }
  });
}

// C[M, N] = act(A[M, K] @ B[K, N] + bias), A and B any strides.
at::Tensor gemm_cpu(const GemmProblem& p, const std::optional<at::Tensor>& bias, Activation act) {
  const GemmOutput o = make_gemm_output(p, bias);
  if (p.M == 0 || p.N == 0) return o.result(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, p.A.scalar_type(), "fastcomm_gemm_cpu", [&] {
        using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        gemm_cpu_kernel<scalar_t, Acc>(
            p.A.const_data_ptr<scalar_t>(), p.A.stride(0), p.A.stride(1),
            p.B.const_data_ptr<scalar_t>(), p.B.stride(0), p.B.stride(1),
            o.bias.defined() ? o.bias.const_data_ptr<scalar_t>() : nullptr,
            o.out.mutable_data_ptr<scalar_t>(), p.M, p.N, p.K, act);
      });
  return o.result(p);
}

at::Tensor matmul_cpu(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cpu(), "fastcomm.matmul (CPU kernel): a is on ", a.device());
  GemmProblem p = make_matmul_problem(a, b);
  return gemm_cpu(p, std::nullopt, Activation::kNone);
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, c10::string_view activation) {
  TORCH_CHECK(x.device().is_cpu(), "fastcomm.linear (CPU kernel): x is on ", x.device());
  const Activation act = parse_activation(std::string_view(activation.data(), activation.size()));
  GemmProblem p = make_linear_problem(x, weight, bias);
  return gemm_cpu(p, bias, act);
}

std::string kernel_name_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view activation) {
  make_matmul_problem(a, b);  // the same argument checks as matmul
  parse_activation(std::string_view(activation.data(), activation.size()));
  return "cpu blocked";
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcomm, CPU, m) {
  m.impl("matmul", &matmul_cpu);
  m.impl("linear", &linear_cpu);
  m.impl("_kernel_name", &kernel_name_cpu);
}

}  // namespace ops
}  // namespace fastcomm
