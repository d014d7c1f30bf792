// torchext._testing (see testing/bindings.hpp).
#include <torch/python.h>

#include "testing/bindings.hpp"

PYBIND11_MODULE(_testing, m) {
  m.doc() = "fastcomm: bindings for tests and benchmarks (not installed by pip install .)";
  // The library this module links against: loaded and its types registered first.
  pybind11::module_::import("torchext._C");
  fastcomm::testing::bindTransport(m);
  fastcomm::testing::bindStagedRail(m);
  fastcomm::testing::bindStagedKernels(m);
  fastcomm::testing::bindConfig(m);
  fastcomm::testing::bindMatmul(m);
  fastcomm::testing::bindIbEmu(m);
  fastcomm::testing::bindTrace(m);
  fastcomm::testing::bindNvlink(m);
}
