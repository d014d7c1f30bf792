#include "intra/nvlink/nvlink_choice.hpp"

#include <algorithm>

namespace fastcomm {

NvlinkLimits nvlinkLimits(int world) {
  // Starting points for 2 GPUs (the range where symm_mem's one-shot and
  // two-shot beat NCCL on H100), scaled down for more readers per byte.
  NvlinkLimits l{int64_t{256} << 10, int64_t{4} << 20};
  if (world > 2) l = {int64_t{128} << 10, int64_t{2} << 20};
  if (world > 4) l = {int64_t{64} << 10, int64_t{1} << 20};
  l.twoShotBytes = std::min(l.twoShotBytes, kNvlinkHalfBytes);
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
