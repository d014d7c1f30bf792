#include "backend/group_state.hpp"

#include <c10/util/Exception.h>

#include <string>

#include "backend/work.hpp"
#include "common/deadline.hpp"

namespace fastcomm {

void CoalescingBlock::open() {
  std::lock_guard<std::mutex> lock(mu_);
  open_ = true;
  block_ = Closed{};
}

CoalescingBlock::Closed CoalescingBlock::close() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(open_, "fastcomm: endCoalescing without startCoalescing");
  open_ = false;
  Closed out;
  std::swap(out, block_);
  return out;
}

bool CoalescingBlock::isOpen() {
  std::lock_guard<std::mutex> lock(mu_);
  return open_;
}

WorkPtr CoalescingBlock::remember(WorkPtr work) {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_) block_.works.push_back(work);
  return work;
}

void CoalescingBlock::issueOrDefer(const WorkPtr& work, std::function<void()> issue) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (open_) {
      block_.works.push_back(work);
      block_.issues.push_back(std::move(issue));
      return;
    }
  }
  issue();
}

WorkPtr CoalescingBlock::deferError(int rank, const std::function<WorkPtr()>& op) {
  if (!isOpen()) return op();
  try {
    return op();
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!block_.error) block_.error = std::current_exception();
    auto work = c10::make_intrusive<HostWork>(rank, c10d::OpType::UNKNOWN, nullptr, 0,
                                              std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
    work->fail(block_.error);
    return work;
  }
}

void GroupState::checkUsable() const {
  std::lock_guard<std::mutex> lock(brokenMu_);
  if (broken_) {
    try {
      std::rethrow_exception(broken_);
    } catch (const std::exception& e) {
      throwCommError(std::string("fastcomm: this process group failed earlier and cannot be "
                                 "used any more (destroy and recreate it): ") +
                     e.what());
    }
  }
}

bool GroupState::markBroken(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(brokenMu_);
  if (broken_) return false;
  broken_ = std::move(error);
  return true;
}

}  // namespace fastcomm
