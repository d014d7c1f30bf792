// ProcessGroupFastComm: the c10d::Backend behind backend="fastcomm".
//
// Each collective is validated here, before any communication (the same
// checks whatever runs it), and then handed to the device path of its
// tensors (backend/device_path.hpp): CPU tensors to HostPath, CUDA tensors
// to the CUDA path chosen when the group is created (NCCL, staged through
// host memory, or refused in a CPU-only build).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend/device_path.hpp"
#include "backend/group_state.hpp"
#include "backend/host_path.hpp"
#include "backend/stats.hpp"
#include "common/config.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

class ProcessGroupFastComm : public c10d::Backend {
 public:
  ProcessGroupFastComm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::vector<uint64_t> globalRanks,
                       std::string groupName);
  ~ProcessGroupFastComm() override;

  const std::string getBackendName() const override { return "fastcomm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  uint64_t getSequenceNumberForGroup() override { return g_.seq.load(); }
  // Sequence numbers start at 0 in every new group; torch 2.11's split_group
  // calls this (newer torch made it a no-op).
  void setSequenceNumberForGroup() override {}
  bool supportsSplitting() const override { return true; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void eagerConnectSingleDevice(at::Device device) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  void shutdown() override;
  void abort() override;
  // The last strong reference went while a weak one remains (the parent's
  // lastSplit_ keeps the memory until its next split): the threads, sockets
  // and shared memory go now, not when the memory does.
  void release_resources() override;

  Stats& stats() { return g_.stats; }
  const Topology& topology() const { return g_.topo; }
  const Config& config() const { return g_.cfg; }

 private:
  // The path of a validated call whose tensors are on `sample`'s device.
  DevicePath& path(const at::Tensor& sample) {
    return sample.is_cuda() ? *cudaPath_ : static_cast<DevicePath&>(*hostPath_);
  }
  c10::intrusive_ptr<c10d::Work> sendNow(std::vector<at::Tensor>& tensors, int dstRank, int tag);
  c10::intrusive_ptr<c10d::Work> recvNow(std::vector<at::Tensor>& tensors, int srcRank, int tag);

  // The last split asked of this group. torch (2.11) asks the backend of
  // every device type of the parent to split; one fastcomm backend serves CPU
  // and CUDA, so the second ask of the same split gets the first answer.
  struct LastSplit {
    c10::weak_intrusive_ptr<c10d::Store> store;
    std::string name;
    std::vector<int> ranks;
    c10::weak_intrusive_ptr<c10d::Backend> child;
  };
  std::mutex splitMu_;
  std::optional<LastSplit> lastSplit_;
  uint64_t splits_ = 0;  // splits of this group so far (names their stores)

  std::vector<uint64_t> globalRanks_;
  std::string groupName_;
  c10::intrusive_ptr<Options> options_;
  GroupState g_;
  std::unique_ptr<HostPath> hostPath_;
  std::unique_ptr<DevicePath> cudaPath_;
};

}  // namespace fastcomm
