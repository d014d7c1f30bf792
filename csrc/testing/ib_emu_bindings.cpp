// torchext._testing.ib_emu_fail: fault injection into the emulated RC device
// (FASTCOMM_IB_EMULATE=1), for the tests of the ib transport's error paths.
#include <torch/python.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "inter/ib/emu_fault.hpp"
#include "testing/bindings.hpp"

namespace fastcomm {
namespace testing {
namespace {

using transport::ib::emu::FaultPlan;

FaultPlan parseFaultPlan(const std::string& spec) {
  FaultPlan f;
  if (spec.empty() || spec == "none") return f;
  const std::string expected =
      "ib_emu_fail('" + spec + "'): expected qp_error:after=N, bad_rkey:after=N or none";
  const auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  if (kind == "qp_error") {
    f.kind = FaultPlan::QpError;
  } else if (kind == "bad_rkey") {
    f.kind = FaultPlan::BadRkey;
  } else {
    throw std::invalid_argument(expected);
  }
  if (colon != std::string::npos) {
    const std::string rest = spec.substr(colon + 1);
    char* end = nullptr;
    if (rest.compare(0, 6, "after=") != 0) throw std::invalid_argument(expected);
    f.after = std::strtoll(rest.c_str() + 6, &end, 10);
    if (end == rest.c_str() + 6 || *end != '\0' || f.after < 0) {
      throw std::invalid_argument(expected);
    }
  }
  return f;
}

}  // namespace

void bindIbEmu(pybind11::module_& m) {
  m.def(
      "ib_emu_fail",
      [](const std::string& spec) { transport::ib::emu::setFaultPlan(parseFaultPlan(spec)); },
      pybind11::arg("spec"),
      "Injects a fault into the emulated RC devices this process opens from now on: "
      "'qp_error:after=N' moves the QP of the (N+1)-th data write to the error state "
      "(IBV_EVENT_QP_FATAL), 'bad_rkey:after=N' corrupts that write's rkey (the peer NAKs "
      "it); 'none' turns injection off. Call it before the transport or process group is "
      "created.");
}

}  // namespace testing
}  // namespace fastcomm
