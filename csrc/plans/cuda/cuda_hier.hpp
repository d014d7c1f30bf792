// CUDA all_reduce across nodes: intra-node NCCL reduce-scatter -> exchange of
// every rank's shard with its rail (same local index on the other nodes) over
// our own transport, staged through pinned host memory and pipelined in
// chunks -> intra-node NCCL all-gather. The GPU copies and reduces; a proxy
// thread only moves bytes over the network (the host CPU never adds big data).
//
// Per chunk k (plans/hier_layout.hpp: each chunk of the shard is cut into one
// piece per rail member, piece p owned by the member on node p):
//   P(k): copy the pieces the peers own to pinned send slots (cast to the
//         16-bit wire dtype first if asked);
//   net:  send them, receive the peers' copies of this rank's own piece;
//   A(k): copy those to the GPU, reduce them into the own piece (one
//         kernel), copy the result to a pinned slot;
//   net:  send it to every peer, receive their reduced pieces;
//   B(k): copy those into place.
// All GPU work of an op is issued at once by the caller's thread, on the
// group's comm stream, in a fixed order in which P of later chunks comes
// before A/B of earlier ones, so copies of chunk k+1, the network of chunk k
// and the reduction of chunk k-1 overlap. The steps that must wait for the
// network wait on flags in mapped pinned memory (cuStreamWaitValue32, then a
// reset with cuStreamWriteValue32 so every slot is reusable and a replay sees
// the same values); the GPU reports finished steps with cuStreamWriteValue32
// to flags the proxy polls. Only the proxy thread releases GPU waits, and it
// does so from host-observed progress alone: no GPU wait ever depends on GPU
// work issued later on another stream, which could deadlock when CUDA maps
// several streams onto one hardware queue (the warning of cuStreamWaitValue32).
// A window of kWindow chunk slots of pinned memory, allocated once, is reused
// across chunks and calls.
//
// Failures (transport errors, timeouts) fail the work with an error naming
// the collective, the peer and the timeout, abort the group's communicators
// and close the transports; the proxy then keeps releasing every GPU wait so
// no stream blocks forever, and shutdown frees the pinned memory only once
// the comm stream drained.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/config.hpp"
#include "common/deadline.hpp"
#include "common/reduce.hpp"
#include "inter/transport.hpp"
#include "plans/hier_layout.hpp"
#include "plans/inter_plan.hpp"
#include "topology/topology.hpp"

namespace fastcomm {

class CudaHier {
 public:
  // How the plan reaches back into the group's CUDA collectives.
  struct Hooks {
    // Fails every work in flight, aborts the communicators (this plan's too,
    // through abortComms()) and refuses later calls; `why` is the error.
    std::function<void(const std::string& why)> abortGroup;
    // Group ranks that stopped issuing collectives at `seq` (heartbeats), as
    // "[1, 2]", or "" when all look alive.
    std::function<std::string(uint64_t seq)> laggingRanks;
  };

  // An all_reduce handed to the proxy: everything it needs, by value, so it
  // could equally be enqueued from a host node of a CUDA graph.
  struct Op {
    std::string name;  // e.g. "all_reduce" (errors, timeline)
    uint64_t seq = 0;
    std::chrono::milliseconds timeout{0};
    Clock::time_point deadline{};
    HierLayout layout;
    int64_t firstChunk = 0;  // plan-wide chunk number of chunk 0 (its slot)
    int64_t esize = 0;       // bytes per element on the wire
    std::function<void(std::exception_ptr)> failWork;
  };

  // Collective over the group: every rank calls it at the same all_reduce.
  // Returns null when some rank cannot run the path (the reason is logged);
  // then every rank keeps the flat NCCL communicator.
  static std::unique_ptr<CudaHier> create(const c10::intrusive_ptr<c10d::Store>& store,
                                          const Topology& topo, const InterPlan& plan,
                                          const Config& cfg, at::Device device,
                                          std::chrono::milliseconds timeout, Hooks hooks);
  ~CudaHier();

