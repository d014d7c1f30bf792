// torchext._testing: bindings that only the test suite and the benchmarks use.
// A separate extension, linked against torchext._C (so both share one copy of
// fastcomm's state), built only with FASTCOMM_BUILD_TESTING=1; users who
// `pip install .` never get it.
#pragma once

#include <pybind11/pybind11.h>

namespace fastcomm {
namespace testing {

// _TransportEndpoint: a transport connected to every other rank, below the
// process group (tests/test_transport.py, tests/test_ib.py).
void bindTransport(pybind11::module_& m);
// The staged rail phase on an emulated device (tests/test_staged_rail.py).
void bindStagedRail(pybind11::module_& m);
// The staged rail's chunk/piece layout and, in CUDA builds, its kernels alone.
void bindStagedKernels(pybind11::module_& m);
// The settings table of common/config.hpp.
void bindConfig(pybind11::module_& m);
// set_matmul_config / reset_matmul_config: the matmul kernel choices (tests/test_ops.py).
void bindMatmul(pybind11::module_& m);
// ib_emu_fail: fault injection into the emulated RC device (tests/test_ib.py).
void bindIbEmu(pybind11::module_& m);
// trace_cost: the flight recorder's cost per op (benchmarks/bench_trace.py).
void bindTrace(pybind11::module_& m);
void bindNvlink(pybind11::module_& m);

}  // namespace testing
}  // namespace fastcomm
