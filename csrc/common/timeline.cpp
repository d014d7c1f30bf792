#include "common/timeline.hpp"

#include <atomic>
#include <mutex>

namespace fastcomm {
namespace {

// Bounded, so a forgotten FASTCOMM_TIMELINE=1 cannot grow without limit.
constexpr size_t kMaxEvents = 1 << 18;

std::atomic<bool> gEnabled{false};
std::mutex gMu;
std::vector<TimelineEvent> gEvents;
const auto gOrigin = std::chrono::steady_clock::now();

int64_t sinceOrigin(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t - gOrigin).count();
}

}  // namespace

bool Timeline::enabled() { return gEnabled.load(std::memory_order_relaxed); }

void Timeline::setEnabled(bool on) { gEnabled.store(on); }

void Timeline::record(const char* name, const char* thread, int64_t chunk,
                      std::chrono::steady_clock::time_point start,
                      std::chrono::steady_clock::time_point end) {
  std::lock_guard<std::mutex> lock(gMu);
  if (gEvents.size() >= kMaxEvents) return;
  gEvents.push_back({name, thread, chunk, sinceOrigin(start), sinceOrigin(end)});
}

std::vector<TimelineEvent> Timeline::drain() {
  std::lock_guard<std::mutex> lock(gMu);
  std::vector<TimelineEvent> out;
  out.swap(gEvents);
  return out;
}

}  // namespace fastcomm
