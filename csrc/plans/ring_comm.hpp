// Collectives among a few ranks on different nodes (a rail, or every rank in
// the flat fallback) over the inter-node transport: rings for bandwidth, and
// recursive doubling for small all-reduces (log2(n) exchanges instead of the
// ring's 2(n-1) steps).
//
// Every block moves in pieces of about FASTCOMM_CHUNK_BYTES, and a piece goes
// on to the next step as soon as it is reduced, so receiving piece j+1,
// reducing piece j and sending piece j-1 of the next step overlap (NCCL's
// ring pipeline). With a wire dtype (plans/wire_codec.hpp), float32 sums
// travel coded and are accumulated in float32; each block's owner rounds its
// finished block the same way, piece by piece as the all-gather sends it, so
// every rank ends with bit-identical values.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <memory>
#include <vector>

#include "common/deadline.hpp"
#include "common/reduce.hpp"
#include "inter/transport.hpp"
#include "plans/wire_codec.hpp"

namespace fastcomm {

class RingComm {
 public:
  // `members` are group ranks in ring order; `me` indexes it. `conns[i]`
  // connects to members[i] (null for me) and must outlive this object.
  RingComm(transport::Transport& transport, std::vector<int> members, int me,
           std::vector<transport::Connection*> conns, int64_t chunkBytes, WireDtype wire);

  int size() const { return static_cast<int>(members_.size()); }
  int index() const { return me_; }
  const std::vector<int>& members() const { return members_; }
  // Extra words for an error about `peer` (why it went away, if known).
  void setPeerReason(std::function<std::string(int)> fn) { peerReason_ = std::move(fn); }

  // In place. `op` must not be Avg (the caller divides once at the end).
  void allreduce(void* data, int64_t count, at::ScalarType dt, RedOp op, const OpContext& ctx);
  // The same by recursive doubling, whole buffers at each exchange: for
  // messages where latency, not bandwidth, counts.
  void allreduceSmall(void* data, int64_t count, at::ScalarType dt, RedOp op, const OpContext& ctx);
  // `data` holds size() blocks of `blockCount` elements; afterwards block
  // index() holds their reduction (the other blocks are clobbered).
  void reduceScatter(void* data, int64_t blockCount, at::ScalarType dt, RedOp op,
                     const OpContext& ctx);
  // `data` holds size() blocks of `blockBytes`, block index() being this
  // rank's; afterwards every block is filled.
  void allgather(void* data, int64_t blockBytes, const OpContext& ctx);
  // `data` holds size() blocks of `blockBytes`, block index() being this
  // rank's; afterwards member `root` (an index) holds every block (the
  // others' buffers are unchanged). The root receives from all at once, in
  // pieces of the chunk size.
  void gatherTo(void* data, int64_t blockBytes, int root, const OpContext& ctx);
  // Pipelined chain from `root` (an index) around the ring.
  void broadcast(void* data, int64_t bytes, int root, const OpContext& ctx);
  void barrier(const OpContext& ctx);

 private:
  struct Blocks {
    std::vector<int64_t> off, len;  // in elements
  };
  // One pipelined ring pass over `b`: `rsSteps` reduce-scatter steps (after
  // size() - 1 of them block index() is reduced here), then `agSteps`
  // all-gather steps (block index() is final here; after size() - 1 of them
  // all are). One pass for both halves of an all-reduce: a piece goes on to
  // the all-gather as soon as it is reduced, with no pause between them.
  void pass(char* data, const Blocks& b, at::ScalarType dt, RedOp op, int rsSteps, int agSteps,
            bool wire, const OpContext& ctx);
  bool useWire(at::ScalarType dt, RedOp op) const;
  // Sends `sendBuf` to and receives `recvBuf` from member `peer` (either may
  // be null), both of `bytes`, and waits for both.
  void exchange(int peer, const void* sendBuf, void* recvBuf, int64_t bytes, const OpContext& ctx);
  // Runs `fn`, turning a transport failure into an error naming the op and
  // the peer.
  template <typename Fn>
  void named(const OpContext& ctx, Fn fn);
  char* scratch(int64_t bytes);

  transport::Transport& transport_;
  std::vector<int> members_;
  int me_;
  std::vector<transport::Connection*> conns_;
  int64_t chunkBytes_;
  WireCodec wire_;
  std::vector<char> scratch_;
  std::function<std::string(int)> peerReason_;
};

}  // namespace fastcomm
