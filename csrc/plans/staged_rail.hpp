// The rail phase of the multi-node all_reduce of device memory: after the
// intra-node reduce-scatter, every rank exchanges its shard with its rail
// (the ranks with its local index on the other nodes) over fastcomm's
// transport, staged through memory the transport can move (pinned host
// memory, or device memory where the transport moves that: GPUDirect RDMA)
// and pipelined in chunks, the device reducing what arrives.
// plans/cuda/cuda_hier.* runs it on a GPU (between NCCL's reduce-scatter and
// all-gather); tests run the same code on the CPU with an emulated device
// (csrc/testing/staged_rail_bindings.cpp).
//
// Per chunk k (kernels/staged_layout.hpp: each chunk of the shard is cut into one
// piece per rail member, piece p owned by the member on node p):
//   P(k): the device stages the pieces the peers own in send slots (coded
//         for the wire dtype if asked);
//   net:  the proxy sends them and receives the peers' copies of this rank's
//         own piece;
//   A(k): the device reduces those into the own piece and stages the result;
//   net:  the proxy sends it to every peer and receives theirs;
//   B(k): the device puts those in place.
// Each step is one device operation that reads and writes the staging in
// place (StagedDevice::packToStaging, reduceFromStaging, gatherFromStaging:
// on a GPU, kernels on mapped pinned or device staging), so a chunk costs 3
// data operations, the same for every rail size and wire dtype.
//
// Two members (two nodes) exchange whole chunks instead: the same bytes
// cross the link, in one network hop per chunk instead of two.
//   P(k): the device stages all of chunk k (coded for the wire dtype);
//   net:  the proxy sends it to the peer and receives the peer's chunk k;
//   A(k): the device reduces that into chunk k (with a wire dtype after
//         putting its own staged codes back in place decoded, so both members
//         add the same two coded values and end with identical sums; the
//         result is coded into the send slot and decoded again, as A does
//         with several members).
// Results match on both members because their two operands are the same
// (op is commutative). The slot's first half holds the staged chunk, its
// second half the peer's. A(k) overwrites what P(k) read, so its wait is
// released only once P(k) is done too (on lanes nothing else orders them),
// and, where it writes the send slot (a wire dtype), once the chunk was sent.
//
// Streams: an eager op puts its steps on three lanes (P, A, B: each in chunk
// order on a stream of its own, forked from the op's stream and joined back
// at its end), so a step waiting for the network holds back only its own
// kind: P(k + W) does not wait behind the all-gather arrival of chunk
// k - lag, nor B(k) behind the reduce-scatter arrival of chunk k + lag. The
// order of the data is kept by the flags alone: A(k) and B(k) touch
// disjoint parts of the chunk (this rank's piece, the peers' pieces); B(k)
// overwrites the pieces P(k) read only after the peers' reduced pieces
// arrived, which they sent after receiving what P(k) staged; and A(k) writes
// the slot's all-gather send piece, which the proxy protects by releasing
// A(k)'s wait (kFlagRsIn) only once the slot's previous chunk was sent
// (freed), which on one stream P(k)'s kFlagFree wait before it did. Deadlock
// freedom where streams share a hardware queue: the steps are still issued
// in the one order above, so each queue runs a subsequence of it, and every
// wait depends only on steps earlier in that order (what makes one stream
// safe); the earliest unfinished step is then always at the head of its
// queue. A CUDA graph replays its nodes in an order of its own choosing, so
// a captured op puts all its steps on the op's stream (one in-order stream
// is deadlock-free by the same argument).
// The caller's thread issues all device work of an op at once, in a fixed
// order in which P of later chunks comes before A/B of earlier ones, so the
// staging of one chunk, the network of another and the reduction of a third
// overlap. Device steps that need the network wait on
// flags in host memory (wait for 1, then reset to 0, so every slot is
// reusable and a replay sees the same values); the device reports finished
// steps by setting flags the proxy polls. Only the proxy thread releases the
// device's waits, from host-observed progress alone: no wait depends on
// device work issued later on another stream, which could deadlock where
// several streams share one hardware queue (the warning of
// cuStreamWaitValue32). One transport breaks that rule: the ib emulation
// (FASTCOMM_IB_EMULATE=1) moves device staging with CUDA copies of its own,
// so with device staging the network's progress is CUDA work. Hence, while
// an op's waits are queued, its own issue must never synchronize the
// context: its kernels are loaded at set-up (hierk::preload; lazy loading
// may synchronize the context at a kernel's first launch), and the
// emulation copies only between device memory and page-locked memory, on a
// non-blocking stream made at registration (inter/ib/gpu_memory.hpp; a copy
// of pageable memory may wait for other streams). What other threads do
// meanwhile (a cudaMalloc, a lazily loaded kernel of the application) may
// still hold those copies back; the emulation then fails the transfer after
// a time limit instead of hanging. A real NIC's DMA is no CUDA work, so
// there such calls only wait for the network. `window` chunk slots of
// staging (the chunks in flight, FASTCOMM_CUDA_WINDOW), allocated once by the
// owner (at connect(), once the transports say what memory they can move),
// are reused across chunks and calls.
//
// Failures (transport errors, timeouts) fail the op's work with an error
// naming the collective, the peer and the timeout, and abort the group (a
// hook); the proxy then keeps releasing every device wait, so no stream waits
// forever.
//
// CUDA graphs. Under capture (StagedDevice::capturing()) the device steps of
// an op are recorded once and run again on every replay, and the op must
// reach the proxy on every replay too. So instead of the issuing thread
// pushing it once, a host call recorded before the op's first device wait
// (StagedDevice::hostCall: a host node of the graph) hands a fresh copy of
// the op's descriptor to the proxy each time the stream gets there, its
// deadline counted from then. The rail owns the captured descriptors until
// stop(). NCCL feeds its proxy from captured kernel plans the same way
// (src/enqueue.cc: for a persistent plan, cudaLaunchHostFunc of
// hostStreamPlanCallback, which uploads the plan's proxy ops). The device
// side needs nothing new: its waits are "wait for 1, reset to 0", the
// staging and flags have fixed addresses, and every flag is back to its
// initial value when the proxy finishes an op (the flags below), so each
// replay starts from the state the capture saw.
//
// Once an op was captured, eager ops go through a host call too (the issuing
// thread no longer pushes them directly, so their receives are posted only
// when the stream reaches them): the proxy must take ops in the device's
// order, and a replay's op reaches the queue only when its stream reaches
// the host node, so an eager op pushed at issue could overtake a replay
// launched before it. NCCL likewise sends an eager plan's proxy work
// through a host callback while the communicator has captured plans and its
// host stream may still run one of theirs (src/enqueue.cc, persistentRefs);
// fastcomm cannot see replays coming and always does once it captured.
//
// Slots: chunk k of an op uses slot (firstChunk + k) % window, and the
// proxy and the device both take firstChunk from the same descriptor, so
// they agree within an op whatever it is: a replay keeps the one fixed at
// capture while eager ops in between move the counter on. Nothing about a
// slot carries over from one op to the next: the proxy serves ops one at a
// time in the device's order, leaves every flag at its initial value, and
// the device only reuses a slot after the kFlagFree the proxy gives once
// the slot's previous chunk (of whichever op) is sent. So a replay starting
// on a slot an eager op has just used merely waits for it, as consecutive
// eager ops do.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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
#include "plans/ring_comm.hpp"
#include "plans/wire_codec.hpp"
#include "kernels/staged_layout.hpp"

