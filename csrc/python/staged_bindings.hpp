// Test-only bindings of the staged rail phase on an emulated device.
#pragma once

#include <pybind11/pybind11.h>

namespace fastcomm {

void bindStagedRail(pybind11::module_& m);

}  // namespace fastcomm
