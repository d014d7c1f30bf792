// How a process group runs the collectives of one kind of tensor. The group
// validates each call (every check before any communication), picks the path
// by the device of its tensors and hands it the validated arguments:
// - HostPath: CPU tensors, on the group's host lane through HostComm (shared
//   memory inside a node, the hierarchical plan across nodes);
// - NcclPath (backend/cuda/): CUDA tensors on the group's NCCL communicator;
// - HostStagedPath (backend/cuda/): CUDA tensors across nodes with
//   FASTCOMM_CUDA_INTER=host, staged through pinned host memory and run by
//   HostPath (all_reduce stays on NcclPath);
// - NoCudaPath: CUDA tensors in a CPU-only build, refused with a clear error.
// Both paths of a group are chosen when it is created.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "common/reduce.hpp"

namespace fastcomm {

// A call as the group names and counts it.
struct OpCall {
  const char* name;   // as torch.distributed spells it, e.g. "all_reduce" (stats, errors)
  const char* title;  // e.g. "fastcomm:all_reduce" (profiler)
  c10d::OpType type;
  int64_t bytes;  // counted in stats
  // async_op=False: a CUDA path may issue on the caller's current stream, as
  // ProcessGroupNCCL does (no cross-stream event pair on the critical path).
  bool sync = false;
};

inline int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// Complex tensors reduce as pairs of reals (the group checked that the op
// allows it).
inline at::Tensor asReal(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t) : t; }

class DevicePath {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;

  virtual ~DevicePath() = default;

  // How this path runs collectives (the group's first log line).
  virtual std::string describe() const = 0;
  // Sets up what the first collective on `device` would (device_id given at init).
  virtual void connect(at::Device device) = 0;

  virtual WorkPtr broadcast(const OpCall& call, const Tensors& tensors, int root) = 0;
  // One tensor (all_reduce) or several (all_reduce_coalesced).
  virtual WorkPtr allreduce(const OpCall& call, const Tensors& tensors, RedOp op) = 0;
  virtual WorkPtr reduce(const OpCall& call, const Tensors& tensors, RedOp op, int root) = 0;
  // `outputs`: one tensor per rank (all_gather) or one of size x input
  // elements (all_gather_into_tensor).
  virtual WorkPtr allgather(const OpCall& call, const Tensors& outputs,
                            const at::Tensor& input) = 0;
  // outputs[i] gathers inputs[i], one block (all_gather_into_tensor_coalesced).
  virtual WorkPtr allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                                     const Tensors& inputs) = 0;
  // `outputs`: one per rank on the root, none elsewhere.
  virtual WorkPtr gather(const OpCall& call, const Tensors& outputs, const at::Tensor& input,
                         int root) = 0;
  // `inputs`: one per rank on the root, none elsewhere.
  virtual WorkPtr scatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                          int root) = 0;
  // `inputs`: one tensor per rank (reduce_scatter) or one of size x output
  // elements (reduce_scatter_tensor).
  virtual WorkPtr reduceScatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                                RedOp op) = 0;
  // outputs[i] gets its block of inputs[i] (reduce_scatter_tensor_coalesced).
  virtual WorkPtr reduceScatterCoalesced(const OpCall& call, const Tensors& outputs,
                                         const Tensors& inputs, RedOp op) = 0;
  // One flat input and output (all_to_all_single) or one tensor per rank
  // each (all_to_all); counts in elements, indexed by peer.
  virtual WorkPtr alltoall(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                           const std::vector<int64_t>& sendCounts,
                           const std::vector<int64_t>& recvCounts) = 0;
  virtual WorkPtr send(const OpCall& call, const at::Tensor& tensor, int peer, int tag) = 0;
  virtual WorkPtr recv(const OpCall& call, const at::Tensor& tensor, int peer, int tag) = 0;

  // The group's coalescing block opened; ops of this path issued before its
  // end may be held back until then.
  virtual void startCoalescing() {}
  // An op of the block was invalid: drop what was held back.
  virtual void cancelCoalescing() {}
  // Issues what was held back; the block's `works` that belong to this path
  // may be replaced by the one work that stands for them.
  virtual void endCoalescing(std::vector<WorkPtr>& works) { (void)works; }

  // Finishes or drops what is queued and releases the path's resources.
  virtual void shutdown() {}
  // Fails what is in flight now (the group was aborted).
  virtual void abort() {}
};

// The CUDA path of a build without CUDA support: every call raises.
class NoCudaPath : public DevicePath {
 public:
  std::string describe() const override;
  void connect(at::Device device) override;
  WorkPtr broadcast(const OpCall&, const Tensors& tensors, int) override;
  WorkPtr allreduce(const OpCall&, const Tensors& tensors, RedOp) override;
  WorkPtr reduce(const OpCall&, const Tensors& tensors, RedOp, int) override;
  WorkPtr allgather(const OpCall&, const Tensors&, const at::Tensor& input) override;
  WorkPtr allgatherCoalesced(const OpCall&, const Tensors&, const Tensors& inputs) override;
  WorkPtr gather(const OpCall&, const Tensors&, const at::Tensor& input, int) override;
  WorkPtr scatter(const OpCall&, const at::Tensor& output, const Tensors&, int) override;
  WorkPtr reduceScatter(const OpCall&, const at::Tensor& output, const Tensors&, RedOp) override;
  WorkPtr reduceScatterCoalesced(const OpCall&, const Tensors&, const Tensors& inputs,
                                 RedOp) override;
  WorkPtr alltoall(const OpCall&, const Tensors&, const Tensors& inputs,
                   const std::vector<int64_t>&, const std::vector<int64_t>&) override;
  WorkPtr send(const OpCall&, const at::Tensor& tensor, int, int) override;
  WorkPtr recv(const OpCall&, const at::Tensor& tensor, int, int) override;

 private:
  [[noreturn]] static void refuse(at::Device device);
};

}  // namespace fastcomm
