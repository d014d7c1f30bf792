// Host-side interface of the Hopper GEMM between its dispatcher
// (kernels/matmul_sm90.cu: operand checks, the choice of schedule / tile /
// cluster, tensor-map encoding) and the translation units that instantiate
// the kernels (kernels/matmul_sm90_{coop,pingpong}_{bf16,f16,tf32}.cu, one per
// schedule and type so that a parallel build compiles them side by side).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "matmul_api.h"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

// How the two consumer warpgroups of a CTA share the work (see
// kernels/matmul_sm90_kernel.cuh):
//   kCoop:     both work on one 128 x BN tile, 64 rows each (BN = 256, 192
//              (16-bit types), 128 or 64);
//   kPingpong: each owns a whole 128 x 128 tile; they alternate, so that one
//              warpgroup's epilogue runs while the other one's MMAs do.
enum class Sched : int { kCoop = 0, kPingpong = 1 };

// One launch, as chosen by the dispatcher.
struct Plan {
  Sched sched = Sched::kCoop;
  int bn = 256;            // tile width: 256, 192, 128 or 64 (ping-pong: 128)
  bool tma_store = false;  // epilogue through shared memory + TMA stores (cooperative)
  // ... in the offload form (activation and stores by warps 1-3 of the
  // producer warpgroup, under the next tile's MMAs; cooperative 128 x 256 only)
  bool epi_offload = false;
  bool raster_n = false;  // walk tiles in groups of columns (true) or of rows (false)
  int group = 2048;       // rows (raster m) or columns (raster n) of C per group
  int num_sms = 0;
  // Split K: work units per tile (1: none). With splits > 1 the kernel writes
  // float32 sums to `partial` (splits x M x N, the caller's workspace) and
  // splitk_finish applies the epilogue; the epilogue is then neither TMA nor
  // offload.
  int splits = 1;
  float* partial = nullptr;
  // Stream-K (cooperative, splits == 1): the last sk_tiles tiles shared out
  // by K-slices over the CTAs (0: none); `fixup` (one tile's float32 sums
  // per CTA) and `fixup_flags` (two per CTA, zeroed before the launch) in
  // the caller's workspace.
  int sk_tiles = 0;
  float* fixup = nullptr;
  int* fixup_flags = nullptr;
};

// Encodes a 2-D TMA map over a row-major [outer][inner] matrix of dtype (16-bit, or float32) with
// leading dimension ld (elements): boxes of box_inner x box_outer, 128-byte
// swizzle, zero fill. False when the driver entry point is missing or the
// driver rejects the geometry.
bool make_map(CUtensorMap* map, DType dtype, const void* ptr, int64_t inner, int64_t outer,
              int64_t ld, uint32_t box_inner, uint32_t box_outer);

// Defined in kernels/matmul_sm90_kernel.cuh, explicitly instantiated for
// T in {__nv_bfloat16, __half, float (TF32)} and both schedules by the files named above.
template <typename T, Sched S>
cudaError_t launch_sched(const GemmArgs& p, const Plan& plan, cudaStream_t stream);

// Attributes of one kernel of that file (the probe of gemm_wgmma_compiled()).
template <typename T, Sched S>
cudaError_t kernel_attributes(cudaFuncAttributes* attr);

}  // namespace sm90
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
