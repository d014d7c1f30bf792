// An opt-in record of pipeline phases (FASTCOMM_TIMELINE=1): which thread ran
// which phase of which chunk, and when. It shows whether copies, network and
// reductions overlap; torchext.save_timeline() writes it as a Chrome trace.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace fastcomm {

struct TimelineEvent {
  std::string name;    // e.g. "inter all_reduce"
  std::string thread;  // e.g. "fc-host", "fc-inter"
  int64_t chunk;
  int64_t startUs;  // since the process's first event
  int64_t endUs;
};

class Timeline {
 public:
  static bool enabled();
  static void setEnabled(bool on);
  static void record(const char* name, const char* thread, int64_t chunk,
                     std::chrono::steady_clock::time_point start,
                     std::chrono::steady_clock::time_point end);
  static std::vector<TimelineEvent> drain();  // returns and clears
};

// Records its scope as one event when the timeline is on.
class TimelineScope {
 public:
  TimelineScope(const char* name, const char* thread, int64_t chunk)
      : name_(name), thread_(thread), chunk_(chunk), on_(Timeline::enabled()) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~TimelineScope() {
    if (on_) Timeline::record(name_, thread_, chunk_, start_, std::chrono::steady_clock::now());
  }
  TimelineScope(const TimelineScope&) = delete;
  TimelineScope& operator=(const TimelineScope&) = delete;

 private:
  const char* name_;
  const char* thread_;
  int64_t chunk_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace fastcomm
