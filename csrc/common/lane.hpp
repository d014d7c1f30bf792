// A thread that runs jobs one after another, in submission order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace fastcomm {

class SerialLane {
 public:
  explicit SerialLane(std::string name);
  // Runs the queued jobs, then joins. On the lane's own thread (a job whose
  // completion callback drops the last reference to the lane's owner), the
  // queued jobs run right here and the thread is detached: it ends once the
  // job it is in returns, with the queue it shares with the lane (State)
  // outliving the lane.
  ~SerialLane();
  SerialLane(const SerialLane&) = delete;
  SerialLane& operator=(const SerialLane&) = delete;

  void submit(std::function<void()> job);

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
  };
  // The next queued job, or an empty one when there is none; with `wait`,
  // first waits until a job is queued or the lane is stopped.
  static std::function<void()> next(State& state, bool wait);
  static void loop(const std::shared_ptr<State>& state, const std::string& name);

  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace fastcomm
