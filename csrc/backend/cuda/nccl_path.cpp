#include "backend/cuda/nccl_path.hpp"

#include <c10/util/Exception.h>

#include <string>

#include "backend/cuda/host_staging.hpp"
#include "backend/work.hpp"
#include "common/deadline.hpp"

namespace fastcomm {

namespace {

using Tensors = std::vector<at::Tensor>;

// stats() key counting the CUDA collectives staged through host memory; each
// is also counted under its own name.
constexpr const char* kCudaViaHost = "cuda_via_host";
// The work of a coalescing block's CUDA ops.
constexpr const char* kCoalesced = "coalesced";
constexpr const char* kCoalescedTitle = "fastcomm:coalesced";

Tensors realViews(const Tensors& tensors) {
  Tensors out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(asReal(t));
  return out;
}

}  // namespace

// ---- NcclPath ----------------------------------------------------------------

NcclPath::NcclPath(GroupState& group, HostPath& host) : g_(group), host_(host) {}

NcclPath::~NcclPath() { shutdown(); }

std::string NcclPath::describe() const {
  return g_.topo.numNodes() > 1 && g_.cfg.cudaHier
             ? "NCCL; large all_reduces across nodes staged over the transport"
             : "NCCL";
}

CudaOpInfo NcclPath::info(const OpCall& call, std::atomic<uint64_t>& seq, const Tensors& inputs,
                          const Tensors& outputs, int redop, int root, int peer) const {
  CudaOpInfo i{call.name, call.title, call.type, ++seq, g_.timeout, call.bytes, call.sync};
  if (g_.trace) {
    const TraceOp op{call.name, &seq == &g_.p2pSeq, i.seq, redop, root, peer};
    i.trace = g_.trace->record(op, inputs, outputs, g_.timeout);
  }
  return i;
}

CudaCollectives& NcclPath::comm(at::Device device, const char* op) {
  g_.checkUsable();
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) {
    // Creating the NCCL communicators, streams and events allocates and
    // synchronises, which would invalidate a capture on the current stream
    // (the user would then only see CUDA's "operation failed due to a
    // previous error during capture"). Refused before any CUDA call; every
    // rank captures alike, so all refuse.
    TORCH_CHECK(!CudaCollectives::currentStreamCapturing(device),
                "fastcomm: ", op ? op : "this collective",
                " is the first CUDA collective of this group, whose set-up (NCCL communicators, "
                "streams) cannot run during a CUDA graph capture: run one CUDA collective eagerly "
                "before capturing (as a warm-up iteration does), or pass device_id to "
                "init_process_group");
    try {
      comm_ = std::make_unique<CudaCollectives>(g_.store, g_.rank, g_.size, g_.timeout, g_.cfg,
                                                g_.stats, device, g_.topo, g_.trace.get());
    } catch (const c10::DistBackendError& e) {
      if (op == nullptr) throw;
      throwCommError(std::string("fastcomm: ") + op + ": " + e.what());
    }
    if (blockOpen_) {  // the first CUDA op of the group came inside a block
      commInBlock_ = true;
      comm_->startCoalescing();
    }
  }
  TORCH_CHECK(comm_->device() == device, "fastcomm: this process group uses ", comm_->device(),
              " but got a tensor on ", device, "; use one CUDA device per rank and group");
  return *comm_;
}

void NcclPath::connect(at::Device device) { comm(device, nullptr); }

DevicePath::WorkPtr NcclPath::broadcast(const OpCall& call, const Tensors& tensors, int root) {
  auto& cc = comm(tensors[0].device(), call.name);
  const auto i = info(call, g_.seq, tensors, tensors, -1, root);
  return g_.block.remember(cc.broadcast(tensors[0], root, i));
}

DevicePath::WorkPtr NcclPath::allreduce(const OpCall& call, const Tensors& tensors, RedOp op) {
  auto& cc = comm(tensors[0].device(), call.name);
  const auto i = info(call, g_.seq, tensors, tensors, static_cast<int>(op));
  return g_.block.remember(cc.allreduce(realViews(tensors), op, i));
}

DevicePath::WorkPtr NcclPath::reduce(const OpCall& call, const Tensors& tensors, RedOp op,
                                     int root) {
  auto& cc = comm(tensors[0].device(), call.name);
  const auto i = info(call, g_.seq, tensors, tensors, static_cast<int>(op), root);
  return g_.block.remember(cc.reduce(asReal(tensors[0]), op, root, i));
}

DevicePath::WorkPtr NcclPath::allgather(const OpCall& call, const Tensors& outputs,
                                        const at::Tensor& input) {
  auto& cc = comm(input.device(), call.name);
  const auto i = info(call, g_.seq, {input}, outputs);
  return g_.block.remember(cc.allgather(outputs, input, i));
}

