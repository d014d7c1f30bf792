// Host-memory collectives for a group spanning several nodes: each collective
// is a short plan of shared phases, intra (shared memory among the node's
// ranks) -> inter (rings over the transport, one per rail, all rails at once)
// -> intra. For example all_reduce = reduce-scatter in the node, all-reduce
// of this rank's shard with its rail, all-gather in the node, pipelined in
// chunks so the intra phases of chunk k+1 run while the network carries
// chunk k.
//
// Nodes of different sizes fall back to a flat plan: one ring over every
// rank, all traffic over the transport (logged at INFO).
// Point-to-point traffic (send/recv, and the pairwise parts of gather,
// scatter and all_to_all) goes straight between the two ranks: shared memory
// inside a node, the transport across nodes.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/lane.hpp"
#include "common/config.hpp"
#include "common/host_comm.hpp"
#include "plans/ring_comm.hpp"
#include "inter/transport.hpp"
#include "intra/shm/shm_comm.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

class HierComm final : public HostComm {
 public:
  // Connects to the peers the plans need; `store` is the group's store.
  HierComm(const c10::intrusive_ptr<c10d::Store>& store, const Topology& topo, const Config& cfg,
           const OpContext& ctx);
  ~HierComm() override;

  int size() const override { return topo_.size; }
  int index() const override { return topo_.rank; }
  bool flat() const { return flat_; }
  std::string describe() const;

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
  void alltoall(const void* in, const std::vector<int64_t>& sendBytes,
                const std::vector<int64_t>& sendOffsets, void* out,
                const std::vector<int64_t>& recvBytes, const std::vector<int64_t>& recvOffsets,
                const OpContext& ctx) override;
  void checkSignatures(const OpSignature& mine, const OpContext& ctx) override;

  void send(const void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) override;
  void recv(void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) override;
  int recvAny(void* data, int64_t bytes, int tag, const OpContext& ctx) override;

  // After a failure: tells the peers why (through the store) and closes the
  // transports so that ranks waiting on this one fail at once, not at their
  // timeout.
  void abort(const std::string& why);

 private:
  // Runs `fn` turning any failure into abort() + rethrow.
  template <typename Fn>
  void guarded(const OpContext& ctx, Fn fn);
  // Adds the first failing rank's reason (published in the store) to an
  // error about `peer`.
  std::string peerReason(int peer);
  bool sameNode(int peer) const { return topo_.nodeOf[peer] == topo_.myNode; }
  // Local index of a group rank in this node (intra_ order).
  int localIndex(int groupRank) const;
  void pairwise(const void* in, const std::vector<int64_t>& sendBytes,
                const std::vector<int64_t>& sendOffsets, void* out,
                const std::vector<int64_t>& recvBytes, const std::vector<int64_t>& recvOffsets,
                bool viaTransportOnly, const OpContext& ctx);
  void divide(void* data, int64_t count, at::ScalarType dt) const;

  // The next user-message header from a peer on another node. The transport
  // cannot peek, so a recv from any source posts a header receive to every
  // such peer and keeps it posted; whichever recv comes next for that peer
  // (any source with a matching tag, or recv(src=peer)) takes it over.
  struct P2PHeader {
    int64_t tag = 0;
    int64_t bytes = 0;
  };
  struct Inbox {
    std::mutex mu;  // a recv(src=peer) holds it while it waits
    P2PHeader header;
    std::unique_ptr<transport::Request> pending;  // posted, not yet complete
    bool arrived = false;                         // `header` holds the next message's
  };
  // Posts or tests `peer`'s header receive; true once the header is in.
  bool headerArrived(Inbox& box, int peer, const OpContext& ctx);
  // Receives the payload announced by box.header into `data`.
  void takeMessage(Inbox& box, void* data, int64_t bytes, int peer, int tag, const OpContext& ctx);

  c10::intrusive_ptr<c10d::Store> store_;
  Topology topo_;
  Config cfg_;
  bool flat_ = false;  // uneven nodes: one ring over every rank
  int numNodes_ = 1, localSize_ = 1;
  std::unique_ptr<ShmComm> intra_;  // this node's ranks (send/recv and intra phases)
  std::unique_ptr<transport::Transport> coll_, p2p_;
  std::vector<std::unique_ptr<transport::Connection>> collConns_, p2pConns_;
  std::vector<transport::Connection*> collTo_, p2pTo_;  // by group rank
  std::unique_ptr<RingComm> ring_;                      // the rail (or, flat, every rank)
  std::unique_ptr<SerialLane> interLane_;               // runs the inter phase of pipelined plans
  std::vector<char> scratch_, scratch2_;
  std::vector<std::unique_ptr<Inbox>> inbox_;  // by group rank; peers reached by p2p_
};

}  // namespace fastcomm