  // Whether an all_reduce of `numel` elements (`bytes`) of `dt` with `op`
  // takes this path: the same answer on every rank, as it depends on the
  // agreed plan and the topology only.
  static bool eligible(const InterPlan& plan, const Topology& topo, at::ScalarType dt, RedOp op,
                       int64_t numel, int64_t bytes);
  std::string describe() const;

  // Issues the all_reduce of the contiguous `t` in place on `stream` (the
  // caller holds the group's issue lock, so calls come in the same order on
  // every rank). `failWork` fails the collective's work.
  void allreduce(const at::Tensor& t, RedOp op, cudaStream_t stream, const OpContext& ctx,
                 std::function<void(std::exception_ptr)> failWork);

  // From the group's abort, under its issue lock: aborts the intra-node
  // communicator and closes the transports; the proxy fails what is left and
  // keeps releasing GPU waits.
  void abortComms(const std::string& why);
  // Destroy: `stream` is the comm stream the ops ran on. Waits for it to
  // drain (bounded after a failure), stops the proxy, closes the transports,
  // frees the pinned memory (leaked, with a warning, if the stream never
  // drained) and releases the intra-node communicator.
  void shutdown(cudaStream_t stream, bool failed);

  CudaHier(const CudaHier&) = delete;
  CudaHier& operator=(const CudaHier&) = delete;

 private:
  struct Resources;  // pinned memory and driver entry points
  struct ChunkState;
  CudaHier(const c10::intrusive_ptr<c10d::Store>& store, const Topology& topo,
           const InterPlan& plan, const Config& cfg, at::Device device,
           std::chrono::milliseconds timeout, Hooks hooks, std::unique_ptr<Resources> res);

  void connect(const OpContext& ctx);
  void proxyLoop();
  // Runs one op to completion; throws on failure.
  void runOp(Op& op);
  [[noreturn]] void failNetwork(const Op& op, const std::vector<int>& pendingPeers);
  [[noreturn]] void failGpu(const Op& op);
  void failAll(std::exception_ptr e, Op* current);
  void releaseAllWaits();
  std::string peerReason(int peer);
  void publishReason(const std::string& why);

  // GPU side of the schedule (caller thread).
  void issueP(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize, bool wire,
              char* dPack, cudaStream_t s);
  void issueA(const HierLayout& l, int64_t k, int64_t slot, char* shard, at::ScalarType dt,
              RedOp op, bool wire, char* dRecv, char* dOut, cudaStream_t s);
  void issueB(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize, bool wire,
              char* dPack, cudaStream_t s);
  void waitFlag(cudaStream_t s, int kind, int64_t slot);
  void writeFlag(cudaStream_t s, int kind, int64_t slot, uint32_t value);
  char* sendSlot(int64_t slot, int j) const;    // RS pieces to peer j
  char* recvSlot(int64_t slot, int j) const;    // RS pieces from peer j
  char* agSendSlot(int64_t slot) const;         // this rank's reduced piece
  char* agRecvSlot(int64_t slot, int j) const;  // reduced piece of peer j

  c10::intrusive_ptr<c10d::Store> store_;
  Topology topo_;
  InterPlan plan_;
  Config cfg_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
  Hooks hooks_;
  std::unique_ptr<Resources> res_;
  int nodes_, local_, me_, localRank_;
  std::vector<int> railPeers_;  // group rank of node peerNode(j, me_), j < nodes_ - 1
  ncclComm_t intra_ = nullptr;  // the node's ranks (null with one rank per node)
  std::unique_ptr<transport::Transport> rsNet_, agNet_;
  std::vector<std::unique_ptr<transport::Connection>> rsConns_, agConns_;
  std::unique_ptr<transport::MemoryRegion> rsMr_, agMr_;
  int64_t nextChunk_ = 0;  // plan-wide chunk counter (caller thread, under the issue lock)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};  // drain mode: keep releasing GPU waits
  std::string abortWhy_;             // the first failure (guarded by mu_)
  std::thread proxy_;
  std::thread aborter_;  // aborts the group after a proxy failure
};

}  // namespace fastcomm