namespace fastcomm {

// Flags. Host -> device (the stream waits for 1, then resets to 0): a slot's
// staging is free again; a chunk's reduce-scatter pieces arrived; its
// all-gather pieces arrived. Device -> host (the stream sets 1, the proxy
// resets to 0): a chunk's send pieces are staged; its own piece is reduced
// and staged; its gathered pieces are in place.
enum StagedFlag : int {
  kFlagFree = 0,
  kFlagRsIn,
  kFlagAgIn,
  kFlagPacked,
  kFlagReduced,
  kFlagGathered,
  kStagedFlagKinds
};

// The device side: operations run in issue order on the stream of the lane
// in use (useLane).
class StagedDevice {
 public:
  virtual ~StagedDevice() = default;
  // Host address of a flag, for the proxy.
  virtual uint32_t* hostFlag(int kind, int64_t slot) = 0;
  virtual void waitFlag(int kind, int64_t slot) = 0;  // wait for 1, then reset to 0
  virtual void setFlag(int kind, int64_t slot) = 0;   // 1, after the earlier work is visible
  // The steps: each one device operation that reads and writes the staging
  // in place. Staging piece slots lie `pitch` bytes apart, slot j
  // holding node peerNode(j, me)'s piece; `chunk` is chunk k's first element
  // of `esize` bytes. With a wire dtype the data is float32 and the slots
  // hold a piece as plans/wire_codec.hpp codes it (fp16, int8: its blocks'
  // scales, then its codes).
  // P(k): the pieces of chunk k the peers own -> `slots` (coded).
  virtual void packToStaging(WireDtype wire, int64_t esize, const void* chunk, void* slots,
                             int64_t pitch, const HierLayout& l, int64_t k, int me) = 0;
  // A(k): reduce() with the peers' pieces read from `recv` (peer j's at
  // recv + j * pitch bytes) and the result stored both in out[] (the
  // all-gather send slot; null for none, without a wire dtype), as dt or
  // coded, and in own[] (with a wire dtype: decoded, so the owner keeps
  // exactly what its peers receive).
  virtual void reduceFromStaging(at::ScalarType dt, RedOp op, WireDtype wire, void* own,
                                 const void* recv, int64_t pitch, int nPeers, int64_t n,
                                 int64_t divisor, void* out) = 0;
  // B(k): the peers' reduced pieces of chunk k from `slots` into place in
  // the chunk (decoded).
  virtual void gatherFromStaging(WireDtype wire, int64_t esize, const void* slots, int64_t pitch,
                                 void* chunk, const HierLayout& l, int64_t k, int me) = 0;
  // Whether the operations issued now are recorded for replays (a CUDA graph
  // capture) rather than run once.
  virtual bool capturing() = 0;
  // fn(arg) runs on a host thread once the stream gets here (recorded: on
  // every replay). It must not call CUDA; `arg` must stay valid as long as
  // the call may run.
  virtual void hostCall(void (*fn)(void*), void* arg) = 0;

