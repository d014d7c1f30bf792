// Dispatcher of the Hopper (sm_90a) GEMM: operand checks, the choice of
// schedule, tile, epilogue and tile order for a problem, and the TMA tensor
// maps. The kernels themselves are in matmul_sm90_kernel.cuh, instantiated by
// matmul_sm90_{coop,pingpong}_{bf16,f16,tf32}.cu; docs/matmul.md has the
// design. float32 operands run as TF32 (the caller decides that TF32 is
// allowed): a K-major, b K-major or N-major (run as the transposed product,
// below), the direct or split-K epilogue.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <string>

#include "matmul_device.cuh"
#include "matmul_sm90_launch.h"

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {
namespace {

// The wave model of the cooperative tiles: a persistent grid takes
// ceil(tiles / SMs) rounds, and a tile takes, in units of a 128 x 128 tile's
// time, 1.5 / kGain192 (128 x 192) or 2 / kGain256 (128 x 256): the wider
// tiles do more flops per byte of shared memory read, at a better rate per
// flop. The ping-pong 128 x 128 tile (forced schedules only) takes
// kTimePingpong. The narrower tile wins ties.
constexpr double kGain192 = 1.05;
constexpr double kGain256 = 1.1;
constexpr double kTimePingpong = 0.92;
// Rows (raster m) or columns (raster n) of C per group of the tile order.
constexpr int kDefaultGroup = 2048;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int elem_bytes(DType t) { return t == DType::kF32 ? 4 : t == DType::kF64 ? 8 : 2; }

constexpr int kTileM = 128;       // tile rows (kBM of the kernel)
constexpr int kSliceBytes = 128;  // K per pipeline stage in bytes (kBKFor<T> of the kernel)
// K per pipeline stage in elements: 64 (16-bit types), 32 (float32 as TF32).
int64_t slice_k(const GemmArgs& p) { return kSliceBytes / elem_bytes(p.dtype); }

// Modelled time of the busiest CTA for tiles of 128 x bn (units above).
double wave_cost(const GemmArgs& p, int num_sms, int bn) {
  const double rounds = static_cast<double>(cdiv(cdiv(p.M, kTileM) * cdiv(p.N, bn), num_sms));
  return rounds * (bn == 256 ? 2.0 / kGain256 : bn == 192 ? 1.5 / kGain192 : 1.0);
}

// ---- the device's memory ------------------------------------------------------------
//
// Where operands stream from DRAM more than once or from fewer SMs, the
// memory's bandwidth decides between choices below: peak bandwidth of at
// least this (H200, 4.8 TB/s) or below it (H100, 3.35 TB/s).
constexpr double kFastMemoryMinBandwidth = 4e12;  // bytes/s, peak

// Whether the current device's peak memory bandwidth (clock x bus width) is
// at least kFastMemoryMinBandwidth. Asked once per device.
bool fast_memory() {
  static detail::PerDeviceAnswer fast;
  return fast.get([](int dev) {
    int clock_khz = 0, bus_bits = 0;
    const bool ok =
        cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess;
    cudaGetLastError();
    if (!ok) return detail::PerDeviceAnswer::kUnknown;
    const double peak = 2.0 * clock_khz * 1e3 * bus_bits / 8;  // double data rate
    return peak >= kFastMemoryMinBandwidth ? detail::PerDeviceAnswer::kYes
                                           : detail::PerDeviceAnswer::kNo;
  });
}

// ---- stream-K ----------------------------------------------------------------------
//
// Where the tile the wave model picked leaves the persistent grid's last round
// part-empty (2048 x 11008 in 128 x 256 tiles: 688 tiles, 5.2 rounds on 132
// SMs), the last whole round plus the remainder are shared out by K-slices
// (matmul_sm90_work.cuh): every CTA then does the same number of slices, at
// the cost of a tile's float32 sums written by one CTA and read back by the
// next, modelled as kStreamKFixupSlices K-slices of the tile. Taken where
// that models at most kStreamKGain of the whole tiles' time, and only from
// two rounds of tiles on (three on slower memory): the CTAs that share out a
// tile do not walk its K in step with the CTAs on the other tiles of its
// column, so where the B panel they share does not stay in L2 it is read
// from DRAM more than once. With every tile shared out (fewer than two
// rounds) stream-K measured up to 20 % behind whole tiles; at 2.6 rounds
// (1024 x 11008 x 4096, 62 % of the tiles shared out) 2-3 % ahead on H200
// and 10-13 % behind on H100 (docs/matmul.md).
constexpr double kStreamKFixupSlices = 4;
constexpr double kStreamKGain = 0.95;

// Tiles of 128 x bn that stream-K takes (0: none).
int64_t stream_k_tiles(const GemmArgs& p, int num_sms, int bn) {
  const int64_t tiles = cdiv(p.M, kTileM) * cdiv(p.N, bn);
  const int64_t min_rounds = fast_memory() ? 2 : 3;
  if (tiles < min_rounds * num_sms || tiles % num_sms == 0) return 0;
  const int64_t sk_tiles = num_sms + tiles % num_sms;
  const int64_t num_kb = cdiv(p.K, slice_k(p));
  // The kernel's work list counts the stream-K slices in 32 bits.
  if (sk_tiles * num_kb > INT_MAX) return 0;
  const double whole = static_cast<double>(cdiv(tiles, num_sms) * num_kb);
  const double shared = static_cast<double>(tiles) / num_sms * num_kb + kStreamKFixupSlices;
  return shared > kStreamKGain * whole ? 0 : sk_tiles;
}

// TF32 with A M-major: the kernel with A through registers (the transposed
// product of matmul(a, b) with b N-major, below).
bool tf32_rs(const GemmArgs& p) { return p.dtype == DType::kF32 && p.sak != 1; }

// A TF32 product with A M-major (the transposed product of matmul(a, b) with
// b N-major, below) of more than 128 columns (a's rows) takes the 128 x 256
// tile, K split where its tiles leave SMs idle: forced against the 128 x 128
// and 128 x 64 tiles there, it ran 15-40 % faster at 256-4096 rows (H100).
// Per flop a 128 x 256 tile brings 3/4 of a 128 x 128 tile's operand bytes
// into shared memory and reads half its A fragments back out of it, and
// TF32 operands take twice the shared-memory bytes per flop of 16-bit ones.
// Where K is at most 1024 and the 128 x 64 tiles fit in one wave, that
// tile's rule keeps the problem: each CTA streams all of its K unsplit, while
// the 128 x 256 tile needs a split whose slices are too short to fill the
// pipeline (1024^3: 0.85x cuBLAS on the 128 x 64 tile, 0.80x on 128 x 256
// with 4 splits; with K = 2048 the 128 x 256 tile is ahead, 0.97 / 1.06x
// against 0.78 / 0.89x at M x N = 512 x 2048 / 256 x 4096; H200).
constexpr int64_t kTf32NarrowMaxK = 1024;
bool tf32_rs_wide(const GemmArgs& p, int num_sms) {
  const bool narrow_wave = cdiv(p.M, kTileM) * cdiv(p.N, 64) <= num_sms;
  return tf32_rs(p) && p.N > 128 && !(narrow_wave && p.K <= kTf32NarrowMaxK);
}

// The cooperative tile width the wave model picks: 128, 192 (16-bit types)
// or 256.
int wave_tile_bn(const GemmArgs& p, int num_sms) {
  if (tf32_rs_wide(p, num_sms)) return 256;
  int best = 128;
  double best_cost = wave_cost(p, num_sms, 128);
  for (int bn : {192, 256}) {
    if (bn == 192 && p.dtype == DType::kF32) continue;
    const double c = wave_cost(p, num_sms, bn);
    if (c < best_cost) {
      best = bn;
      best_cost = c;
    }
  }
  return best;
}

// One operand of the TMA path: unit stride along `inner`, leading dimension
// ld (elements of es bytes) that TMA accepts (a multiple of 16 bytes, not
// below the row).
bool tma_operand_ok(int64_t inner, int64_t ld, int es) {
  return (ld * es) % 16 == 0 && ld >= inner && ld < (int64_t(1) << 36);
}

// ---- TF32 with b N-major -------------------------------------------------------
//
// The TF32 wgmma reads shared-memory operands K-major only. matmul(a, b) with
// b [K, N] N-major runs as its transpose, C^T = B^T A^T: the kernel's A is b
// (M-major, through registers: the RS form), its B is a (K-major), and it
// writes its [N][M] result into C's [M][N] (matmul_sm90_epilogue.cuh). Every
// choice of the plan (tile, split, stream-K, order) is made on that problem.
bool tf32_transposed(const GemmArgs& p) { return p.dtype == DType::kF32 && p.sbk != 1; }

// The problem the kernel computes: p itself, or its transpose (above).
GemmArgs kernel_problem(const GemmArgs& p) {
  if (!tf32_transposed(p)) return p;
  GemmArgs t = p;
  t.M = p.N;
  t.N = p.M;
  t.a = p.b;
  t.sam = p.sbn;
  t.sak = p.sbk;
  t.b = p.a;
  t.sbk = p.sak;
  t.sbn = p.sam;
  return t;
}

// ---- split K ---------------------------------------------------------------------
//
// Where the output tiles are too few to occupy the SMs (small M: 128 x 4096
// is 32 tiles of 128 x 128 on 132 SMs), each tile's K-slices are shared by
// `splits` CTAs, which write float32 sums; splitk_finish adds them in split
// order and applies bias, activation and the cast (deterministic). The choice
// of splits models such a small product as bound by the bytes it moves, in
// bytes per SM: the more of
//   waves x (slices per unit x bytes per slice + the unit's float32 store)
// on the busiest SM (waves = ceil(units / SMs)), and the bytes the product
// reads from and writes to DRAM (A and B once, the float32 sums) over
// kBandwidthSms, the SMs whose streams take all of the memory's bandwidth;
// plus (the finish pass's bytes + a launch) / SMs. Tiles that already keep
// that many SMs streaming (16 x 11008 x 4096: 86 tiles of 128 x 128) gain
// nothing from a split, which only adds the sums and the second pass. A
// split is taken only where it models kSplitGain faster than none, since the
// second pass and the extra traffic are what the model knows least well.
constexpr int kMaxSplits = 16;
constexpr int kMinSlicesPerSplit = 4;        // K >= 256 per unit: the pipeline fills
constexpr double kSplitGain = 0.8;           // modelled time at most 0.8 x the unsplit one
constexpr double kFinishLaunchBytes = 48e3;  // ~2 us of one SM's share of the bandwidth
// SMs that, streaming at their own rate, take the memory's bandwidth: an
// unsplit TF32 128 x 11008 x 4096 moved 4.2 MB per SM at ~55 GB/s per SM
// on 86 SMs (H100), so ~3 TB/s takes about 50.
constexpr double kBandwidthSms = 48;

double split_cost(const GemmArgs& p, int num_sms, int bn, int64_t tiles, int64_t num_kb,
                  int splits) {
  const double rows = static_cast<double>(std::min<int64_t>(p.M, kTileM));
  const double slice_bytes = (rows + bn) * kSliceBytes;
  const int64_t units = tiles * splits;
  const double waves = static_cast<double>(cdiv(units, num_sms));
  const double slices = static_cast<double>(cdiv(num_kb, splits));
  double busiest = waves * slices * slice_bytes;
  double dram = (static_cast<double>(p.M) + p.N) * p.K * elem_bytes(p.dtype);
  double finish = 0;
  if (splits > 1) {
    busiest += waves * rows * bn * 4;
    dram += static_cast<double>(p.M) * p.N * 4.0 * splits;
    const double finish_bytes =
        static_cast<double>(p.M) * p.N * (4.0 * splits + elem_bytes(p.dtype));
    finish = (finish_bytes + kFinishLaunchBytes * num_sms) / num_sms;
  }
  return std::max(busiest, dram / kBandwidthSms) + finish;
}

// The modelled best split count for tiles of 128 x bn (1: no split).
int auto_splits(const GemmArgs& p, int num_sms, int bn) {
  const int64_t tiles = cdiv(p.M, kTileM) * cdiv(p.N, bn);
  const int64_t num_kb = cdiv(p.K, slice_k(p));
  if (tiles >= num_sms) return 1;
  const double none = split_cost(p, num_sms, bn, tiles, num_kb, 1);
  int best = 1;
  double best_cost = none * kSplitGain;
  for (int s = 2; s <= kMaxSplits && s * kMinSlicesPerSplit <= num_kb; ++s) {
    const double c = split_cost(p, num_sms, bn, tiles, num_kb, s);
    if (c < best_cost) {
      best = s;
      best_cost = c;
    }
  }
  return best;
}

// A forced split count: at least one K-slice per unit, at most kMaxSplits.
int clamp_splits(const GemmArgs& p, int splits) {
  const int64_t num_kb = cdiv(p.K, slice_k(p));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({splits, num_kb, kMaxSplits})));
}

