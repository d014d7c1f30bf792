// CUDA tensors: collectives on an NCCL communicator over the group's ranks,
// with ProcessGroupNCCL's stream semantics:
// - each collective runs on an internal stream that first waits for the
//   caller's current stream (a synchronous call, async_op=False, runs on the
//   current stream itself);
// - the work records an end event; wait() makes the caller's current stream
//   wait for it without blocking the host (FASTCOMM_BLOCKING_WAIT=1 blocks);
// - getFuture() is a CUDA-aware future completed under the internal stream;
// - tensors stay alive (recordStream) until the collective finished.
// On one node whose GPUs all reach each other over NVLink, small and medium
// float all_reduces and reduce_scatters and all_gathers of flat tensors run on
// fastcomm's own kernels over peer memory (intra/nvlink/) with the same
// stream semantics, works and watchdog.
// A watchdog thread turns a collective that exceeds the group timeout into an
// error naming the ranks that stopped making progress, and aborts the
// communicator so no kernel spins forever. While the current stream is being
// captured into a CUDA graph nothing here synchronises, queries events or
// enqueues for the watchdog: the work of a captured collective only orders
// streams in wait() (FASTCOMM_BLOCKING_WAIT does not apply to it) and has no
// completion state to query; the watchdog thread uses thread-local capture
// mode, so its queries of eager works do not break another thread's capture.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <vector>

#include "backend/flight_recorder.hpp"
#include "backend/stats.hpp"
#include "common/config.hpp"
#include "common/reduce.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

struct CudaOpInfo {
  const char* name;   // e.g. "all_reduce" (stats, errors)
  const char* title;  // e.g. "fastcomm:all_reduce" (profiler)
  c10d::OpType type;
  uint64_t seq;
  std::chrono::milliseconds timeout;
  int64_t bytes;
  // async_op=False: issue on the caller's current stream instead of the
  // internal one (no event hand-off, no recordStream), as ProcessGroupNCCL.
  bool onCurrentStream = false;
  // The op's flight recorder entry (0: none): completed when its end event is
  // seen (watchdog, isCompleted, a blocking wait), started when its start
  // event is (FASTCOMM_CUDA_TIMING only).
  uint64_t trace = 0;
};

class CudaCollectives {
 public:
  // Whether `device`'s current stream is capturing a CUDA graph (a query that
  // is legal during a capture).
  static bool currentStreamCapturing(at::Device device);
  // `topo` tells the nodes apart: across several, large all_reduces take the
  // staged multi-node pipeline (plans/cuda/cuda_hier.hpp). `trace`: the
  // group's flight recorder (null when off), which outlives this object.
  CudaCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout, const Config& cfg, Stats& stats,
                  at::Device device, const Topology& topo, TraceRing* trace);
  ~CudaCollectives();

  at::Device device() const;
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;

  WorkPtr allreduce(Tensors tensors, RedOp op, const CudaOpInfo& info);
  WorkPtr broadcast(at::Tensor tensor, int root, const CudaOpInfo& info);
  WorkPtr reduce(at::Tensor tensor, RedOp op, int root, const CudaOpInfo& info);
  // `outputs` holds one flat tensor of size * input.numel() or one per rank.
  WorkPtr allgather(Tensors outputs, at::Tensor input, const CudaOpInfo& info);
  WorkPtr gather(Tensors outputs, at::Tensor input, int root, const CudaOpInfo& info);
  WorkPtr scatter(at::Tensor output, Tensors inputs, int root, const CudaOpInfo& info);
  // `inputs` holds one flat tensor of size * output.numel() or one per rank.
  WorkPtr reduceScatter(at::Tensor output, Tensors inputs, RedOp op, const CudaOpInfo& info);
  // Counts and offsets in elements of the flat tensors.
  WorkPtr alltoall(Tensors outputs, Tensors inputs, std::vector<int64_t> sendCounts,
                   std::vector<int64_t> recvCounts, const CudaOpInfo& info);
  WorkPtr send(at::Tensor tensor, int peer, const CudaOpInfo& info);
  WorkPtr recv(at::Tensor tensor, int peer, const CudaOpInfo& info);

  // Collectives between start and end are issued as one NCCL group; the
  // group's work, or null when none was issued here.
  void startCoalescing();
  WorkPtr endCoalescing(const CudaOpInfo& info);
  void cancelCoalescing();  // drops the block's ops unissued

  void shutdown();
  void abort();

  class Impl;  // public so the work type in the .cpp can name it

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fastcomm
