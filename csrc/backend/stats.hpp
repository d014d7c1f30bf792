// Per-collective counters of one process group: calls, bytes, time.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace fastcomm {

struct OpStats {
  uint64_t count = 0;
  uint64_t bytes = 0;   // local input bytes per call, summed
  double timeUs = 0.0;  // time spent running (host time or GPU event time)
};

class Stats {
 public:
  void addCall(const std::string& op, uint64_t bytes);
  void addTime(const std::string& op, double micros);
  std::map<std::string, OpStats> snapshot() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::map<std::string, OpStats> ops_;
};

}  // namespace fastcomm
