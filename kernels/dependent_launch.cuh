// Programmatic dependent launch (sm_90 and later; no-ops elsewhere), shared by
// the matmul and NVLink kernels: a kernel launched with
// programmatic_dependent_launch() may start its blocks before the kernel ahead
// of it on the stream has finished, once that kernel calls
// griddep_launch_dependents() (or exits); griddep_wait() then waits until the
// grids it depends on have completed and their memory is visible (at once
// where it was launched without the attribute).
#pragma once

#include <cuda_runtime.h>

namespace fastcomm {

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Whether the current device takes programmatic dependent launches (compute
// capability 9.0 and later); false, with the runtime's error, where it cannot
// be asked.
inline cudaError_t dependent_launch_supported(bool* supported) {
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  *supported = err == cudaSuccess && major >= 9;
  return err;
}

// The launch attribute that makes a kernel a programmatic dependent of the
// one before it on the stream (set launch.attrs to it, numAttrs to 1).
inline cudaLaunchAttribute programmatic_dependent_launch() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

}  // namespace fastcomm
