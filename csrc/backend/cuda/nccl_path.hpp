// The CUDA paths of a process group (backend/device_path.hpp).
//
// NcclPath runs CUDA collectives on the group's NCCL communicator
// (CudaCollectives: ProcessGroupNCCL's stream semantics, the watchdog, large
// all_reduces across nodes on the staged multi-node pipeline). The
// communicator is created by the first CUDA collective, which knows the
// device, or by connect() when init_process_group binds a device_id. A rank's
// sends to itself never touch NCCL: creating the communicator needs every
// rank, and batch_isend_irecv may pair a rank with itself alone. They pass
// through HostPath's mailbox, staged in host memory.
//
// HostStagedPath (FASTCOMM_CUDA_INTER=host, several nodes) stages the CUDA
// tensors of every collective but all_reduce through pinned host memory
// (HostStaging) and runs it with HostPath's bodies; all_reduce, and with it
// coalescing blocks, shutdown and abort, stays on NcclPath.
#pragma once

#include <memory>
#include <mutex>

#include "backend/cuda/cuda_collectives.hpp"
#include "backend/device_path.hpp"
#include "backend/group_state.hpp"
#include "backend/host_path.hpp"

namespace fastcomm {

class NcclPath : public DevicePath {
 public:
  NcclPath(GroupState& group, HostPath& host);
  ~NcclPath() override;

  std::string describe() const override;
  void connect(at::Device device) override;

  WorkPtr broadcast(const OpCall& call, const Tensors& tensors, int root) override;
  WorkPtr allreduce(const OpCall& call, const Tensors& tensors, RedOp op) override;
  WorkPtr reduce(const OpCall& call, const Tensors& tensors, RedOp op, int root) override;
  WorkPtr allgather(const OpCall& call, const Tensors& outputs, const at::Tensor& input) override;
  WorkPtr allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                             const Tensors& inputs) override;
  WorkPtr gather(const OpCall& call, const Tensors& outputs, const at::Tensor& input,
                 int root) override;
  WorkPtr scatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                  int root) override;
  WorkPtr reduceScatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                        RedOp op) override;
  WorkPtr reduceScatterCoalesced(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                                 RedOp op) override;
  WorkPtr alltoall(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                   const std::vector<int64_t>& sendCounts,
                   const std::vector<int64_t>& recvCounts) override;
  WorkPtr send(const OpCall& call, const at::Tensor& tensor, int peer, int tag) override;
  WorkPtr recv(const OpCall& call, const at::Tensor& tensor, int peer, int tag) override;

  // CUDA ops of a block are issued as one NCCL group at its end.
  void startCoalescing() override;
  void cancelCoalescing() override;
  void endCoalescing(std::vector<WorkPtr>& works) override;

  void shutdown() override;
  void abort() override;

 protected:
  // Starts copying `inputs` into their host mirrors; `outputs` are copied
  // back when the host body is done.
  HostPath::Staged stage(const char* op, const Tensors& inputs, const Tensors& outputs);

  GroupState& g_;
  HostPath& host_;

 private:
  // The communicator on `device`, created at its first use; `op` names the
  // collective that creates it (in its errors).
  CudaCollectives& comm(at::Device device, const char* op);
  // The next op's info on counter `seq` (g_.seq or g_.p2pSeq), recorded in
  // the flight recorder with its reduce op (a RedOp), root and peer (-1: none).
  CudaOpInfo info(const OpCall& call, std::atomic<uint64_t>& seq, const Tensors& inputs,
                  const Tensors& outputs, int redop = -1, int root = -1, int peer = -1) const;

  std::mutex mu_;
  std::unique_ptr<CudaCollectives> comm_;
  bool blockOpen_ = false;    // the group's coalescing block
  bool commInBlock_ = false;  // comm_ holds back the block's ops
};

class HostStagedPath : public NcclPath {
 public:
  HostStagedPath(GroupState& group, HostPath& host);

  std::string describe() const override;

  WorkPtr broadcast(const OpCall& call, const Tensors& tensors, int root) override;
  WorkPtr reduce(const OpCall& call, const Tensors& tensors, RedOp op, int root) override;
  WorkPtr allgather(const OpCall& call, const Tensors& outputs, const at::Tensor& input) override;
  WorkPtr allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                             const Tensors& inputs) override;
  WorkPtr gather(const OpCall& call, const Tensors& outputs, const at::Tensor& input,
                 int root) override;
  WorkPtr scatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                  int root) override;
  WorkPtr reduceScatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                        RedOp op) override;
  WorkPtr reduceScatterCoalesced(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                                 RedOp op) override;
  WorkPtr alltoall(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                   const std::vector<int64_t>& sendCounts,
                   const std::vector<int64_t>& recvCounts) override;
  WorkPtr send(const OpCall& call, const at::Tensor& tensor, int peer, int tag) override;
  WorkPtr recv(const OpCall& call, const at::Tensor& tensor, int peer, int tag) override;
};

// The CUDA path of a group: HostStagedPath across nodes with
// FASTCOMM_CUDA_INTER=host (agreed by all ranks at creation), else NcclPath.
std::unique_ptr<DevicePath> makeCudaPath(GroupState& group, HostPath& host);

}  // namespace fastcomm
