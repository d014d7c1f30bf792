#include "common/lane.hpp"

#include "common/thread_name.hpp"

namespace fastcomm {

SerialLane::SerialLane(std::string name) : state_(std::make_shared<State>()) {
  thread_ = std::thread([state = state_, name = std::move(name)] { loop(state, name); });
}

SerialLane::~SerialLane() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
    return;
  }
  // On the lane itself: the jobs still queued run now, in order, while their
  // owner is still alive (it is destroying this lane).
  while (auto job = next(*state_, /*wait=*/false)) job();
  thread_.detach();
}

void SerialLane::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->jobs.push_back(std::move(job));
  }
  state_->cv.notify_one();
}

std::function<void()> SerialLane::next(State& state, bool wait) {
  std::unique_lock<std::mutex> lock(state.mu);
  if (wait) state.cv.wait(lock, [&] { return state.stop || !state.jobs.empty(); });
  if (state.jobs.empty()) return {};
  std::function<void()> job = std::move(state.jobs.front());
  state.jobs.pop_front();
  return job;
}

void SerialLane::loop(const std::shared_ptr<State>& state, const std::string& name) {
  nameThisThread(name);
  // Ends once stopped and drained; jobs catch their own exceptions.
  while (auto job = next(*state, /*wait=*/true)) job();
}

}  // namespace fastcomm
