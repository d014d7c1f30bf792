// Memory of the ib transport: registrations of caller buffers (a cache with
// reference counts, handed out as MemoryRegion), the staging slots that
// unregistered buffers go through, and page-aligned control memory.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>
#include <unistd.h>
#include <cstddef>

#include "inter/ib/device.hpp"
#include "inter/ib/wire.hpp"
#include "inter/transport.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

// Page-aligned, zeroed host memory.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes) : bytes_(bytes) {
    if (posix_memalign(&p_, 4096, bytes) != 0) throw std::bad_alloc();
    std::memset(p_, 0, bytes);
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  char* get() const { return static_cast<char*>(p_); }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Registrations of caller memory, reused for any range they cover and
// deregistered when the last MemoryRegion handle on them goes.
class RegCache {
 public:
  struct Entry {
    uintptr_t start = 0, end = 0;
    MemKind kind = MemKind::Host;
    std::unique_ptr<Mr> mr;
    int refs = 0;
  };

  explicit RegCache(Device* dev) : dev_(dev) {}

  // Host and device ranges never overlap (one virtual address space), so a
  // hit needs no kind check.
  Entry* acquire(void* data, int64_t bytes, MemKind kind);
  void release(Entry* e);

  void close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    entries_.clear();
  }

  void counters(std::map<std::string, int64_t>* out);

 private:
  std::mutex mu_;
  Device* dev_;
  std::vector<std::unique_ptr<Entry>> entries_;
  bool closed_ = false;
  int64_t hits_ = 0, misses_ = 0;
};

class IbMemoryRegion : public MemoryRegion {
 public:
  IbMemoryRegion(std::shared_ptr<RegCache> cache, RegCache::Entry* e, void* data, int64_t bytes)
      : cache_(std::move(cache)), entry_(e), data_(data), bytes_(bytes) {}
  ~IbMemoryRegion() override {
    if (entry_) cache_->release(entry_);
  }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }
  bool device() const { return entry_ != nullptr && entry_->kind == MemKind::Device; }

  // The keys when [p, p + n) lies in this registration of `cache`.
  bool covers(const RegCache* cache, const void* p, int64_t n, uint32_t* lkey,
              uint32_t* rkey) const {
    if (entry_ == nullptr || cache != cache_.get()) return false;
    const auto a = reinterpret_cast<uintptr_t>(p);
    if (a < entry_->start || a + static_cast<uint64_t>(n) > entry_->end) return false;
    *lkey = entry_->mr->lkey;
    *rkey = entry_->mr->rkey;
    return true;
  }

 private:
  std::shared_ptr<RegCache> cache_;
  RegCache::Entry* entry_;
  void* data_;
  int64_t bytes_;
};

// A pool of registered staging slots of kPieceBytes, allocated on first use.
class Staging {
 public:
  int take(Device& dev) {
    if (!mem_.get()) {
      mem_ = AlignedBuffer(static_cast<size_t>(kStagingSlots * kPieceBytes));
      mr_ = dev.regMr(mem_.get(), mem_.size(), MemKind::Host);
      for (int i = kStagingSlots - 1; i >= 0; --i) free_.push_back(i);
    }
    if (free_.empty()) return -1;
    int s = free_.back();
    free_.pop_back();
    return s;
  }
  void give(int s) { free_.push_back(s); }
  char* at(int s) const { return mem_.get() + s * kPieceBytes; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  void release() {
    mr_.reset();
    mem_ = AlignedBuffer();
    free_.clear();
  }

 private:
  AlignedBuffer mem_;
  std::unique_ptr<Mr> mr_;
  std::vector<int> free_;
};

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
