// CUDA implementations of fastcomm::matmul and fastcomm::linear: argument
// checks (shared with the CPU kernels), operand preparation and the choice
// of kernel. Kernels run on the current stream of the inputs' device.
//
// Kernel choice: the skinny kernel (kernels/matmul_skinny.cu: a few rows of
// A, B streamed once) where a row of kSkinnyRules takes the problem; else, for
// float16 / bfloat16, and for float32 where torch's matmul precision allows
// TF32 (tf32_allowed(); float32 otherwise, and float64, take the tiled
// CUDA-core kernel), the first row of kAutoRules below that matches the
// problem, among
//   * on sm_90, the Hopper kernel (TMA + wgmma, warp-specialised,
//     persistent; kernels/matmul_sm90*.cu{,h}): cooperative 128 x 64 tile
//     where its rule takes the problem, else 128 x 128 tile
//     (K split over CTAs where its tiles leave SMs idle) or 128 x 256 tile,
//     whichever a wave model finds faster;
//     float32 runs there as TF32 with A K-major (copied where it is not) and
//     B K-major or N-major (as the transposed product);
//   * the mma.sync tensor-core kernel (kernels/matmul_sm80.cu) on sm_80+,
//     with its own K split for small M: the 16-bit types and float32 as TF32
//     off sm_90;
//   * otherwise the CUDA-core kernel (kernels/matmul_simt.cu).
// The FASTCOMM_MATMUL_* settings (common/config.hpp, MatmulConfig; read once,
// ops/matmul_config.hpp) force a path, tile, schedule, epilogue or tile order,
// for debugging.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "common/config.hpp"
#include "kernels/matmul_api.h"
#include "ops/matmul_common.h"
#include "ops/matmul_config.hpp"