// ---- the 128 x 64 tile ------------------------------------------------------------
//
// Where the 128 x 128 tiles leave SMs idle and the 128 x 64 tiles fit in one
// wave (small M with N up to 8448, squares up to 1024), the 128 x 64 tile
// measured ahead of both a K split of the 128 x 128 tile (no float32 sums,
// no second pass: those cost a small product a few microseconds) and the
// 128 x 128 tile on part of the GPU (H100, bf16; docs/matmul.md). Its own K
// is split only to give each row of tiles enough CTAs to draw the memory's
// bandwidth, or to keep each CTA's K within what unsplit CTAs streamed at
// speed; where a split for the latter does not fit in one wave, the default
// dispatch leaves the tile.
constexpr int64_t kNarrowMinRowUnits = 64;  // CTAs per row of tiles: fewer split K
constexpr int64_t kNarrowMinSplitK = 2048;  // no split leaves a CTA less K than this
constexpr int64_t kNarrowMaxUnitK = 8192;   // nor more K than this
// 16-bit products of one row of tiles may stream up to this much K unsplit
// (K = 11008; the unsplit tile also keeps the TMA epilogue instead of the
// second pass), where that measured ahead of 2 splits: at most 64 rows, whose
// 64-row stages keep more of B in flight, on memory of 4 TB/s peak or more
// (H200: 3-6 % ahead for either layout of B, behind at 128 rows); on slower
// memory (H100, 3.35 TB/s) only with B N-major, to 128 rows (4-11 % ahead;
// a K-major B, linear's weight, read 4-9 % slower unsplit).
constexpr int64_t kNarrowMaxUnitKSmallA = 11008;
// Whether the 128 x 64 tile's CTAs may stream kNarrowMaxUnitKSmallA of K.
bool narrow_small_a(const GemmArgs& p) {
  if (p.dtype == DType::kF32) return false;
  const bool b_kmajor = p.sbk == 1;
  return fast_memory() ? p.M <= 64 : p.M <= kTileM && !b_kmajor;
}

