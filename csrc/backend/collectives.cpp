// The collectives of ProcessGroupFastComm: every check of a call runs here,
// before any communication and whatever device path then runs it.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

#include "backend/process_group.hpp"
#include "backend/sparse_allreduce.hpp"
#include "backend/work.hpp"

namespace fastcomm {

namespace {

// Names as torch.distributed spells the collectives (stats keys, errors) and
// the profiler range of each.
#define FASTCOMM_OP(ident, text)      \
  constexpr const char* ident = text; \
  constexpr const char* ident##Title = "fastcomm:" text;
FASTCOMM_OP(kBroadcast, "broadcast")
FASTCOMM_OP(kAllReduce, "all_reduce")
FASTCOMM_OP(kAllReduceCoalesced, "all_reduce_coalesced")
FASTCOMM_OP(kReduce, "reduce")
FASTCOMM_OP(kAllGather, "all_gather")
FASTCOMM_OP(kAllGatherInto, "all_gather_into_tensor")
FASTCOMM_OP(kAllGatherCoalesced, "all_gather_coalesced")
FASTCOMM_OP(kAllGatherIntoCoalesced, "all_gather_into_tensor_coalesced")
FASTCOMM_OP(kGather, "gather")
FASTCOMM_OP(kScatter, "scatter")
FASTCOMM_OP(kReduceScatter, "reduce_scatter")
FASTCOMM_OP(kReduceScatterTensor, "reduce_scatter_tensor")
FASTCOMM_OP(kReduceScatterCoalesced, "reduce_scatter_tensor_coalesced")
FASTCOMM_OP(kAllToAllSingle, "all_to_all_single")
FASTCOMM_OP(kAllToAll, "all_to_all")
FASTCOMM_OP(kSend, "send")
FASTCOMM_OP(kRecv, "recv")
FASTCOMM_OP(kBarrier, "barrier")
#undef FASTCOMM_OP
// The wildcard receive's profiler range is named as c10d's other backends name it.
constexpr const char* kRecvAny = "recv_anysource";
constexpr const char* kRecvAnyTitle = "fastcomm:recvAnySource";

// `ident`'s OpCall; `opts` tells whether the call is synchronous.
#define FASTCOMM_CALL(ident, type, bytes, opts) \
  OpCall { ident, ident##Title, c10d::OpType::type, bytes, !(opts).asyncOp }

using Tensors = std::vector<at::Tensor>;

void checkTensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "fastcomm: ", op, ": undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, "fastcomm: ", op, " supports dense tensors only, got ",
              t.layout());
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "fastcomm: ", op,
              " supports CPU and CUDA tensors, got ", t.device());
}

const at::Tensor& single(const Tensors& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "fastcomm: ", op, " takes exactly one tensor per rank, got ",
              tensors.size());
  checkTensor(tensors[0], op);
  return tensors[0];
}

void checkSameKind(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* what) {
  checkTensor(t, op);
  TORCH_CHECK(t.device() == ref.device(), "fastcomm: ", op, ": ", what, " is on ", t.device(),
              " but the input is on ", ref.device(), "; all tensors of a call must share a device");
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "fastcomm: ", op, ": ", what, " has dtype ",
              t.scalar_type(), " but the input has ", ref.scalar_type());
}

// Complex tensors reduce as pairs of reals where that is exact (SUM, AVG).
void checkComplex(const at::Tensor& t, const c10d::ReduceOp& op, const char* name) {
  TORCH_CHECK(!t.is_complex() || c10d::isComplexViewAsRealAllowed(op), "fastcomm: ", name,
              " supports complex tensors only with SUM and AVG");
}

