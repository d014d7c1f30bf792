// Fault injection into the emulated RC device (FASTCOMM_IB_EMULATE=1), so
// that tests can drive the ib transport's error paths without hardware. The
// product never sets a plan; torchext._testing.ib_emu_fail() does.
#pragma once

#include <cstdint>

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {

struct FaultPlan {
  enum Kind {
    None,
    QpError,  // the QP of the write enters the error state (IBV_EVENT_QP_FATAL)
    BadRkey,  // the write carries a corrupted rkey (the peer NAKs it)
  } kind = None;
  // The fault hits this process's (after + 1)-th data write (an RDMA write
  // with immediate and a payload) counted from setFaultPlan().
  int64_t after = 0;
};

// Process-wide: devices opened afterwards apply `plan`; restarts the count of
// data writes. FaultPlan{} turns injection off.
void setFaultPlan(const FaultPlan& plan);

}  // namespace emu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
