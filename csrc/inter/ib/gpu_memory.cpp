#include "inter/ib/gpu_memory.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#ifdef FASTCOMM_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>
#endif

namespace fastcomm {
namespace transport {
namespace ib {
namespace gpu {

#ifndef FASTCOMM_WITH_CUDA

namespace {
const char* kNoCuda = "this fastcomm build has no CUDA (built without CUDA or FASTCOMM_CPU_ONLY=1)";
[[noreturn]] void noCuda(const char* what) {
  throw std::runtime_error(std::string("fastcomm: ib: ") + what + ": " + kNoCuda);
}
}  // namespace

bool usable(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}
bool isDeviceMemory(const void*) { return false; }
int deviceOf(const void*, size_t) { noCuda("device memory registration"); }
bool dmaBufExportSupported(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}
int dmaBufFd(void*, size_t, int) { noCuda("dma-buf export"); }
struct DeviceCopier::Impl {};
DeviceCopier::DeviceCopier(int device) : device_(device), impl_(nullptr) {
  noCuda("device memory copies");
}
DeviceCopier::~DeviceCopier() = default;
bool DeviceCopier::toDevice(void*, const void*, size_t, std::string* err) {
  *err = kNoCuda;
  return false;
}
bool DeviceCopier::fromDevice(void*, const void*, size_t, std::string* err) {
  *err = kNoCuda;
  return false;
}

#else  // FASTCOMM_WITH_CUDA

namespace {

std::string cudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// cudaGetDeviceCount once: it initializes the driver (no context) and its
// answer does not change within a process.
int deviceCount(std::string* why) {
  static std::once_flag once;
  static int count = 0;
  static std::string error;
  std::call_once(once, [] {
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it for torch's next call
      count = 0;
      error = "no usable CUDA device (cudaGetDeviceCount: " + cudaText(e) + ")";
    } else if (count == 0) {
      error = "no CUDA device is visible to this process";
    }
  });
  if (why) *why = error;
  return count;
}

// Runs `fn` with a device current that already has its primary context, so
// that the runtime call inside creates none (as torch's is_pinned does); the
// previous device is restored without creating one either. False when no
// device has a context: then no device memory exists in this process.
template <typename Fn>
bool withSomeContext(int prefer, Fn&& fn) {
  std::optional<c10::DeviceIndex> d;
  if (prefer >= 0 && c10::cuda::hasPrimaryContext(static_cast<c10::DeviceIndex>(prefer))) {
    d = static_cast<c10::DeviceIndex>(prefer);
  } else {
    d = c10::cuda::getDeviceIndexWithPrimaryContext();
  }
  if (!d) return false;
  const c10::DeviceIndex prev = c10::cuda::ExchangeDevice(*d);
  fn();
  c10::cuda::MaybeSetDevice(prev);
  return true;
}

// cudaPointerGetAttributes: the device ordinal of device memory, else -1.
int pointerDevice(const void* p, std::string* why) {
  if (deviceCount(why) == 0) return -1;
  cudaPointerAttributes attr{};
  cudaError_t e = cudaSuccess;
  if (!withSomeContext(-1, [&] { e = cudaPointerGetAttributes(&attr, p); })) {
    if (why) *why = "no CUDA context exists in this process, so it has no device memory";
    return -1;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = "cudaPointerGetAttributes: " + cudaText(e);
    return -1;
  }
  if (attr.type != cudaMemoryTypeDevice) {
    if (why) {
      *why = attr.type == cudaMemoryTypeManaged
                 ? "it is CUDA managed memory (only cudaMalloc'd device memory is supported)"
                 : "it is host memory";
    }
    return -1;
  }
  return attr.device;
}

template <typename Fn>
Fn driverEntry(const char* name, std::string* why) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  // The 12.0 ABI of each call is all we use.
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    if (why) *why = std::string("the CUDA driver has no ") + name;
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

// The bounce buffer of a copier: one wire packet (the emulation's payload
// per packet is 64 KiB); larger copies go through it in turns.
constexpr size_t kBounceBytes = 64 << 10;
// How long the HCA thread waits for one copy before it gives up on the GPU.
constexpr auto kCopyLimit = std::chrono::seconds(30);
using Clock = std::chrono::steady_clock;

// The calling thread's current device is `device` while this lives (the
// previous one restored; no context is created for either: `device` has
// device memory, so its primary context exists).
class DeviceScope {
 public:
  explicit DeviceScope(int device)
      : prev_(c10::cuda::ExchangeDevice(static_cast<c10::DeviceIndex>(device))) {}
  ~DeviceScope() { c10::cuda::MaybeSetDevice(prev_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex prev_;
};

// Waits for everything on `s`, polling: cudaStreamQuery looks at this stream
// only. cudaErrorNotReady when it did not finish within kCopyLimit.
cudaError_t waitCopy(cudaStream_t s) {
  const auto until = Clock::now() + kCopyLimit;
  for (int polls = 0;; ++polls) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e != cudaErrorNotReady) return e;
    (void)cudaGetLastError();  // "not ready" is no error: leave none behind
    if (Clock::now() >= until) return cudaErrorNotReady;
    // A 64 KiB copy takes microseconds: spin briefly, then nap.
    if (polls < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

}  // namespace

bool usable(std::string* why) { return deviceCount(why) > 0; }

bool isDeviceMemory(const void* p) { return p != nullptr && pointerDevice(p, nullptr) >= 0; }

int deviceOf(const void* p, size_t n) {
  std::string why;
  const int d = pointerDevice(p, &why);
  std::ostringstream os;
  os << "fastcomm: ib: cannot register " << n << " bytes at " << p << " as device memory: ";
  if (d < 0) throw std::runtime_error(os.str() + why);
  const int dEnd = n > 1 ? pointerDevice(static_cast<const char*>(p) + n - 1, &why) : d;
  if (dEnd != d) {
    throw std::runtime_error(os.str() + "the range does not lie in the memory of one device");
  }
  return d;
}

bool dmaBufExportSupported(std::string* why) {
  const int n = deviceCount(why);
  if (n == 0) return false;
  if (!driverEntry<PFN_cuMemGetHandleForAddressRange_v11070>("cuMemGetHandleForAddressRange",
                                                             why)) {
    return false;
  }
  auto get = driverEntry<PFN_cuDeviceGet_v2000>("cuDeviceGet", why);
  auto attr = driverEntry<PFN_cuDeviceGetAttribute_v2000>("cuDeviceGetAttribute", why);
  if (get == nullptr || attr == nullptr) return false;
  for (int i = 0; i < n; ++i) {
    CUdevice dev = 0;
    int ok = 0;
    if (get(&dev, i) != CUDA_SUCCESS ||
        attr(&ok, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) != CUDA_SUCCESS || ok == 0) {
      if (why) {
        *why = "CUDA device " + std::to_string(i) +
               " cannot export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: needs the "
               "open GPU kernel module and Linux >= 5.12)";
      }
      return false;
    }
  }
  return true;
}

int dmaBufFd(void* p, size_t n, int device) {
  std::string why;
  auto fn =
      driverEntry<PFN_cuMemGetHandleForAddressRange_v11070>("cuMemGetHandleForAddressRange", &why);
  if (fn == nullptr) throw std::runtime_error("fastcomm: ib: dma-buf export: " + why);
  int fd = -1;
  CUresult r = CUDA_ERROR_UNKNOWN;
  if (!withSomeContext(device, [&] {
        r = fn(&fd, reinterpret_cast<CUdeviceptr>(p), n, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
      })) {
    throw std::runtime_error("fastcomm: ib: dma-buf export: no CUDA context in this process");
  }
  if (r != CUDA_SUCCESS || fd < 0) {
    std::ostringstream os;
    os << "fastcomm: ib: cuMemGetHandleForAddressRange(DMA_BUF_FD) of " << n << " bytes at " << p
       << " on CUDA device " << device << " failed with CUresult " << static_cast<int>(r)
       << " (the range must be page-aligned cudaMalloc'd memory of one device)";
    throw std::runtime_error(os.str());
  }
  return fd;
}

// A stream and a page-locked bounce buffer of one device (gpu_memory.hpp
// says why). Made once, pooled per device when its copier goes, never freed.
struct DeviceCopier::Impl {
  cudaStream_t stream = nullptr;
  char* bounce = nullptr;
  bool broken = false;  // a copy never completed: the GPU may still write `bounce`
  std::string brokenWhy;

  static std::mutex& poolMu() {
    static std::mutex mu;
    return mu;
  }
  using Free = std::vector<Impl*>;  // of one device
  static std::map<int, Free>& pool() {
    static auto* p = new std::map<int, Free>();  // outlives static destructors
    return *p;
  }
};

DeviceCopier::DeviceCopier(int device) : device_(device), impl_(nullptr) {
  {
    std::lock_guard<std::mutex> lock(Impl::poolMu());
    auto& free = Impl::pool()[device];
    if (!free.empty()) {
      impl_ = free.back();
      free.pop_back();
      return;
    }
  }
  auto fail = [&](const char* what, cudaError_t e) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("fastcomm: ib emulation: ") + what +
                             " for copies of device memory on CUDA device " +
                             std::to_string(device) + ": " + cudaText(e));
  };
  auto impl = std::make_unique<Impl>();
  DeviceScope scope(device);
  cudaError_t e = cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) fail("cudaStreamCreateWithFlags", e);
  // Portable: page-locked for every context of the process, whichever
  // device is current on the thread that copies.
  e = cudaHostAlloc(reinterpret_cast<void**>(&impl->bounce), kBounceBytes, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    (void)cudaStreamDestroy(impl->stream);  // nothing ran on it
    fail("cudaHostAlloc of the bounce buffer", e);
  }
  impl_ = impl.release();
}

DeviceCopier::~DeviceCopier() {
  if (impl_ == nullptr || impl_->broken) return;  // leaked: the GPU may still use it
  std::lock_guard<std::mutex> lock(Impl::poolMu());
  Impl::pool()[device_].push_back(impl_);
}

bool DeviceCopier::toDevice(void* dst, const void* src, size_t n, std::string* err) {
  return copy(dst, src, n, true, err);
}

bool DeviceCopier::fromDevice(void* dst, const void* src, size_t n, std::string* err) {
  return copy(dst, src, n, false, err);
}

bool DeviceCopier::copy(void* dst, const void* src, size_t n, bool toDevice, std::string* err) {
  Impl& m = *impl_;
  auto describe = [&](const std::string& what) {
    return "copy of " + std::to_string(n) + " bytes " + (toDevice ? "to" : "from") +
           " CUDA device " + std::to_string(device_) + ": " + what;
  };
  if (m.broken) {
    *err = describe(m.brokenWhy);
    return false;
  }
  // The stream's device current, as for any work on it; cheap, and no
  // context is made (the device has memory here, so its context exists).
  cudaError_t e = cudaSetDevice(device_);
  for (size_t done = 0; e == cudaSuccess && done < n;) {
    const size_t len = std::min(kBounceBytes, n - done);
    if (toDevice) {
      std::memcpy(m.bounce, static_cast<const char*>(src) + done, len);
      e = cudaMemcpyAsync(static_cast<char*>(dst) + done, m.bounce, len, cudaMemcpyHostToDevice,
                          m.stream);
    } else {
      e = cudaMemcpyAsync(m.bounce, static_cast<const char*>(src) + done, len,
                          cudaMemcpyDeviceToHost, m.stream);
    }
    if (e == cudaSuccess) e = waitCopy(m.stream);
    if (e == cudaErrorNotReady) {
      m.broken = true;
      m.brokenWhy =
          "an earlier copy did not complete within " + std::to_string(kCopyLimit.count()) +
          " s: the GPU did not run it (is its stream queued behind work that waits for this "
          "transfer? see CUDA_DEVICE_MAX_CONNECTIONS); the emulated HCA gives up on this GPU";
      *err = describe("did not complete within " + std::to_string(kCopyLimit.count()) +
                      " s: the GPU did not run it (is its stream queued behind work that waits "
                      "for this transfer? see CUDA_DEVICE_MAX_CONNECTIONS)");
      return false;
    }
    if (e == cudaSuccess && !toDevice) {
      std::memcpy(static_cast<char*>(dst) + done, m.bounce, len);
    }
    done += len;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *err = describe(cudaText(e));
    return false;
  }
  return true;
}

#endif  // FASTCOMM_WITH_CUDA

}  // namespace gpu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
