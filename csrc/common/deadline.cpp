#include "common/deadline.hpp"

namespace fastcomm {

std::string formatRanks(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s + "]";
}

void throwCommError(const std::string& message) { C10_THROW_ERROR(DistBackendError, message); }

std::string errorText(const std::exception& e) {
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}

}  // namespace fastcomm
