// Schema of the fastcomm fused-matmul operators (the only TORCH_LIBRARY for the
// namespace "fastcomm"). Kernels are registered per dispatch key elsewhere:
//   CPU  -> csrc/ops/matmul_cpu.cpp
//   CUDA -> csrc/ops/cuda/matmul_cuda.cpp (CUDA builds only)
//   Autograd -> csrc/ops/matmul_autograd.cpp
// The fake (meta) kernels live in Python, torchext/ops.py, as in
// pytorch/extension-cpp.
#include <torch/library.h>

TORCH_LIBRARY(fastcomm, m) {
  // register_fake for these operators is in torchext.ops; torch imports that
  // module on demand when a fake kernel is needed and it was not imported yet.
  m.set_python_module("torchext.ops");
  // out[..., n] = sum_k a[..., k] * b[k, n]
  m.def("matmul(Tensor a, Tensor b) -> Tensor");
  // out[..., n] = act(sum_k x[..., k] * weight[n, k] + bias[n]),
  // act in none | relu | gelu | gelu_tanh | silu.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, str activation=\"none\") -> Tensor");
  // The kernel matmul(a, b) would run with the current FASTCOMM_MATMUL_*
  // settings, e.g. "wgmma pingpong 128x128 cluster 1 raster m", with the
  // epilogue of `activation` (the epilogue choice depends on it; for tests
  // and benchmark reports; no autograd, no fake kernel).
  m.def("_kernel_name(Tensor a, Tensor b, str activation=\"none\") -> str");
}
