#include "plans/inter_plan.hpp"

#include <sstream>
#include <vector>

#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "inter/transport.hpp"

namespace fastcomm {
namespace {

constexpr const char* kKey = "fastcomm/inter_plan";

// "key=value;key=value" -> value of `key` ("" when absent).
std::string field(const std::string& plan, const std::string& key) {
  std::istringstream is(plan);
  std::string item;
  while (std::getline(is, item, ';')) {
    auto eq = item.find('=');
    if (eq != std::string::npos && item.substr(0, eq) == key) return item.substr(eq + 1);
  }
  return "";
}

// Rank 0: "tcp", "ib", or "" with `error` set when ib is forced but some rank
// cannot use it. `auto` takes ib only when every rank has a usable device.
std::string chooseTransport(const c10::intrusive_ptr<c10d::Store>& store, int size,
                            const Config& cfg, const OpContext& ctx, std::string* error) {
  if (cfg.transport == "tcp") return "tcp";
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back("fastcomm/ib_usable/" + std::to_string(r));
  store->wait(keys, ctx.remaining());
  std::vector<int> without;
  std::string reasons;
  for (int r = 0; r < size; ++r) {
    const std::string v = storeGet(store, keys[r]);
    if (v.compare(0, 2, "1 ") == 0) continue;
    without.push_back(r);
    if (without.size() <= 4) reasons += "; rank " + std::to_string(r) + ": " + v.substr(2);
  }
  if (without.empty()) {
    FASTCOMM_LOG(Info, "FASTCOMM_TRANSPORT=" << cfg.transport << ": ib, every rank has a usable "
                                             << "RDMA device (rank 0: "
                                             << storeGet(store, keys[0]).substr(2) << ")");
    return "ib";
  }
  const std::string why =
      "group rank(s) " + formatRanks(without) + " have no usable ib device" + reasons;
  if (cfg.transport == "ib") {
    *error = "fastcomm: FASTCOMM_TRANSPORT=ib (group rank 0's choice), but " + why +
             " (FASTCOMM_TRANSPORT=auto falls back to tcp)";
    return "";
  }
  FASTCOMM_LOG(Info, "FASTCOMM_TRANSPORT=auto: tcp, because " << why);
  return "tcp";
}

}  // namespace

std::string InterPlan::encode() const { return "transport=" + transport; }

InterPlan InterPlan::decode(const std::string& text) {
  InterPlan p;
  p.transport = field(text, "transport");
  return p;
}

InterPlan InterPlan::agree(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           int ranksPerHost, const Config& cfg, const OpContext& ctx) {
  {
    std::string why;
    const bool ib = transport::transportUsable("ib", cfg, &why);
    store->set("fastcomm/ib_usable/" + std::to_string(rank), (ib ? "1 " : "0 ") + why);
  }
  if (rank == 0 && !store->check({kKey})) {
    // The host and the CUDA side both come here: the first one decides.
    InterPlan mine;
    std::string error;
    mine.transport = chooseTransport(store, size, cfg, ctx, &error);
    if (!error.empty()) store->set("fastcomm/inter_plan_error", error);
    store->set(kKey, mine.encode());
  }
  try {
    store->wait({kKey}, ctx.remaining());
  } catch (const std::exception&) {
    throwCommError("fastcomm: " + ctx.describe() + " failed on group rank " + std::to_string(rank) +
                   ": group rank [0] did not publish the multi-node plan " +
                   "within the timeout of " + std::to_string(ctx.timeout.count()) + " ms");
  }
  InterPlan plan = decode(storeGet(store, kKey));
  if (plan.transport.empty()) throwCommError(storeGet(store, "fastcomm/inter_plan_error"));
  // Agreed when the group was created: the same on every rank.
  plan.wireDtype = cfg.wireDtype;
  plan.chunkBytes = cfg.chunkBytes;
  plan.cudaHier = cfg.cudaHier;
  plan.cudaChunkBytes = cfg.cudaChunkBytes;
  plan.cudaWindow = cfg.cudaWindow;
  plan.cudaHierMinBytes = cfg.cudaHierMinBytes;
  plan.tcpSocketsPerPeer = cfg.tcpSocketsFor(ranksPerHost);
  return plan;
}

Config InterPlan::transportConfig(const Config& cfg) const {
  Config c = cfg;
  c.tcpSocketsPerPeer = tcpSocketsPerPeer;
  return c;
}

}  // namespace fastcomm
