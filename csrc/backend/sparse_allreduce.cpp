#include "backend/sparse_allreduce.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/work.hpp"

namespace fastcomm {

namespace {

// Every rank's `t` (same shape on every rank), in rank order.
std::vector<at::Tensor> gatherAll(c10d::Backend& backend, const at::Tensor& t) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < backend.getSize(); ++r) outputs[0].push_back(at::empty_like(t));
  std::vector<at::Tensor> inputs{t};
  backend.allgather(outputs, inputs, c10d::AllgatherOptions())->wait();
  return outputs[0];
}

// `t` padded with zeros along `dim` to `to` entries.
at::Tensor padded(const at::Tensor& t, int64_t dim, int64_t to) {
  auto sizes = t.sizes().vec();
  sizes[dim] = to;
  at::Tensor out = at::zeros(sizes, t.options());
  out.narrow(dim, 0, t.size(dim)).copy_(t);
  return out;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> allreduceSparse(c10d::Backend& backend, at::Tensor& tensor,
                                               const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensor.layout() == at::kSparse, "fastcomm: all_reduce: not a sparse COO tensor");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM,
              "fastcomm: all_reduce of sparse tensors supports SUM only");
  // The profiler range spans the whole call.
  auto work = c10::make_intrusive<HostWork>(
      backend.getRank(), c10d::OpType::ALLREDUCE, "fastcomm:all_reduce",
      backend.getSequenceNumberForGroup(), std::vector<at::Tensor>{tensor},
      std::vector<at::Tensor>{tensor});
  const at::Tensor input = tensor.coalesce();
  const at::Tensor indices = input._indices();
  const at::Tensor values = input._values();

  const std::vector<at::Tensor> counts =
      gatherAll(backend, at::full({1}, input._nnz(), indices.options()));
  std::vector<int64_t> nnz;
  for (const auto& c : counts) nnz.push_back(c.item<int64_t>());
  const int64_t most = *std::max_element(nnz.begin(), nnz.end());
  if (most > 0) {  // every rank knows `most`: all skip or none
    const std::vector<at::Tensor> allIndices = gatherAll(backend, padded(indices, 1, most));
    const std::vector<at::Tensor> allValues = gatherAll(backend, padded(values, 0, most));
    std::vector<at::Tensor> idx, val;
    for (size_t r = 0; r < nnz.size(); ++r) {
      idx.push_back(allIndices[r].narrow(1, 0, nnz[r]));
      val.push_back(allValues[r].narrow(0, 0, nnz[r]));
    }
    tensor.copy_(
        at::sparse_coo_tensor(at::cat(idx, 1), at::cat(val, 0), input.sizes(), input.options())
            .coalesce());
  }
  work->complete();
  return work;
}

}  // namespace fastcomm
