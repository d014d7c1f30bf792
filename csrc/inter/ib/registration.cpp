#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <map>
#include <mutex>

#include "inter/ib/engine.hpp"
#include "inter/ib/gpu_memory.hpp"
#include "inter/ib/ib_memory.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

RegCache::Entry* RegCache::acquire(void* data, int64_t bytes, MemKind kind) {
  const auto pageMask = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE) - 1);
  const uintptr_t a = reinterpret_cast<uintptr_t>(data) & ~pageMask;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(data) + bytes + pageMask) & ~pageMask;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw std::runtime_error("fastcomm: ib transport: registerMemory after close()");
  for (auto& e : entries_) {
    if (e->start <= a && b <= e->end) {
      ++e->refs;
      ++hits_;
      return e.get();
    }
  }
  auto e = std::make_unique<Entry>();
  e->start = a;
  e->end = b;
  e->kind = kind;
  e->mr = dev_->regMr(reinterpret_cast<void*>(a), b - a, kind);
  e->refs = 1;
  ++misses_;
  entries_.push_back(std::move(e));
  return entries_.back().get();
}

void RegCache::release(Entry* e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  if (--e->refs > 0) return;
  entries_.erase(std::find_if(entries_.begin(), entries_.end(),
                              [&](const std::unique_ptr<Entry>& x) { return x.get() == e; }));
}

void RegCache::counters(std::map<std::string, int64_t>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  (*out)["reg_cache_hits"] = hits_;
  (*out)["reg_cache_misses"] = misses_;
  (*out)["reg_cache_entries"] = static_cast<int64_t>(entries_.size());
}

std::unique_ptr<MemoryRegion> Engine::registerMemory(void* data, int64_t bytes) {
  // Device pointers are told apart only in a CUDA build (never true in a
  // CPU-only one); the check creates no CUDA context.
  if (data != nullptr && gpu::isDeviceMemory(data)) return registerDeviceMemory(data, bytes);
  if (data == nullptr || bytes <= 0) {
    return std::make_unique<IbMemoryRegion>(regCache_, nullptr, data, bytes);
  }
  return std::make_unique<IbMemoryRegion>(regCache_, regCache_->acquire(data, bytes, MemKind::Host),
                                          data, bytes);
}

std::unique_ptr<MemoryRegion> Engine::registerDeviceMemory(void* data, int64_t bytes) {
  if (!deviceMemory_) {
    std::ostringstream os;
    os << "fastcomm: ib transport: cannot register " << bytes << " bytes of device memory at "
       << data << ": GPUDirect RDMA is " << gdrHow_;
    throw std::runtime_error(os.str());
  }
  if (data == nullptr || bytes <= 0) {
    return std::make_unique<IbMemoryRegion>(regCache_, nullptr, data, bytes);
  }
  return std::make_unique<IbMemoryRegion>(
      regCache_, regCache_->acquire(data, bytes, MemKind::Device), data, bytes);
}

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
