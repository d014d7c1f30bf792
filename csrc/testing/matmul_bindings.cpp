// The matmul kernel choices for tests and benchmarks: the FASTCOMM_MATMUL_*
// environment is read once per process (ops/matmul_config.hpp), so switching
// kernels inside one process goes through this override.
#include <pybind11/stl.h>
#include <torch/python.h>

#include <map>
#include <stdexcept>
#include <string>

#include "ops/matmul_config.hpp"
#include "testing/bindings.hpp"

namespace py = pybind11;

namespace fastcomm {
namespace testing {

void bindMatmul(py::module_& m) {
  m.def(
      "set_matmul_config",
      [](const py::kwargs& settings) {
        MatmulConfig c;
        for (const auto& [key, value] : settings) {
          try {
            c.set(py::str(key), py::str(value));
          } catch (const std::invalid_argument& e) {
            throw py::value_error(e.what());
          }
        }
        ops::setMatmulConfigOverride(c);
      },
      "Replaces the FASTCOMM_MATMUL_* settings of this process until reset_matmul_config(): "
      "keywords impl, tile, sched, epi, raster, group, splits (values as the variables take them); "
      "the ones not given are auto. Raises ValueError naming the variable of a bad value.");
  m.def(
      "reset_matmul_config", [] { ops::setMatmulConfigOverride(std::nullopt); },
      "Back to the FASTCOMM_MATMUL_* environment settings.");
  m.def(
      "matmul_config",
      [] {
        const MatmulConfig c = ops::matmulConfig();
        return std::map<std::string, std::string>{{"impl", c.impl},
                                                  {"tile", c.tile},
                                                  {"sched", c.sched},
                                                  {"epi", c.epi},
                                                  {"raster", c.raster},
                                                  {"group", std::to_string(c.group)},
                                                  {"splits", std::to_string(c.splits)}};
      },
      "The matmul settings in force: the override, else the environment's.");
}

}  // namespace testing
}  // namespace fastcomm