// The K splits of the 128 x 64 tile under its rule; 0 where the rule does
// not take the tile.
int narrow_splits(const GemmArgs& p, int num_sms) {
  if (tf32_rs_wide(p, num_sms)) return 0;
  const int64_t tm = cdiv(p.M, kTileM), tn = cdiv(p.N, 64), tiles = tm * tn;
  if (tm * cdiv(p.N, 128) >= num_sms || tiles > num_sms) return 0;
  const int64_t max_unit_k = narrow_small_a(p) ? kNarrowMaxUnitKSmallA : kNarrowMaxUnitK;
  auto can_split = [&](int s) {
    return s <= kMaxSplits && tiles * s <= num_sms && p.K / s >= kNarrowMinSplitK;
  };
  int s = 1;
  while (can_split(s + 1) && (tn * s < kNarrowMinRowUnits || cdiv(p.K, s) > max_unit_k)) {
    ++s;
  }
  return cdiv(p.K, s) > max_unit_k ? 0 : s;
}

// Tiles (of the plan's width) per SM from which the default takes the offload
// epilogue (choose_plan).
constexpr int64_t kOffloadMinWaves = 3;

// C can be written by 64 x 64 TMA stores.
// float32 (TF32) outputs always take the register epilogues: the TMA
// epilogues stage 16-bit chunks.
bool tma_store_ok(const GemmArgs& p) {
  return p.dtype != DType::kF32 && detail::aligned16(p.c) && tma_operand_ok(p.N, p.ldc, 2);
}

