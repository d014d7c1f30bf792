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
  while (true) {
    std::function<void()> job;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->jobs.empty()) break;
      job = std::move(state_->jobs.front());
      state_->jobs.pop_front();
    }
    job();
  }
  thread_.detach();
}

void SerialLane::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->jobs.push_back(std::move(job));
  }
  state_->cv.notify_one();
}

void SerialLane::loop(const std::shared_ptr<State>& state, const std::string& name) {
  nameThisThread(name);
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->stop || !state->jobs.empty(); });
      if (state->jobs.empty()) return;  // stopped and drained
      job = std::move(state->jobs.front());
      state->jobs.pop_front();
    }
    job();  // jobs catch their own exceptions
  }
}

}  // namespace fastcomm
