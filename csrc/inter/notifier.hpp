// Wakes Transport::waitForProgress() whenever a request of the transport
// finishes; shared by the transport implementations.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "common/deadline.hpp"

namespace fastcomm {
namespace transport {

// Wakes waitForProgress() whenever a request finishes. Shared with the peers,
// which may outlive the transport (a Connection kept after close()).
class Notifier {
 public:
  void notify() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.store(epoch_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  // Returns when a request finished after the calling thread's previous wait
  // returned (so a completion between the caller's test() and this call is not
  // missed), or after `max`.
  void wait(std::chrono::microseconds max, int64_t spinMicros) {
    const auto tid = std::this_thread::get_id();
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = lastSeen_[tid];
    }
    if (epoch_.load(std::memory_order_acquire) == seen && spinMicros > 0) {
      // A short spin saves the sleep/wake latency where cores are plenty.
      auto until = Clock::now() + std::chrono::microseconds(std::min<int64_t>(
                                      spinMicros, std::max<int64_t>(0, max.count())));
      while (epoch_.load(std::memory_order_acquire) == seen && Clock::now() < until) {
        std::this_thread::yield();
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, max, [&] { return epoch_.load(std::memory_order_relaxed) != seen; });
    lastSeen_[tid] = epoch_.load(std::memory_order_relaxed);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::unordered_map<std::thread::id, uint64_t> lastSeen_;
};

}  // namespace transport
}  // namespace fastcomm
