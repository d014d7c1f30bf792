// In CUDA builds, the NVLink kernels' size limits (intra/nvlink/
// nvlink_choice.hpp, and the low-latency one-shot's), so tests/test_nvlink_allreduce.py and
// tests/test_nvlink_gather_scatter.py check the switch-over wherever the
// limits are set.
#include <torch/python.h>

#include "testing/bindings.hpp"

#ifdef FASTCOMM_WITH_CUDA
#include "intra/nvlink/nvlink_choice.hpp"
#include "kernels/nvlink_collectives.hpp"
#endif

namespace fastcomm {
namespace testing {

void bindNvlink(pybind11::module_& m) {
#ifdef FASTCOMM_WITH_CUDA
  m.def(
      "nvlink_limits",
      [](int world) {
        const NvlinkLimits l = nvlinkLimits(world);
        return pybind11::make_tuple(l.oneShotBytes, l.twoShotBytes);
      },
      "(one_shot_bytes, two_shot_bytes): the largest CUDA all_reduce each NVLink kernel takes "
      "in a group of `world` GPUs");
  m.def(
      "nvlink_low_latency_bytes", [](int world) { return nvlk::lowLatencyMaxBytes(world); },
      "the largest one-shot all_reduce on the low-latency (flagged-line) kernel in a group of "
      "`world` GPUs");
  m.def(
      "nvlink_part_limits",
      [](int world) {
        const NvlinkLimits l = nvlinkLimits(world);
        return pybind11::make_tuple(l.gatherBytes, l.scatterBytes);
      },
      "(all_gather_bytes, reduce_scatter_bytes): the largest part per rank of a CUDA "
      "all_gather / reduce_scatter the NVLink kernels take in a group of `world` GPUs");
#else
  (void)m;
#endif
}

}  // namespace testing
}  // namespace fastcomm