// The reduction `op` on `t` (as the path will see it, see asReal).
RedOp redOpFor(const at::Tensor& t, const c10d::ReduceOp& op, const char* name) {
  checkComplex(t, op, name);
  return toRedOp(op, asReal(t).scalar_type(), name);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::broadcast(Tensors& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, kBroadcast);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "fastcomm: broadcast: invalid root ",
              opts.rootRank, " for a group of ", size_);
  TORCH_CHECK(opts.rootTensor == 0, "fastcomm: broadcast: rootTensor must be 0");
  return path(t).broadcast(FASTCOMM_CALL(kBroadcast, BROADCAST, nbytes(t), opts), tensors,
                           static_cast<int>(opts.rootRank));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allreduce(Tensors& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
    return allreduceSparse(*this, tensors[0], opts);
  const at::Tensor& t = single(tensors, kAllReduce);
  const RedOp op = redOpFor(t, opts.reduceOp, kAllReduce);
  return path(t).allreduce(FASTCOMM_CALL(kAllReduce, ALLREDUCE, nbytes(t), opts), tensors, op);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allreduce_coalesced(
    Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "fastcomm: all_reduce_coalesced needs at least one tensor");
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    checkSameKind(tensors[0], t, kAllReduceCoalesced, "a tensor");
    checkComplex(t, opts.reduceOp, kAllReduceCoalesced);
    bytes += nbytes(t);
  }
  const RedOp op = redOpFor(tensors[0], opts.reduceOp, kAllReduceCoalesced);
  return path(tensors[0])
      .allreduce(FASTCOMM_CALL(kAllReduceCoalesced, ALLREDUCE_COALESCED, bytes, opts), tensors, op);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::reduce(Tensors& tensors,
                                                            const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors, kReduce);
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "fastcomm: reduce: invalid root ",
              opts.rootRank, " for a group of ", size_);
  TORCH_CHECK(opts.rootTensor == 0, "fastcomm: reduce: rootTensor must be 0");
  const RedOp op = redOpFor(t, opts.reduceOp, kReduce);
  return path(t).reduce(FASTCOMM_CALL(kReduce, REDUCE, nbytes(t), opts), tensors, op,
                        static_cast<int>(opts.rootRank));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allgather(std::vector<Tensors>& outputs,
                                                               Tensors& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, kAllGather);
  TORCH_CHECK(outputs.size() == 1, "fastcomm: all_gather takes one output list, got ",
              outputs.size());
  auto& outs = outputs[0];
  TORCH_CHECK(static_cast<int>(outs.size()) == size_, "fastcomm: all_gather: the output list has ",
              outs.size(), " tensors but the group has ", size_, " ranks");
  bool even = true;
  for (const auto& o : outs) {
    checkSameKind(in, o, kAllGather, "an output tensor");
    even = even && o.numel() == in.numel();
  }
  if (even)
    return path(in).allgather(FASTCOMM_CALL(kAllGather, ALLGATHER, nbytes(in), opts), outs, in);
  // Ranks of different sizes (NCCL's all_gather_v): output r is rank r's
  // broadcast. Every rank sees the same sizes, so every rank takes this path.
  TORCH_CHECK(outs[rank_].numel() == in.numel(), "fastcomm: all_gather: output ", rank_, " has ",
              outs[rank_].numel(), " elements but this rank's input has ", in.numel());
  outs[rank_].copy_(in.reshape(outs[rank_].sizes()));
  std::vector<WorkPtr> parts;
  for (int r = 0; r < size_; ++r) {
    Tensors one{outs[r]};
    parts.push_back(path(in).broadcast(
        OpCall{kAllGather, nullptr, c10d::OpType::BROADCAST, nbytes(outs[r]), !opts.asyncOp}, one,
        r));
  }
  return c10::make_intrusive<GroupedWork>(rank_, std::move(parts), outs, kAllGatherTitle, inputs);
}

