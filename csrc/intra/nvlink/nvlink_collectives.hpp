// all_reduce, all_gather and reduce_scatter of CUDA tensors over peer memory
// inside one node, for the GPUs of a group that all reach each other over
// NVLink: fastcomm's own kernels (one-shot and two-shot all_reduce)
// (kernels/nvlink_collectives.hpp) on registered buffers (PeerBuffers) synchronised through signal
// pads (SignalPads), for the sizes NvlinkAlgo picks; everything else stays on NCCL.
//
// Each call's kernel reads the caller's tensor and pushes it into the
// peers' registered buffers, so an eager call and a call captured into a
// CUDA graph run the same kernel with the same fixed buffer addresses, and
// the call counter that the signals follow lives in device memory, advanced
// by the kernel itself: replays need no host work.
//
// Calls of a group must run one after another on the GPU (as NCCL's must),
// in the same order on every rank.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "common/reduce.hpp"
#include "intra/nvlink/nvlink_choice.hpp"
#include "intra/nvlink/peer_buffers.hpp"
#include "intra/nvlink/signal_pads.hpp"

namespace fastcomm {

class NvlinkCollectives {
 public:
  // Collective over the group's `size` ranks, all on this node, at the
  // group's CUDA set-up (never during a graph capture). Null when some rank
  // cannot run the path (group rank 0 logs why at INFO, once); throws a comm
  // error when a rank does not take part within `timeout`.
  static std::unique_ptr<NvlinkCollectives> create(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size, at::Device device,
                                                   std::chrono::milliseconds timeout);
  // Releases the buffers once no kernel of this rank uses them any more (the
  // caller waited for its last one): unmaps the peers' buffers, then frees
  // its own once every peer unmapped it (a store barrier of a few seconds at
  // most; past that the buffer is given up unfreed). `failed`: the group
  // failed; waiting kernels give up and the buffer is freed at once. Graphs
  // that captured these all_reduces must not be replayed afterwards.
  void shutdown(bool failed);
  // shutdown(true) if it did not run.
  ~NvlinkCollectives();

  // The kernel for an all_reduce of `t` with `op`, or None: the same answer
  // on every rank for the same call.
  NvlinkAlgo choose(const at::Tensor& t, RedOp op) const;
  // Issues the all_reduce of the contiguous `in` into `out` (the same shape
  // and dtype, possibly the same memory) on `stream`. `seq` and `captured`
  // name the op if a wait in it times out.
  void allreduce(const at::Tensor& in, const at::Tensor& out, RedOp op, NvlinkAlgo algo,
                 cudaStream_t stream, uint64_t seq, bool captured);
  // Whether the all_gather of `input` (each rank's part) / the
  // reduce_scatter into `output` (each rank's part) with `op` runs here: the
  // same answer on every rank for the same call.
  bool takesAllgather(const at::Tensor& input) const;
  bool takesReduceScatter(const at::Tensor& output, RedOp op) const;
  // The all_gather of the contiguous `in` into the contiguous `out` of size x
  // its elements (this rank's part of `out` may be `in`).
  void allgather(const at::Tensor& in, const at::Tensor& out, cudaStream_t stream, uint64_t seq,
                 bool captured);
  // The reduce_scatter of the contiguous `in` (size x out's elements) into
  // the contiguous `out` (which may be this rank's part of `in`).
  void reduceScatter(const at::Tensor& in, const at::Tensor& out, RedOp op, cudaStream_t stream,
                     uint64_t seq, bool captured);

  // The first wait that outlasted the group's timeout, if any kernel
  // reported one.
  std::optional<SignalPads::Timeout> timedOut() const { return pads_->timedOut(); }
  // Makes every waiting kernel of the group give up (the group failed).
  void abort() { pads_->abort(); }
  std::string describe() const;

  NvlinkCollectives(const NvlinkCollectives&) = delete;
  NvlinkCollectives& operator=(const NvlinkCollectives&) = delete;

 private:
  NvlinkCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    std::chrono::milliseconds timeout, std::unique_ptr<SignalPads> pads);
  // The kernel arguments of a call over `n` elements (or bytes).
  nvlk::Args args(nvlk::Collective collective, const at::Tensor& in, const at::Tensor& out,
                  int64_t n, RedOp op, uint64_t seq, bool captured) const;

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<SignalPads> pads_;
  std::unique_ptr<PeerBuffers> buffers_;  // freed first: no kernel uses the pads after
};

}  // namespace fastcomm
