// What the ib device layer needs from CUDA for GPUDirect RDMA: whether a
// pointer is device memory, a dma-buf fd for a device range, and (for the
// emulated HCA) copies between device memory and its host wires.
//
// Everything goes through the CUDA runtime that torch already loads; driver
// calls are reached with cudaGetDriverEntryPointByVersion, since fastcomm
// does not link libcuda. In a CPU-only build (no FASTCOMM_WITH_CUDA) nothing
// is device memory and the calls that need CUDA throw, saying so.
#pragma once

#include <cstddef>
#include <string>

namespace fastcomm {
namespace transport {
namespace ib {
namespace gpu {

// Whether this process can use CUDA: a CUDA build and at least one visible
// device. Initializes the driver but creates no context. `why` says why not.
bool usable(std::string* why);

// Whether `p` is CUDA device memory (cudaPointerGetAttributes). Never creates
// a CUDA context: without an active primary context on some device, no
// device memory can exist in this process and the answer is false.
bool isDeviceMemory(const void* p);

// The device ordinal of [p, p + n); throws std::runtime_error saying why
// when the range is not device memory or CUDA is not usable.
int deviceOf(const void* p, size_t n);

// Whether the driver can export device memory of every visible device as
// dma-buf (cuMemGetHandleForAddressRange, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED).
bool dmaBufExportSupported(std::string* why);

// A dma-buf fd for [p, p + n), both aligned to the host page size; the
// caller closes it. Throws std::runtime_error saying why not.
int dmaBufFd(void* p, size_t n, int device);

// The emulated HCA's "DMA" to and from the memory of one CUDA device.
//
// The emulation's wires are plain POSIX shared memory: pageable, never
// page-locked. A cudaMemcpyAsync straight between them and device memory can
// hang the staged multi-node all_reduce with device staging: the comm stream
// sits in a cuStreamWaitValue32 that the rail's proxy releases only once the
// transport delivered (plans/staged_rail.hpp), and delivering needs the HCA
// thread's copies. Nothing lets such a copy run while the context is
// otherwise held up:
// - CUDA Runtime API, "API synchronization behavior", for cudaMemcpyAsync:
//   "For transfers between device memory and pageable host memory, the
//   function might be synchronous with respect to host" and "If pageable
//   memory must first be staged to pinned memory, the driver may synchronize
//   with the stream and stage the copy into pinned memory"; for every call:
//   "Any CUDA API call may block or synchronize for various reasons such as
//   contention for or unavailability of internal resources".
// - CUDA C++ Programming Guide, "Implicit Synchronization": "Two commands
//   from different streams cannot run concurrently if any one of the
//   following operations is issued in-between them by the host thread: a
//   page-locked host memory allocation, a device memory allocation, ..."
//   (what staging a pageable copy may take), and "If asynchronous memory
//   copies involve host memory that is not page-locked, they will be
//   synchronous".
// - CUDA Driver API, "Stream Memory Operations": "Improper use of these APIs
//   may deadlock the application. Synchronization ordering established
//   through these APIs is not visible to CUDA. CUDA tasks that are (even
//   indirectly) ordered by these APIs should also have that order expressed
//   with CUDA-visible dependencies such as events. This ensures that the
//   scheduler does not serialize them in an improper order." The HCA's copy
//   is such a task: the comm stream's wait is (through the proxy) ordered
//   after it, and no event can say so.
// (On the issuing thread, the first launch of a kernel behind those waits
// loads it lazily, which may synchronize the context: kernels/staged_kernels.hpp
// preloads.) A hardware NIC's DMA is no
// CUDA work at all; the closest the emulation gets is to keep every copy an
// ordinary, fully asynchronous stream operation that needs nothing else:
// - device <-> a page-locked bounce buffer only ("For all other transfers,
//   the function should be fully asynchronous"), the bounce <-> wire part a
//   memcpy on the host;
// - on a cudaStreamNonBlocking stream of the region's device (work in it
//   "may run concurrently with work in stream 0 (the NULL stream)", and it
//   "should perform no implicit synchronization with stream 0",
//   cudaStreamCreateWithFlags), never the legacy default stream, with that
//   device current on the calling thread;
// - the stream and the bounce buffer are made at registration (set-up, on
//   the registering thread), never on the HCA thread while transfers are in
//   flight: a page-locked allocation is one of the implicitly synchronizing
//   operations above. They are never freed
//   (cudaFreeHost, like cudaFree, may wait for the whole device: "Managing
//   memory allocations using cudaMalloc and cudaFree causes the GPU to
//   synchronize across all executing CUDA streams", Programming Guide,
//   "Stream-Ordered Memory Allocator"), only handed to the next copier of
//   the same device in this process;
// - the HCA thread waits for a copy by polling cudaStreamQuery (this stream
//   only) with a time limit, so a copy the GPU never runs (e.g. its stream
//   shares a hardware work queue with a stream that waits for this transfer:
//   CUDA_DEVICE_MAX_CONNECTIONS) fails the transfer with an error saying so
//   instead of hanging the HCA. Such a copier is leaked, never reused.
class DeviceCopier {
 public:
  // For device `device`; throws std::runtime_error saying why not (no CUDA).
  explicit DeviceCopier(int device);
  ~DeviceCopier();
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  int device() const { return device_; }
  // `n` bytes from host memory `src` to device memory `dst`, and back; they
  // return once the bytes are in place. False with `err` set when CUDA
  // reported an error or the copy did not complete in time. One thread at a
  // time (the HCA thread).
  bool toDevice(void* dst, const void* src, size_t n, std::string* err);
  bool fromDevice(void* dst, const void* src, size_t n, std::string* err);

 private:
  bool copy(void* dst, const void* src, size_t n, bool toDevice, std::string* err);

  struct Impl;
  int device_;
  Impl* impl_;  // pooled, never freed (see above)
};

}  // namespace gpu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
