// Shared pieces of the fastcomm::matmul / fastcomm::linear operators: the
// activation names, argument checks with clear errors, and the reshaping of
// inputs to a 2-D problem C[M, N] = A[M, K] @ B[K, N] (+ bias[N], activation).
//
// Header-only and free of CUDA so that the CPU and the CUDA implementations
// (csrc/ops/matmul_cpu.cpp, csrc/ops/cuda/matmul_cuda.cpp) agree on the
// semantics and the error messages.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fastcomm {
namespace ops {

// Keep in sync with fastcomm::ops::cuda::Act (kernels/matmul_api.h) and
// the list in torchext/ops.py.
enum class Activation : int { kNone = 0, kRelu = 1, kGelu = 2, kGeluTanh = 3, kSilu = 4 };

inline Activation parse_activation(std::string_view name) {
  if (name == "none") return Activation::kNone;
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "silu") return Activation::kSilu;
  TORCH_CHECK(false, "fastcomm.linear: unknown activation '", std::string(name),
              "' (expected one of none, relu, gelu, gelu_tanh, silu)");
}

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(supported_dtype(t.scalar_type()), "fastcomm.", op, ": ", name, " has dtype ",
              t.scalar_type(), "; supported dtypes are float32, float16, bfloat16 (and float64)");
}

// A 2-D GEMM problem C[M, N] = A[M, K] @ B[K, N]; A and B are (possibly
// strided) 2-D views of the user's tensors, out_sizes the user-visible shape.
struct GemmProblem {
  at::Tensor A;  // [M, K]
  at::Tensor B;  // [K, N]
  std::vector<int64_t> out_sizes;
  int64_t M = 0, N = 0, K = 0;
};

// Product of all but the last dimension (works when the last one is 0).
inline int64_t leading_numel(const at::Tensor& t) {
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) m *= t.size(d);
  return m;
}

// matmul(a, b): a is [..., M, K] (at least 2-D), b is [K, N].
inline GemmProblem make_matmul_problem(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() >= 2,
              "fastcomm.matmul: a must have at least 2 dimensions [..., M, K], got shape ",
              a.sizes());
  TORCH_CHECK(b.dim() == 2, "fastcomm.matmul: b must be 2-D [K, N], got shape ", b.sizes());
  check_dtype("matmul", "a", a);
  check_dtype("matmul", "b", b);
  TORCH_CHECK(a.scalar_type() == b.scalar_type(),
              "fastcomm.matmul: a and b must have the same dtype, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "fastcomm.matmul: a and b must be on the same device, got ",
              a.device(), " and ", b.device());
  TORCH_CHECK(a.size(-1) == b.size(0), "fastcomm.matmul: shapes ", a.sizes(), " and ", b.sizes(),
              " cannot be multiplied (a.size(-1)=", a.size(-1), " != b.size(0)=", b.size(0), ")");
  GemmProblem p;
  p.K = a.size(-1);
  p.N = b.size(1);
  p.M = leading_numel(a);
  p.A = a.reshape({p.M, p.K});
  p.B = b;
  p.out_sizes = a.sizes().vec();
  p.out_sizes.back() = p.N;
  return p;
}

// linear(x, weight, bias): x is [..., K] (at least 1-D), weight [N, K], bias [N].
inline GemmProblem make_linear_problem(const at::Tensor& x, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, "fastcomm.linear: x must have at least 1 dimension [..., in_features]");
  TORCH_CHECK(weight.dim() == 2,
              "fastcomm.linear: weight must be 2-D [out_features, in_features], got shape ",
              weight.sizes());
  check_dtype("linear", "x", x);
  check_dtype("linear", "weight", weight);
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "fastcomm.linear: x and weight must have the same dtype, got ", x.scalar_type(),
              " and ", weight.scalar_type());
  TORCH_CHECK(x.device() == weight.device(),
              "fastcomm.linear: x and weight must be on the same device, got ", x.device(), " and ",
              weight.device());
  TORCH_CHECK(x.size(-1) == weight.size(1), "fastcomm.linear: x has ", x.size(-1),
              " features (shape ", x.sizes(), ") but weight expects ", weight.size(1), " (shape ",
              weight.sizes(), ")");
  if (bias.has_value()) {
    const at::Tensor& bt = *bias;
    TORCH_CHECK(bt.dim() == 1 && bt.size(0) == weight.size(0),
                "fastcomm.linear: bias must be 1-D of size ", weight.size(0),
                " (out_features), got shape ", bt.sizes());
    TORCH_CHECK(bt.scalar_type() == x.scalar_type(),
                "fastcomm.linear: bias must have the dtype of x (", x.scalar_type(), "), got ",
                bt.scalar_type());
    TORCH_CHECK(bt.device() == x.device(), "fastcomm.linear: bias must be on the device of x (",
                x.device(), "), got ", bt.device());
  }
  GemmProblem p;
  p.K = x.size(-1);
  p.N = weight.size(0);
  p.M = leading_numel(x);
  p.A = x.reshape({p.M, p.K});
  p.B = weight.t();  // [K, N] view, K-major when weight is contiguous
  p.out_sizes = x.sizes().vec();
  p.out_sizes.back() = p.N;
  return p;
}

// The new [M, N] output of a problem and the contiguous bias the kernels
// read (undefined without bias); result() gives the output in the user's shape.
struct GemmOutput {
  at::Tensor out;
  at::Tensor bias;
  at::Tensor result(const GemmProblem& p) const { return out.view(p.out_sizes); }
};

inline GemmOutput make_gemm_output(const GemmProblem& p, const std::optional<at::Tensor>& bias) {
  GemmOutput o;
  o.out = at::empty({p.M, p.N}, p.A.options());
  if (bias.has_value()) o.bias = bias->contiguous();
  return o;
}

}  // namespace ops
}  // namespace fastcomm