Plan choose_plan(const GemmArgs& p, int num_sms, const WgmmaOptions& o) {
  Plan plan;
  plan.num_sms = num_sms;
  const int wave_bn = wave_tile_bn(p, num_sms);
  // TF32 with A M-major (a transposed product): the cooperative kernel only.
  const bool rs = tf32_rs(p);
  // Split K first: where the 128 x 128 tiles leave the SMs idle and the
  // model gains from a split, the cooperative 128 x 128 kernel with split K
  // (unless a schedule or tile is forced).
  if (o.splits == 0 && (o.sched != WgmmaSched::kPingpong || rs) && !tf32_rs_wide(p, num_sms) &&
      (o.tile == Tile::kAuto || o.tile == Tile::kSmall)) {
    const int s = auto_splits(p, num_sms, 128);
    if (s > 1) {
      plan.sched = Sched::kCoop;
      plan.bn = 128;
      plan.splits = s;
      plan.group = o.group == 0 ? kDefaultGroup : o.group;
      plan.raster_n = o.raster == Raster::kN;
      return plan;
    }
  }
  bool pingpong;
  if (rs) {
    pingpong = false;
  } else if (o.sched == WgmmaSched::kAuto) {
    // A forced tile width means the cooperative kernel of that width.
    pingpong = o.tile == Tile::kAuto &&
               wave_cost(p, num_sms, 128) * kTimePingpong <= wave_cost(p, num_sms, wave_bn);
  } else {
    pingpong = o.sched == WgmmaSched::kPingpong;
  }
  if (pingpong) {
    plan.sched = Sched::kPingpong;
    plan.bn = 128;
  } else {
    plan.sched = Sched::kCoop;
    switch (o.tile) {
      case Tile::kAuto:
        plan.bn = wave_bn;
        break;
      case Tile::kLarge:
        plan.bn = 256;
        break;
      case Tile::kMedium:  // 16-bit types; float32 (TF32) takes the 128 x 256 tile
        plan.bn = p.dtype == DType::kF32 ? 256 : 192;
        break;
      case Tile::kNarrow:
        plan.bn = 64;
        break;
      default:
        plan.bn = 128;
    }
  }
  // TMA stores need a 16-byte aligned C with a leading dimension of a
  // multiple of 8 elements; otherwise, and for ping-pong (whose epilogue is
  // hidden anyway), the epilogue stores from registers.
  plan.tma_store = plan.sched == Sched::kCoop && o.epi != WgmmaEpi::kDirect && tma_store_ok(p);
  // The offload epilogue (activation by warps 1-3 of the producer warpgroup,
  // under the next tile's MMAs) exists for the 128 x 256 and 128 x 128
  // tiles; elsewhere EPI=offload falls back as tma does (the TMA epilogue on
  // the 128 x 192 and 128 x 64 tiles, direct stores where C takes no TMA
  // stores or for ping-pong). auto takes it where there is activation math
  // to hide (gelu, gelu_tanh, silu) under later tiles: from kOffloadMinWaves
  // tiles per SM, where it measured at or above the TMA epilogue. With fewer,
  // a CTA's last tile's activation has nothing to hide under, and on the
  // 128 x 256 tile the TMA epilogue's fourth stage wins (docs/matmul.md). The
  // bare product (none / relu) keeps the TMA epilogue.
  const bool act_math = detail::act_has_math(p.act);
  const bool many_tiles = cdiv(p.M, kTileM) * cdiv(p.N, plan.bn) >= kOffloadMinWaves * num_sms;
  plan.epi_offload =
      plan.tma_store && (plan.bn == 256 || plan.bn == 128) &&
      (o.epi == WgmmaEpi::kOffload || (o.epi == WgmmaEpi::kAuto && act_math && many_tiles));
  const int narrow = plan.bn == 64 && o.splits == 0 ? narrow_splits(p, num_sms) : 0;
  if (o.splits > 0) {
    plan.splits = clamp_splits(p, o.splits);
  } else if (narrow > 0) {
    plan.splits = narrow;
  } else {
    plan.splits = auto_splits(p, num_sms, plan.bn);
  }
  if (plan.splits > 1) {
    // The units store float32 sums from registers; the epilogue is splitk_finish's.
    plan.tma_store = false;
    plan.epi_offload = false;
  } else if (o.splits == 0 && plan.sched == Sched::kCoop && plan.bn >= 128) {
    // A forced split count (1 included) keeps whole tiles per CTA.
    plan.sk_tiles = static_cast<int>(stream_k_tiles(p, num_sms, plan.bn));
  }
  plan.group = o.group == 0 ? kDefaultGroup : o.group;
  if (o.raster == Raster::kAuto) {
    // Bytes read from DRAM, if each group's panel stays in L2: rows-first
    // groups (group rows of A) stream all of B once per group, columns-first
    // groups (group columns of B) all of A once per group.
    const double a = static_cast<double>(p.M) * p.K, b = static_cast<double>(p.N) * p.K;
    plan.raster_n = b + a * cdiv(p.N, plan.group) < a + b * cdiv(p.M, plan.group);
  } else {
    plan.raster_n = o.raster == Raster::kN;
  }
  return plan;
}

