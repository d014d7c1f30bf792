// PTX wrappers of the Hopper (sm_90a) GEMM: mbarriers, TMA loads and stores,
// bulk groups, named barriers, shared-memory vector access, wgmma fences
// and descriptors, register reallocation (programmatic dependent launch:
// matmul_device.cuh).
// Device code only, for matmul_sm90_epilogue.cuh and matmul_sm90_kernel.cuh.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "matmul_device.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FASTCOMM_SM90A_DEVICE 1
#else
#define FASTCOMM_SM90A_DEVICE 0
#endif

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

using namespace detail;

// ---- PTX wrappers (sm_90a) ---------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void mbar_init_fence() {
#if FASTCOMM_SM90A_DEVICE
  // Makes the initialised barriers visible to the async proxy (TMA).
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// Blocks until the phase of `bar` with the given parity has completed. A
// freshly initialised barrier counts as having completed the phase of
// parity 1, so waiting for parity 1 passes at once.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if FASTCOMM_SM90A_DEVICE
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// 2-D TMA copy of the box at (c0 = inner coordinate, c1 = outer coordinate)
// into shared memory at dst, completing its bytes on the mbarrier bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}

// 1-D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte
// aligned) from global memory into shared memory at dst, completing its bytes
// on the mbarrier bar.
__device__ __forceinline__ void bulk_load_1d(uint32_t dst, const void* src, uint32_t bytes,
                                             uint32_t bar) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
#endif
}

// 2-D TMA store of the box at (c0, c1) from shared memory at src; elements
// outside the tensor are not written. Tracked by this thread's bulk groups.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(src)
      : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit_group() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's bulk store groups are still reading
// their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}

// Waits until all of this thread's bulk store groups have completed.
__device__ __forceinline__ void bulk_wait_all() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Makes this thread's ordinary shared-memory writes visible to the async
// proxy (the TMA engine that reads them next).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Barrier among `count` threads on hardware barrier `id` (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ void ld_shared_v2(uint32_t addr, uint32_t& x, uint32_t& y) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(x), "=r"(y) : "r"(addr) : "memory");
#endif
}

__device__ __forceinline__ void ld_shared_v4(uint32_t addr, uint32_t (&v)[4]) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
#endif
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, const uint32_t (&v)[4]) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]), "r"(v[1]),
               "r"(v[2]), "r"(v[3])
               : "memory");
#endif
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
#if FASTCOMM_SM90A_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#endif
}

// Keeps the compiler from moving accumulator reads / writes across the
// asynchronous wgmma (the registers are in use until wgmma.wait_group).
template <int MS, int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[MS][N]) {
#pragma unroll
  for (int m = 0; m < MS; ++m) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[m][i])::"memory");
  }
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle, kept as its two
// 32-bit halves so that the main loop moves it over stages and k16 steps with
// one 32-bit add to `lo` (desc_advance) instead of rebuilding it per wgmma:
//   lo bits  0-13: start address >> 4
//   lo bits 16-29: leading-dimension byte offset >> 4
//   hi bits  0-13: stride-dimension byte offset >> 4
//   hi bits 30-31: swizzle mode (1 = 128B)
struct DescPair {
  uint32_t lo, hi;
};

__device__ __forceinline__ DescPair smem_desc_pair(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return {((addr & 0x3FFFFu) >> 4) | (((lbo & 0x3FFFFu) >> 4) << 16),
          ((sbo & 0x3FFFFu) >> 4) | (1u << 30)};
}

// `d` advanced by `bytes` (a multiple of 16). Only the 14-bit start-address
// field changes: a CTA's shared-memory addresses lie below 2^18 (228 KB), so
// start + bytes / 16 never carries into the offset field above it.
__device__ __forceinline__ DescPair desc_advance(DescPair d, uint32_t bytes) {
  return {d.lo + (bytes >> 4), d.hi};
}

__device__ __forceinline__ uint64_t desc_u64(DescPair d) {
  return (static_cast<uint64_t>(d.hi) << 32) | d.lo;
}

// x through a volatile move: the compiler cannot hoist or share what is
// computed from it, so values derived from it are recomputed where used.
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
  uint32_t y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float v0, float v1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(v0, v1);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

}  // namespace sm90
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
