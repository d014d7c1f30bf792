// Autograd of fastcomm::matmul and fastcomm::linear (the Autograd key), in
// C++ so that a training step pays torch's own per-op overhead: a formula
// registered from Python costs tens of microseconds of host time per call,
// which is more than the kernels of a small-batch linear take on the GPU.
// The backward calls the same operators through the dispatcher, so it runs
// on the same kernels and is itself differentiable (double backward):
//   dA = dC @ B^T, dB = A^T @ dC (batch folded into the rows);
//   dY' = dY * act'(pre), dX = dY' @ W, dW = dY'^T @ X, dbias = sum(dY').
// relu's mask is read off the saved output; gelu / gelu_tanh / silu recompute
// the pre-activation with linear(..., "none") rather than keep an output-sized
// tensor (torchext.ops.linear keeps it instead, through torch's activation).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

#include "ops/matmul_common.h"

namespace fastcomm {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_matmul(const at::Tensor& a, const at::Tensor& b) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastcomm::matmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b);
}

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::string_view activation) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastcomm::linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view)>();
  return op.call(x, weight, bias, activation);
}

struct MatmulFunction : public torch::autograd::Function<MatmulFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({a, b});
    return call_matmul(a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    const at::Tensor& grad = grads[0];
    at::Tensor grad_a, grad_b;
    if (ctx->needs_input_grad(0)) grad_a = call_matmul(grad, b.t());
    if (ctx->needs_input_grad(1)) {
      const int64_t k = a.size(-1), n = grad.size(-1);
      grad_b = call_matmul(a.reshape({-1, k}).t(), grad.reshape({-1, n}));
    }
    return {grad_a, grad_b};
  }
};

// dY * act'(pre), through aten's own derivative kernels.
at::Tensor activation_backward(const at::Tensor& grad, Activation act, const at::Tensor& x,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const at::Tensor& out) {
  switch (act) {
    case Activation::kNone:
      return grad;
    case Activation::kRelu:
      return at::threshold_backward(grad, out, 0);
    case Activation::kGelu:
      return at::gelu_backward(grad, call_linear(x, weight, bias, "none"), "none");
    case Activation::kGeluTanh:
      return at::gelu_backward(grad, call_linear(x, weight, bias, "none"), "tanh");
    case Activation::kSilu: {
      const at::Tensor pre = call_linear(x, weight, bias, "none");
      if (!at::GradMode::is_enabled()) return at::silu_backward(grad, pre);
      // aten's silu_backward has no derivative; a differentiable backward
      // (create_graph) takes torch's composite form of it.
      const at::Tensor sig = at::sigmoid(pre);
      return grad * sig * (1 + pre * (1 - sig));
    }
  }
  TORCH_INTERNAL_ASSERT(false, "fastcomm.linear: unknown activation");
}

struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, c10::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Activation act = parse_activation(std::string_view(activation.data(), activation.size()));
    at::Tensor out = call_linear(x, weight, bias, activation);
    ctx->saved_data["activation"] = static_cast<int64_t>(act);
    ctx->save_for_backward(
        {x, weight, bias.value_or(at::Tensor()), act == Activation::kRelu ? out : at::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const std::optional<at::Tensor> bias =
        saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    const auto act = static_cast<Activation>(ctx->saved_data["activation"].toInt());
    const at::Tensor g = activation_backward(grads[0], act, x, weight, bias, saved[3]);
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor g2 = g.reshape({-1, n});
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0)) grad_x = call_matmul(g2, weight).reshape(x.sizes());
    if (ctx->needs_input_grad(1)) grad_w = call_matmul(g2.t(), x.reshape({-1, k}));
    // The bias, when given, is the third of the inputs autograd tracks.
    if (bias.has_value() && ctx->needs_input_grad(2)) grad_b = g2.sum(0);
    return {grad_x, grad_w, grad_b, at::Tensor()};
  }
};

at::Tensor matmul_autograd(const at::Tensor& a, const at::Tensor& b) {
  return MatmulFunction::apply(a, b);
}

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view activation) {
  return LinearFunction::apply(x, weight, bias, activation);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcomm, Autograd, m) {
  m.impl("matmul", &matmul_autograd);
  m.impl("linear", &linear_autograd);
}

}  // namespace ops
}  // namespace fastcomm
