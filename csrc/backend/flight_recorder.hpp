// The flight recorder: per process group, a bounded ring of its last
// collectives and point-to-point ops (FASTCOMM_TRACE_BUFFER_SIZE entries),
// each with its sequence number, op, tensor sizes and dtypes, reduce op,
// root or peer, timeout and state (scheduled, started, completed) with
// timestamps; optionally the caller's Python stack.
//
// A dump holds the rings of every live group of the process, written to
// <FASTCOMM_TRACE_FILE><global rank> in the pickle format of PyTorch's flight
// recorder (FlightRecorder.hpp, version 2.10), so the same tools read it
// (python -m torchext.trace_analysis; torch's fr_trace from torch 2.15, which
// accepts other communication libraries than its own). A rank dumps
// - when a collective of one of its groups times out or fails, before the
//   error reaches the caller; it then asks every rank, through the root of
//   the group's store, to dump too (FASTCOMM_TRACE_DUMP_ON_TIMEOUT);
// - on FASTCOMM_TRACE_SIGNAL (the handler only sets a flag);
// - on demand (torchext.dump_trace).
// A watcher thread, running while some group records, does the dumps asked
// for by a signal or a peer.
//
// Cost: one pointer test per op when off; when on, a mutex and a timestamp at
// each of three state changes, the sizes copied into a slot whose buffers are
// reused (no allocation once the ring has wrapped).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/config.hpp"

namespace torch {
struct CapturedTraceback;
}

namespace fastcomm {

// What the recorder keeps of one op besides its tensors.
struct TraceOp {
  const char* name;  // as torch.distributed spells it, e.g. "all_reduce" (a literal)
  bool p2p = false;
  uint64_t seq = 0;  // the group's collective or point-to-point sequence number
  int redop = -1;    // RedOp, -1: none
  int root = -1;     // group rank, -1: none
  int peer = -1;     // group rank of a send's destination or a recv's source; -1: any
};

// Who a group is, as a dump names it.
struct TraceGroup {
  std::string name;  // torch's group name
  // The backend's group description: torch sets it after creation, so each
  // op copies it until it is set.
  const std::string* desc;
  std::vector<uint64_t> ranks;            // global ranks, in group-rank order
  int rank;                               // this process's group rank
  c10::intrusive_ptr<c10d::Store> store;  // the group's store; its root carries dump requests
};

class TraceRing {
 public:
  // A ring of cfg.traceBufferSize entries, registered for dumps until
  // unregister() (the group's shutdown).
  static std::shared_ptr<TraceRing> create(const Config& cfg, TraceGroup group);
  ~TraceRing();
  void unregister();

  // Records `op` as scheduled now; returns its id for the calls below.
  uint64_t record(const TraceOp& op, const std::vector<at::Tensor>& inputs,
                  const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout);
  void started(uint64_t id);
  void completed(uint64_t id);  // implies started
  // The op failed: it stays in its state and is marked retired, as torch's
  // recorder marks an op that timed out.
  void retire(uint64_t id);
  // The group failed with `why` (a timeout, a peer's failure): dump now and
  // ask the other ranks to dump (FASTCOMM_TRACE_DUMP_ON_TIMEOUT).
  void groupFailed(const std::string& why);

  struct Entry;
  struct Snapshot;
  class Registry;
  // A copy of the group's identity, status and entries (oldest first).
  Snapshot snapshot();
  const Config& config() const { return cfg_; }

 private:
  TraceRing(const Config& cfg, TraceGroup group);
  Entry& slot(uint64_t id);      // of a recorded op (under mu_)
  Entry& nextSlot(uint64_t id);  // for op `id`, lastId_ + 1 (under mu_)

  const size_t capacity_;
  const bool pythonStack_;
  const uint64_t pgId_;
  TraceGroup group_;
  c10::intrusive_ptr<c10d::Store> rootStore_;
  const Config cfg_;

  std::mutex mu_;
  std::vector<Entry> entries_;
  uint64_t lastId_ = 0;
  uint64_t opCount_ = 0;
  uint64_t lastColl_ = 0, lastP2P_ = 0;
  int64_t lastEnqueued_ = -1, lastStarted_ = -1, lastCompleted_ = -1;
  std::string desc_;

  friend class Registry;
};

// Writes this process's dump to `path` ("": <FASTCOMM_TRACE_FILE><global
// rank>); returns the path written, or "" when no live group records.
// Raises when the file cannot be written.
std::string dumpTrace(const std::string& path, const std::string& reason);

}  // namespace fastcomm
