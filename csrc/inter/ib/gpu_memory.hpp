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

// Copies `n` bytes where one side (or both) is memory of `device`, and waits
// for it. Runs on a non-blocking stream of the calling thread, so it is never
// ordered behind work on the legacy default stream (which may wait on this
// very transfer). False with `err` set when CUDA reported an error.
bool copy(void* dst, const void* src, size_t n, int device, std::string* err);

}  // namespace gpu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