// The legacy list form: outputs[r][i] receives rank r's inputs[i]. One
// all_gather per input, all validated before the first is issued.
c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allgather_coalesced(
    std::vector<Tensors>& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "fastcomm: all_gather_coalesced needs at least one input tensor");
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_,
              "fastcomm: all_gather_coalesced: the output has ", outputs.size(),
              " lists but the group has ", size_, " ranks");
  for (const auto& in : inputs) checkSameKind(inputs[0], in, kAllGatherCoalesced, "an input");
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK(outputs[r].size() == inputs.size(), "fastcomm: all_gather_coalesced: output list ",
                r, " has ", outputs[r].size(), " tensors but there are ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkSameKind(inputs[i], outputs[r][i], kAllGatherCoalesced, "an output tensor");
      TORCH_CHECK(outputs[r][i].numel() == inputs[i].numel(),
                  "fastcomm: all_gather_coalesced: output [", r, "][", i, "] has ",
                  outputs[r][i].numel(), " elements but input ", i, " has ", inputs[i].numel());
    }
  }
  std::vector<WorkPtr> parts;
  std::vector<at::Tensor> results;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensors outs;
    for (auto& list : outputs) outs.push_back(list[i]);
    // The group, not each part, is the call's profiler range.
    parts.push_back(path(inputs[i]).allgather(
        OpCall{kAllGatherCoalesced, nullptr, c10d::OpType::ALLGATHER_COALESCED, nbytes(inputs[i]),
               !opts.asyncOp},
        outs, inputs[i]));
    results.insert(results.end(), outs.begin(), outs.end());
  }
  return c10::make_intrusive<GroupedWork>(rank_, std::move(parts), std::move(results),
                                          kAllGatherCoalescedTitle, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  checkTensor(input, kAllGatherInto);
  checkSameKind(input, output, kAllGatherInto, "the output");
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "fastcomm: all_gather_into_tensor: output "
              "has ",
              output.numel(), " elements but must have world_size (", size_, ") x input (",
              input.numel(), ")");
  return path(input).allgather(FASTCOMM_CALL(kAllGatherInto, _ALLGATHER_BASE, nbytes(input), opts),
                               {output}, input);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::allgather_into_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "fastcomm: all_gather_into_tensor_coalesced needs as many outputs as inputs (got ",
              outputs.size(), " and ", inputs.size(), ")");
  int64_t bytes = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], kAllGatherIntoCoalesced);
    checkSameKind(inputs[0], inputs[i], kAllGatherIntoCoalesced, "an input");
    checkSameKind(inputs[i], outputs[i], kAllGatherIntoCoalesced, "an output");
    TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * size_,
                "fastcomm: all_gather_into_tensor_coalesced: output ", i,
                " must have world_size x "
                "input elements");
    bytes += nbytes(inputs[i]);
  }
  return path(inputs[0]).allgatherCoalesced(
      FASTCOMM_CALL(kAllGatherIntoCoalesced, COALESCED, bytes, opts), outputs, inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::gather(std::vector<Tensors>& outputs,
                                                            Tensors& inputs,
                                                            const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs, kGather);
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "fastcomm: gather: invalid root ", root,
              " for a group of ", size_);
  Tensors outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                "fastcomm: gather: the root needs one output list of ", size_, " tensors");
    outs = outputs[0];
    for (const auto& o : outs) {
      checkSameKind(in, o, kGather, "an output tensor");
      TORCH_CHECK(o.numel() == in.numel(),
                  "fastcomm: gather: output tensors must have the "
                  "input's ",
                  in.numel(), " elements, got ", o.numel());
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "fastcomm: gather: only the root may pass output tensors");
  }
  return path(in).gather(FASTCOMM_CALL(kGather, GATHER, nbytes(in), opts), outs, in, root);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::scatter(Tensors& outputs,
                                                             std::vector<Tensors>& inputs,
                                                             const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs, kScatter);
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "fastcomm: scatter: invalid root ", root,
              " for a group of ", size_);
  Tensors ins;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                "fastcomm: scatter: the root needs one input list of ", size_, " tensors");
    ins = inputs[0];
    for (const auto& i : ins) {
      checkSameKind(out, i, kScatter, "an input tensor");
      TORCH_CHECK(i.numel() == out.numel(),
                  "fastcomm: scatter: input tensors must have the "
                  "output's ",
                  out.numel(), " elements, got ", i.numel());
    }
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "fastcomm: scatter: only the root may pass input tensors");
  }
  return path(out).scatter(FASTCOMM_CALL(kScatter, SCATTER, nbytes(out), opts), out, ins, root);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::reduce_scatter(
    Tensors& outputs, std::vector<Tensors>& inputs, const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, kReduceScatter);
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
              "fastcomm: reduce_scatter: the input list has ",
              inputs.empty() ? 0 : inputs[0].size(), " tensors but the group has ", size_,
              " ranks");
  Tensors& ins = inputs[0];
  bool even = true;
  for (const auto& i : ins) {
    checkSameKind(out, i, kReduceScatter, "an input tensor");
    even = even && i.numel() == out.numel();
  }
  const RedOp op = redOpFor(out, opts.reduceOp, kReduceScatter);
  if (even)
    return path(out).reduceScatter(
        FASTCOMM_CALL(kReduceScatter, REDUCE_SCATTER, nbytes(out) * size_, opts), out, ins, op);
  // Ranks of different sizes (NCCL's reduce_scatter_v): share r is a reduce to
  // rank r, here into the output, elsewhere into a copy (inputs stay as given).
  TORCH_CHECK(ins[rank_].numel() == out.numel(), "fastcomm: reduce_scatter: input ", rank_, " has ",
              ins[rank_].numel(), " elements but this rank's output has ", out.numel());
  out.copy_(ins[rank_].reshape(out.sizes()));
  std::vector<WorkPtr> parts;
  for (int r = 0; r < size_; ++r) {
    Tensors one{r == rank_ ? out : ins[r].clone(at::MemoryFormat::Contiguous)};
    parts.push_back(path(out).reduce(
        OpCall{kReduceScatter, nullptr, c10d::OpType::REDUCE, nbytes(one[0]), !opts.asyncOp}, one,
        op, r));
  }
  return c10::make_intrusive<GroupedWork>(rank_, std::move(parts), outputs, kReduceScatterTitle,
                                          ins);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, kReduceScatterTensor);
  checkSameKind(input, output, kReduceScatterTensor, "the output");
  TORCH_CHECK(input.numel() == output.numel() * size_,
              "fastcomm: reduce_scatter_tensor: input "
              "has ",
              input.numel(), " elements but must have world_size (", size_, ") x output (",
              output.numel(), ")");
  const RedOp op = redOpFor(output, opts.reduceOp, kReduceScatterTensor);
  return path(input).reduceScatter(
      FASTCOMM_CALL(kReduceScatterTensor, _REDUCE_SCATTER_BASE, nbytes(input), opts), output,
      {input}, op);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::reduce_scatter_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size() && !inputs.empty(),
              "fastcomm: reduce_scatter_tensor_coalesced needs as many outputs as inputs (got ",
              outputs.size(), " and ", inputs.size(), ")");
  int64_t bytes = 0;
  RedOp op = RedOp::Sum;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], kReduceScatterCoalesced);
    checkSameKind(inputs[0], inputs[i], kReduceScatterCoalesced, "an input");
    checkSameKind(inputs[i], outputs[i], kReduceScatterCoalesced, "an output");
    TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * size_,
                "fastcomm: reduce_scatter_tensor_coalesced: input ", i,
                " must have world_size x output elements");
    op = redOpFor(inputs[i], opts.reduceOp, kReduceScatterCoalesced);
    bytes += nbytes(inputs[i]);
  }
  return path(inputs[0]).reduceScatterCoalesced(
      FASTCOMM_CALL(kReduceScatterCoalesced, COALESCED, bytes, opts), outputs, inputs, op);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  checkTensor(input, kAllToAllSingle);
  checkSameKind(input, output, kAllToAllSingle, "the output");
  // Counts in rows of dim 0 (equal splits when none are given).
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    std::vector<int64_t> c(size_);
    if (splits.empty()) {
      const int64_t rows = t.dim() == 0 ? t.numel() : t.size(0);
      TORCH_CHECK(rows % size_ == 0, "fastcomm: all_to_all_single: ", what, " dim 0 (", rows,
                  ") is not divisible by the group size ", size_);
      std::fill(c.begin(), c.end(), rows / size_);
    } else {
      TORCH_CHECK(static_cast<int>(splits.size()) == size_, "fastcomm: all_to_all_single: ", what,
                  " split sizes have ", splits.size(), " entries, expected ", size_);
      const int64_t sum = std::accumulate(splits.begin(), splits.end(), int64_t{0});
      TORCH_CHECK(t.dim() > 0 && sum == t.size(0), "fastcomm: all_to_all_single: ", what,
                  " split sizes sum to ", sum, " but dim 0 is ", t.dim() > 0 ? t.size(0) : 0);
      for (int64_t s : splits) TORCH_CHECK(s >= 0, "fastcomm: all_to_all_single: negative split");
      c = splits;
    }
    const int64_t rows = t.dim() == 0 ? t.numel() : t.size(0);
    const int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
    for (auto& v : c) v *= rowElems;  // elements
    return c;
  };
  std::vector<int64_t> sendCounts = counts(input, inputSplits, "input");
  std::vector<int64_t> recvCounts = counts(output, outputSplits, "output");
  return path(input).alltoall(FASTCOMM_CALL(kAllToAllSingle, ALLTOALL_BASE, nbytes(input), opts),
                              {output}, {input}, sendCounts, recvCounts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::alltoall(Tensors& outputs, Tensors& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
              "fastcomm: all_to_all needs ", size_, " input and ", size_, " output tensors, got ",
              inputs.size(), " and ", outputs.size());
  checkTensor(inputs[0], kAllToAll);
  for (const auto& t : inputs) checkSameKind(inputs[0], t, kAllToAll, "an input tensor");
  for (const auto& t : outputs) checkSameKind(inputs[0], t, kAllToAll, "an output tensor");
  std::vector<int64_t> sendCounts, recvCounts;
  int64_t bytes = 0;
  for (int i = 0; i < size_; ++i) {
    sendCounts.push_back(inputs[i].numel());
    recvCounts.push_back(outputs[i].numel());
    bytes += nbytes(inputs[i]);
  }
  return path(inputs[0]).alltoall(FASTCOMM_CALL(kAllToAll, ALLTOALL, bytes, opts), outputs, inputs,
                                  sendCounts, recvCounts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::send(Tensors& tensors, int dstRank, int tag) {
  return g_.block.deferError(rank_, [&] { return sendNow(tensors, dstRank, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::sendNow(Tensors& tensors, int dstRank,
                                                             int tag) {
  const at::Tensor& t = single(tensors, kSend);
  TORCH_CHECK(dstRank >= 0 && dstRank < size_,
              "fastcomm: send: invalid "
              "destination ",
              dstRank, " (group of ", size_, ", this is rank ", rank_, ")");
  return path(t).send(OpCall{kSend, kSendTitle, c10d::OpType::SEND, nbytes(t)}, t, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::recv(Tensors& tensors, int srcRank, int tag) {
  return g_.block.deferError(rank_, [&] { return recvNow(tensors, srcRank, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::recvNow(Tensors& tensors, int srcRank,
                                                             int tag) {
  const at::Tensor& t = single(tensors, kRecv);
  TORCH_CHECK(srcRank >= 0 && srcRank < size_,
              "fastcomm: recv: invalid "
              "source ",
              srcRank, " (group of ", size_, ", this is rank ", rank_, ")");
  return path(t).recv(OpCall{kRecv, kRecvTitle, c10d::OpType::RECV, nbytes(t)}, t, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::recvAnysource(Tensors& tensors, int tag) {
  const at::Tensor& t = single(tensors, kRecvAny);
  TORCH_CHECK(!t.is_cuda(),
              "fastcomm: recv from any source is supported for CPU tensors only "
              "(NCCL has no wildcard receive); pass an explicit source rank");
  return hostPath_->recvAny(OpCall{kRecvAny, kRecvAnyTitle, c10d::OpType::RECVANYSOURCE, nbytes(t)},
                            t, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::barrier(const c10d::BarrierOptions&) {
  // A host barrier: every rank's host reached it. (ProcessGroupNCCL's device
  // all-reduce also orders GPU work; fastcomm's work.wait() already does.)
  return hostPath_->barrier(OpCall{kBarrier, kBarrierTitle, c10d::OpType::BARRIER, 0});
}

}  // namespace fastcomm
