#include "intra/nvlink/peer_buffers.hpp"

#include <c10/cuda/CUDAGuard.h>

#include <cstdio>
#include <random>
#include <sstream>

#include "common/store_util.hpp"
#include "kernels/nvlink_collectives.hpp"

namespace fastcomm {

namespace {

const char* const kPrefix = "fastcomm/nvlink/";

// "" on success, else what failed (the CUDA error cleared, so that no later
// unrelated check finds it).
std::string cudaProblem(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return "";
  cudaGetLastError();
  return what + ": " + cudaGetErrorString(e);
}

std::string toHex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

bool fromHex(const std::string& s, void* data, size_t n) {
  if (s.size() != 2 * n) return false;
  auto* p = static_cast<unsigned char*>(data);
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    const int hi = nibble(s[2 * i]), lo = nibble(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    p[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

// The token rank `from` writes into rank `to`'s probe slot: never zero (the
// slot's value before), and different for every buffer a rank ever exports.
uint64_t token(uint64_t nonce, int from, int to) {
  uint64_t z = nonce ^ (static_cast<uint64_t>(from) << 32 | static_cast<uint64_t>(to));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) | 1;
}

// Publishes `mine` as this rank's answer to `step` and returns every rank's.
std::vector<std::string> everyone(const c10::intrusive_ptr<c10d::Store>& store, const char* step,
                                  int rank, int size, const std::string& mine,
                                  const OpContext& ctx) {
  const std::string prefix = std::string(kPrefix) + step + "/";
  store->set(prefix + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store->wait(keys, ctx.remaining());
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!store->check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
    throwCommError("fastcomm: NVLink all_reduce setup (" + std::string(step) +
                   ") failed on group rank " + std::to_string(rank) + ": timeout after " +
                   std::to_string(ctx.timeout.count()) + " ms waiting for group rank(s) " +
                   formatRanks(missing));
  }
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(storeGet(store, k));
  return out;
}

// "group rank r: reason; ..." of the ranks whose answer is not "ok..."; "" if none.
std::string refusals(const std::vector<std::string>& answers) {
  std::string out;
  for (size_t r = 0; r < answers.size(); ++r) {
    if (answers[r].rfind("ok", 0) == 0) continue;
    const std::string reason = answers[r].rfind("no ", 0) == 0 ? answers[r].substr(3) : answers[r];
    out +=
        (out.empty() ? "" : "; ") + std::string("group rank ") + std::to_string(r) + ": " + reason;
  }
  return out;
}

}  // namespace

PeerBuffers::PeerBuffers(int rank, int size, int64_t bytes, int device)
    : rank_(rank), device_(device), bytes_(bytes), ptrs_(static_cast<size_t>(size), nullptr) {}

PeerBuffers::~PeerBuffers() {
  closePeers();
  releaseOwn(true);
}

void PeerBuffers::closePeers() {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  for (int r = 0; r < size(); ++r) {
    void*& p = ptrs_[static_cast<size_t>(r)];
    if (r == rank_ || p == nullptr) continue;
    // An error here (e.g. at exit, the runtime already unloading) leaves
    // nothing to do.
    if (cudaIpcCloseMemHandle(p) != cudaSuccess) cudaGetLastError();
    p = nullptr;
  }
}

void PeerBuffers::releaseOwn(bool free) {
  void*& p = ptrs_[static_cast<size_t>(rank_)];
  if (p == nullptr) return;
  if (free) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    if (cudaFree(p) != cudaSuccess) cudaGetLastError();
  }
  p = nullptr;
}

std::string PeerBuffers::allocate(cudaStream_t stream, std::string* published) {
  void* own = nullptr;
  std::string p = cudaProblem(cudaMalloc(&own, static_cast<size_t>(bytes_)),
                              "cudaMalloc of " + std::to_string(bytes_) + " B");
  if (!p.empty()) return p;
  ptrs_[static_cast<size_t>(rank_)] = own;
  p = cudaProblem(cudaMemsetAsync(own, 0, static_cast<size_t>(bytes_), stream), "cudaMemsetAsync");
  if (p.empty()) p = cudaProblem(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!p.empty()) return p;
  cudaIpcMemHandle_t handle;
  p = cudaProblem(cudaIpcGetMemHandle(&handle, own), "cudaIpcGetMemHandle");
  if (!p.empty()) return p;
  char bus[32] = {0};
  p = cudaProblem(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId");
  if (!p.empty()) return p;
  *published = std::string(bus) + " " + toHex(&handle, sizeof(handle));
  return "";
}

std::string PeerBuffers::open(const std::vector<std::string>& published) {
  char myBus[32] = {0};
  cudaDeviceGetPCIBusId(myBus, sizeof(myBus), device_);
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    // "ok <nonce> <bus id> <handle>"
    std::istringstream is(published[static_cast<size_t>(r)]);
    std::string ok, nonce, bus, hex;
    is >> ok >> nonce >> bus >> hex;
    cudaIpcMemHandle_t handle;
    const std::string who = "group rank " + std::to_string(r) + " (GPU " + bus + ")";
    if (!fromHex(hex, &handle, sizeof(handle))) return "unreadable handle from " + who;
    int dev = -1;
    if (cudaDeviceGetByPCIBusId(&dev, bus.c_str()) != cudaSuccess) {
      cudaGetLastError();
      return "the GPU of " + who + " is not visible here (CUDA_VISIBLE_DEVICES?)";
    }
    if (dev == device_) return "shares GPU " + bus + " with " + who;
    int access = 0, atomics = 0;
    std::string p =
        cudaProblem(cudaDeviceCanAccessPeer(&access, device_, dev), "cudaDeviceCanAccessPeer");
    if (!p.empty()) return p;
    if (access == 0) return std::string("no peer access from GPU ") + myBus + " to " + who;
    // Native atomics between two GPUs exist over NVLink, not over PCIe:
    // the kernels only pay off over NVLink.
    p = cudaProblem(
        cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, device_, dev),
        "cudaDeviceGetP2PAttribute");
    if (!p.empty()) return p;
    if (atomics == 0) {
      return std::string("GPU ") + myBus + " reaches " + who +
             " only over PCIe (no native peer atomics, so no NVLink)";
    }
    void* mapped = nullptr;
    p = cudaProblem(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
                    "cudaIpcOpenMemHandle of the buffer of " + who);
    if (!p.empty()) return p;
    ptrs_[static_cast<size_t>(r)] = mapped;
  }
  return "";
}

std::string PeerBuffers::writeProbes(cudaStream_t stream, const std::vector<uint64_t>& nonces) {
  nvlk::Args a{};
  for (int r = 0; r < size(); ++r) a.bufs[r] = ptrs_[static_cast<size_t>(r)];
  a.rank = rank_;
  a.world = size();
  uint64_t tokens[nvlk::kMaxRanks] = {0};
  for (int r = 0; r < size(); ++r) tokens[r] = token(nonces[static_cast<size_t>(rank_)], rank_, r);
  try {
    nvlk::writeProbes(a, tokens, stream);
  } catch (const std::exception& e) {
    cudaGetLastError();
    return e.what();
  }
  return cudaProblem(cudaStreamSynchronize(stream), "the probe writes into the peers' buffers");
}

std::string PeerBuffers::checkProbes(cudaStream_t stream, const std::vector<uint64_t>& nonces) {
  uint64_t got[nvlk::kMaxRanks] = {0};
  const char* slots =
      static_cast<const char*>(ptrs_[static_cast<size_t>(rank_)]) + nvlk::kProbeOffset;
  std::string p = cudaProblem(
      cudaMemcpyAsync(got, slots, sizeof(got), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  if (p.empty()) p = cudaProblem(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!p.empty()) return p;
  std::string missing;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_ || got[r] == token(nonces[static_cast<size_t>(r)], r, rank_)) continue;
    missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (missing.empty()) return "";
  return "peer writes through the mapping did not arrive from group rank(s) [" + missing +
         "] although the driver reports peer access";
}

std::unique_ptr<PeerBuffers> PeerBuffers::exchange(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size, int64_t bytes,
                                                   at::Device device, const OpContext& ctx,
                                                   const std::string& refusal, std::string* why) {
  c10::cuda::CUDAGuard guard(device);
  std::unique_ptr<PeerBuffers> b(new PeerBuffers(rank, size, bytes, device.index()));
  cudaStream_t stream = nullptr;
  std::string problem = refusal;
  if (problem.empty() && size > nvlk::kMaxRanks) {
    problem = "more than " + std::to_string(nvlk::kMaxRanks) + " ranks";
  }
  if (problem.empty()) {
    problem = cudaProblem(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                          "cudaStreamCreateWithFlags");
  }
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() {
      if (s != nullptr && cudaStreamDestroy(s) != cudaSuccess) cudaGetLastError();
    }
  } streamGuard{stream};
  // 1. Allocate and publish: "ok <nonce> <bus id> <handle>" or "no <why>".
  std::string published;
  if (problem.empty()) problem = b->allocate(stream, &published);
  uint64_t nonce = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  char nonceText[17];
  std::snprintf(nonceText, sizeof(nonceText), "%016llx", static_cast<unsigned long long>(nonce));
  auto answers = everyone(
      store, "map", rank, size,
      problem.empty() ? "ok " + std::string(nonceText) + " " + published : "no " + problem, ctx);
  *why = refusals(answers);
  if (!why->empty()) return nullptr;
  std::vector<uint64_t> nonces;
  for (const auto& a : answers) {
    std::istringstream is(a);
    std::string ok, text;
    is >> ok >> text;
    nonces.push_back(std::strtoull(text.c_str(), nullptr, 16));
  }
  // 2. Map every peer's buffer and write a token into it; "ok" only once the
  // writes completed, so after this round every token is in place.
  problem = b->open(answers);
  if (problem.empty()) problem = b->writeProbes(stream, nonces);
  *why =
      refusals(everyone(store, "open", rank, size, problem.empty() ? "ok" : "no " + problem, ctx));
  if (!why->empty()) return nullptr;
  // 3. Every rank checks the tokens it received.
  problem = b->checkProbes(stream, nonces);
  *why =
      refusals(everyone(store, "probe", rank, size, problem.empty() ? "ok" : "no " + problem, ctx));
  if (!why->empty()) return nullptr;
  return b;
}

}  // namespace fastcomm
