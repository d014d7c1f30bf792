// all_reduce of sparse COO tensors, as torch.distributed offers it (DDP's sparse
// gradients, e.g. nn.Embedding(sparse=True)).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fastcomm {

// SUM over the group of `tensor`, a sparse COO tensor, in place: every rank
// gathers every rank's coalesced indices and values through `backend`'s own
// all_gather and sums them locally (as ProcessGroupGloo does). Runs to the end
// before it returns, on the caller's thread; the work it returns is complete.
c10::intrusive_ptr<c10d::Work> allreduceSparse(c10d::Backend& backend, at::Tensor& tensor,
                                               const c10d::AllreduceOptions& opts);

}  // namespace fastcomm
