#include "intra/nvlink/nvlink_choice.hpp"

#include <algorithm>

#include "kernels/nvlink_collectives.hpp"

namespace fastcomm {

int64_t nvlinkSlotBytes(int world) {
  // Registered memory per rank: 32 MiB on 2 GPUs, 32-48 MiB on 3-4 (two-shot
  // to 12-16 MiB), 28 MiB on 8.
  if (world <= 2) return int64_t{16} << 20;
  if (world <= 4) return int64_t{8} << 20;
  return int64_t{2} << 20;
}

NvlinkLimits nvlinkLimits(int world) {
  // Measured with benchmarks/bench_nvlink.py on 2 and 4 GPUs. all_reduce:
  // one-shot sends world - 1 copies of the message, two-shot about two, so
  // one-shot's range shrinks as the group grows; two-shot runs as far as the
  // slots hold (it beats NCCL and symm_mem's two-shot there). all_gather and
  // reduce_scatter beat NCCL up to the slot on 2 GPUs; on 4 the reduce_scatter
  // loses from 4 MiB per rank. Beyond 4 GPUs: not measured.
  const int64_t KiB = 1024, MiB = 1024 * KiB;
  NvlinkLimits l{2 * MiB, 16 * MiB, 16 * MiB, 16 * MiB};
  if (world > 2) l = {256 * KiB, 16 * MiB, 4 * MiB, 2 * MiB};
  if (world > 4) l = {128 * KiB, 2 * MiB, 128 * KiB, 128 * KiB};
  const int64_t slot = nvlinkSlotBytes(world);
  l.twoShotBytes = std::min(l.twoShotBytes, nvlk::twoShotMaxBytes(world, slot));
  l.oneShotBytes = std::min({l.oneShotBytes, l.twoShotBytes, nvlk::oneShotMaxBytes(slot)});
  l.gatherBytes = std::min(l.gatherBytes, slot);
  l.scatterBytes = std::min(l.scatterBytes, slot);
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
  return groupFits(world, partBytes) && partBytes <= nvlinkLimits(world).gatherBytes;
}

bool useNvlinkReduceScatter(at::ScalarType dtype, RedOp op, int64_t partBytes, int world) {
  return groupFits(world, partBytes) && partBytes <= nvlinkLimits(world).scatterBytes &&
         reducible(dtype, op);
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
