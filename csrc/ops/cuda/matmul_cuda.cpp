// CUDA implementations of fastcomm::matmul and fastcomm::linear: argument
// checks (shared with the CPU kernels), operand preparation and the choice
// of kernel. Kernels run on the current stream of the inputs' device.
//
// Kernel choice, for float16 / bfloat16 (float32 / float64 always take the
// tiled CUDA-core kernel):
//   1. the Hopper kernel (TMA + wgmma, warp-specialised, persistent;
//      kernels/matmul_sm90.cu) on an sm_90 device when FASTCOMM_MATMUL_WGMMA=1.
//      It is OFF by default until it has been validated on the GPU machine
//      (tests/test_ops.py::test_cuda_wgmma_kernel); then flip the default here.
//   2. otherwise the mma.sync tensor-core kernel (kernels/matmul_sm80.cu) on
//      sm_80+;
//   3. otherwise the CUDA-core kernel (kernels/matmul_simt.cu).
// Debug / benchmark knobs (read on every call):
//   FASTCOMM_MATMUL_IMPL = auto | wgmma | mma | simt   force a path (wgmma and
//       mma raise an error when they cannot run, rather than fall back);
//   FASTCOMM_MATMUL_TILE = auto | large | small        force the tile shape;
//   FASTCOMM_MATMUL_WGMMA_MN = 0                       copy M-/N-major operands to
//       K-major before the wgmma kernel instead of using its transposed loads;
//   FASTCOMM_MATMUL_CLUSTER = 1 | 2                    wgmma kernel on single CTAs
//       (default) or on CTA pairs sharing B through TMA multicast.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "ops/cuda/matmul_api.h"
#include "ops/matmul_common.h"

namespace fastcomm {
namespace ops {
namespace {

namespace kc = ::fastcomm::ops::cuda;

enum class Impl { kAuto, kWgmma, kMma, kSimt };

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? std::string(v) : std::string(fallback);
}

Impl impl_from_env() {
  const std::string v = env_or("FASTCOMM_MATMUL_IMPL", "auto");
  if (v == "auto") return Impl::kAuto;
  if (v == "wgmma") return Impl::kWgmma;
  if (v == "mma") return Impl::kMma;
  if (v == "simt") return Impl::kSimt;
  TORCH_CHECK(false, "FASTCOMM_MATMUL_IMPL must be auto, wgmma, mma or simt, got '", v, "'");
}

kc::Tile tile_from_env() {
  const std::string v = env_or("FASTCOMM_MATMUL_TILE", "auto");
  if (v == "auto") return kc::Tile::kAuto;
  if (v == "large") return kc::Tile::kLarge;
  if (v == "small") return kc::Tile::kSmall;
  TORCH_CHECK(false, "FASTCOMM_MATMUL_TILE must be auto, large or small, got '", v, "'");
}

kc::DType to_kdtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kc::DType::kF32;
    case at::kHalf:
      return kc::DType::kF16;
    case at::kBFloat16:
      return kc::DType::kBF16;
    case at::kDouble:
      return kc::DType::kF64;
    default:
      TORCH_CHECK(false, "fastcomm: unsupported dtype ", t);
  }
}

int64_t round_up8(int64_t v) { return (v + 7) / 8 * 8; }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A 2-D operand X[R][C] as the tensor-core kernels want it: unit stride along
// one dimension, leading dimension a multiple of 8 elements and at least the
// contiguous extent, 16-byte aligned base. Strides of size-1 dimensions are
// free and get normalised.
struct Operand {
  const void* ptr = nullptr;
  int64_t s0 = 0, s1 = 0;  // element strides of dims 0 and 1
  at::Tensor keep;         // owns a copy, when one was made
};

// Tries unit stride along `unit_dim` (0 or 1) for t [R][C].
bool try_layout(const at::Tensor& t, int unit_dim, Operand& op) {
  const int64_t R = t.size(0), C = t.size(1);
  const int64_t other = 1 - unit_dim;
  const int64_t unit_extent = unit_dim == 1 ? C : R;
  const int64_t other_extent = unit_dim == 1 ? R : C;
  if (unit_extent != 1 && t.stride(unit_dim) != 1) return false;
  int64_t ld = t.stride(other);
  if (other_extent == 1) ld = round_up8(unit_extent);  // never used for addressing
  if (ld % 8 != 0 || ld < unit_extent) return false;
  op.ptr = t.const_data_ptr();
  if (!aligned16(op.ptr)) return false;
  if (unit_dim == 1) {
    op.s0 = ld;
    op.s1 = 1;
  } else {
    op.s0 = 1;
    op.s1 = ld;
  }
  return true;
}

// Prepares t [R][C] for a tensor-core kernel. `k_dim` is the dimension of t
// that is the GEMM's K (1 for A [M][K], 0 for B [K][N]); K-major (unit
// stride along k_dim) is preferred, M/N-major is taken when allowed, and
// anything else is copied into a K-major buffer with a padded leading
// dimension.
Operand prepare_tc_operand(const at::Tensor& t, int k_dim, bool allow_mn_major) {
  {
    Operand op;
    if (try_layout(t, k_dim, op)) return op;
  }
  if (allow_mn_major) {
    Operand op;
    if (try_layout(t, 1 - k_dim, op)) return op;
  }
  const int64_t K = t.size(k_dim), other = t.size(1 - k_dim);
  // buf is [other][K] with leading dimension round_up8(K): K-major.
  at::Tensor buf = at::empty({other, round_up8(K)}, t.options()).narrow(1, 0, K);
  buf.copy_(k_dim == 1 ? t : t.t());
  Operand op;
  const bool ok = try_layout(k_dim == 1 ? buf : buf.t(), k_dim, op);
  TORCH_INTERNAL_ASSERT(ok, "fastcomm: K-major copy of an operand has an unexpected layout");
  op.keep = buf;
  return op;
}

