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
  // 2 GPUs: measured (benchmarks/bench_nvlink.py; one-shot is faster up
  // to 2 MiB, two-shot above, both faster than NCCL through 16 MiB). More
  // GPUs: one-shot sends world - 1 copies of the message, two-shot about two,
  // so one-shot's range shrinks. all_gather and reduce_scatter take
  // one-shot's limit per rank, where they measured twice NCCL's speed on 2
  // and 4 GPUs; past it, and every limit beyond 4 GPUs, is not measured.
  NvlinkLimits l{int64_t{2} << 20, int64_t{16} << 20, int64_t{2} << 20};
  if (world > 2) l = {int64_t{256} << 10, int64_t{4} << 20, int64_t{256} << 10};
  if (world > 4) l = {int64_t{128} << 10, int64_t{2} << 20, int64_t{128} << 10};
  l.twoShotBytes = std::min(l.twoShotBytes, nvlinkSlotBytes(world));
  l.oneShotBytes = std::min(l.oneShotBytes, l.twoShotBytes);
  l.partBytes = std::min(l.partBytes, nvlinkSlotBytes(world));
  return l;
}

namespace {

bool reducible(at::ScalarType dtype, RedOp op) {
  return (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) &&
         (op == RedOp::Sum || op == RedOp::Avg || op == RedOp::Min || op == RedOp::Max);
}

bool groupFits(int world, int64_t bytes) { return world >= 2 && world <= 8 && bytes > 0; }

}  // namespace

NvlinkAlgo chooseNvlinkAllreduce(at::ScalarType dtype, RedOp op, int64_t bytes, int world) {
  if (!groupFits(world, bytes) || !reducible(dtype, op)) return NvlinkAlgo::None;
  const NvlinkLimits l = nvlinkLimits(world);
  if (bytes <= l.oneShotBytes) return NvlinkAlgo::OneShot;
  if (bytes <= l.twoShotBytes) return NvlinkAlgo::TwoShot;
  return NvlinkAlgo::None;
}

bool useNvlinkAllgather(int64_t partBytes, int world) {
  return groupFits(world, partBytes) && partBytes <= nvlinkLimits(world).partBytes;
}

bool useNvlinkReduceScatter(at::ScalarType dtype, RedOp op, int64_t partBytes, int world) {
  return useNvlinkAllgather(partBytes, world) && reducible(dtype, op);
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
