// ProcessGroupFastComm: creation (the group's store, topology and paths),
// shutdown, coalescing blocks and splitting; the collectives are in
// collectives.cpp.
#include "backend/process_group.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <numeric>

#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "common/timeline.hpp"
#include "inter/transport.hpp"

#ifdef FASTCOMM_WITH_CUDA
#include "backend/cuda/nccl_path.hpp"
#endif

namespace fastcomm {

namespace {

// torch reuses group names (and, with env://, the store) after a destroy and
// re-init, so every key of one initialisation lives under its own epoch:
// each rank takes a ticket, and the size tickets of one init share an epoch.
c10::intrusive_ptr<c10d::Store> epochStore(const c10::intrusive_ptr<c10d::Store>& store, int size) {
  const int64_t ticket = store->add("fastcomm/init_tickets", 1);
  const int64_t epoch = (ticket - 1) / size;
  return c10::make_intrusive<c10d::PrefixStore>("fastcomm/" + std::to_string(epoch), store);
}

// Where the ranks of a split meet: under the parent's own store, named by the
// split's index among the parent's splits and by its members, not by the
// group name torch passes (torch 2.11 salts the names of split groups with a
// count that differs between ranks after a new_group not every rank joined).
c10::intrusive_ptr<c10d::Store> splitStore(const c10::intrusive_ptr<c10d::Store>& store,
                                           const std::vector<int>& ranks, uint64_t index) {
  auto* named = dynamic_cast<c10d::PrefixStore*>(store.get());
  c10::intrusive_ptr<c10d::Store> parent = named ? named->getUnderlyingStore() : store;
  std::string prefix = "fastcomm/split/" + std::to_string(index) + "/";
  for (int r : ranks) prefix += std::to_string(r) + ",";
  return c10::make_intrusive<c10d::PrefixStore>(prefix, parent);
}

}  // namespace

ProcessGroupFastComm::ProcessGroupFastComm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout,
                                           std::vector<uint64_t> globalRanks, std::string groupName)
    : Backend(rank, size),
      globalRanks_(std::move(globalRanks)),
      groupName_(std::move(groupName)),
      options_(c10::make_intrusive<Options>("fastcomm", timeout)) {
  options_->global_ranks_in_group = globalRanks_;
  options_->group_name = groupName_;
  g_.store = epochStore(store, size);
  g_.rank = rank;
  g_.size = size;
  g_.timeout = timeout;
  g_.cfg = Config::fromEnv();
  const Config& cfg = g_.cfg;
  if (cfg.crashBacktrace) installCrashBacktrace();
  if (cfg.timeline) Timeline::setEnabled(true);
  // The agreed settings ride along with the host ids: group rank 0's hold.
  std::vector<std::string> settings;
  g_.topo = Topology::exchange(g_.store, rank, size, localHostId(cfg), timeout, cfg.encodeAgreed(),
                               &settings);
  const std::string differ = g_.cfg.adoptAgreed(settings[0]);
  if (!differ.empty()) {
    FASTCOMM_LOG(Warn, "group '" << groupName_ << "', group rank " << rank
                                 << ": settings that must agree across the group follow group "
                                    "rank 0: "
                                 << differ);
  }
  if (g_.topo.numNodes() > 1 && cfg.transport == "ib") {
    // Forced ib without a device fails here, at init, not at the first collective.
    std::string why;
    if (!transport::transportUsable("ib", cfg, &why)) {
      throw std::runtime_error("fastcomm: FASTCOMM_TRANSPORT=ib, but group rank " +
                               std::to_string(rank) + " has no usable RDMA device: " + why +
                               " (FASTCOMM_TRANSPORT=auto falls back to tcp)");
    }
  }
  if (cfg.traceBufferSize > 0) {
    // torch passes no global ranks for the world group.
    std::vector<uint64_t> members = globalRanks_;
    if (members.size() != static_cast<size_t>(size)) {
      members.resize(static_cast<size_t>(size));
      std::iota(members.begin(), members.end(), uint64_t{0});
    }
    g_.trace = TraceRing::create(cfg, TraceGroup{groupName_, &pg_desc_, members, rank, store});
  }
  hostPath_ = std::make_unique<HostPath>(g_);
#ifdef FASTCOMM_WITH_CUDA
  cudaPath_ = makeCudaPath(g_, *hostPath_);
#else
  cudaPath_ = std::make_unique<NoCudaPath>();
#endif
  if (rank == 0) {
    FASTCOMM_LOG(Info, "group '" << groupName_ << "' of " << size << " ranks, timeout "
                                 << timeout.count() << " ms; " << g_.topo.describe()
                                 << "; CPU tensors: " << hostPath_->describe() << "; CUDA tensors: "
                                 << cudaPath_->describe() << "; config: " << cfg.describe());
  }
}