  // Lanes (eager ops; see the header): the steps P, A and B of an op each on
  // a stream of their own. forkLanes(): lanes A and B start after
  // everything issued so far (on the op's stream, which is lane P);
  // useLane(): later operations go to that lane; joinLanes(): the op's
  // stream waits for lanes A and B, and later operations go to it again.
  virtual void forkLanes() = 0;
  virtual void useLane(int lane) = 0;
  virtual void joinLanes() = 0;
};

enum StagedLane : int { kLaneP = 0, kLaneA, kLaneB, kStagedLanes };

class StagedRail {
 public:
  struct Hooks {
    // Fails every work in flight, aborts the communicators (this rail's
    // transports too, through abort()) and refuses later calls.
    std::function<void(const std::string& why)> abortGroup;
    // Group ranks that stopped issuing collectives at `seq`, as "[1, 2]", or
    // "" when all look alive.
    std::function<std::string(uint64_t seq)> laggingRanks;
  };

  // An op handed to the proxy: everything it needs, by value, so it could
  // equally be enqueued from a host node of a CUDA graph.
  struct Op {
    std::string name;  // e.g. "all_reduce" (errors, timeline)
    uint64_t seq = 0;
    std::chrono::milliseconds timeout{0};
    Clock::time_point deadline{};
    HierLayout layout;
    int64_t firstChunk = 0;            // rail-wide chunk number of chunk 0 (its slot)
    int64_t esize = 0;                 // bytes per element of the data
    WireDtype wire = WireDtype::None;  // how float32 sums travel (None: as they are)
    std::function<void(std::exception_ptr)> failWork;
    // Bytes that a piece of `len` elements takes on the network.
    int64_t pieceBytes(int64_t len) const {
      return wire == WireDtype::None ? len * esize : WireCodec(wire).bytes(len);
    }
  };

