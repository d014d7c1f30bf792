// Host interface between the CUDA operator code (csrc/ops/cuda/matmul_cuda.cpp,
// compiled by the host compiler) and the kernels (kernels/matmul_*.cu,
// compiled by nvcc). Plain C++: no torch and no device code, so both sides
// include it.
//
// Every launcher computes C[M, N] = act(A[M, K] @ B[K, N] + bias[N]) with
// float32 accumulation (float64 for double), writing C row-major with leading
// dimension ldc, on the given stream, and returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace fastcomm {
namespace ops {
namespace cuda {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

// Same values as fastcomm::ops::Activation (csrc/ops/matmul_common.h).
enum class Act : int { kNone = 0, kRelu = 1, kGelu = 2, kGeluTanh = 3, kSilu = 4 };

struct GemmArgs {
  // A[m][k] = a[m * sam + k * sak]; B[k][n] = b[k * sbk + n * sbn] (elements).
  const void* a = nullptr;
  int64_t sam = 0, sak = 0;
  const void* b = nullptr;
  int64_t sbk = 0, sbn = 0;
  const void* bias = nullptr;  // [N], contiguous, dtype of A; may be null
  void* c = nullptr;           // C[m][n] = c[m * ldc + n]
  int64_t ldc = 0;
  int64_t M = 0, N = 0, K = 0;  // each below 2^31
  DType dtype = DType::kF32;
  Act act = Act::kNone;
};

// Tile-size choice: kAuto lets the launcher's heuristic decide.
// kNarrow: the Hopper kernel's cooperative 128 x 64 tile, the mma.sync
// kernel's TF32 row tiles (M rounded up to 16, 32 or 64, by 128); the other
// kernels take it as kSmall. kMedium: the Hopper kernel's cooperative
// 128 x 192 tile (16-bit types; float32 takes kLarge there); the other
// kernels take it as kSmall.
enum class Tile : int { kAuto = 0, kLarge = 1, kSmall = 2, kNarrow = 3, kMedium = 4 };

// Generic tiled kernel (CUDA cores, any strides, any dtype, any arch).
// Its tile choice: true for the wide kernel (tiles of gemm_simt_wide_rows x
// 128), false for 64 x 64 (always for double).
bool gemm_simt_large_tile(const GemmArgs& args, int num_sms, Tile tile);
// The wide kernel's tile rows: 32, 64 (for as few rows of A) or 128.
int gemm_simt_wide_rows(const GemmArgs& args);
// K split over blocks of the wide kernel where its tiles leave SMs idle (1:
// none), and the float32 scratch the launch then needs (splits x M x N x 4
// bytes; 0 for none). forced_splits: 0 for the launcher's choice, n >= 1
// forced (clamped to K's slices and to 16).
int gemm_simt_splits(const GemmArgs& args, int num_sms, Tile tile, int forced_splits);
int64_t gemm_simt_workspace_bytes(const GemmArgs& args, int num_sms, Tile tile, int forced_splits);
cudaError_t launch_gemm_simt(const GemmArgs& args, int num_sms, Tile tile, int forced_splits,
                             void* workspace, cudaStream_t stream);

// Tensor-core kernel with mma.sync (sm_80+): float16 / bfloat16, and float32
// as TF32 (each operand rounded to TF32; the caller decides that TF32 is
// allowed). Requirements (the caller copies operands that miss them):
//   each of A and B has a unit stride in one dimension: A K-major (sak == 1)
//   or M-major (sam == 1), B K-major (sbk == 1) or N-major (sbn == 1); the
//   other stride is a multiple of 16 bytes (8 elements of a 16-bit type, 4 of
//   float32); both base pointers are 16-byte aligned; K >= 1.
bool gemm_mma_supported(const GemmArgs& args);
// K split over blocks per output tile where the tiles are too few to occupy
// the SMs (small M): how many (1: none), and the float32 scratch the launch
// then needs (its `workspace`; null when 0). forced_splits: 0 for the
// launcher's own choice, n >= 1 forced (clamped to K's slices and to 16).
int gemm_mma_splits(const GemmArgs& args, int num_sms, Tile tile, int forced_splits);
int64_t gemm_mma_workspace_bytes(const GemmArgs& args, int num_sms, Tile tile, int forced_splits);
cudaError_t launch_gemm_mma_sm80(const GemmArgs& args, int num_sms, Tile tile, int forced_splits,
                                 void* workspace, cudaStream_t stream);
// What launch_gemm_mma_sm80 would run, e.g. "mma 16x128 tf32 splitk 12" (tile,
// TF32, K split; for tests and benchmark reports).
std::string describe_gemm_mma(const GemmArgs& args, int num_sms, Tile tile, int forced_splits);

// K-major float32 copies for the TF32 kernel (kernels/matmul_tf32_pack.cu):
// dst[r][k] = src[k][r] rounded to TF32 (to nearest), src[k][r] at
// src[k * ld_src + r], dst[r][k] at dst[r * ld_dst + k]; `ks` values of K.
cudaError_t launch_pack_kmajor_tf32(const float* src, int64_t ld_src, float* dst, int64_t ld_dst,
                                    int64_t rows, int64_t ks, cudaStream_t stream);

// Skinny products (kernels/matmul_skinny.cu): at most kSkinnyMaxM rows of A,
// A K-major (sak == 1) with a row stride of whole 16-byte loads and a 16-byte
// aligned base; B either K-major (sbk == 1; the weight of F.linear as it is;
// float16, bfloat16 or float32, K and B's column stride whole 16-byte loads,
// 16-byte aligned base) or N-major (sbn == 1, sbk != 1; float32, any row
// stride). They stream B once, at the memory's rate, accumulating in float32
// (exact float32 products for float32).
constexpr int kSkinnyMaxM = 8;
bool gemm_skinny_supported(const GemmArgs& args);
// Whether a launch runs the bulk form of the K-major kernel (float32 on
// sm_90a, B K-major): a persistent block per SM streams its range of B's rows through
// shared memory with bulk copies; K is not split.
bool gemm_skinny_bulk(const GemmArgs& args);
// How K is split: B K-major, warps per output column (1, 2, 4 or 8); B
// N-major, blocks along K (1: none).
int gemm_skinny_splits(const GemmArgs& args, int num_sms);
// The float32 scratch of an N-major launch whose K is split (splits x M x N x
// 4 bytes; 0 for none), on the stream's device and not in use until the
// launch's work on `stream` is done.
int64_t gemm_skinny_workspace_bytes(const GemmArgs& args, int num_sms);
cudaError_t launch_gemm_skinny(const GemmArgs& args, int num_sms, void* workspace,
                               cudaStream_t stream);

// Hopper kernel: TMA loads, wgmma, warp-specialised producer / consumers,
// persistent tile loop (sm_90a only; see kernels/matmul_sm90_kernel.cuh).
// Same operand requirements as the mma.sync kernel, plus the TMA ones
// (leading dimension >= the contiguous extent and below 2^31 elements); float32
// (TF32) takes A K-major only (B N-major runs as the transposed product).
bool gemm_wgmma_supported(const GemmArgs& args);
// True when the loaded module carries the sm_90a kernel for the current device.
bool gemm_wgmma_compiled();

// Schedules of the Hopper kernel: two consumer warpgroups on one 128 x 256
// (or 128 x 128) tile, or ping-pong on two 128 x 128 tiles.
enum class WgmmaSched : int { kAuto = 0, kCoop = 1, kPingpong = 2 };
// Cooperative epilogue: stores from registers (kDirect), or through shared
// memory and TMA (kTma: the tile's bias prefetched into registers under the
// last MMAs, one barrier per chunk, the lean activations); kOffload (128 x 256
// tile only, else as kTma): the consumers hand acc + bias to a whole-tile
// buffer and the producer warpgroup's idle warps apply the activation and
// store it, under the next tile's main loop.
enum class WgmmaEpi : int { kAuto = 0, kDirect = 1, kTma = 2, kOffload = 3 };
// Tile order: groups of tile rows (kM) or of tile columns (kN).
enum class Raster : int { kAuto = 0, kM = 1, kN = 2 };

// Choices for one Hopper launch; kAuto / 0 leave them to the heuristic.
struct WgmmaOptions {
  WgmmaSched sched = WgmmaSched::kAuto;
  // cooperative tile: kLarge = 128 x 256, kMedium = 128 x 192, kSmall = 128 x 128,
  // kNarrow = 128 x 64
  Tile tile = Tile::kAuto;
  WgmmaEpi epi = WgmmaEpi::kAuto;
  Raster raster = Raster::kAuto;
  int group = 0;  // rows / columns of C per tile group; 0 (auto) = 2048
  // K split over CTAs per output tile (float32 sums in a workspace, then an
  // ordered second pass applies the epilogue): 0 (auto) for the 128 x 64
  // tile the count of its rule where that takes the problem; otherwise
  // where the tiles do not fill the SMs and a bytes-per-SM model gains from
  // it, then on the cooperative 128 x 128 tile unless a schedule or tile is
  // forced; 1 none, and no stream-K either (every tile taken whole by one
  // CTA); n > 1 forced (clamped to the K-slices of 64 and to 16). Stream-K (0
  // only): kernels/matmul_sm90.cu.
  int splits = 0;
};
// Whether the cooperative 128 x 64 tile's rule takes the problem (where the
// 128 x 128 tiles leave SMs idle and 128 x 64 ones fit in one wave; its K
// split is then the rule's, unless forced).
bool gemm_wgmma_narrow_tile_wins(const GemmArgs& args, int num_sms);
// The cooperative tile of the wave model (kSmall, kMedium or kLarge): the
// fewest modelled rounds of tiles over the SMs, a wider tile's round taking
// longer (kernels/matmul_sm90.cu).
Tile gemm_wgmma_wave_tile(const GemmArgs& args, int num_sms);
// Split count of the launch these options give (1: none), and the workspace
// it needs: split K's float32 sums (splits x M x N x 4 bytes), or stream-K's
// fix-up (one tile of float32 sums and two int flags per SM); 0 for neither.
int gemm_wgmma_splits(const GemmArgs& args, int num_sms, const WgmmaOptions& opts);
int64_t gemm_wgmma_workspace_bytes(const GemmArgs& args, int num_sms, const WgmmaOptions& opts);
// `workspace`: gemm_wgmma_workspace_bytes of float32 scratch, 8-byte aligned
// (null when that is 0), on the stream's device and not in use until the
// launch's work on `stream` is done.
cudaError_t launch_gemm_wgmma_sm90(const GemmArgs& args, int num_sms, const WgmmaOptions& opts,
                                   void* workspace, cudaStream_t stream);
// What launch_gemm_wgmma_sm90 would run, e.g. "wgmma pingpong 128x128 raster m"
// (for tests and benchmark reports).
std::string describe_gemm_wgmma_sm90(const GemmArgs& args, int num_sms, const WgmmaOptions& opts);

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
