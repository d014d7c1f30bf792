#include "intra/nvlink/nvlink_choice.hpp"

#include <algorithm>

namespace fastcomm {

int64_t nvlinkSlotBytes(int world) {
  // Registered memory per rank stays near 32 MiB as the group grows.
  if (world <= 2) return int64_t{16} << 20;
  if (world <= 4) return int64_t{4} << 20;
  return int64_t{2} << 20;
}

NvlinkLimits nvlinkLimits(int world) {
  // 2 GPUs: measured (benchmarks/bench_nvlink_ar.py; one-shot is faster up
  // to 2 MiB, two-shot above, both faster than NCCL through 16 MiB). More
  // GPUs: one-shot sends world - 1 copies of the message, two-shot about two,
  // so one-shot's range shrinks; these limits are not measured yet.
  NvlinkLimits l{int64_t{2} << 20, int64_t{16} << 20};
  if (world > 2) l = {int64_t{256} << 10, int64_t{4} << 20};
  if (world > 4) l = {int64_t{128} << 10, int64_t{2} << 20};
  l.twoShotBytes = std::min(l.twoShotBytes, nvlinkSlotBytes(world));
  l.oneShotBytes = std::min(l.oneShotBytes, l.twoShotBytes);
  return l;
}

NvlinkAlgo chooseNvlinkAllreduce(at::ScalarType dtype, RedOp op, int64_t bytes, int world) {
  if (world < 2 || world > 8 || bytes <= 0) return NvlinkAlgo::None;
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) return NvlinkAlgo::None;
  if (op != RedOp::Sum && op != RedOp::Avg && op != RedOp::Min && op != RedOp::Max)
    return NvlinkAlgo::None;
  const NvlinkLimits l = nvlinkLimits(world);
  if (bytes <= l.oneShotBytes) return NvlinkAlgo::OneShot;
  if (bytes <= l.twoShotBytes) return NvlinkAlgo::TwoShot;
  return NvlinkAlgo::None;
}

const char* nvlinkAlgoName(NvlinkAlgo algo) {
  switch (algo) {
    case NvlinkAlgo::OneShot:
      return "one-shot";
    case NvlinkAlgo::TwoShot:
      return "two-shot";
    case NvlinkAlgo::None:
      break;
  }
  return "none";
}

}  // namespace fastcomm
