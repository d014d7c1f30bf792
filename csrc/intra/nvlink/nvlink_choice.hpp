// Which CUDA all_reduces, all_gathers and reduce_scatters of a group with
// working NVLink peer access run on the peer-memory kernels
// (kernels/nvlink_collectives.hpp) and which stay on NCCL: a function of
// dtype, op, size and group size alone, so every rank picks the same for the
// same call.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/reduce.hpp"

namespace fastcomm {

enum class NvlinkAlgo : int { None, OneShot, TwoShot };

// The bytes of each peer's slot in a registered buffer of a group of `world`
// ranks (two sets of world - 1 slots): what bounds each kernel's messages
// (nvlk::oneShotMaxBytes, nvlk::twoShotMaxBytes, all_gather and
// reduce_scatter parts of at most a slot).
int64_t nvlinkSlotBytes(int world);

// Up to oneShotBytes: one-shot (every rank sends its input to every peer,
// one barrier); up to twoShotBytes: two-shot (reduce-scatter and all-gather
// through peer memory, two barriers); above: NCCL. One-shot sends
// (world - 1) x the message per rank, so its range shrinks as the group grows.
// all_gather and reduce_scatter send each rank's part once to every peer
// (one barrier), as one-shot does: up to gatherBytes / scatterBytes per rank.
struct NvlinkLimits {
  int64_t oneShotBytes;
  int64_t twoShotBytes;
  int64_t gatherBytes;
  int64_t scatterBytes;
};
NvlinkLimits nvlinkLimits(int world);

// float32, float16 and bfloat16; SUM, AVG, MIN and MAX; 1 byte to the limits.
NvlinkAlgo chooseNvlinkAllreduce(at::ScalarType dtype, RedOp op, int64_t bytes, int world);

// all_gather of `partBytes` per rank (any dtype).
bool useNvlinkAllgather(int64_t partBytes, int world);
// reduce_scatter of `partBytes` per rank: the dtypes and ops of all_reduce.
bool useNvlinkReduceScatter(at::ScalarType dtype, RedOp op, int64_t partBytes, int world);

const char* nvlinkAlgoName(NvlinkAlgo algo);

}  // namespace fastcomm