// Stream-K fix-up workspace: one slot of a tile's float32 sums per CTA
// (kFixupSlotFloats of the kernel), then two int flags per CTA.
int64_t fixup_slot_floats(const Plan& plan) { return int64_t{kTileM} * plan.bn; }
int64_t fixup_flag_bytes(const Plan& plan) { return int64_t{2} * 4 * plan.num_sms; }
int64_t fixup_bytes(const Plan& plan) {
  return fixup_slot_floats(plan) * 4 * plan.num_sms + fixup_flag_bytes(plan);
}

}  // namespace

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

bool make_map(CUtensorMap* map, DType dtype, const void* ptr, int64_t inner, int64_t outer,
              int64_t ld, uint32_t box_inner, uint32_t box_outer) {
  auto fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * elem_bytes(dtype)};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  // float32 stays float32 in shared memory: the TF32 wgmma reads the words
  // and uses their TF32 bits.
  const CUtensorMapDataType dt = dtype == DType::kBF16  ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                 : dtype == DType::kF32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = fn(map, dt, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The plan's kernel for element type T on the kernel's problem kp
// (kernel_problem(p)), then (split K) the pass that adds the splits' sums,
// which lie in C's orientation either way.
template <typename T>
cudaError_t launch_typed(const GemmArgs& p, const GemmArgs& kp, const Plan& plan,
                         cudaStream_t stream) {
  const cudaError_t err = plan.sched == Sched::kPingpong
                              ? launch_sched<T, Sched::kPingpong>(kp, plan, stream)
                              : launch_sched<T, Sched::kCoop>(kp, plan, stream);
  if (err != cudaSuccess || plan.splits == 1) return err;
  return detail::launch_splitk_finish<T>(p, plan.partial, plan.splits, stream, /*early=*/true);
}

}  // namespace sm90

