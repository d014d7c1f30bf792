#include "intra/nccl/nccl_utils.hpp"

#include <mutex>
#include <thread>

#include <cstdlib>
#include <cstring>

#include "common/deadline.hpp"

namespace fastcomm {

void ncclCheck(ncclResult_t r, ncclComm_t comm, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  std::string msg = std::string("fastcomm: ") + what + ": NCCL error: " + ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last) msg += std::string(" (") + last + ")";
  }
  throwCommError(msg);
}

ncclDataType_t ncclType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kChar:
      return ncclInt8;
    case at::kByte:
      return ncclUint8;
    case at::kBool:
      return ncclUint8;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    default:
      TORCH_CHECK(false, "fastcomm: dtype ", t,
                  " is not supported for CUDA tensors (NCCL types: "
                  "float32, float64, float16, bfloat16, int8, uint8, bool, int32, int64)");
  }
}

ncclRedOp_t ncclRedOp(RedOp op, at::ScalarType t, NcclAvg avg) {
  if (t == at::kBool) {
    // bool travels as uint8 0/1: OR is MAX, AND is MIN.
    switch (op) {
      case RedOp::Sum:
      case RedOp::Max:
      case RedOp::BOr:
        return ncclMax;
      case RedOp::Product:
      case RedOp::Min:
      case RedOp::BAnd:
        return ncclMin;
      default:
        break;
    }
    TORCH_CHECK(false, "fastcomm: internal: no NCCL op for bool ", redOpName(op));
  }
  switch (op) {
    case RedOp::Sum:
      return ncclSum;
    case RedOp::Avg:
      return avg == NcclAvg::Native ? ncclAvg : ncclSum;
    case RedOp::Product:
      return ncclProd;
    case RedOp::Min:
      return ncclMin;
    case RedOp::Max:
      return ncclMax;
    default:
      break;
  }
  TORCH_CHECK(false, "fastcomm: internal: no NCCL op for ", redOpName(op));
}

bool preferNcclSocketParallelism() {
  static std::once_flag once;
  bool setNow = false;
  std::call_once(once, [&setNow] {
    if (std::getenv("NCCL_SOCKET_NTHREADS") != nullptr ||
        std::getenv("NCCL_NSOCKS_PERTHREAD") != nullptr) {
      return;
    }
    // Process-wide and never undone: NCCL keeps the first values it read.
    setNow =
        setenv("NCCL_SOCKET_NTHREADS", "4", 0) == 0 && setenv("NCCL_NSOCKS_PERTHREAD", "4", 0) == 0;
  });
  return setNow;
}

ncclComm_t ncclCommFromStore(const c10::intrusive_ptr<c10d::Store>& store,
                             const std::string& prefix, int nranks, int rank,
                             const std::vector<int>& readyRanks, int groupRank,
                             std::chrono::milliseconds timeout, const std::string& what) {
  const auto ctx = OpContext::start(what.c_str(), 0, timeout);
  const std::string uidKey = prefix + "uid";
  ncclUniqueId id;
  if (rank == 0) {
    ncclCheck(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
    const auto* p = reinterpret_cast<const uint8_t*>(&id);
    store->set(uidKey, std::vector<uint8_t>(p, p + sizeof(id)));
  }
  const std::string readyPrefix = prefix + "ready/";
  store->set(readyPrefix + std::to_string(groupRank), std::vector<uint8_t>{1});
  std::vector<std::string> keys{uidKey};
  for (int r : readyRanks) keys.push_back(readyPrefix + std::to_string(r));
  try {
    store->wait(keys, ctx.remaining());
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r : readyRanks)
      if (!store->check({readyPrefix + std::to_string(r)})) missing.push_back(r);
    throwCommError("fastcomm: " + what + " failed on group rank " + std::to_string(groupRank) +
                   ": timeout after " + std::to_string(timeout.count()) +
                   " ms waiting for group rank(s) " + formatRanks(missing));
  }
  if (rank != 0) {
    auto v = store->get(uidKey);
    TORCH_CHECK(v.size() == sizeof(id), "fastcomm: bad NCCL unique id in the store");
    std::memcpy(&id, v.data(), sizeof(id));
  }
  ncclComm_t comm = nullptr;
  ncclCheck(ncclCommInitRank(&comm, nranks, id, rank), nullptr, "ncclCommInitRank");
  return comm;
}

void ncclRelease(ncclComm_t comm) {
  if (comm != nullptr) ncclCommAbort(comm);
}

void ncclAbortAll(const std::vector<ncclComm_t>& comms) {
  std::vector<std::thread> aborters;
  for (ncclComm_t c : comms) {
    if (c != nullptr) aborters.emplace_back([c] { ncclCommAbort(c); });
  }
  for (auto& t : aborters) t.join();
}

}  // namespace fastcomm
