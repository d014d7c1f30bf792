#include "intra/nccl/nccl_collectives.hpp"

#include <c10/cuda/CUDAException.h>

#include <numeric>

#include "intra/nccl/nccl_utils.hpp"

namespace fastcomm {
namespace nccl {

namespace {

// Data movement needs no arithmetic: any dtype moves as bytes.
ncclDataType_t moveType(const at::Tensor& t, int64_t& count) {
  count = t.numel() * static_cast<int64_t>(t.element_size());
  return ncclUint8;
}

// NCCL has no bitwise reductions; bool XOR is parity. These reduce locally
// after gathering every rank's contribution.
bool needsLocalReduce(RedOp op, at::ScalarType t) {
  if (op == RedOp::BAnd || op == RedOp::BOr || op == RedOp::BXor) {
    return !(t == at::kBool && op != RedOp::BXor);
  }
  return false;
}

// rows: [n, ...] gathered contributions; returns their reduction over dim 0.
at::Tensor reduceRows(const at::Tensor& rows, RedOp op) {
  if (rows.scalar_type() == at::kBool) {  // only BXOR gets here
    return rows.to(at::kInt).sum(0).remainder(2).to(at::kBool);
  }
  at::Tensor acc = rows[0].clone();
  for (int64_t i = 1; i < rows.size(0); ++i) {
    if (op == RedOp::BAnd)
      acc.bitwise_and_(rows[i]);
    else if (op == RedOp::BOr)
      acc.bitwise_or_(rows[i]);
    else
      acc.bitwise_xor_(rows[i]);
  }
  return acc;
}

// One contiguous buffer holding `inputs` back to back (the tensor itself when
// there is one).
at::Tensor flatInput(const Tensors& inputs) {
  if (inputs.size() == 1) return inputs[0].contiguous();
  std::vector<at::Tensor> flats;
  for (const auto& i : inputs) flats.push_back(i.reshape({-1}));
  return at::cat(flats);
}

}  // namespace

DeviceContig::DeviceContig(const at::Tensor& t)
    : orig(t), work(t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous)) {}

void DeviceContig::load() const {
  if (!work.is_same(orig)) work.copy_(orig);
}

void DeviceContig::finish() const {
  if (!work.is_same(orig)) orig.copy_(work);
}

void allreduce(const Call& c, const Tensors& tensors, RedOp op) {
  for (const auto& t : tensors) {
    DeviceContig d(t);
    d.load();
    if (needsLocalReduce(op, t.scalar_type())) {
      at::Tensor rows = at::empty({c.size, t.numel()}, t.options());
      int64_t n;
      auto type = moveType(d.work, n);
      ncclCheck(ncclAllGather(d.work.data_ptr(), rows.data_ptr(), n, type, c.comm, c.stream),
                c.comm, "all_reduce");
      d.work.view({-1}).copy_(reduceRows(rows, op));
    } else if (t.numel() > 0) {
      ncclCheck(
          ncclAllReduce(d.work.data_ptr(), d.work.data_ptr(), t.numel(), ncclType(t.scalar_type()),
                        ncclRedOp(op, t.scalar_type()), c.comm, c.stream),
          c.comm, "all_reduce");
    }
    d.finish();
  }
}

void broadcast(const Call& c, const at::Tensor& tensor, int root) {
  DeviceContig d(tensor);
  d.load();
  int64_t n;
  auto type = moveType(d.work, n);
  ncclCheck(ncclBroadcast(d.work.data_ptr(), d.work.data_ptr(), n, type, root, c.comm, c.stream),
            c.comm, "broadcast");
  d.finish();
}

void reduce(const Call& c, const at::Tensor& tensor, RedOp op, int root) {
  DeviceContig d(tensor);
  d.load();
  if (needsLocalReduce(op, tensor.scalar_type())) {
    at::Tensor rows = at::empty({c.size, tensor.numel()}, tensor.options());
    int64_t n;
    auto type = moveType(d.work, n);
    ncclCheck(ncclAllGather(d.work.data_ptr(), rows.data_ptr(), n, type, c.comm, c.stream), c.comm,
              "reduce");
    if (c.rank == root) d.work.view({-1}).copy_(reduceRows(rows, op));
  } else if (tensor.numel() > 0) {
    ncclCheck(ncclReduce(d.work.data_ptr(), d.work.data_ptr(), tensor.numel(),
                         ncclType(tensor.scalar_type()), ncclRedOp(op, tensor.scalar_type()), root,
                         c.comm, c.stream),
              c.comm, "reduce");
  }
  if (c.rank == root) d.finish();
}

void allgather(const Call& c, const Tensors& outputs, const at::Tensor& input) {
  at::Tensor src = input.contiguous();
  const bool flat = outputs.size() == 1 && outputs[0].is_contiguous();
  at::Tensor dst = flat ? outputs[0] : at::empty({c.size, input.numel()}, input.options());
  int64_t n;
  auto type = moveType(src, n);
  ncclCheck(ncclAllGather(src.data_ptr(), dst.data_ptr(), n, type, c.comm, c.stream), c.comm,
            "all_gather");
  if (!flat) {
    if (outputs.size() == 1) {
      outputs[0].copy_(dst.view(outputs[0].sizes()));
    } else {
      for (int i = 0; i < c.size; ++i) outputs[i].copy_(dst[i].view(outputs[i].sizes()));
    }
  }
}

void gather(const Call& c, const Tensors& outputs, const at::Tensor& input, int root) {
  at::Tensor src = input.contiguous();
  int64_t n;
  auto type = moveType(src, n);
  std::vector<DeviceContig> dsts;
  for (const auto& o : outputs) dsts.emplace_back(o);
  ncclCheck(ncclGroupStart(), c.comm, "gather");
  if (c.rank == root) {
    for (int i = 0; i < c.size; ++i) {
      if (i == c.rank) {
        C10_CUDA_CHECK(cudaMemcpyAsync(dsts[i].work.data_ptr(), src.data_ptr(), n,
                                       cudaMemcpyDeviceToDevice, c.stream));
      } else {
        ncclCheck(ncclRecv(dsts[i].work.data_ptr(), n, type, i, c.comm, c.stream), c.comm,
                  "gather");
      }
    }
  } else {
    ncclCheck(ncclSend(src.data_ptr(), n, type, root, c.comm, c.stream), c.comm, "gather");
  }
  ncclCheck(ncclGroupEnd(), c.comm, "gather");
  for (const auto& d : dsts) d.finish();
}

void scatter(const Call& c, const at::Tensor& output, const Tensors& inputs, int root) {
  DeviceContig dst(output);
  int64_t n;
  auto type = moveType(dst.work, n);
  ncclCheck(ncclGroupStart(), c.comm, "scatter");
  std::vector<at::Tensor> srcs;
  if (c.rank == root) {
    for (int i = 0; i < c.size; ++i) {
      srcs.push_back(inputs[i].contiguous());
      if (i == c.rank) {
        C10_CUDA_CHECK(cudaMemcpyAsync(dst.work.data_ptr(), srcs[i].data_ptr(), n,
                                       cudaMemcpyDeviceToDevice, c.stream));
      } else {
        ncclCheck(ncclSend(srcs[i].data_ptr(), n, type, i, c.comm, c.stream), c.comm, "scatter");
      }
    }
  } else {
    ncclCheck(ncclRecv(dst.work.data_ptr(), n, type, root, c.comm, c.stream), c.comm, "scatter");
  }
  ncclCheck(ncclGroupEnd(), c.comm, "scatter");
  dst.finish();
}

void reduceScatter(const Call& c, const at::Tensor& output, const Tensors& inputs, RedOp op) {
  at::Tensor src = flatInput(inputs);
  DeviceContig dst(output);
  const int64_t count = output.numel();
  if (needsLocalReduce(op, output.scalar_type())) {
    // Every rank's block for me, then a local reduction.
    at::Tensor rows = at::empty({c.size, count}, output.options());
    const int64_t n = count * static_cast<int64_t>(output.element_size());
    ncclCheck(ncclGroupStart(), c.comm, "reduce_scatter");
    for (int i = 0; i < c.size; ++i) {
      ncclCheck(
          ncclSend(static_cast<char*>(src.data_ptr()) + i * n, n, ncclUint8, i, c.comm, c.stream),
          c.comm, "reduce_scatter");
      ncclCheck(ncclRecv(rows[i].data_ptr(), n, ncclUint8, i, c.comm, c.stream), c.comm,
                "reduce_scatter");
    }
    ncclCheck(ncclGroupEnd(), c.comm, "reduce_scatter");
    dst.work.view({-1}).copy_(reduceRows(rows, op));
  } else if (count > 0) {
    ncclCheck(ncclReduceScatter(src.data_ptr(), dst.work.data_ptr(), count,
                                ncclType(output.scalar_type()), ncclRedOp(op, output.scalar_type()),
                                c.comm, c.stream),
              c.comm, "reduce_scatter");
  }
  dst.finish();
}

void alltoall(const Call& c, const Tensors& outputs, const Tensors& inputs,
              const std::vector<int64_t>& sendCounts, const std::vector<int64_t>& recvCounts) {
  const int64_t es = static_cast<int64_t>(inputs[0].element_size());
  at::Tensor src = flatInput(inputs);
  const int64_t recvTotal = std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0});
  const bool flatOut = outputs.size() == 1 && outputs[0].is_contiguous();
  at::Tensor dst = flatOut ? outputs[0] : at::empty({recvTotal}, inputs[0].options());
  ncclCheck(ncclGroupStart(), c.comm, "all_to_all");
  int64_t so = 0, ro = 0;
  for (int i = 0; i < c.size; ++i) {
    if (sendCounts[i] > 0)
      ncclCheck(ncclSend(static_cast<char*>(src.data_ptr()) + so * es, sendCounts[i] * es,
                         ncclUint8, i, c.comm, c.stream),
                c.comm, "all_to_all");
    if (recvCounts[i] > 0)
      ncclCheck(ncclRecv(static_cast<char*>(dst.data_ptr()) + ro * es, recvCounts[i] * es,
                         ncclUint8, i, c.comm, c.stream),
                c.comm, "all_to_all");
    so += sendCounts[i];
    ro += recvCounts[i];
  }
  ncclCheck(ncclGroupEnd(), c.comm, "all_to_all");
  if (!flatOut) {
    if (outputs.size() == 1) {
      outputs[0].copy_(dst.view(outputs[0].sizes()));
    } else {
      int64_t off = 0;
      for (int i = 0; i < c.size; ++i) {
        outputs[i].copy_(dst.narrow(0, off, recvCounts[i]).view(outputs[i].sizes()));
        off += recvCounts[i];
      }
    }
  }
}

void send(const Call& c, const at::Tensor& tensor, int peer) {
  at::Tensor src = tensor.contiguous();
  int64_t n;
  auto type = moveType(src, n);
  ncclCheck(ncclSend(src.data_ptr(), n, type, peer, c.comm, c.stream), c.comm, "send");
}

void recv(const Call& c, const at::Tensor& tensor, int peer) {
  DeviceContig dst(tensor);
  int64_t n;
  auto type = moveType(dst.work, n);
  ncclCheck(ncclRecv(dst.work.data_ptr(), n, type, peer, c.comm, c.stream), c.comm, "recv");
  dst.finish();
}

}  // namespace nccl
}  // namespace fastcomm