namespace fastcomm {
namespace ops {
namespace {

namespace kc = ::fastcomm::ops::cuda;

kc::Tile to_tile(const std::string& v) {
  return v == "large"    ? kc::Tile::kLarge
         : v == "small"  ? kc::Tile::kSmall
         : v == "narrow" ? kc::Tile::kNarrow
         : v == "medium" ? kc::Tile::kMedium
                         : kc::Tile::kAuto;
}

kc::WgmmaOptions wgmma_options(const MatmulConfig& c) {
  kc::WgmmaOptions o;
  o.sched = c.sched == "coop"       ? kc::WgmmaSched::kCoop
            : c.sched == "pingpong" ? kc::WgmmaSched::kPingpong
                                    : kc::WgmmaSched::kAuto;
  o.tile = to_tile(c.tile);
  o.epi = c.epi == "direct"    ? kc::WgmmaEpi::kDirect
          : c.epi == "tma"     ? kc::WgmmaEpi::kTma
          : c.epi == "offload" ? kc::WgmmaEpi::kOffload
                               : kc::WgmmaEpi::kAuto;
  o.raster = c.raster == "m"   ? kc::Raster::kM
             : c.raster == "n" ? kc::Raster::kN
                               : kc::Raster::kAuto;
  o.group = c.group;
  o.splits = c.splits;
  return o;
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

// torch's float32 precision for CUDA matmuls, "tf32" or not, through the
// Context API of the torch at hand: float32Precision(backend, op) takes enums
// (Float32Backend::CUDA, Float32Op::MATMUL) in newer torch and strings
// ("cuda", "matmul") in older; the member function's parameter types tell
// which, so that neither spelling is named where it does not exist.
template <typename R, typename B, typename O>
bool cuda_matmul_tf32(const at::Context& ctx, R (at::Context::*get)(B, O) const) {
  if constexpr (std::is_enum<std::decay_t<B>>::value) {
    using Backend = std::decay_t<B>;
    using Op = std::decay_t<O>;
    return (ctx.*get)(Backend::CUDA, Op::MATMUL) == std::decay_t<R>::TF32;
  } else {
    return (ctx.*get)("cuda", "matmul") == "tf32";
  }
}
// Where float32Precision is missing or overloaded: the legacy flag.
template <typename Ctx, typename = void>
struct Float32Matmul {
  static bool tf32(const Ctx& ctx) { return ctx.allowTF32CuBLAS(); }
};
template <typename Ctx>
struct Float32Matmul<Ctx, std::void_t<decltype(&Ctx::float32Precision)>> {
  static bool tf32(const Ctx& ctx) { return cuda_matmul_tf32(ctx, &Ctx::float32Precision); }
};

// Whether float32 products may run on the TF32 tensor cores, read at each
// call as ATen's CUDA matmul reads it for cuBLAS: the CUDA matmul precision
// is "tf32" (torch.backends.cuda.matmul.fp32_precision = "tf32",
// torch.set_float32_matmul_precision("high" / "medium"),
// torch.backends.cuda.matmul.allow_tf32 = True) and no at::NoTF32Guard is
// active. "highest" / "ieee" (torch's default) keeps float32 exact. (The
// legacy allowTF32CuBLAS() is not asked first: newer torch raises there once
// the legacy and the new API have both been used.)
bool tf32_allowed() {
  return Float32Matmul<at::Context>::tf32(at::globalContext()) &&
         !at::NoTF32Guard::should_disable_tf32();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A 2-D operand X[R][C] as the tensor-core kernels want it: unit stride along
// one dimension, leading dimension a multiple of 16 bytes (8 elements of a
// 16-bit type, 4 of float32) and at least the contiguous extent, 16-byte
// aligned base. Strides of size-1 dimensions are
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
  if ((ld * static_cast<int64_t>(t.element_size())) % 16 != 0 || ld < unit_extent) return false;
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

// A copy of t [R][C] into a K-major buffer ([other][K], leading dimension
// round_up8(K): aligned rows for 16-byte loads) as an Operand that owns it.
// `k_dim`: the dimension of t that is the GEMM's K. round_tf32: each value
// rounded to TF32 on the way (t contiguous along the other dimension).
Operand kmajor_copy(const at::Tensor& t, int k_dim, bool round_tf32) {
  const int64_t K = t.size(k_dim), other = t.size(1 - k_dim);
  at::Tensor buf = at::empty({other, round_up8(K)}, t.options()).narrow(1, 0, K);
  if (round_tf32) {
    C10_CUDA_CHECK(kc::launch_pack_kmajor_tf32(
        t.const_data_ptr<float>(), t.stride(k_dim), buf.mutable_data_ptr<float>(), buf.stride(0),
        other, K, at::cuda::getCurrentCUDAStream(t.device().index()).stream()));
  } else {
    buf.copy_(k_dim == 1 ? t : t.t());
  }
  Operand op;
  const bool ok = try_layout(k_dim == 1 ? buf : buf.t(), k_dim, op);
  TORCH_INTERNAL_ASSERT(ok, "fastcomm: K-major copy of an operand has an unexpected layout");
  op.keep = buf;
  return op;
}

// Prepares t [R][C] for a tensor-core kernel. `k_dim` is the dimension of t
// that is the GEMM's K (1 for A [M][K], 0 for B [K][N]); K-major (unit
// stride along k_dim) or, unless `k_major_only`, M/N-major is taken as it
// is, anything else is copied into a K-major buffer with a padded leading
// dimension. k_major_only: A of the TF32 kernel, whose wgmma reads a 32-bit
// A from shared memory K-major only; an M-major a (matmul(x.t(), b)) is then
// transposed into an [M, K] buffer, rounded to TF32.
Operand prepare_tc_operand(const at::Tensor& t, int k_dim, bool k_major_only = false) {
  {
    Operand op;
    if (try_layout(t, k_dim, op)) return op;
  }
  if (!k_major_only) {
    Operand op;
    if (try_layout(t, 1 - k_dim, op)) return op;
  }
  // The TF32 kernel's operand, contiguous along the other dimension: a
  // transposing copy that rounds each value to TF32.
  const bool round_tf32 = k_major_only && t.scalar_type() == at::kFloat && t.stride(1 - k_dim) == 1;
  return kmajor_copy(t, k_dim, round_tf32);
}

void fill_ab(kc::GemmArgs& args, const Operand& a, const Operand& b) {
  args.a = a.ptr;
  args.sam = a.s0;
  args.sak = a.s1;
  args.b = b.ptr;
  args.sbk = b.s0;
  args.sbn = b.s1;
}

// The CUDA-core kernel reads A and B through their strides, any layout.
void fill_simt_ab(kc::GemmArgs& args, const GemmProblem& p) {
  args.a = p.A.const_data_ptr();
  args.sam = p.A.stride(0);
  args.sak = p.A.stride(1);
  args.b = p.B.const_data_ptr();
  args.sbk = p.B.stride(0);
  args.sbn = p.B.stride(1);
}

// The problem's sizes and types as the kernels see them; operand pointers
// and strides are filled in per kernel. The strides set here say only which
// way the Hopper kernel would take each operand (A K-major, B K-major or
// N-major in place), for the choice of kernel: a TF32 product with B
// N-major runs transposed there, with its own tiles.
kc::GemmArgs problem_args(const GemmProblem& p, Activation act) {
  kc::GemmArgs args;
  Operand b;
  const bool b_n_major = !try_layout(p.B, 0, b) && try_layout(p.B, 1, b);
  args.sam = p.K;
  args.sak = 1;
  args.sbk = b_n_major ? p.N : 1;
  args.sbn = b_n_major ? 1 : p.K;
  args.ldc = p.N;
  args.M = p.M;
  args.N = p.N;
  args.K = p.K;
  args.dtype = to_kdtype(p.A.scalar_type());
  args.act = static_cast<kc::Act>(static_cast<int>(act));
  return args;
}

enum class Path { kSimt, kSkinny, kMma, kWgmma };

// ---- the default dispatch (impl=auto; half types, float32 as TF32) ----------------

// When a row of kAutoRules applies, besides its bound on M.
enum class When {
  kWgmmaTile64,   // sm_90: the 128 x 64 tile's rule takes the problem
  kWgmmaTile128,  // sm_90: the wave model picks the 128 x 128 tile (gemm_wgmma_wave_tile)
  kWgmmaTile192,  // sm_90: ... the 128 x 192 tile (16-bit types)
  kWgmma,         // sm_90
  kSm80,          // sm_80+
  kAlways,
};

// One row: problems with M <= max_m for which `when` holds take `path` with
// these Hopper options (unset ones auto); problems of kSkinnyRules (below)
// take the skinny kernel before any row. Why these rows (ratios to cuBLAS
// per shape class, in docs/matmul.md):
//   * on sm_90 every problem takes the Hopper kernel, small ones too:
//     its 128 x 64 tile where that tile's rule takes the problem (128 x 128
//     tiles leave SMs idle, 128 x 64 ones fit in one wave: small M on N up
//     to 8448, squares up to 1024), ahead of a K split of the 128 x 128 tile;
//     otherwise the 128 x 128 tile (K split where its tiles leave SMs idle;
//     it beats mma.sync on every small shape measured), the 128 x 192 tile
//     (16-bit types) or the 128 x 256 tile, by the Hopper kernel's wave
//     model; split counts are the Hopper kernel's (kernels/matmul_sm90.cu);
//   * float32 with TF32 allowed takes the same Hopper rows (the TF32 kernel:
//     same tiles and stage bytes, half the K per stage), matmul's N-major b
//     as the transposed product with b read through registers:
//     from 32 rows ahead of the mma.sync kernel's TF32 form, within a few
//     percent of it below (docs/matmul.md). Off sm_90 float32 with TF32
//     takes the mma.sync kernel, without TF32 the CUDA-core kernel.
struct AutoRule {
  int64_t max_m;
  When when;
  Path path;
  kc::WgmmaSched sched;
  kc::Tile tile;
};
constexpr int64_t kAnyM = INT64_MAX;
constexpr AutoRule kAutoRules[] = {
    {kAnyM, When::kWgmmaTile64, Path::kWgmma, kc::WgmmaSched::kCoop, kc::Tile::kNarrow},
    {kAnyM, When::kWgmmaTile128, Path::kWgmma, kc::WgmmaSched::kCoop, kc::Tile::kSmall},
    {kAnyM, When::kWgmmaTile192, Path::kWgmma, kc::WgmmaSched::kCoop, kc::Tile::kMedium},
    {kAnyM, When::kWgmma, Path::kWgmma, kc::WgmmaSched::kCoop, kc::Tile::kLarge},
    {kAnyM, When::kSm80, Path::kMma, kc::WgmmaSched::kAuto, kc::Tile::kAuto},
    {kAnyM, When::kAlways, Path::kSimt, kc::WgmmaSched::kAuto, kc::Tile::kAuto},
};

// ---- the skinny kernel (a few rows of A, B streamed once) -------------------------

// B as the skinny kernel takes it in place: K-major (linear's weight; K a
// multiple of one 16-byte load) or, for float32, N-major with any row stride.
enum class SkinnyB { kNone, kKMajor, kNMajor };

// The operand types of a skinny rule.
enum class SkinnyTypes {
  kHalf,      // float16 / bfloat16
  kF32Tf32,   // float32 with TF32 allowed (the kernel stays exact float32)
  kF32Exact,  // float32, TF32 not allowed
};

// Problems the default dispatch gives the skinny kernel: operand types, B's
// layout, at most max_m rows of A, and whether only off sm_90. Why (ratios to
// cuBLAS in docs/matmul.md): it reads B once at the memory's rate, where
//   * one row of a 16-bit A with B K-major: off sm_90; on sm_90 the Hopper
//     kernel's 128 x 64 and 128 x 128 tiles are as fast;
//   * up to 4 rows of a float32 A with N-major b under TF32: the Hopper
//     kernel's transposed product computes mostly padding there (at 8 rows
//     it is ahead again);
//   * exact float32 up to kSkinnyMaxM rows, either layout: the CUDA-core
//     kernel's tiles are mostly padding there (from 9 rows its 32-row tiles
//     are ahead).
struct SkinnyRule {
  SkinnyTypes types;
  SkinnyB b;
  int64_t max_m;
  bool off_sm90_only;
};
constexpr SkinnyRule kSkinnyRules[] = {
    {SkinnyTypes::kHalf, SkinnyB::kKMajor, 1, true},
    {SkinnyTypes::kF32Tf32, SkinnyB::kNMajor, 4, false},
    {SkinnyTypes::kF32Exact, SkinnyB::kKMajor, kc::kSkinnyMaxM, false},
    {SkinnyTypes::kF32Exact, SkinnyB::kNMajor, kc::kSkinnyMaxM, false},
};

// The Hopper kernel runs here: an sm_90 device and a build with its sm_90a code.
bool wgmma_usable(const cudaDeviceProp* prop) {
  return prop->major == 9 && prop->minor == 0 && kc::gemm_wgmma_compiled();
}

// B's layout for the skinny kernel (no copy: B is the large operand).
SkinnyB skinny_b_layout(const GemmProblem& p, Operand* b) {
  const at::ScalarType t = p.B.scalar_type();
  const bool f32 = t == at::kFloat;
  if (!(f32 || t == at::kHalf || t == at::kBFloat16) || p.M < 1 || p.M > kc::kSkinnyMaxM ||
      p.K < 1) {
    return SkinnyB::kNone;
  }
  if (p.K % (f32 ? 4 : 8) == 0 && try_layout(p.B, 0, *b)) return SkinnyB::kKMajor;
  // N-major: a row stride of 1 would read as K-major (kernels/matmul_skinny.cu).
  if (f32 && p.B.stride(1) == 1 && p.B.stride(0) != 1) {
    b->ptr = p.B.const_data_ptr();
    b->s0 = p.B.stride(0);
    b->s1 = 1;
    return SkinnyB::kNMajor;
  }
  return SkinnyB::kNone;
}

bool skinny_rule_takes(const GemmProblem& p, SkinnyB layout, const cudaDeviceProp* prop,
                       bool tf32) {
  const at::ScalarType t = p.A.scalar_type();
  const SkinnyTypes types = t != at::kFloat ? SkinnyTypes::kHalf
                            : tf32          ? SkinnyTypes::kF32Tf32
                                            : SkinnyTypes::kF32Exact;
  for (const SkinnyRule& r : kSkinnyRules) {
    if (r.types == types && r.b == layout && p.M <= r.max_m &&
        !(r.off_sm90_only && wgmma_usable(prop))) {
      return true;
    }
  }
  return false;
}

// The skinny kernel's operands when it runs the problem: forced
// (FASTCOMM_MATMUL_IMPL=skinny) and possible, or a row of kSkinnyRules takes
// it. B as it is; A K-major with rows aligned for 16-byte loads, copied where
// it is not (A has at most kSkinnyMaxM rows).
struct SkinnyOperands {
  Operand a, b;
};
std::optional<SkinnyOperands> skinny_operands(const MatmulConfig& cfg, const GemmProblem& p,
                                              const cudaDeviceProp* prop, bool tf32) {
  if (cfg.impl != "skinny" && cfg.impl != "auto") return std::nullopt;
  SkinnyOperands o;
  const SkinnyB layout = skinny_b_layout(p, &o.b);
  if (layout == SkinnyB::kNone) return std::nullopt;
  if (cfg.impl == "auto" && !skinny_rule_takes(p, layout, prop, tf32)) return std::nullopt;
  if (!try_layout(p.A, 1, o.a)) o.a = kmajor_copy(p.A, 1, /*round_tf32=*/false);
  return o;
}

// The row of kAutoRules for a problem (always found: the last row matches
// everything).
const AutoRule& auto_rule(const kc::GemmArgs& args, const cudaDeviceProp* prop, bool wgmma_ok,
                          bool mma_ok) {
  for (const AutoRule& r : kAutoRules) {
    if (args.M > r.max_m) continue;
    bool ok = false;
    switch (r.when) {
      case When::kWgmmaTile64:
        ok = wgmma_ok && kc::gemm_wgmma_narrow_tile_wins(args, prop->multiProcessorCount);
        break;
      case When::kWgmmaTile128:
        ok = wgmma_ok &&
             kc::gemm_wgmma_wave_tile(args, prop->multiProcessorCount) == kc::Tile::kSmall;
        break;
      case When::kWgmmaTile192:
        ok = wgmma_ok &&
             kc::gemm_wgmma_wave_tile(args, prop->multiProcessorCount) == kc::Tile::kMedium;
        break;
      case When::kWgmma:
        ok = wgmma_ok;
        break;
      case When::kSm80:
        ok = mma_ok;
        break;
      case When::kAlways:
        ok = true;
        break;
    }
    if (ok) return r;
  }
  return kAutoRules[sizeof(kAutoRules) / sizeof(kAutoRules[0]) - 1];
}

// The kernel for a problem on the current device (see the top of the file);
// raises where a forced kernel cannot run. `skinny`: the skinny kernel runs
// the problem (skinny_operands found its operands).
// `tf32`: float32 may run as TF32 (tf32_allowed()). `wopts`: the Hopper
// options, from the settings, which the default dispatch may complete
// (schedule and tile of its row).
Path choose_path(const kc::GemmArgs& args, const MatmulConfig& cfg, const cudaDeviceProp* prop,
                 bool skinny, bool tf32, kc::WgmmaOptions* wopts) {
  const bool half = args.dtype == kc::DType::kF16 || args.dtype == kc::DType::kBF16;
  // float32 with TF32 allowed: a tensor-core kernel's TF32 form where one
  // runs; else, and with TF32 not allowed, the exact CUDA-core kernel.
  const bool f32_tc = args.dtype == kc::DType::kF32 && tf32;
  TORCH_CHECK(cfg.impl != "skinny" || skinny,
              "FASTCOMM_MATMUL_IMPL=skinny: the skinny kernel needs at most ", kc::kSkinnyMaxM,
              " rows of A and B K-major (K a multiple of 8 for float16 / bfloat16, of 4 for "
              "float32) or, for float32, N-major (got M=",
              args.M, " N=", args.N, " K=", args.K, ")");
  if (skinny) return Path::kSkinny;
  // K == 0 (bias + activation only) also goes to the CUDA-core kernel.
  if (!(half || f32_tc) || args.K == 0 || cfg.impl == "simt") return Path::kSimt;
  const bool wgmma_ok = wgmma_usable(prop);
  const bool mma_ok = prop->major >= 8;
  TORCH_CHECK(cfg.impl != "wgmma" || wgmma_ok,
              "FASTCOMM_MATMUL_IMPL=wgmma: the wgmma kernel needs an sm_90 device (", prop->name,
              " is sm_", prop->major, prop->minor,
              ") and an extension built for sm_90a (TORCH_CUDA_ARCH_LIST containing 9.0a)");
  if (cfg.impl == "wgmma") return Path::kWgmma;
  if (cfg.impl == "auto") {
    const AutoRule& r = auto_rule(args, prop, wgmma_ok, mma_ok);
    if (r.path == Path::kWgmma) {
      // The row's schedule and tile where the settings leave them auto.
      if (wopts->sched == kc::WgmmaSched::kAuto && wopts->tile == kc::Tile::kAuto) {
        wopts->sched = r.sched;
        wopts->tile = r.tile;
      }
    }
    return r.path;
  }
  if (mma_ok) return Path::kMma;
  TORCH_CHECK(cfg.impl != "mma", "FASTCOMM_MATMUL_IMPL=mma: the mma.sync kernel needs sm_80+, ",
              prop->name, " is sm_", prop->major, prop->minor);
  return Path::kSimt;
}

// The float32 scratch of a split-K launch (`bytes` from the kernel's
// *_workspace_bytes; none when 0), from the caching allocator on the
// current stream, so a captured call takes it from the graph's pool.
at::Tensor float_workspace(const GemmProblem& p, int64_t bytes) {
  return bytes > 0 ? at::empty({bytes / 4}, p.A.options().dtype(at::kFloat)) : at::Tensor();
}
void* workspace_ptr(const at::Tensor& workspace) {
  return workspace.defined() ? workspace.mutable_data_ptr() : nullptr;
}

// Makes `device`'s primary context current on this thread. A device guard
// leaves a fresh thread (autograd's, a user's) whose current device already
// is the one asked for without any context current, and kernel attribute
// calls there (cudaFuncSetAttribute, cudaFuncGetAttributes) fail with
// "invalid argument" where a launch would have bound the context itself.
void bind_device_context(c10::DeviceIndex device) {
  thread_local uint64_t bound = 0;  // devices bound on this thread
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if ((bound & bit) != 0) return;
  C10_CUDA_CHECK(cudaSetDevice(device));
  bound |= bit;
}

at::Tensor gemm_cuda(const GemmProblem& p, const std::optional<at::Tensor>& bias, Activation act) {
  TORCH_CHECK(p.M < (int64_t(1) << 31) && p.N < (int64_t(1) << 31) && p.K < (int64_t(1) << 31),
              "fastcomm: matrix dimensions must be below 2^31, got M=", p.M, " N=", p.N,
              " K=", p.K);
  c10::cuda::CUDAGuard guard(p.A.device());
  bind_device_context(p.A.device().index());
  const GemmOutput o = make_gemm_output(p, bias);
  if (p.M == 0 || p.N == 0) return o.result(p);

  kc::GemmArgs args = problem_args(p, act);
  args.bias = o.bias.defined() ? o.bias.const_data_ptr() : nullptr;
  args.c = o.out.mutable_data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(p.A.device().index()).stream();
  const MatmulConfig cfg = matmulConfig();
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();

  cudaError_t err = cudaSuccess;
  const bool tf32 = tf32_allowed();
  const std::optional<SkinnyOperands> skinny = skinny_operands(cfg, p, prop, tf32);
  kc::WgmmaOptions wopts = wgmma_options(cfg);
  switch (choose_path(args, cfg, prop, skinny.has_value(), tf32, &wopts)) {
    case Path::kSkinny: {
      fill_ab(args, skinny->a, skinny->b);
      TORCH_INTERNAL_ASSERT(kc::gemm_skinny_supported(args));
      const at::Tensor workspace =
          float_workspace(p, kc::gemm_skinny_workspace_bytes(args, prop->multiProcessorCount));
      err =
          kc::launch_gemm_skinny(args, prop->multiProcessorCount, workspace_ptr(workspace), stream);
      break;
    }
    case Path::kWgmma: {
      // float32 (TF32): A K-major; B K-major or N-major (kernels/matmul_sm90.cu).
      const bool k_major_only = args.dtype == kc::DType::kF32;
      Operand a = prepare_tc_operand(p.A, 1, k_major_only);
      Operand b = prepare_tc_operand(p.B, 0);
      fill_ab(args, a, b);
      TORCH_INTERNAL_ASSERT(kc::gemm_wgmma_supported(args));
      const int64_t scratch =
          kc::gemm_wgmma_workspace_bytes(args, prop->multiProcessorCount, wopts);
      const at::Tensor workspace = float_workspace(p, scratch);
      err = kc::launch_gemm_wgmma_sm90(args, prop->multiProcessorCount, wopts,
                                       workspace_ptr(workspace), stream);
      break;
    }
    case Path::kMma: {
      Operand a = prepare_tc_operand(p.A, 1);
      Operand b = prepare_tc_operand(p.B, 0);
      fill_ab(args, a, b);
      TORCH_INTERNAL_ASSERT(kc::gemm_mma_supported(args));
      const int64_t scratch = kc::gemm_mma_workspace_bytes(args, prop->multiProcessorCount,
                                                           to_tile(cfg.tile), cfg.splits);
      const at::Tensor workspace = float_workspace(p, scratch);
      err = kc::launch_gemm_mma_sm80(args, prop->multiProcessorCount, to_tile(cfg.tile), cfg.splits,
                                     workspace_ptr(workspace), stream);
      break;
    }
    case Path::kSimt: {
      fill_simt_ab(args, p);
      const int64_t scratch = kc::gemm_simt_workspace_bytes(args, prop->multiProcessorCount,
                                                            to_tile(cfg.tile), cfg.splits);
      const at::Tensor workspace = float_workspace(p, scratch);
      err = kc::launch_gemm_simt(args, prop->multiProcessorCount, to_tile(cfg.tile), cfg.splits,
                                 workspace_ptr(workspace), stream);
      break;
    }
  }
  C10_CUDA_CHECK(err);
  return o.result(p);
}

// fastcomm::_kernel_name(a, b, activation): the kernel matmul(a, b) would
// run here with the current matmul settings and that activation
// in its epilogue (tests, benchmark reports).
std::string kernel_name_cuda(const at::Tensor& a, const at::Tensor& b,
                             c10::string_view activation) {
  TORCH_CHECK(a.device().is_cuda(), "fastcomm._kernel_name (CUDA kernel): a is on ", a.device());
  const Activation act = parse_activation(std::string_view(activation.data(), activation.size()));
  const GemmProblem p = make_matmul_problem(a, b);
  c10::cuda::CUDAGuard guard(p.A.device());
  bind_device_context(p.A.device().index());
  kc::GemmArgs args = problem_args(p, act);
  // The output of a real call is a fresh caching-allocator block, which is
  // 512-byte aligned: any aligned address stands for it here.
  alignas(16) static const char aligned_c[16] = {};
  args.c = const_cast<char*>(aligned_c);
  const MatmulConfig cfg = matmulConfig();
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const bool tf32 = tf32_allowed();
  const std::optional<SkinnyOperands> skinny = skinny_operands(cfg, p, prop, tf32);
  kc::WgmmaOptions wopts = wgmma_options(cfg);
  switch (choose_path(args, cfg, prop, skinny.has_value(), tf32, &wopts)) {
    case Path::kSkinny: {
      fill_ab(args, skinny->a, skinny->b);
      if (kc::gemm_skinny_bulk(args)) return "skinny k-major bulk";
      const int splits = kc::gemm_skinny_splits(args, prop->multiProcessorCount);
      return args.sbk == 1 ? "skinny k-major splits " + std::to_string(splits)
                           : "skinny n-major splitk " + std::to_string(splits);
    }
    case Path::kWgmma:
      return kc::describe_gemm_wgmma_sm90(args, prop->multiProcessorCount, wopts);
    case Path::kMma:
      return kc::describe_gemm_mma(args, prop->multiProcessorCount, to_tile(cfg.tile), cfg.splits);
    case Path::kSimt:
      break;
  }
  if (!kc::gemm_simt_large_tile(args, prop->multiProcessorCount, to_tile(cfg.tile))) {
    return "simt 64x64";
  }
  const int splits =
      kc::gemm_simt_splits(args, prop->multiProcessorCount, to_tile(cfg.tile), cfg.splits);
  const std::string tile = "simt " + std::to_string(kc::gemm_simt_wide_rows(args)) + "x128";
  return splits > 1 ? tile + " splitk " + std::to_string(splits) : tile;
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
  m.impl("_kernel_name", &kernel_name_cuda);
}

}  // namespace ops
}  // namespace fastcomm