ProcessGroupFastComm::~ProcessGroupFastComm() { shutdown(); }

void ProcessGroupFastComm::shutdown() {
  hostPath_->shutdown();
  cudaPath_->shutdown();
  // A group that was shut down is in no later dump.
  if (g_.trace) g_.trace->unregister();
}

void ProcessGroupFastComm::release_resources() { shutdown(); }

void ProcessGroupFastComm::abort() {
  try {
    throwCommError("fastcomm: process group aborted");
  } catch (...) {
    g_.markBroken(std::current_exception());
  }
  hostPath_->abort();
  cudaPath_->abort();
}

void ProcessGroupFastComm::setTimeout(std::chrono::milliseconds timeout) {
  g_.timeout = timeout;
  options_->timeout = timeout;
}

void ProcessGroupFastComm::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda()) cudaPath_->connect(device);
}

void ProcessGroupFastComm::startCoalescing() {
  g_.block.open();
  hostPath_->startCoalescing();
  cudaPath_->startCoalescing();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupFastComm::endCoalescing() {
  CoalescingBlock::Closed block = g_.block.close();
  if (block.error) {
    // An invalid op in the block: nothing of the block was issued; raise now.
    hostPath_->cancelCoalescing();
    cudaPath_->cancelCoalescing();
    std::rethrow_exception(block.error);
  }
  for (auto& issue : block.issues) issue();
  hostPath_->endCoalescing(block.works);
  cudaPath_->endCoalescing(block.works);
  std::vector<at::Tensor> outputs;
  for (auto& w : block.works)
    for (auto& t : w->result()) outputs.push_back(t);
  return c10::make_intrusive<GroupedWork>(rank_, std::move(block.works), std::move(outputs));
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupFastComm::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  auto timeout = opts ? opts->timeout : g_.timeout;
  auto name = opts ? opts->group_name : std::string();
  std::lock_guard<std::mutex> lock(splitMu_);
  if (lastSplit_ && lastSplit_->name == name && lastSplit_->ranks == ranks &&
      lastSplit_->store.lock() == store) {
    return lastSplit_->child.lock();  // the same split, asked for another device type
  }
  // Every rank of this group takes part in every split of it, members or not.
  const uint64_t splitIndex = splits_++;
  c10::intrusive_ptr<c10d::Backend> child;
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it != ranks.end()) {
    std::vector<uint64_t> globals;
    for (int r : ranks)
      globals.push_back(globalRanks_.empty() ? static_cast<uint64_t>(r) : globalRanks_[r]);
    child = c10::make_intrusive<ProcessGroupFastComm>(
        splitStore(store, ranks, splitIndex), static_cast<int>(it - ranks.begin()),
        static_cast<int>(ranks.size()), timeout, globals, name);
  }
  lastSplit_ = LastSplit{c10::weak_intrusive_ptr<c10d::Store>(store), name, ranks,
                         c10::weak_intrusive_ptr<c10d::Backend>(child)};
  return child;
}

}  // namespace fastcomm
