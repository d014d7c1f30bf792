// Collectives over host memory among the ranks of a group, as the backend's
// CPU path calls them. Two implementations: ShmComm (all ranks on one node,
// shared memory) and HierComm (several nodes: shared memory inside each node,
// the inter-node transport between them).
//
// Collective methods are called from one thread (the group's collective lane)
// in the same order on every rank. Buffers are contiguous host memory; ranks
// and roots are indices into the communicator (group ranks for the backend).
// Point-to-point methods may be called from several threads (one per peer and
// direction); messages from one peer arrive in order and the tag of the next
// message must match.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/deadline.hpp"
#include "common/reduce.hpp"

namespace fastcomm {

// What a rank is about to run; compared across ranks with FASTCOMM_CHECK=1.
struct OpSignature {
  char name[40] = {};
  int32_t dtype = -1;
  int32_t redop = -1;
  int32_t root = -1;
  int32_t pad = 0;
  int64_t numel = 0;
  int64_t aux = 0;  // e.g. output numel
  bool operator==(const OpSignature& o) const;
  std::string describe() const;
};

// Throws naming the ranks whose signature differs from the majority's.
// `all[i]` is the signature of `ranks[i]`.
void checkSignatureVotes(const std::vector<OpSignature>& all, const std::vector<int>& ranks,
                         const OpContext& ctx);

class HostComm {
 public:
  virtual ~HostComm() = default;

  virtual int size() const = 0;
  virtual int index() const = 0;

  virtual void barrier(const OpContext& ctx) = 0;
  virtual void allreduce(void* data, int64_t count, at::ScalarType dt, RedOp op,
                         const OpContext& ctx) = 0;
  virtual void reduce(void* data, int64_t count, at::ScalarType dt, RedOp op, int root,
                      const OpContext& ctx) = 0;
  virtual void broadcast(void* data, int64_t bytes, int root, const OpContext& ctx) = 0;
  // `out` holds size() blocks of `bytes`, in rank order.
  virtual void allgather(const void* in, void* out, int64_t bytes, const OpContext& ctx) = 0;
  virtual void gather(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) = 0;
  virtual void scatter(const void* in, void* out, int64_t bytes, int root,
                       const OpContext& ctx) = 0;
  // `in` holds size() blocks of `count` elements; this rank's block reduced
  // over all ranks lands in `out`.
  virtual void reduceScatter(const void* in, void* out, int64_t count, at::ScalarType dt, RedOp op,
                             const OpContext& ctx) = 0;
  // sendBytes/sendOffsets index the input by destination, recvBytes/recvOffsets
  // the output by source; the pairwise sizes are checked against each other.
  virtual void alltoall(const void* in, const std::vector<int64_t>& sendBytes,
                        const std::vector<int64_t>& sendOffsets, void* out,
                        const std::vector<int64_t>& recvBytes,
                        const std::vector<int64_t>& recvOffsets, const OpContext& ctx) = 0;
  // Exchanges signatures and throws naming the ranks that differ from the
  // majority (FASTCOMM_CHECK=1).
  virtual void checkSignatures(const OpSignature& mine, const OpContext& ctx) = 0;

  virtual void send(const void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) = 0;
  virtual void recv(void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) = 0;
  // Receives the first message with `tag` from any peer; returns its index.
  virtual int recvAny(void* data, int64_t bytes, int tag, const OpContext& ctx) = 0;
};

}  // namespace fastcomm
