#include "inter/ib/gpu_memory.hpp"

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

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
bool copy(void*, const void*, size_t, int, std::string* err) {
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

// A non-blocking stream per device for the calling thread, destroyed when
// the thread ends (the emulated HCA's thread ends at device close).
class ThreadStreams {
 public:
  ~ThreadStreams() {
    for (auto& [dev, s] : streams_) {
      (void)dev;
      (void)cudaStreamDestroy(s);
    }
  }
  cudaError_t get(int device, cudaStream_t* out) {
    auto it = streams_.find(device);
    if (it != streams_.end()) {
      *out = it->second;
      return cudaSuccess;
    }
    cudaStream_t s = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return e;
    streams_[device] = s;
    *out = s;
    return cudaSuccess;
  }

 private:
  std::map<int, cudaStream_t> streams_;
};

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

bool copy(void* dst, const void* src, size_t n, int device, std::string* err) {
  thread_local ThreadStreams streams;
  cudaError_t e = cudaSetDevice(device);
  cudaStream_t s = nullptr;
  if (e == cudaSuccess) e = streams.get(device, &s);
  if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    *err = "cudaMemcpy of " + std::to_string(n) + " bytes on CUDA device " +
           std::to_string(device) + ": " + cudaText(e);
    return false;
  }
  return true;
}

#endif  // FASTCOMM_WITH_CUDA

}  // namespace gpu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