bool gemm_wgmma_supported(const GemmArgs& p) {
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16 && p.dtype != DType::kF32) return false;
  if (p.M <= 0 || p.N <= 0 || p.K <= 0 || p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    return false;
  if (!detail::aligned16(p.a) || !detail::aligned16(p.b)) return false;
  const int es = sm90::elem_bytes(p.dtype);
  const bool a_k = p.sak == 1 && sm90::tma_operand_ok(p.K, p.sam, es);
  const bool b_k = p.sbk == 1 && sm90::tma_operand_ok(p.K, p.sbn, es);
  // TF32: a K-major, b K-major or N-major (the transposed product).
  if (p.dtype == DType::kF32) {
    return a_k && (b_k || (p.sbn == 1 && sm90::tma_operand_ok(p.N, p.sbk, es)));
  }
  const bool a_ok = a_k || (p.sam == 1 && sm90::tma_operand_ok(p.M, p.sak, es));
  const bool b_ok = b_k || (p.sbn == 1 && sm90::tma_operand_ok(p.N, p.sbk, es));
  return a_ok && b_ok;
}

bool gemm_wgmma_compiled() {
  static detail::PerDeviceAnswer compiled;
  return compiled.get([](int) {
    // Every instantiation file is built with the same targets: probing one
    // kernel of each schedule is enough.
    cudaFuncAttributes attr{};
    for (int i = 0; i < 2; ++i) {
      const cudaError_t err =
          i == 0 ? sm90::kernel_attributes<__nv_bfloat16, sm90::Sched::kCoop>(&attr)
                 : sm90::kernel_attributes<__nv_bfloat16, sm90::Sched::kPingpong>(&attr);
      if (err != cudaSuccess) {  // a failed query says nothing of the build
        cudaGetLastError();
        return detail::PerDeviceAnswer::kUnknown;
      }
      // The real kernel has its mbarriers in static shared memory; the empty
      // body of a build without sm_90a has none.
      if (attr.binaryVersion < 90 || attr.sharedSizeBytes == 0) return detail::PerDeviceAnswer::kNo;
    }
    return detail::PerDeviceAnswer::kYes;
  });
}

