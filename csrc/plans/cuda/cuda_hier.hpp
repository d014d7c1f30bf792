// CUDA all_reduce across nodes: intra-node NCCL reduce-scatter -> the rail
// phase (plans/staged_rail.hpp: every rank's shard exchanged with its rail
// over fastcomm's transport, staged through mapped pinned host memory, or
// device memory where the transport moves it, and pipelined in chunks, the
// GPU reducing what arrives) -> intra-node NCCL all-gather.
// The host CPU never adds big data; a proxy thread only moves bytes, and the
// caller's thread never waits.
//
// On the GPU, the rail phase's device steps follow the reduce-scatter: one
// kernel per step that reads and writes the staging in place
// (kernels/staged_kernels.cu), the staging allocated once
// (FASTCOMM_STAGED_MEMORY), and the flags as stream memory operations on
// mapped pinned memory (cuStreamWaitValue32 / cuStreamWriteValue32, through
// cudaGetDriverEntryPoint, so fastcomm does not link libcuda). Only the proxy
// releases the stream's waits, from host-observed progress, so no wait ever
// depends on GPU work issued later on another stream (which could deadlock
// where CUDA maps several streams onto one hardware queue: the warning of
// cuStreamWaitValue32). An eager op runs the three kinds of step on streams
// of their own forked from the group's comm stream, issued in one order
// (plans/staged_rail.hpp, "Streams", says why that stays deadlock-free); a
// captured op runs them all on the comm stream.
//
// Failures abort the group (the CUDA collectives' abort: works fail, NCCL
// communicators abort); the rail then keeps releasing the stream's waits, and
// shutdown frees the staging only once the comm stream drained.
//
// CUDA graphs: everything above can be captured (NCCL calls, kernels,
// stream memory operations on mapped memory, padding from the caching
// allocator, i.e. the graph's pool),
// and the rail adds a host node that hands each replay's op to the proxy
// (plans/staged_rail.hpp). The set-up cannot be captured: the first
// all_reduce that takes this path must be eager (the caller checks).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "common/config.hpp"
#include "common/deadline.hpp"
#include "common/reduce.hpp"
#include "plans/inter_plan.hpp"
#include "plans/staged_rail.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

class CudaHier {
 public:
  using Hooks = StagedRail::Hooks;

  // Collective over the group: every rank calls it at the same all_reduce.
  // Returns null when some rank cannot run the path (the reason is logged);
  // then every rank keeps the flat NCCL communicator.
  static std::unique_ptr<CudaHier> create(const c10::intrusive_ptr<c10d::Store>& store,
                                          const Topology& topo, const InterPlan& plan,
                                          const Config& cfg, at::Device device,
                                          std::chrono::milliseconds timeout, Hooks hooks);
  ~CudaHier();

  // Whether an all_reduce of `numel` elements (`bytes`) of `dt` with `op`
  // takes this path: the same answer on every rank, as it depends on the
  // agreed plan and the topology only.
  static bool eligible(const InterPlan& plan, const Topology& topo, at::ScalarType dt, RedOp op,
                       int64_t numel, int64_t bytes);
  std::string describe() const;

  // Issues the all_reduce of the contiguous `t` in place on `stream` (the
  // caller holds the group's issue lock, so calls come in the same order on
  // every rank). `failWork` fails the collective's work.
  void allreduce(const at::Tensor& t, RedOp op, cudaStream_t stream, const OpContext& ctx,
                 std::function<void(std::exception_ptr)> failWork);

  // From the group's abort, under its issue lock: aborts the rail's
  // transports (the rail keeps releasing waits), then the intra-node
  // communicator together with `flat` (the group's own, may be null).
  void abortComms(const std::string& why, ncclComm_t flat);
  // Destroy: `stream` is the comm stream the ops ran on. Waits for it to
  // drain (bounded after a failure; once ops were captured, for the whole
  // device, as a graph may still replay them), stops the rail, frees the
  // staging (leaked, with a warning, if the stream never drained, or
  // after a failure once ops were captured) and releases the intra-node
  // communicator. Graphs holding these all_reduces must not be replayed
  // afterwards (as with NCCL's communicators).
  void shutdown(cudaStream_t stream, bool failed);

  CudaHier(const CudaHier&) = delete;
  CudaHier& operator=(const CudaHier&) = delete;

  struct Resources;  // staging, flags, driver entry points; the device

 private:
  CudaHier(const Topology& topo, const InterPlan& plan, at::Device device,
           std::unique_ptr<Resources> res);

  Topology topo_;
  InterPlan plan_;
  at::Device device_;
  std::unique_ptr<Resources> res_;
  ncclComm_t intra_ = nullptr;  // the node's ranks (null with one rank per node)
  std::unique_ptr<StagedRail> rail_;
};

}  // namespace fastcomm
