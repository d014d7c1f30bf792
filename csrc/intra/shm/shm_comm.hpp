// Collectives among the ranks of one node through one POSIX shared-memory
// segment.
//
// Protocol: the collective lane of every rank advances through numbered
// *steps*. In step s a rank writes only into its own region of the buffer with
// parity s % 2, arrives at barrier s, then reads any rank's region of that
// parity. A region written in step s is rewritten no earlier than step s + 2,
// which a rank enters only after everyone arrived at barrier s + 1, i.e. after
// everyone finished reading it. So one barrier per step suffices, and a
// pipelined all-reduce costs one barrier per chunk.
//
// Point-to-point messages use a separate ring buffer per directed pair.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/config.hpp"
#include "common/deadline.hpp"
#include "common/host_comm.hpp"
#include "common/reduce.hpp"

namespace fastcomm {

struct ShmHeader;
struct MemberCtl;
struct RingCtl;

class ShmComm final : public HostComm {
 public:
  // Collective over `groupRanks` (the group ranks of this node's members, in
  // local order); `me` indexes into it. Uses `store` (already prefixed for the
  // group) to find the segment. Blocks until every member mapped it or `ctx`
  // expires.
  ShmComm(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
          std::vector<int> groupRanks, int me, const Config& cfg, const OpContext& ctx);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  int size() const override { return size_; }
  int index() const override { return me_; }
  int64_t segmentBytes() const { return mapBytes_; }

  // Collectives: called from one thread (the group's collective lane) in the
  // same order on every member. Buffers are contiguous host memory; roots are
  // local indices.
  void barrier(const OpContext& ctx) override;
  void allreduce(void* data, int64_t count, at::ScalarType dt, RedOp op,
                 const OpContext& ctx) override;
  void reduce(void* data, int64_t count, at::ScalarType dt, RedOp op, int root,
              const OpContext& ctx) override;
  void broadcast(void* data, int64_t bytes, int root, const OpContext& ctx) override;
  void allgather(const void* in, void* out, int64_t bytes, const OpContext& ctx) override;
  void gather(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) override;
  void scatter(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) override;
  void reduceScatter(const void* in, void* out, int64_t count, at::ScalarType dt, RedOp op,
                     const OpContext& ctx) override;
  // sendBytes/sendOffsets index the input by destination, recvBytes/recvOffsets
  // the output by source; the pairwise sizes are checked against each other.
  void alltoall(const void* in, const std::vector<int64_t>& sendBytes,
                const std::vector<int64_t>& sendOffsets, void* out,
                const std::vector<int64_t>& recvBytes, const std::vector<int64_t>& recvOffsets,
                const OpContext& ctx) override;
  // Exchanges signatures and throws naming the ranks that differ from the
  // majority (FASTCOMM_CHECK=1).
  void checkSignatures(const OpSignature& mine, const OpContext& ctx) override;

  // Point to point, callable from several threads (one per peer and
  // direction). Messages from one peer arrive in order; the tag of the next
  // message must match.
  void send(const void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) override;
  void recv(void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) override;
  // One look at every peer's ring: receives a waiting message with `tag` and
  // returns its sender's index, or -1 (never waits).
  int tryRecvAny(void* data, int64_t bytes, int tag, const OpContext& ctx);
  // Receives the first message with `tag` from any peer; returns its index.
  int recvAny(void* data, int64_t bytes, int tag, const OpContext& ctx) override;

 private:
  struct Ring;

  char* slot(int rank, uint64_t step) const;
  // Ends the write phase of a step: publish arrival, wait for all members.
  void arriveAndWait(const OpContext& ctx);
  // Waits until `ready()`, sleeping on the segment's futex after a short spin;
  // throws when ctx expires or a member process exits. `pending()` lists the
  // local indices still awaited (for the error message).
  template <typename Ready, typename Pending>
  void waitFor(Ready ready, Pending pending, const OpContext& ctx, const char* phase);
  void wake();
  std::vector<int> deadMembers(const std::vector<int>& among) const;
  [[noreturn]] void fail(const OpContext& ctx, const std::vector<int>& missing,
                         const char* phase) const;

  void ringWrite(int peer, const void* data, int64_t bytes, const OpContext& ctx);
  void ringRead(int peer, void* data, int64_t bytes, const OpContext& ctx);
  bool ringPeek(int peer, void* data, int64_t bytes) const;

  std::vector<int> groupRanks_;
  int size_;
  int me_;
  Config cfg_;
  int64_t slotBytes_;
  int64_t p2pBytes_;
  int64_t spinIters_;
  ShmHeader* hdr_ = nullptr;
  MemberCtl* ctl_ = nullptr;  // one per member
  RingCtl* rings_ = nullptr;  // [sender][receiver]
  char* slots_ = nullptr;     // [member][parity] x slotBytes_
  char* p2p_ = nullptr;       // [sender][receiver] x p2pBytes_
  char* base_ = nullptr;
  int64_t mapBytes_ = 0;
  uint64_t step_ = 0;
  std::vector<std::mutex> sendLocks_;
  std::vector<std::mutex> recvLocks_;
};

}  // namespace fastcomm
