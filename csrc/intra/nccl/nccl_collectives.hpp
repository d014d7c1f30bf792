// The collectives on one NCCL communicator as stream work: each function
// issues its NCCL calls (and the copies around them) on `stream` and returns
// without waiting. The caller holds a guard for the communicator's device
// with `stream` current, so that temporaries belong to it, and decides
// grouping, events and error handling.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <vector>

#include "common/reduce.hpp"

namespace fastcomm {
namespace nccl {

using Tensors = std::vector<at::Tensor>;

struct Call {
  ncclComm_t comm;
  cudaStream_t stream;
  int rank;  // of this process in the communicator
  int size;
};

// A contiguous stand-in for `t`: load() copies `t` in when it is not
// contiguous itself, finish() copies the result back.
struct DeviceContig {
  at::Tensor orig, work;
  explicit DeviceContig(const at::Tensor& t);
  void load() const;
  void finish() const;
};

// `tensors` one after the other. Bitwise reductions, which NCCL lacks,
// gather every rank's contribution and reduce locally (bool XOR as parity).
void allreduce(const Call& c, const Tensors& tensors, RedOp op);
void broadcast(const Call& c, const at::Tensor& tensor, int root);
// Only the root's tensor is written.
void reduce(const Call& c, const at::Tensor& tensor, RedOp op, int root);
// `outputs`: one flat tensor of size x input elements or one per rank.
void allgather(const Call& c, const Tensors& outputs, const at::Tensor& input);
void gather(const Call& c, const Tensors& outputs, const at::Tensor& input, int root);
void scatter(const Call& c, const at::Tensor& output, const Tensors& inputs, int root);
// `inputs`: one flat tensor of size x output elements or one per rank.
void reduceScatter(const Call& c, const at::Tensor& output, const Tensors& inputs, RedOp op);
// Counts in elements of the flat input and output, indexed by peer.
void alltoall(const Call& c, const Tensors& outputs, const Tensors& inputs,
              const std::vector<int64_t>& sendCounts, const std::vector<int64_t>& recvCounts);
void send(const Call& c, const at::Tensor& tensor, int peer);
void recv(const Call& c, const at::Tensor& tensor, int peer);

}  // namespace nccl
}  // namespace fastcomm
