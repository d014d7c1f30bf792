// What the device paths of one process group share: who the group is, its
// settings and counters, whether it failed, and the coalescing block it has
// open.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/flight_recorder.hpp"
#include "backend/stats.hpp"
#include "common/config.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// torch's startCoalescing / endCoalescing: the works of the ops issued in the
// block, the point-to-point jobs that run only at its end (so that an invalid
// op in the block leaves nothing half sent), and the first validation error
// of an op in it.
class CoalescingBlock {
 public:
  struct Closed {
    std::vector<WorkPtr> works;
    std::vector<std::function<void()>> issues;
    std::exception_ptr error;
  };

  // torch leaves a block open when an op inside it raised; opening starts afresh.
  void open();
  Closed close();  // raises when no block is open
  bool isOpen();

  // Adds `work` to the open block, if any.
  WorkPtr remember(WorkPtr work);
  // Inside a block: keeps `work` and runs `issue` at the block's end;
  // otherwise runs `issue` now.
  void issueOrDefer(const WorkPtr& work, std::function<void()> issue);
  // Inside a block an error raised by `op` is kept for close() and a failed
  // work returned: torch leaves its own coalescing state broken when an op
  // inside the block raises.
  WorkPtr deferError(int rank, const std::function<WorkPtr()>& op);

 private:
  std::mutex mu_;
  bool open_ = false;
  Closed block_;
};

struct GroupState {
  c10::intrusive_ptr<c10d::Store> store;  // under the group's own prefix
  int rank = 0;
  int size = 0;
  std::chrono::milliseconds timeout{0};
  Config cfg;
  Topology topo;
  Stats stats;
  std::atomic<uint64_t> seq{0};     // collectives
  std::atomic<uint64_t> p2pSeq{0};  // point-to-point ops
  CoalescingBlock block;
  std::shared_ptr<TraceRing> trace;  // the flight recorder; null when off

  // Raises once the group failed (an op's error, abort()).
  void checkUsable() const;
  // Returns whether this is the group's first failure.
  bool markBroken(std::exception_ptr error);

 private:
  mutable std::mutex brokenMu_;
  std::exception_ptr broken_;
};

}  // namespace fastcomm
