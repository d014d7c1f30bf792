// ProcessGroupFastComm: the c10d::Backend behind backend="fastcomm".
//
// Each collective is validated here, before any communication, and then run
// by a plan: CPU tensors on the group's host lane through shared memory, CUDA
// tensors on the group's NCCL communicator (CudaCollectives); with
// FASTCOMM_CUDA_INTER=host and several nodes, CUDA collectives other than
// all_reduce are staged through host memory and run by the host plan.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/lane.hpp"
#include "backend/stats.hpp"
#include "backend/work.hpp"
#include "common/config.hpp"
#include "common/deadline.hpp"
#include "common/host_comm.hpp"
#include "intra/shm/shm_comm.hpp"
#include "plans/hier_comm.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

class CudaCollectives;
class HostStaging;

class ProcessGroupFastComm : public c10d::Backend {
 public:
  ProcessGroupFastComm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::vector<uint64_t> globalRanks,
                       std::string groupName);
  ~ProcessGroupFastComm() override;

  const std::string getBackendName() const override { return "fastcomm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
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

  Stats& stats() { return stats_; }
  const Topology& topology() const { return topo_; }
  const Config& config() const { return cfg_; }

 private:
  using HostBody = std::function<void(HostComm&, const OpContext&)>;

  // Runs `body` on the host lane (collectives) and returns its work. With
  // `staging` (CUDA tensors, see stageThroughHost) the body runs on the host
  // mirrors once they are filled, and the work completes once the outputs are
  // copied back.
  c10::intrusive_ptr<c10d::Work> runHost(const char* name, const char* title, c10d::OpType type,
                                         const std::vector<at::Tensor>& inputs,
                                         std::vector<at::Tensor> outputs, int64_t bytes,
                                         const OpSignature& sig, HostBody body,
                                         std::shared_ptr<HostStaging> staging = nullptr);
  // Runs a point-to-point `body` on the lane of (peer, direction).
  c10::intrusive_ptr<HostWork> runP2P(
      const char* name, const char* title, c10d::OpType type, SerialLane& lane,
      const at::Tensor& tensor, std::function<void(HostComm&, const OpContext&, HostWork&)> body,
      std::shared_ptr<HostStaging> staging = nullptr);
  // For CUDA tensors when FASTCOMM_CUDA_INTER=host and the group spans several
  // nodes: starts copying `inputs` into pinned host mirrors (HostStaging) so
  // that the host body of the collective runs on them. Null otherwise: CPU
  // tensors run on themselves, CUDA tensors take CudaCollectives.
  std::shared_ptr<HostStaging> stageThroughHost(const char* op,
                                                const std::vector<at::Tensor>& inputs,
                                                const std::vector<at::Tensor>& outputs);
  c10::intrusive_ptr<c10d::Work> sendNow(std::vector<at::Tensor>& tensors, int dstRank, int tag);
  c10::intrusive_ptr<c10d::Work> recvNow(std::vector<at::Tensor>& tensors, int srcRank, int tag);
  HostComm& host(const OpContext& ctx);  // created on first use, on the host lane
  SerialLane& p2pLane(int peer, bool sending);
  // `op` names the collective that creates the communicator (in its errors).
  CudaCollectives& cuda(const at::Tensor& sample, const char* op = nullptr);
  void checkUsable() const;
  void markBroken(std::exception_ptr error);
  c10::intrusive_ptr<c10d::Work> remember(c10::intrusive_ptr<c10d::Work> work);
  // Inside a coalescing block a validation error of a point-to-point op is
  // kept for endCoalescing: torch leaves its own coalescing state broken when
  // an op inside the block raises.
  c10::intrusive_ptr<c10d::Work> deferErrorInBlock(
      const std::function<c10::intrusive_ptr<c10d::Work>()>& op);

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::vector<uint64_t> globalRanks_;
  std::string groupName_;
  Config cfg_;
  Topology topo_;
  // FASTCOMM_CUDA_INTER=host and more than one node (agreed by all ranks).
  bool cudaThroughHost_ = false;
  c10::intrusive_ptr<Options> options_;
  Stats stats_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> p2pSeq_{0};

  std::unique_ptr<HostComm> host_;  // touched only on the host lane after creation
  std::mutex hostInitMu_;

  mutable std::mutex brokenMu_;
  std::exception_ptr broken_;

  std::mutex coalesceMu_;
  bool coalescing_ = false;
  bool coalescingCuda_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  // Point-to-point jobs of an open block run only at endCoalescing, so an
  // invalid op in the block (raised there) leaves nothing half sent.
  std::vector<std::pair<SerialLane*, std::function<void()>>> coalescedJobs_;
  std::exception_ptr coalesceError_;

  std::mutex lanesMu_;
  std::map<std::pair<int, bool>, std::unique_ptr<SerialLane>> p2pLanes_;
  std::unique_ptr<SerialLane> hostLane_;

#ifdef FASTCOMM_WITH_CUDA
  std::mutex cudaMu_;
  std::unique_ptr<CudaCollectives> cuda_;
#endif
};

}  // namespace fastcomm