void fill_ab(kc::GemmArgs& args, const Operand& a, const Operand& b) {
  args.a = a.ptr;
  args.sam = a.s0;
  args.sak = a.s1;
  args.b = b.ptr;
  args.sbk = b.s0;
  args.sbn = b.s1;
}

at::Tensor gemm_cuda(const GemmProblem& p, const std::optional<at::Tensor>& bias, Activation act) {
  TORCH_CHECK(p.M < (int64_t(1) << 31) && p.N < (int64_t(1) << 31) && p.K < (int64_t(1) << 31),
              "fastcomm: matrix dimensions must be below 2^31, got M=", p.M, " N=", p.N,
              " K=", p.K);
  c10::cuda::CUDAGuard guard(p.A.device());
  at::Tensor out = at::empty({p.M, p.N}, p.A.options());
  if (p.M == 0 || p.N == 0) return out.view(p.out_sizes);

  at::Tensor bias_c;
  if (bias.has_value()) bias_c = bias->contiguous();

  kc::GemmArgs args;
  args.bias = bias_c.defined() ? bias_c.const_data_ptr() : nullptr;
  args.c = out.mutable_data_ptr();
  args.ldc = p.N;
  args.M = p.M;
  args.N = p.N;
  args.K = p.K;
  args.dtype = to_kdtype(p.A.scalar_type());
  args.act = static_cast<kc::Act>(static_cast<int>(act));

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(p.A.device().index()).stream();
  const Impl impl = impl_from_env();
  const kc::Tile tile = tile_from_env();
  const bool half = args.dtype == kc::DType::kF16 || args.dtype == kc::DType::kBF16;

  cudaError_t err = cudaSuccess;
  if (!half || p.K == 0 || impl == Impl::kSimt) {
    // Strided loads, any layout; also the K == 0 case (bias + activation only).
    args.a = p.A.const_data_ptr();
    args.sam = p.A.stride(0);
    args.sak = p.A.stride(1);
    args.b = p.B.const_data_ptr();
    args.sbk = p.B.stride(0);
    args.sbn = p.B.stride(1);
    err = kc::launch_gemm_simt(args, stream);
  } else {
    const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    const bool sm90 = prop->major == 9 && prop->minor == 0;
    bool use_wgmma = impl == Impl::kWgmma ||
                     (impl == Impl::kAuto && sm90 && env_or("FASTCOMM_MATMUL_WGMMA", "0") == "1");
    if (use_wgmma && !(sm90 && kc::gemm_wgmma_compiled())) {
      TORCH_CHECK(impl != Impl::kWgmma,
                  "FASTCOMM_MATMUL_IMPL=wgmma: the wgmma kernel needs an sm_90 device (",
                  prop->name, " is sm_", prop->major, prop->minor,
                  ") and an extension built for sm_90a (TORCH_CUDA_ARCH_LIST containing 9.0a)");
      use_wgmma = false;
    }
    if (use_wgmma) {
      const bool allow_mn = env_or("FASTCOMM_MATMUL_WGMMA_MN", "1") != "0";
      Operand a = prepare_tc_operand(p.A, 1, allow_mn);
      Operand b = prepare_tc_operand(p.B, 0, allow_mn);
      fill_ab(args, a, b);
      TORCH_INTERNAL_ASSERT(kc::gemm_wgmma_supported(args, allow_mn));
      const std::string cl = env_or("FASTCOMM_MATMUL_CLUSTER", "1");
      TORCH_CHECK(cl == "1" || cl == "2", "FASTCOMM_MATMUL_CLUSTER must be 1 or 2, got '", cl, "'");
      err = kc::launch_gemm_wgmma_sm90(args, prop->multiProcessorCount, tile, cl == "2" ? 2 : 1,
                                       stream);
    } else if (prop->major >= 8) {
      Operand a = prepare_tc_operand(p.A, 1, true);
      Operand b = prepare_tc_operand(p.B, 0, true);
      fill_ab(args, a, b);
      TORCH_INTERNAL_ASSERT(kc::gemm_mma_supported(args));
      err = kc::launch_gemm_mma_sm80(args, prop->multiProcessorCount, tile, stream);
    } else {
      TORCH_CHECK(impl != Impl::kMma,
                  "FASTCOMM_MATMUL_IMPL=mma: the mma.sync kernel needs sm_80+, ", prop->name,
                  " is sm_", prop->major, prop->minor);
      args.a = p.A.const_data_ptr();
      args.sam = p.A.stride(0);
      args.sak = p.A.stride(1);
      args.b = p.B.const_data_ptr();
      args.sbk = p.B.stride(0);
      args.sbn = p.B.stride(1);
      err = kc::launch_gemm_simt(args, stream);
    }
  }
  C10_CUDA_CHECK(err);
  return out.view(p.out_sizes);
}

at::Tensor matmul_cuda(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cuda(), "fastcomm.matmul (CUDA kernel): a is on ", a.device());
  GemmProblem p = make_matmul_problem(a, b);
  return gemm_cuda(p, std::nullopt, Activation::kNone);
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::string_view activation) {
  TORCH_CHECK(x.device().is_cuda(), "fastcomm.linear (CUDA kernel): x is on ", x.device());
  const Activation act = parse_activation(std::string_view(activation.data(), activation.size()));
  GemmProblem p = make_linear_problem(x, weight, bias);
  return gemm_cuda(p, bias, act);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcomm, CUDA, m) {
  m.impl("matmul", &matmul_cuda);
  m.impl("linear", &linear_cuda);
}

}  // namespace ops
}  // namespace fastcomm
