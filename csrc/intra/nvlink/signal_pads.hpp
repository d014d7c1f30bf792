// The signal pads of the NVLink all-reduce: per kernel block and peer, a
// counter slot in every rank's registered buffer (laid out by
// kernels/nvlink_collectives.hpp), written by the peers with system-scope
// release stores and read with acquire loads, never reset: call e writes
// e + 1. Beside them, in mapped pinned host memory, the control block
// through which the host makes waiting kernels give up (the group's abort)
// and a kernel whose wait outlasted the group's timeout reports the op and
// the peer it waited for.
#pragma once

#include <cstdint>
#include <optional>

#include "kernels/nvlink_collectives.hpp"

namespace fastcomm {

class SignalPads {
 public:
  struct Timeout {
    uint64_t seq;            // the op's sequence number in the group
    bool captured;           // the op was captured into a CUDA graph (seq is the capture's)
    const char* collective;  // "all_reduce", "all_gather" or "reduce_scatter"
    int peer;                // the group rank waited for
  };

  // Allocates the control block, zeroed. Throws std::runtime_error.
  SignalPads();
  ~SignalPads();
  SignalPads(const SignalPads&) = delete;
  SignalPads& operator=(const SignalPads&) = delete;

  // The control block's device address (kernel argument).
  nvlk::HostCtl* deviceCtl() const { return device_; }
  // The first wait that timed out, if a kernel reported one.
  std::optional<Timeout> timedOut() const;
  // Waiting kernels give up from now on, without a report.
  void abort();

  // Bytes of a registered buffer of `world` ranks with slots of `slotBytes`.
  // The pads and the call counter in it must start zeroed.
  static int64_t bufferBytes(int world, int64_t slotBytes) {
    return nvlk::bufferBytes(world, slotBytes);
  }

 private:
  nvlk::HostCtl* host_ = nullptr;
  nvlk::HostCtl* device_ = nullptr;
};

}  // namespace fastcomm