DevicePath::WorkPtr NcclPath::allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                                                 const Tensors& inputs) {
  auto& cc = comm(inputs[0].device(), nullptr);
  const auto i = info(call, g_.seq, inputs, outputs);
  cc.startCoalescing();
  for (size_t k = 0; k < inputs.size(); ++k) cc.allgather({outputs[k]}, inputs[k], i);
  return g_.block.remember(cc.endCoalescing(i));
}

DevicePath::WorkPtr NcclPath::gather(const OpCall& call, const Tensors& outputs,
                                     const at::Tensor& input, int root) {
  auto& cc = comm(input.device(), call.name);
  const auto i = info(call, g_.seq, {input}, outputs, -1, root);
  return g_.block.remember(cc.gather(outputs, input, root, i));
}

DevicePath::WorkPtr NcclPath::scatter(const OpCall& call, const at::Tensor& output,
                                      const Tensors& inputs, int root) {
  auto& cc = comm(output.device(), call.name);
  const auto i = info(call, g_.seq, inputs, {output}, -1, root);
  return g_.block.remember(cc.scatter(output, inputs, root, i));
}

DevicePath::WorkPtr NcclPath::reduceScatter(const OpCall& call, const at::Tensor& output,
                                            const Tensors& inputs, RedOp op) {
  auto& cc = comm(output.device(), call.name);
  const auto i = info(call, g_.seq, inputs, {output}, static_cast<int>(op));
  return g_.block.remember(cc.reduceScatter(asReal(output), realViews(inputs), op, i));
}

DevicePath::WorkPtr NcclPath::reduceScatterCoalesced(const OpCall& call, const Tensors& outputs,
                                                     const Tensors& inputs, RedOp op) {
  auto& cc = comm(inputs[0].device(), nullptr);
  const auto i = info(call, g_.seq, inputs, outputs, static_cast<int>(op));
  Tensors srcs;
  for (const auto& t : inputs) srcs.push_back(asReal(t).contiguous());
  cc.startCoalescing();
  for (size_t k = 0; k < srcs.size(); ++k) cc.reduceScatter(asReal(outputs[k]), {srcs[k]}, op, i);
  return g_.block.remember(cc.endCoalescing(i));
}

DevicePath::WorkPtr NcclPath::alltoall(const OpCall& call, const Tensors& outputs,
                                       const Tensors& inputs,
                                       const std::vector<int64_t>& sendCounts,
                                       const std::vector<int64_t>& recvCounts) {
  auto& cc = comm(inputs[0].device(), call.name);
  const auto i = info(call, g_.seq, inputs, outputs);
  return g_.block.remember(cc.alltoall(outputs, inputs, sendCounts, recvCounts, i));
}

DevicePath::WorkPtr NcclPath::send(const OpCall& call, const at::Tensor& tensor, int peer,
                                   int tag) {
  if (peer == g_.rank) return host_.send(call, tensor, peer, tag, stage(call.name, {tensor}, {}));
  auto& cc = comm(tensor.device(), call.name);
  const auto i = info(call, g_.p2pSeq, {tensor}, {}, -1, -1, peer);
  return g_.block.remember(cc.send(tensor, peer, i));
}

DevicePath::WorkPtr NcclPath::recv(const OpCall& call, const at::Tensor& tensor, int peer,
                                   int tag) {
  if (peer == g_.rank) return host_.recv(call, tensor, peer, tag, stage(call.name, {}, {tensor}));
  auto& cc = comm(tensor.device(), call.name);
  const auto i = info(call, g_.p2pSeq, {}, {tensor}, -1, -1, peer);
  return g_.block.remember(cc.recv(tensor, peer, i));
}

void NcclPath::startCoalescing() {
  std::lock_guard<std::mutex> lock(mu_);
  blockOpen_ = true;
  commInBlock_ = comm_ != nullptr;
  if (commInBlock_) comm_->startCoalescing();
}

void NcclPath::cancelCoalescing() {
  std::lock_guard<std::mutex> lock(mu_);
  blockOpen_ = false;
  if (commInBlock_) comm_->cancelCoalescing();
  commInBlock_ = false;
}

