// The registered buffers of the NVLink all-reduce: one plain cudaMalloc
// allocation per rank (never the caching allocator's memory, whose
// expandable segments cudaIpcGetMemHandle refuses), exported as a CUDA IPC
// handle through the group's store and mapped by every other rank of the
// node. Peer access is proven, not taken from the driver's answer: each rank
// writes a token into every peer's buffer through its mapping, and each
// checks, after a store barrier, that every peer's token arrived.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/deadline.hpp"

namespace fastcomm {

class PeerBuffers {
 public:
  // Collective over the group's `size` ranks, all on this node, each on its
  // own GPU `device`: buffers of `bytes`, zeroed. A non-empty `refusal` says
  // this rank cannot take part (then it only votes). Returns null with the
  // reasons in *why (the same on every rank) when some rank refused or could
  // not map or reach every peer's buffer; throws a comm error naming the
  // ranks that did not answer within ctx's time.
  static std::unique_ptr<PeerBuffers> exchange(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size, int64_t bytes, at::Device device,
                                               const OpContext& ctx, const std::string& refusal,
                                               std::string* why);
  // Unmaps the peers' buffers and frees this rank's (which waits for the
  // device: no kernel may still use them).
  ~PeerBuffers();
  // Unmaps the peers' buffers (no kernel of this rank may still use them).
  void closePeers();
  // Frees this rank's buffer, or with `free` false gives it up unfreed:
  // freeing memory that a peer still maps is undefined behaviour in CUDA.
  void releaseOwn(bool free);
  PeerBuffers(const PeerBuffers&) = delete;
  PeerBuffers& operator=(const PeerBuffers&) = delete;

  // Rank r's buffer as mapped in this process.
  void* base(int r) const { return ptrs_[static_cast<size_t>(r)]; }
  int size() const { return static_cast<int>(ptrs_.size()); }
  int64_t bytes() const { return bytes_; }

 private:
  PeerBuffers(int rank, int size, int64_t bytes, int device);
  // Each returns "" or why this rank cannot go on.
  std::string allocate(cudaStream_t stream, std::string* published);
  std::string open(const std::vector<std::string>& published);
  std::string writeProbes(cudaStream_t stream, const std::vector<uint64_t>& nonces);
  std::string checkProbes(cudaStream_t stream, const std::vector<uint64_t>& nonces);

  int rank_;
  int device_;
  int64_t bytes_;
  std::vector<void*> ptrs_;
};

}  // namespace fastcomm
