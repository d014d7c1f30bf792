// A collective's time budget and the context its errors must name.
#pragma once

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace fastcomm {

using Clock = std::chrono::steady_clock;

struct OpContext {
  const char* name = "";  // torch.distributed name, e.g. "all_reduce"
  uint64_t seq = 0;       // per-group sequence number of the collective
  std::chrono::milliseconds timeout{0};
  Clock::time_point deadline{};

  static OpContext start(const char* name, uint64_t seq, std::chrono::milliseconds timeout) {
    return OpContext{name, seq, timeout, Clock::now() + timeout};
  }
  bool expired() const { return Clock::now() >= deadline; }
  std::chrono::milliseconds remaining() const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return left.count() > 0 ? left : std::chrono::milliseconds(0);
  }
  std::string describe() const { return std::string(name) + " (seq " + std::to_string(seq) + ")"; }
};

std::string formatRanks(const std::vector<int>& ranks);

// Raised as torch.distributed.DistBackendError (a RuntimeError) in Python.
[[noreturn]] void throwCommError(const std::string& message);

// The message of `e` without the C++ backtrace c10 errors append (for
// errors that are passed on inside other messages).
std::string errorText(const std::exception& e);

}  // namespace fastcomm
