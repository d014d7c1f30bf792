// A thread that runs jobs one after another, in submission order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace fastcomm {

class SerialLane {
 public:
  explicit SerialLane(std::string name);
  ~SerialLane();  // runs the queued jobs, then joins
  SerialLane(const SerialLane&) = delete;
  SerialLane& operator=(const SerialLane&) = delete;

  void submit(std::function<void()> job);

 private:
  void loop();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fastcomm
