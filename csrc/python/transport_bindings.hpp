// Test-only Python access to the inter-node transport (torchext._C._TransportEndpoint).
#pragma once

#include <pybind11/pybind11.h>

namespace fastcomm {

void bindTransport(pybind11::module_& m);

}  // namespace fastcomm
