#include "common/lane.hpp"

#include "common/thread_name.hpp"

namespace fastcomm {

SerialLane::SerialLane(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { loop(); });
}

SerialLane::~SerialLane() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void SerialLane::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void SerialLane::loop() {
  nameThisThread(name_);
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();  // jobs catch their own exceptions
  }
}

}  // namespace fastcomm
