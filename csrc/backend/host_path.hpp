// CPU tensors: each collective runs on the group's host lane through its
// HostComm (shared memory inside a node, the hierarchical plan across nodes),
// each point-to-point op on the lane of its peer and direction.
//
// The same bodies run CUDA collectives staged through host memory
// (HostStagedPath): given HostMirrors, a body runs on the host mirrors of the
// call's tensors once they are filled, and its work completes once the
// outputs are copied back.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "backend/device_path.hpp"
#include "backend/group_state.hpp"
#include "backend/work.hpp"
#include "common/deadline.hpp"
#include "common/host_comm.hpp"
#include "common/lane.hpp"

namespace fastcomm {

// The host memory a host body runs on for a call whose tensors live on a
// device.
class HostMirrors {
 public:
  virtual ~HostMirrors() = default;
  // The contiguous host mirror of `device`, one of the call's tensors.
  virtual at::Tensor host(const at::Tensor& device) const = 0;
  // On the lane, before the body: the inputs are in the mirrors.
  virtual void waitForInputs(const OpContext& ctx) = 0;
  // On the lane, after the body: the outputs are back on the device.
  virtual void copyOutputsBack(const OpContext& ctx) = 0;
};

class HostPath : public DevicePath {
 public:
  using Staged = std::shared_ptr<HostMirrors>;  // null: the tensors are host memory

  explicit HostPath(GroupState& group);
  ~HostPath() override;

  std::string describe() const override;
  void connect(at::Device) override {}

  WorkPtr broadcast(const OpCall& call, const Tensors& tensors, int root) override {
    return broadcast(call, tensors, root, nullptr);
  }
  WorkPtr allreduce(const OpCall& call, const Tensors& tensors, RedOp op) override;
  WorkPtr reduce(const OpCall& call, const Tensors& tensors, RedOp op, int root) override {
    return reduce(call, tensors, op, root, nullptr);
  }
  WorkPtr allgather(const OpCall& call, const Tensors& outputs, const at::Tensor& input) override {
    return allgather(call, outputs, input, nullptr);
  }
  WorkPtr allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                             const Tensors& inputs) override {
    return allgatherCoalesced(call, outputs, inputs, nullptr);
  }
  WorkPtr gather(const OpCall& call, const Tensors& outputs, const at::Tensor& input,
                 int root) override {
    return gather(call, outputs, input, root, nullptr);
  }
  WorkPtr scatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                  int root) override {
    return scatter(call, output, inputs, root, nullptr);
  }
  WorkPtr reduceScatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                        RedOp op) override {
    return reduceScatter(call, output, inputs, op, nullptr);
  }
  WorkPtr reduceScatterCoalesced(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                                 RedOp op) override {
    return reduceScatterCoalesced(call, outputs, inputs, op, nullptr);
  }
  WorkPtr alltoall(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                   const std::vector<int64_t>& sendCounts,
                   const std::vector<int64_t>& recvCounts) override {
    return alltoall(call, outputs, inputs, sendCounts, recvCounts, nullptr);
  }
  WorkPtr send(const OpCall& call, const at::Tensor& tensor, int peer, int tag) override {
    return send(call, tensor, peer, tag, nullptr);
  }
  WorkPtr recv(const OpCall& call, const at::Tensor& tensor, int peer, int tag) override {
    return recv(call, tensor, peer, tag, nullptr);
  }
  // Host-only ops.
  WorkPtr recvAny(const OpCall& call, const at::Tensor& tensor, int tag);
  WorkPtr barrier(const OpCall& call);

  // The collectives on host mirrors (`staged`, see HostMirrors).
  WorkPtr broadcast(const OpCall& call, const Tensors& tensors, int root, const Staged& staged);
  WorkPtr reduce(const OpCall& call, const Tensors& tensors, RedOp op, int root,
                 const Staged& staged);
  WorkPtr allgather(const OpCall& call, const Tensors& outputs, const at::Tensor& input,
                    const Staged& staged);
  WorkPtr allgatherCoalesced(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                             const Staged& staged);
  WorkPtr gather(const OpCall& call, const Tensors& outputs, const at::Tensor& input, int root,
                 const Staged& staged);
  WorkPtr scatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs, int root,
                  const Staged& staged);
  WorkPtr reduceScatter(const OpCall& call, const at::Tensor& output, const Tensors& inputs,
                        RedOp op, const Staged& staged);
  WorkPtr reduceScatterCoalesced(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                                 RedOp op, const Staged& staged);
  WorkPtr alltoall(const OpCall& call, const Tensors& outputs, const Tensors& inputs,
                   const std::vector<int64_t>& sendCounts, const std::vector<int64_t>& recvCounts,
                   const Staged& staged);
  WorkPtr send(const OpCall& call, const at::Tensor& tensor, int peer, int tag,
               const Staged& staged);
  WorkPtr recv(const OpCall& call, const at::Tensor& tensor, int peer, int tag,
               const Staged& staged);

  // Lanes finish what was queued (each job bounded by its timeout) and join;
  // then the host communicator goes.
  void shutdown() override;

 private:
  using Body = std::function<void(HostComm&, const OpContext&)>;
  // `comm` is null for a message to the rank itself.
  using P2PBody = std::function<void(HostComm*, const OpContext&, HostWork&)>;

  // Runs `body` on the host lane and returns its work.
  WorkPtr run(const OpCall& call, const Tensors& inputs, Tensors outputs, const OpSignature& sig,
              Body body, const Staged& staged);
  // Runs a point-to-point `body` with `peer` (-1: any) on `lane` (at the end
  // of an open coalescing block).
  WorkPtr runP2P(const OpCall& call, SerialLane& lane, const at::Tensor& tensor, int peer,
                 P2PBody body, const Staged& staged);
  HostComm& comm(const OpContext& ctx);  // created on first use, on the host lane
  SerialLane& p2pLane(int peer, bool sending);
  // A rank's sends to itself wait here for its receives (batch_isend_irecv
  // may pair a rank with itself): by tag, oldest first.
  void postToSelf(int tag, at::Tensor message);
  at::Tensor takeFromSelf(int tag, const OpContext& ctx);

  GroupState& g_;
  std::unique_ptr<HostComm> comm_;  // touched only on the host lane after creation
  std::mutex commInitMu_;
  std::mutex lanesMu_;
  std::map<std::pair<int, bool>, std::unique_ptr<SerialLane>> p2pLanes_;
  std::unique_ptr<SerialLane> lane_;
  std::mutex selfMu_;
  std::condition_variable selfPosted_;
  std::multimap<int, at::Tensor> toSelf_;  // equal tags keep their order
};

}  // namespace fastcomm