void NcclPath::endCoalescing(std::vector<WorkPtr>& works) {
  std::lock_guard<std::mutex> lock(mu_);
  blockOpen_ = false;
  if (!commInBlock_) return;
  commInBlock_ = false;
  CudaOpInfo i{kCoalesced, kCoalescedTitle, c10d::OpType::COALESCED, g_.seq.load(), g_.timeout, 0};
  auto cudaWork = comm_->endCoalescing(i);
  if (!cudaWork) return;  // the block's ops all ran on the host
  // The CUDA parts complete with the group's work; host parts on their own.
  std::vector<WorkPtr> kept;
  for (auto& w : works)
    if (dynamic_cast<HostWork*>(w.get()) != nullptr) kept.push_back(w);
  kept.push_back(cudaWork);
  works.swap(kept);
}

void NcclPath::shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_) comm_->shutdown();
  comm_.reset();
}

void NcclPath::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_) comm_->abort();
}

// ---- HostStagedPath ----------------------------------------------------------

HostStagedPath::HostStagedPath(GroupState& group, HostPath& host) : NcclPath(group, host) {}

std::string HostStagedPath::describe() const {
  return "across nodes staged through host memory and run by the hierarchical host plan "
         "(FASTCOMM_CUDA_INTER=host), except all_reduce: NCCL, large ones staged over the "
         "transport";
}

HostPath::Staged NcclPath::stage(const char* op, const Tensors& inputs, const Tensors& outputs) {
  g_.checkUsable();
  auto staging = HostStaging::begin(op, inputs, outputs);
  int64_t bytes = 0;
  for (const auto& t : inputs) bytes += nbytes(t);
  g_.stats.addCall(kCudaViaHost, static_cast<uint64_t>(bytes));
  return staging;
}

DevicePath::WorkPtr HostStagedPath::broadcast(const OpCall& call, const Tensors& tensors,
                                              int root) {
  return host_.broadcast(call, tensors, root, stage(call.name, tensors, tensors));
}

DevicePath::WorkPtr HostStagedPath::reduce(const OpCall& call, const Tensors& tensors, RedOp op,
                                           int root) {
  // Only the root's tensor is written back.
  return host_.reduce(call, tensors, op, root,
                      stage(call.name, tensors, g_.rank == root ? tensors : Tensors{}));
}

DevicePath::WorkPtr HostStagedPath::allgather(const OpCall& call, const Tensors& outputs,
                                              const at::Tensor& input) {
  return host_.allgather(call, outputs, input, stage(call.name, {input}, outputs));
}

DevicePath::WorkPtr HostStagedPath::allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                                                       const Tensors& inputs) {
  return host_.allgatherCoalesced(call, outputs, inputs, stage(call.name, inputs, outputs));
}

DevicePath::WorkPtr HostStagedPath::gather(const OpCall& call, const Tensors& outputs,
                                           const at::Tensor& input, int root) {
  return host_.gather(call, outputs, input, root, stage(call.name, {input}, outputs));
}

DevicePath::WorkPtr HostStagedPath::scatter(const OpCall& call, const at::Tensor& output,
                                            const Tensors& inputs, int root) {
  return host_.scatter(call, output, inputs, root, stage(call.name, inputs, {output}));
}

DevicePath::WorkPtr HostStagedPath::reduceScatter(const OpCall& call, const at::Tensor& output,
                                                  const Tensors& inputs, RedOp op) {
  return host_.reduceScatter(call, output, inputs, op, stage(call.name, inputs, {output}));
}

DevicePath::WorkPtr HostStagedPath::reduceScatterCoalesced(const OpCall& call,
                                                           const Tensors& outputs,
                                                           const Tensors& inputs, RedOp op) {
  return host_.reduceScatterCoalesced(call, outputs, inputs, op, stage(call.name, inputs, outputs));
}

DevicePath::WorkPtr HostStagedPath::alltoall(const OpCall& call, const Tensors& outputs,
                                             const Tensors& inputs,
                                             const std::vector<int64_t>& sendCounts,
                                             const std::vector<int64_t>& recvCounts) {
  return host_.alltoall(call, outputs, inputs, sendCounts, recvCounts,
                        stage(call.name, inputs, outputs));
}

DevicePath::WorkPtr HostStagedPath::send(const OpCall& call, const at::Tensor& tensor, int peer,
                                         int tag) {
  return host_.send(call, tensor, peer, tag, stage(call.name, {tensor}, {}));
}

DevicePath::WorkPtr HostStagedPath::recv(const OpCall& call, const at::Tensor& tensor, int peer,
                                         int tag) {
  return host_.recv(call, tensor, peer, tag, stage(call.name, {}, {tensor}));
}

std::unique_ptr<DevicePath> makeCudaPath(GroupState& group, HostPath& host) {
  if (group.topo.numNodes() > 1 && group.cfg.cudaInterHost)
    return std::make_unique<HostStagedPath>(group, host);
  return std::make_unique<NcclPath>(group, host);
}

}  // namespace fastcomm
