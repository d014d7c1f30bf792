#include "plans/hier_comm.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstring>
#include <future>
#include <sstream>
#include <thread>

#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "common/timeline.hpp"
#include "plans/inter_plan.hpp"

namespace fastcomm {
namespace {

// All-reduces up to this size skip the sharding: all-reduce in the node, then
// every rail all-reduces the whole (small) buffer by recursive doubling.
// Latency, not bandwidth.
constexpr int64_t kSmallBytes = 64 << 10;

// The hierarchical all-reduce's pipeline: a medium all-reduce is cut into at
// least kMinPipelineChunks chunks, so that the node's shared-memory phases of
// one chunk run while the network carries another, but no rank's shard of a
// chunk is smaller than kMinShardBytes (below it each rail all-reduce costs
// more in per-message latency than the overlap gains); large ones keep shards
// of FASTCOMM_CHUNK_BYTES. Both bounds measured on the shaped-link testbed
// (benchmarks/RESULTS.md, CPU tensors, 2 nodes x 2 ranks).
constexpr int64_t kMinPipelineChunks = 4;
constexpr int64_t kMinShardBytes = 256 << 10;

// A rank's shard of one chunk of a `bytes` all-reduce among `localSize`
// ranks per node.
int64_t pipelineShardBytes(int64_t bytes, int localSize, int64_t chunkBytes) {
  const int64_t perRank = (bytes + localSize - 1) / localSize;
  const int64_t wanted = (perRank + kMinPipelineChunks - 1) / kMinPipelineChunks;
  return std::min(chunkBytes, std::max(kMinShardBytes, wanted));
}

}  // namespace

HierComm::HierComm(const c10::intrusive_ptr<c10d::Store>& store, const Topology& topo,
                   const Config& cfg, const OpContext& ctx)
    : store_(store), topo_(topo), cfg_(cfg) {
  const int P = topo_.size;
  numNodes_ = topo_.numNodes();
  localSize_ = topo_.localSize;
  for (const auto& node : topo_.nodeRanks)
    if (static_cast<int>(node.size()) != localSize_) flat_ = true;

  // Choices that must agree on every rank (a mismatch would hang or corrupt)
  // come from group rank 0 through the store.
  const InterPlan plan =
      InterPlan::agree(store_, topo_.rank, topo_.size, topo_.maxLocalSize(), cfg_, ctx);
  const std::string transportName = plan.transport;
  cfg_ = plan.transportConfig(cfg_);
  cfg_.wireDtype = plan.wireDtype;
  cfg_.chunkBytes = plan.chunkBytes;

  if (localSize_ > 1) {
    // One segment per node, so one store key per node.
    intra_ = std::make_unique<ShmComm>(store_, "fastcomm/shm/node" + std::to_string(topo_.myNode),
                                       topo_.nodeRanks[topo_.myNode], topo_.localRank, cfg_, ctx);
  }
  // Collective traffic and user send/recv use separate transports, so their
  // in-order message streams never interleave.
  std::vector<int> collPeers, p2pPeers;
  for (int r = 0; r < P; ++r) {
    if (r == topo_.rank) continue;
    if (!sameNode(r)) p2pPeers.push_back(r);
    if (flat_ || !sameNode(r)) collPeers.push_back(r);
  }
  coll_ = transport::createTransport(transportName, cfg_);
  p2p_ = transport::createTransport(transportName, cfg_);
  auto collStore = c10::make_intrusive<c10d::PrefixStore>("fastcomm/coll", store_);
  auto p2pStore = c10::make_intrusive<c10d::PrefixStore>("fastcomm/p2p", store_);
  collConns_ = coll_->connect(collStore, topo_.rank, P, collPeers, ctx);
  p2pConns_ = p2p_->connect(p2pStore, topo_.rank, P, p2pPeers, ctx);
  collTo_.assign(P, nullptr);
  p2pTo_.assign(P, nullptr);
  for (size_t i = 0; i < collPeers.size(); ++i) collTo_[collPeers[i]] = collConns_[i].get();
  inbox_.resize(P);
  for (size_t i = 0; i < p2pPeers.size(); ++i) {
    p2pTo_[p2pPeers[i]] = p2pConns_[i].get();
    inbox_[p2pPeers[i]] = std::make_unique<Inbox>();
  }

  std::vector<int> members;
  int me = 0;
  if (flat_) {
    for (int r = 0; r < P; ++r) members.push_back(r);
    me = topo_.rank;
  } else {
    for (int n = 0; n < numNodes_; ++n) members.push_back(topo_.nodeRanks[n][topo_.localRank]);
    me = topo_.myNode;
  }
  std::vector<transport::Connection*> conns;
  for (int m : members) conns.push_back(m == topo_.rank ? nullptr : collTo_[m]);
  ring_ = std::make_unique<RingComm>(*coll_, members, me, conns, cfg_.chunkBytes,
                                     parseWireDtype(cfg_.wireDtype));
  ring_->setPeerReason([this](int peer) { return peerReason(peer); });
  interLane_ = std::make_unique<SerialLane>("fc-inter");
  if (topo_.rank == 0) FASTCOMM_LOG(Info, describe());
}

HierComm::~HierComm() {
  interLane_.reset();
  if (coll_) coll_->close();
  if (p2p_) p2p_->close();
}

std::string HierComm::describe() const {
  std::ostringstream os;
  os << "multi-node plan: " << numNodes_ << " nodes, ";
  if (flat_) {
    os << "uneven local sizes, so a flat ring over all " << topo_.size
       << " ranks on the transport (no intra-node phases)";
  } else {
    os << localSize_ << " ranks each; intra-node: "
       << (localSize_ > 1 ? "shared memory" : "none (one rank per node)")
       << "; inter-node: " << localSize_ << " rail(s) of " << numNodes_
       << " ranks (rings; recursive doubling for all-reduces up to " << kSmallBytes << " B)";
  }
  os << "; transport " << coll_->name();
  if (coll_->name() == "tcp") os << " (" << cfg_.tcpSocketsPerPeer << " sockets per peer)";
  os << "; wire dtype " << cfg_.wireDtype << "; chunk " << cfg_.chunkBytes << " B";
  return os.str();
}

void HierComm::abort(const std::string& why) {
  try {
    const std::string key = "fastcomm/failed/" + std::to_string(topo_.rank);
    if (!store_->check({key})) store_->set(key, why);
  } catch (...) {
    // The store may be gone with the failed rank; the transports still close.
  }
  if (coll_) coll_->close();
  if (p2p_) p2p_->close();
}

std::string HierComm::peerReason(int peer) {
  // A peer that failed too publishes why (abort()); it may be timing out at
  // this very moment, so give it a moment to say so.
  const auto until = Clock::now() + std::chrono::seconds(2);
  const std::string key = "fastcomm/failed/" + std::to_string(peer);
  try {
    do {
      if (store_->check({key})) {
        return " (group rank " + std::to_string(peer) + " failed too: " + storeGet(store_, key) +
               ")";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (Clock::now() < until);
  } catch (...) {
    // The store went away with its host: nothing more to learn.
  }
  return "";
}

template <typename Fn>
void HierComm::guarded(const OpContext& ctx, Fn fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
}

int HierComm::localIndex(int groupRank) const {
  const auto& node = topo_.nodeRanks[topo_.nodeOf[groupRank]];
  return static_cast<int>(std::find(node.begin(), node.end(), groupRank) - node.begin());
}

void HierComm::divide(void* data, int64_t count, at::ScalarType dt) const {
  const void* ins[1] = {data};
  reduceInto(data, ins, 1, count, dt, RedOp::Avg, topo_.size);
}

// ---- collectives ----------------------------------------------------------------

void HierComm::barrier(const OpContext& ctx) {
  guarded(ctx, [&] {
    if (intra_ && !flat_) intra_->barrier(ctx);
    ring_->barrier(ctx);
    if (intra_ && !flat_) intra_->barrier(ctx);
  });
}

void HierComm::allreduce(void* data, int64_t count, at::ScalarType dt, RedOp op,
                         const OpContext& ctx) {
  const RedOp phaseOp = op == RedOp::Avg ? RedOp::Sum : op;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  char* bytes = static_cast<char*>(data);
  guarded(ctx, [&] {
    const bool small = count * esize <= kSmallBytes;
    if (flat_ || localSize_ == 1) {
      if (small) {
        ring_->allreduceSmall(data, count, dt, phaseOp, ctx);
      } else {
        ring_->allreduce(data, count, dt, phaseOp, ctx);
      }
    } else if (small || count < localSize_) {
      intra_->allreduce(data, count, dt, phaseOp, ctx);
      ring_->allreduceSmall(data, count, dt, phaseOp, ctx);
    } else {
      // Chunk k: reduce-scatter in the node (this thread), all-reduce of this
      // rank's shard with the rail (inter lane), all-gather in the node (this
      // thread, after chunk k+1's reduce-scatter). The intra order is the same
      // on every rank: RS0 RS1 AG0 RS2 AG1 ... AG(n-1).
      const int L = localSize_;
      const int64_t shard =
          std::max<int64_t>(1, pipelineShardBytes(count * esize, L, cfg_.chunkBytes) / esize);
      const int64_t chunk = shard * L;
      const int64_t nChunks = (count + chunk - 1) / chunk;
      constexpr int kBuffers = 3;
      if (static_cast<int64_t>(scratch_.size()) < kBuffers * shard * esize)
        scratch_.resize(kBuffers * shard * esize);
      if (static_cast<int64_t>(scratch2_.size()) < chunk * esize) scratch2_.resize(chunk * esize);
      auto shardBuf = [&](int64_t k) { return scratch_.data() + (k % kBuffers) * shard * esize; };
      char* pad = scratch2_.data();
      auto shardLen = [&](int64_t k) {
        const int64_t len = std::min(chunk, count - k * chunk);
        return len == chunk ? shard : (len + L - 1) / L;
      };
      auto reduceScatter = [&](int64_t k) {
        const int64_t len = std::min(chunk, count - k * chunk), s = shardLen(k);
        char* src = bytes + k * chunk * esize;
        if (len != chunk) {
          // The last, partial chunk goes through a buffer padded to L shards.
          std::memcpy(pad, src, len * esize);
          std::memset(pad + len * esize, 0, (s * L - len) * esize);
          src = pad;
        }
        TimelineScope scope("intra reduce-scatter (shm)", "fc-host", k);
        intra_->reduceScatter(src, shardBuf(k), s, dt, phaseOp, ctx);
      };
      auto allgather = [&](int64_t k) {
        const int64_t len = std::min(chunk, count - k * chunk), s = shardLen(k);
        char* dst = bytes + k * chunk * esize;
        TimelineScope scope("intra all-gather (shm)", "fc-host", k);
        intra_->allgather(shardBuf(k), len == chunk ? dst : pad, s * esize, ctx);
        if (len != chunk) std::memcpy(dst, pad, len * esize);
      };
      std::vector<std::future<void>> inter;
      auto submitInter = [&](int64_t k) {
        auto job = std::make_shared<std::packaged_task<void()>>(
            [this, k, &shardBuf, &shardLen, dt, phaseOp, &ctx] {
              TimelineScope scope("inter all-reduce (rail ring)", "fc-inter", k);
              ring_->allreduce(shardBuf(k), shardLen(k), dt, phaseOp, ctx);
            });
        inter.push_back(job->get_future());
        interLane_->submit([job] { (*job)(); });
      };
      try {
        reduceScatter(0);
        submitInter(0);
        for (int64_t k = 1; k < nChunks; ++k) {
          reduceScatter(k);
          submitInter(k);
          inter[k - 1].get();
          allgather(k - 1);
        }
        inter[nChunks - 1].get();
        allgather(nChunks - 1);
      } catch (const std::exception& e) {
        // Close the transports first so inter jobs still running fail fast,
        // then let them finish: they use this frame's buffers.
        abort(e.what());
        for (auto& f : inter)
          if (f.valid()) f.wait();
        throw;
      }
    }
    if (op == RedOp::Avg) divide(data, count, dt);
  });
}

void HierComm::reduce(void* data, int64_t count, at::ScalarType dt, RedOp op, int root,
                      const OpContext& ctx) {
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t bytes = count * esize;
  const int N = numNodes_, L = flat_ ? 1 : localSize_;
  const int parts = flat_ ? topo_.size : N * L;
  if (bytes <= kSmallBytes || count < parts) {
    // Latency-bound: an all-reduce (recursive doubling across nodes) whose
    // result only the root keeps; non-roots' buffers stay as they were.
    if (root == topo_.rank) {
      allreduce(data, count, dt, op, ctx);
      return;
    }
    std::vector<char> copy(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    allreduce(copy.data(), count, dt, op, ctx);
    return;
  }
  // Bandwidth-bound: the all-reduce's reduce-scatter phases, then only the
  // root's node collects: reduce-scatter in the node, reduce-scatter along
  // each rail, the rail's blocks gathered on the root's node, the node's
  // shards gathered on the root. Each rank sends about what an all-reduce's
  // reduce-scatter half sends, plus 1/(N L) of the data to the root's node.
  const RedOp phaseOp = op == RedOp::Avg ? RedOp::Sum : op;
  const int64_t per = (count + parts - 1) / parts;  // elements of one rank's final block
  guarded(ctx, [&] {
    if (static_cast<int64_t>(scratch_.size()) < parts * per * esize)
      scratch_.resize(parts * per * esize);
    char* whole = scratch_.data();  // [local rank][node][per] (padded; tail discarded)
    std::memcpy(whole, data, bytes);
    std::memset(whole + bytes, 0, parts * per * esize - bytes);
    if (flat_) {
      ring_->reduceScatter(whole, per, dt, phaseOp, ctx);
      ring_->gatherTo(whole, per * esize, root, ctx);
    } else {
      const int n0 = topo_.nodeOf[root], l0 = localIndex(root);
      const int64_t shardCount = per * N;  // this local rank's part, one block per node
      char* shard = whole;
      if (L > 1) {
        if (static_cast<int64_t>(scratch2_.size()) < shardCount * esize)
          scratch2_.resize(shardCount * esize);
        shard = scratch2_.data();
        intra_->reduceScatter(whole, shard, shardCount, dt, phaseOp, ctx);
      }
      ring_->reduceScatter(shard, per, dt, phaseOp, ctx);
      ring_->gatherTo(shard, per * esize, n0, ctx);
      if (topo_.myNode == n0 && L > 1) intra_->gather(shard, whole, shardCount * esize, l0, ctx);
    }
    if (topo_.rank == root) {
      std::memcpy(data, whole, bytes);
      if (op == RedOp::Avg) divide(data, count, dt);
    }
  });
}

void HierComm::broadcast(void* data, int64_t bytes, int root, const OpContext& ctx) {
  guarded(ctx, [&] {
    if (flat_) {
      ring_->broadcast(data, bytes, root, ctx);
      return;
    }
    const int n0 = topo_.nodeOf[root], l0 = localIndex(root);
    if (localSize_ == 1) {
      ring_->broadcast(data, bytes, n0, ctx);
      return;
    }
    const int L = localSize_;
    if (bytes <= kSmallBytes * L) {
      if (topo_.localRank == l0) ring_->broadcast(data, bytes, n0, ctx);
      intra_->broadcast(data, bytes, l0, ctx);
      return;
    }
    // Every rail carries 1/L of the data: scatter in the root's node,
    // broadcast the shards along the rails, all-gather in every node.
    const int64_t shard = (bytes + L * 64 - 1) / (L * 64) * 64;
    if (static_cast<int64_t>(scratch2_.size()) < shard * L) scratch2_.resize(shard * L);
    if (static_cast<int64_t>(scratch_.size()) < shard) scratch_.resize(shard);
    char* whole = scratch2_.data();
    char* mine = scratch_.data();
    if (topo_.myNode == n0) {
      if (topo_.rank == root) std::memcpy(whole, data, bytes);
      intra_->scatter(whole, mine, shard, l0, ctx);
    }
    ring_->broadcast(mine, shard, n0, ctx);
    intra_->allgather(mine, whole, shard, ctx);
    if (topo_.rank != root) std::memcpy(data, whole, bytes);
  });
}

void HierComm::allgather(const void* in, void* out, int64_t bytes, const OpContext& ctx) {
  guarded(ctx, [&] {
    char* o = static_cast<char*>(out);
    if (flat_) {
      std::memcpy(o + topo_.rank * bytes, in, bytes);
      ring_->allgather(o, bytes, ctx);
      return;
    }
    // Rails first: each rank sends only its own block across nodes; then the
    // node exchanges what its rails gathered.
    const int N = numNodes_, L = localSize_;
    if (static_cast<int64_t>(scratch_.size()) < N * bytes) scratch_.resize(N * bytes);
    char* rail = scratch_.data();
    std::memcpy(rail + topo_.myNode * bytes, in, bytes);
    ring_->allgather(rail, bytes, ctx);
    char* node = rail;
    if (L > 1) {
      if (static_cast<int64_t>(scratch2_.size()) < L * N * bytes) scratch2_.resize(L * N * bytes);
      node = scratch2_.data();
      intra_->allgather(rail, node, N * bytes, ctx);
    }
    for (int n = 0; n < N; ++n)
      for (int l = 0; l < L; ++l)
        std::memcpy(o + topo_.nodeRanks[n][l] * bytes, node + (l * N + n) * bytes, bytes);
  });
}

void HierComm::reduceScatter(const void* in, void* out, int64_t count, at::ScalarType dt, RedOp op,
                             const OpContext& ctx) {
  const RedOp phaseOp = op == RedOp::Avg ? RedOp::Sum : op;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t bytes = count * esize;
  const char* src = static_cast<const char*>(in);
  guarded(ctx, [&] {
    const int P = topo_.size;
    if (static_cast<int64_t>(scratch_.size()) < P * bytes) scratch_.resize(P * bytes);
    char* work = scratch_.data();
    char* mine;
    if (flat_) {
      std::memcpy(work, src, P * bytes);
      ring_->reduceScatter(work, count, dt, phaseOp, ctx);
      mine = work + topo_.rank * bytes;
    } else {
      // Local rank l reduces, for its rail, the blocks of the ranks (n, l):
      // lay the input out as [l][n] so the node's reduce-scatter hands each
      // local rank exactly its rail's blocks, then the rail reduce-scatters.
      const int N = numNodes_, L = localSize_;
      for (int n = 0; n < N; ++n)
        for (int l = 0; l < L; ++l)
          std::memcpy(work + (l * N + n) * bytes, src + topo_.nodeRanks[n][l] * bytes, bytes);
      char* shard = work;
      if (L > 1) {
        if (static_cast<int64_t>(scratch2_.size()) < N * bytes) scratch2_.resize(N * bytes);
        shard = scratch2_.data();
        intra_->reduceScatter(work, shard, N * count, dt, phaseOp, ctx);
      }
      ring_->reduceScatter(shard, count, dt, phaseOp, ctx);
      mine = shard + topo_.myNode * bytes;
    }
    std::memcpy(out, mine, bytes);
    if (op == RedOp::Avg) divide(out, count, dt);
  });
}

void HierComm::gather(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) {
  const int P = topo_.size;
  std::vector<int64_t> sendBytes(P, 0), sendOffsets(P, 0), recvBytes(P, 0), recvOffsets(P, 0);
  sendBytes[root] = bytes;
  if (topo_.rank == root) {
    for (int s = 0; s < P; ++s) {
      recvBytes[s] = bytes;
      recvOffsets[s] = s * bytes;
    }
  }
  guarded(ctx, [&] {
    pairwise(in, sendBytes, sendOffsets, out, recvBytes, recvOffsets, /*exact=*/false, ctx);
  });
}

void HierComm::scatter(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) {
  const int P = topo_.size;
  std::vector<int64_t> sendBytes(P, 0), sendOffsets(P, 0), recvBytes(P, 0), recvOffsets(P, 0);
  recvBytes[root] = bytes;
  if (topo_.rank == root) {
    for (int d = 0; d < P; ++d) {
      sendBytes[d] = bytes;
      sendOffsets[d] = d * bytes;
    }
  }
  guarded(ctx, [&] {
    pairwise(in, sendBytes, sendOffsets, out, recvBytes, recvOffsets, /*exact=*/false, ctx);
  });
}

void HierComm::alltoall(const void* in, const std::vector<int64_t>& sendBytes,
                        const std::vector<int64_t>& sendOffsets, void* out,
                        const std::vector<int64_t>& recvBytes,
                        const std::vector<int64_t>& recvOffsets, const OpContext& ctx) {
  guarded(ctx, [&] {
    pairwise(in, sendBytes, sendOffsets, out, recvBytes, recvOffsets, /*exact=*/true, ctx);
  });
}

// Moves sendBytes[d] bytes to every rank d and receives recvBytes[s] from every
// s: over the transport across nodes (all posted first), through the node's
// shared-memory all-to-all inside it. With `exact`, empty messages are sent
// too, so split sizes that disagree fail on both sides instead of hanging.
void HierComm::pairwise(const void* in, const std::vector<int64_t>& sendBytes,
                        const std::vector<int64_t>& sendOffsets, void* out,
                        const std::vector<int64_t>& recvBytes,
                        const std::vector<int64_t>& recvOffsets, bool exact, const OpContext& ctx) {
  const int P = topo_.size, me = topo_.rank;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<std::unique_ptr<transport::Request>> reqs;
  std::vector<int> peers;
  auto viaTransport = [&](int r) { return r != me && (flat_ || !sameNode(r)); };
  for (int r = 0; r < P; ++r) {
    if (!viaTransport(r)) continue;
    // One message per direction and peer: far below the transport's limit.
    if (exact || recvBytes[r] > 0) {
      reqs.push_back(collTo_[r]->irecv(dst + recvOffsets[r], recvBytes[r], nullptr));
      peers.push_back(r);
      TORCH_INTERNAL_ASSERT(reqs.back(), "fastcomm: transport refused a first receive");
    }
    if (exact || sendBytes[r] > 0) {
      reqs.push_back(collTo_[r]->isend(src + sendOffsets[r], sendBytes[r], nullptr));
      peers.push_back(r);
      TORCH_INTERNAL_ASSERT(reqs.back(), "fastcomm: transport refused a first send");
    }
  }
  if (!flat_ && intra_) {
    const auto& node = topo_.nodeRanks[topo_.myNode];
    const int L = static_cast<int>(node.size());
    std::vector<int64_t> sb(L), so(L), rb(L), ro(L);
    for (int l = 0; l < L; ++l) {
      sb[l] = sendBytes[node[l]];
      so[l] = sendOffsets[node[l]];
      rb[l] = recvBytes[node[l]];
      ro[l] = recvOffsets[node[l]];
    }
    intra_->alltoall(src, sb, so, dst, rb, ro, ctx);
  } else if (recvBytes[me] > 0) {
    TORCH_CHECK(recvBytes[me] == sendBytes[me], "fastcomm: ", ctx.describe(), ": sends ",
                sendBytes[me], " bytes to itself but expects ", recvBytes[me]);
    std::memmove(dst + recvOffsets[me], src + sendOffsets[me], recvBytes[me]);
  }
  std::vector<transport::Request*> raw;
  for (auto& r : reqs) raw.push_back(r.get());
  transport::waitAll(*coll_, raw, peers, ctx);
}

void HierComm::checkSignatures(const OpSignature& mine, const OpContext& ctx) {
  std::vector<OpSignature> all(topo_.size);
  allgather(&mine, all.data(), sizeof(OpSignature), ctx);
  std::vector<int> ranks(topo_.size);
  for (int r = 0; r < topo_.size; ++r) ranks[r] = r;
  checkSignatureVotes(all, ranks, ctx);
}

// ---- point to point ----------------------------------------------------------------

void HierComm::send(const void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) {
  if (intra_ && sameNode(peer)) {
    intra_->send(data, bytes, localIndex(peer), tag, ctx);
    return;
  }
  // A header first, so the receiver checks tag and size before the payload.
  P2PHeader header{tag, bytes};
  auto h = p2pTo_[peer]->isend(&header, sizeof(header), nullptr);
  auto d = p2pTo_[peer]->isend(data, bytes, nullptr);
  TORCH_INTERNAL_ASSERT(h && d, "fastcomm: transport refused a send");
  transport::waitAll(*p2p_, {h.get(), d.get()}, {peer, peer}, ctx);
}

bool HierComm::headerArrived(Inbox& box, int peer, const OpContext& ctx) {
  if (box.arrived) return true;
  if (!box.pending) {
    box.pending = p2pTo_[peer]->irecv(&box.header, sizeof(box.header), nullptr);
    TORCH_INTERNAL_ASSERT(box.pending, "fastcomm: transport refused a receive");
  }
  try {
    box.arrived = box.pending->test();
  } catch (const transport::TransportError& e) {
    box.pending.reset();
    throwCommError("fastcomm: " + ctx.describe() + " failed: communication with rank " +
                   std::to_string(e.peer()) + " broke: " + e.what() + peerReason(e.peer()));
  }
  if (box.arrived) box.pending.reset();
  return box.arrived;
}

void HierComm::takeMessage(Inbox& box, void* data, int64_t bytes, int peer, int tag,
                           const OpContext& ctx) {
  box.arrived = false;
  if (box.header.tag != tag || box.header.bytes != bytes) {
    throwCommError("fastcomm: " + ctx.describe() + ": the next message from group rank " +
                   std::to_string(peer) + " has tag " + std::to_string(box.header.tag) + " and " +
                   std::to_string(box.header.bytes) + " bytes, but this recv expects tag " +
                   std::to_string(tag) + " and " + std::to_string(bytes) + " bytes");
  }
  auto d = p2pTo_[peer]->irecv(data, bytes, nullptr);
  TORCH_INTERNAL_ASSERT(d, "fastcomm: transport refused a receive");
  transport::waitAll(*p2p_, {d.get()}, {peer}, ctx);
}

void HierComm::recv(void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) {
  if (intra_ && sameNode(peer)) {
    intra_->recv(data, bytes, localIndex(peer), tag, ctx);
    return;
  }
  Inbox& box = *inbox_[peer];
  std::lock_guard<std::mutex> lock(box.mu);
  if (!headerArrived(box, peer, ctx)) {
    transport::waitAll(*p2p_, {box.pending.get()}, {peer}, ctx);
    box.pending.reset();
    box.arrived = true;
  }
  takeMessage(box, data, bytes, peer, tag, ctx);
}

int HierComm::recvAny(void* data, int64_t bytes, int tag, const OpContext& ctx) {
  // Polls the node's shared-memory rings and the header receives posted to
  // every other-node peer. A header with another tag stays for the recv it
  // belongs to.
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    if (intra_) {
      const int l = intra_->tryRecvAny(data, bytes, tag, ctx);
      if (l >= 0) return topo_.nodeRanks[topo_.myNode][l];
    }
    for (int peer = 0; peer < topo_.size; ++peer) {
      if (!inbox_[peer]) continue;
      Inbox& box = *inbox_[peer];
      std::unique_lock<std::mutex> lock(box.mu, std::try_to_lock);
      if (!lock.owns_lock()) continue;  // a recv(src=peer) is reading from it
      if (headerArrived(box, peer, ctx) && box.header.tag == tag) {
        takeMessage(box, data, bytes, peer, tag, ctx);
        return peer;
      }
    }
    if (ctx.expired()) {
      throwCommError("fastcomm: " + ctx.describe() + ": recv from any source timed out after " +
                     std::to_string(ctx.timeout.count()) + " ms: no message with tag " +
                     std::to_string(tag) + " arrived from any rank");
    }
    // Shared-memory arrivals do not wake the transport, so the sleep is short
    // and grows only to 1 ms.
    p2p_->waitForProgress(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
  }
}

}  // namespace fastcomm