  // Staging the owner allocates and keeps alive until stop() returned and
  // the device stopped using it: host memory the device reaches (for a GPU
  // mapped pinned memory), or device memory (`device`) registered with the
  // transports as such.
  struct Staging {
    char* base = nullptr;
    int64_t bytes = 0;
    int64_t pieceBytes = 0;  // one piece slot
    int64_t slotBytes = 0;   // one chunk slot: 3 (R-1) + 1 pieces
    bool device = false;
  };
  // Sizes (base null) of `window` chunk slots.
  static Staging stagingFor(int rails, int64_t chunkBytes, int64_t window);
  // At connect(): sets `s.base` (s.bytes of it, 256-byte aligned) and
  // `s.device`; `deviceMemoryMoves` says whether both of the rail's
  // transports can move device memory (Transport::supportsDeviceMemory).
  using StagingAllocator = std::function<void(Staging& s, bool deviceMemoryMoves)>;

  // `railRanks[n]` is the group rank of this rank's rail member on node n
  // (itself at `me`). `groupSize` divides AVG results.
  StagedRail(StagedDevice& device, std::vector<int> railRanks, int me, int groupRank, int groupSize,
             int64_t chunkBytes, int64_t window, int64_t lag, WireDtype wire,
             const c10::intrusive_ptr<c10d::Store>& store, Hooks hooks);
  ~StagedRail();

  // Connects to the rail peers with two transports (reduce-scatter and
  // all-gather messages, each in chunk order on its own connections) through
  // `store` (prefixed for this rail), has `allocate` provide the staging,
  // registers it with both and starts the proxy thread.
  void connect(const std::string& transport, const Config& cfg,
               const c10::intrusive_ptr<c10d::Store>& store, const OpContext& ctx,
               const StagingAllocator& allocate);

  // Issues the rail phase of an all_reduce of `shard` (device memory, in
  // place) onto the device and hands its op to the proxy (while the device
  // captures: on every replay, see the header). The caller holds the group's
  // issue lock (so calls come in one order on every rank). `failWork` may be
  // empty.
  void allreduce(char* shard, int64_t shardElems, at::ScalarType dt, RedOp op, const OpContext& ctx,
                 std::function<void(std::exception_ptr)> failWork);

  bool wireFor(at::ScalarType dt, RedOp op) const {
    return wire_ != WireDtype::None && dt == at::kFloat && (op == RedOp::Sum || op == RedOp::Avg);
  }
  // The chunks and pieces of one all_reduce: chunks of about chunkBytes of
  // what crosses the network, i.e. of the wire's codes on a wire dtype (2 or
  // 4 times the float32 elements per chunk; the scales of fp16 and int8 add
  // 1/128 or 1/64), since the per-chunk costs (the proxy's posts and flags,
  // the device's waits) are paid per wire chunk.
  // Small ops take smaller chunks (at least 4, of at least 256 KiB; the .cpp says
  // why), so their steps overlap too.
  HierLayout layoutFor(int64_t shardElems, at::ScalarType dt, RedOp op) const;
  bool failed() const { return failed_.load(); }
  // Whether an op was captured (a graph may replay it until stop()).
  bool hasCaptured() const { return !captured_.empty(); }
  int64_t stagingBytes() const { return staging_.bytes; }
  bool stagingOnDevice() const { return staging_.device; }
  int64_t lag() const { return lag_; }
  std::string transportName() const;

  // From the group's abort: closes the transports (requests in flight fail,
  // peers see the connections close); the proxy fails what is left and keeps
  // releasing device waits.
  void abort(const std::string& why);
  // Stops the proxy (serving queued ops first unless failed) and closes the
  // transports. Call once the device finished or gave up: afterwards nobody
  // releases its waits, and host calls that still run find no rail to feed.
  // `deviceMayRun`: the device may still run captured host calls (a replay
  // the owner could not wait for), so their descriptors are leaked, not
  // freed.
  void stop(bool deviceMayRun = false);

  StagedRail(const StagedRail&) = delete;
  StagedRail& operator=(const StagedRail&) = delete;