bool gemm_wgmma_narrow_tile_wins(const GemmArgs& p, int num_sms) {
  return sm90::narrow_splits(sm90::kernel_problem(p), num_sms) > 0;
}

Tile gemm_wgmma_wave_tile(const GemmArgs& p, int num_sms) {
  const int bn = sm90::wave_tile_bn(sm90::kernel_problem(p), num_sms);
  return bn == 256 ? Tile::kLarge : bn == 192 ? Tile::kMedium : Tile::kSmall;
}

int gemm_wgmma_splits(const GemmArgs& p, int num_sms, const WgmmaOptions& opts) {
  return sm90::choose_plan(sm90::kernel_problem(p), num_sms, opts).splits;
}

int64_t gemm_wgmma_workspace_bytes(const GemmArgs& p, int num_sms, const WgmmaOptions& opts) {
  const sm90::Plan plan = sm90::choose_plan(sm90::kernel_problem(p), num_sms, opts);
  if (plan.splits > 1) return int64_t{plan.splits} * p.M * p.N * 4;
  return plan.sk_tiles > 0 ? sm90::fixup_bytes(plan) : 0;
}

cudaError_t launch_gemm_wgmma_sm90(const GemmArgs& p, int num_sms, const WgmmaOptions& opts,
                                   void* workspace, cudaStream_t stream) {
  if (!gemm_wgmma_supported(p) || num_sms <= 0) return cudaErrorInvalidValue;
  const GemmArgs kp = sm90::kernel_problem(p);
  sm90::Plan plan = sm90::choose_plan(kp, num_sms, opts);
  if (plan.splits > 1) {
    if (workspace == nullptr || (reinterpret_cast<uintptr_t>(workspace) & 7) != 0) {
      return cudaErrorInvalidValue;
    }
    plan.partial = static_cast<float*>(workspace);
  } else if (plan.sk_tiles > 0) {
    // 16-byte fix-up stores; the flags after the slots start at zero.
    if (workspace == nullptr || !detail::aligned16(workspace)) return cudaErrorInvalidValue;
    plan.fixup = static_cast<float*>(workspace);
    plan.fixup_flags = reinterpret_cast<int*>(plan.fixup + sm90::fixup_slot_floats(plan) * num_sms);
    const cudaError_t err =
        cudaMemsetAsync(plan.fixup_flags, 0, sm90::fixup_flag_bytes(plan), stream);
    if (err != cudaSuccess) return err;
  }
  switch (p.dtype) {
    case DType::kF32:
      return sm90::launch_typed<float>(p, kp, plan, stream);
    case DType::kBF16:
      return sm90::launch_typed<__nv_bfloat16>(p, kp, plan, stream);
    default:  // kF16: gemm_wgmma_supported admits no other type
      return sm90::launch_typed<__half>(p, kp, plan, stream);
  }
}

std::string describe_gemm_wgmma_sm90(const GemmArgs& p, int num_sms, const WgmmaOptions& opts) {
  const sm90::Plan plan = sm90::choose_plan(sm90::kernel_problem(p), num_sms, opts);
  std::string s = plan.sched == sm90::Sched::kPingpong
                      ? std::string("wgmma pingpong 128x128")
                      : "wgmma coop 128x" + std::to_string(plan.bn);
  if (p.dtype == DType::kF32) s += sm90::tf32_transposed(p) ? " tf32 transposed" : " tf32";
  if (plan.splits > 1) {
    s += " splitk " + std::to_string(plan.splits);
  } else if (plan.sched == sm90::Sched::kCoop) {
    s += !plan.tma_store ? " epi direct" : plan.epi_offload ? " epi offload" : " epi tma";
    if (plan.sk_tiles > 0) s += " streamk " + std::to_string(plan.sk_tiles);
  }
  s += plan.raster_n ? " raster n" : " raster m";
  if (plan.group != sm90::kDefaultGroup) s += " group " + std::to_string(plan.group);
  return s;
}

}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
