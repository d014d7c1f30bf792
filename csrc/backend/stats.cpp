#include "backend/stats.hpp"

namespace fastcomm {

void Stats::addCall(const std::string& op, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& s = ops_[op];
  s.count += 1;
  s.bytes += bytes;
}

void Stats::addTime(const std::string& op, double micros) {
  std::lock_guard<std::mutex> lock(mu_);
  ops_[op].timeUs += micros;
}

std::map<std::string, OpStats> Stats::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_;
}

void Stats::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  ops_.clear();
}

}  // namespace fastcomm
