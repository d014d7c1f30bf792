// The Request both transports hand out: a view on an operation that the
// transport's progress thread completes. tcp's and ib's operations differ in
// what they track, but complete the same way, so one class tests both.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "inter/transport.hpp"

namespace fastcomm {
namespace transport {

enum class OpStatus : int { Pending = 0, Done = 1, Failed = 2 };

// `Op` has `std::atomic<OpStatus> status` and `std::string error`; the
// transport writes `error` before it stores Failed with release order, so
// the acquire load below makes the message visible. test() only loads, so it
// never blocks on the progress thread.
template <class Op>
class OpRequest : public Request {
 public:
  OpRequest(std::shared_ptr<Op> op, int peer) : op_(std::move(op)), peer_(peer) {}

  bool test() override {
    switch (op_->status.load(std::memory_order_acquire)) {
      case OpStatus::Done:
        return true;
      case OpStatus::Failed:
        throw TransportError(peer_, op_->error);
      default:
        return false;
    }
  }

 private:
  // Shared: the operation stays alive while either the caller holds the
  // request or the transport still works on it.
  std::shared_ptr<Op> op_;
  int peer_;
};

}  // namespace transport
}  // namespace fastcomm