 private:
  struct ChunkState;
  struct Gate;
  struct HostOp;
  // The host call of an op (a HostOp): hands a copy to the proxy.
  static void enqueueFromStream(void* hostOp);
  void enqueue(Op op);
  void proxyLoop();
  void runOp(Op& op);  // to completion; throws on failure
  // The proxy loops' shared exits and idling: an abort of the group, a
  // failed transfer, and spinning then napping while nothing progresses.
  void throwIfAborted(const Op& op);
  // Whether the device raised host flag `flag` of `slot`; lowers it if so.
  bool takeFlag(int flag, int64_t slot);
  // The peers' data of chunk k is in `slot`: lets the device reduce it and
  // records the network span from `since`; returns the time of release.
  Clock::time_point releaseReduction(int64_t k, int64_t slot, Clock::time_point since);
  [[noreturn]] void failTransport(const Op& op, const transport::TransportError& e);
  static void pause(Clock::duration sinceProgress);
  [[noreturn]] void failNetwork(const Op& op, const std::vector<int>& pendingPeers);
  [[noreturn]] void failDevice(const Op& op);
  void failAll(std::exception_ptr e, Op* current);
  void releaseAllWaits();
  std::string peerReason(int peer);
  std::string laggingNote(const Op& op);
  void publishReason(const std::string& why);

  void runExchange(Op& op);  // runOp of the two-member exchange
  void issueP(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize, bool wire);
  void issueA(const HierLayout& l, int64_t k, int64_t slot, char* shard, at::ScalarType dt,
              RedOp op, bool wire);
  void issueB(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize, bool wire);
  bool anyPeerPiece(const HierLayout& l, int64_t k) const;  // chunk k has a peer's piece
  char* sendSlot(int64_t slot, int j) const;                // pieces for peer j
  char* recvSlot(int64_t slot, int j) const;                // this rank's piece from peer j
  char* agSendSlot(int64_t slot) const;                     // this rank's reduced piece
  char* agRecvSlot(int64_t slot, int j) const;              // the reduced piece of peer j
  // Two-member exchange: the chunk this rank staged (sendSlot(slot, 0), two
  // pieces long) and the peer's chunk (the slot's second half).
  void issuePWhole(const HierLayout& l, int64_t k, int64_t slot, char* shard, int64_t esize,
                   bool wire);
  void issueAWhole(const HierLayout& l, int64_t k, int64_t slot, char* shard, at::ScalarType dt,
                   RedOp op, bool wire);
  char* exchangeRecvSlot(int64_t slot) const;

  StagedDevice& dev_;
  Staging staging_;
  std::vector<int> railRanks_;
  std::vector<int> peers_;  // group rank of peer slot j (node peerNode(j, me_))
  int me_, groupRank_, groupSize_;
  bool exchange_;  // two members: whole chunks in one hop (see the header)
  int64_t chunkBytes_;
  int64_t window_;  // chunk slots (of staging and flags) in flight
  // B (the all-gather step) of chunk k is issued after A (the reduction) of
  // chunk k + lag_, so the stream does not sit waiting for the network of a
  // chunk it just reduced while later chunks' pieces already arrived.
  int64_t lag_;
  WireDtype wire_;
  c10::intrusive_ptr<c10d::Store> store_;  // the group's (failure reasons)
  Hooks hooks_;
  std::unique_ptr<transport::Transport> rsNet_, agNet_;
  std::vector<std::unique_ptr<transport::Connection>> rsConns_, agConns_;
  std::unique_ptr<transport::MemoryRegion> rsMr_, agMr_;
  int64_t nextChunk_ = 0;  // rail-wide chunk counter (issuing thread, under its lock)
  // What host calls reach the rail through (cleared by stop()).
  std::shared_ptr<Gate> gate_;
  // Descriptors of captured ops, each run by its graph's host node on every
  // replay (issuing thread; freed at stop()).
  std::vector<std::unique_ptr<HostOp>> captured_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stop_ = false;
  std::atomic<bool> failed_{false};  // drain mode: keep releasing device waits
  std::string abortWhy_;             // the first failure (guarded by mu_)
  std::thread proxy_;
  std::thread aborter_;  // aborts the group after a proxy failure
};

}  // namespace fastcomm
