#include "plans/inter_plan.hpp"

#include <sstream>

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

int64_t number(const std::string& plan, const std::string& key) {
  const std::string v = field(plan, key);
  TORCH_CHECK(!v.empty(), "fastcomm: the multi-node plan in the store lacks '", key, "': ", plan);
  return std::stoll(v);
}

}  // namespace

std::string InterPlan::encode() const {
  std::ostringstream os;
  os << "transport=" << transport << ";wire=" << wireDtype << ";chunk=" << chunkBytes
     << ";cuda_hier=" << (cudaHier ? 1 : 0) << ";cuda_chunk=" << cudaChunkBytes
     << ";cuda_min=" << cudaHierMinBytes;
  return os.str();
}

InterPlan InterPlan::decode(const std::string& text) {
  InterPlan p;
  p.transport = field(text, "transport");
  p.wireDtype = field(text, "wire");
  p.chunkBytes = number(text, "chunk");
  p.cudaHier = number(text, "cuda_hier") != 0;
  p.cudaChunkBytes = number(text, "cuda_chunk");
  p.cudaHierMinBytes = number(text, "cuda_min");
  return p;
}

InterPlan InterPlan::agree(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                           const Config& cfg, const OpContext& ctx) {
  if (rank == 0) {
    InterPlan mine;
    mine.transport = cfg.transport == "auto" ? "tcp" : cfg.transport;
    mine.wireDtype = cfg.wireDtype;
    mine.chunkBytes = cfg.chunkBytes;
    mine.cudaHier = cfg.cudaHier;
    mine.cudaChunkBytes = cfg.cudaChunkBytes;
    mine.cudaHierMinBytes = cfg.cudaHierMinBytes;
    // The host and the CUDA side both come here; the value is the same.
    store->set(kKey, mine.encode());
  }
  try {
    store->wait({kKey}, ctx.remaining());
  } catch (const std::exception&) {
    throwCommError("fastcomm: " + ctx.describe() + " failed on group rank " + std::to_string(rank) +
                   ": group rank [0] did not publish the multi-node plan " +
                   "within the timeout of " + std::to_string(ctx.timeout.count()) + " ms");
  }
  auto v = store->get(kKey);
  return decode(std::string(v.begin(), v.end()));
}

}  // namespace fastcomm
