#include "intra/nvlink/signal_pads.hpp"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace fastcomm {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // not left for the next unrelated check to find
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
}

}  // namespace

SignalPads::SignalPads() {
  void* p = nullptr;
  check(cudaHostAlloc(&p, sizeof(nvlk::HostCtl), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of the NVLink control block");
  host_ = static_cast<nvlk::HostCtl*>(p);
  host_->abort = 0;
  host_->report = 0;
  void* d = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&d, p, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(p);
    host_ = nullptr;
    check(e, "cudaHostGetDevicePointer of the NVLink control block");
  }
  device_ = static_cast<nvlk::HostCtl*>(d);
}

SignalPads::~SignalPads() {
  if (host_ != nullptr && cudaFreeHost(host_) != cudaSuccess) cudaGetLastError();
}

std::optional<SignalPads::Timeout> SignalPads::timedOut() const {
  const uint64_t r = __atomic_load_n(&host_->report, __ATOMIC_ACQUIRE);
  if (r == 0) return std::nullopt;
  static const char* const names[] = {"all_reduce", "all_gather", "reduce_scatter"};
  const auto c = static_cast<size_t>(nvlk::reportCollective(r));
  return Timeout{nvlk::reportSeq(r), nvlk::reportCaptured(r), c < 3 ? names[c] : "collective",
                 nvlk::reportPeer(r)};
}

void SignalPads::abort() { __atomic_store_n(&host_->abort, uint64_t{1}, __ATOMIC_RELEASE); }

}  // namespace fastcomm
