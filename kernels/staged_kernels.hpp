// Kernels of the CUDA multi-node all-reduce (plans/cuda/cuda_hier.*): the
// reduction of the pieces received from the rail peers into this rank's own
// piece, the casts to and from a 16-bit wire dtype, and the fused steps that
// do either straight from and into the staging. Host-callable
// launchers with plain types, so this header needs no ATen.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "staged_layout.hpp"

namespace fastcomm {
namespace hierk {

// Element types the path reduces (the NCCL arithmetic types but bool).
enum class Elem : int { F32, F64, F16, BF16, I8, U8, I32, I64 };
enum class Op : int { Sum, Prod, Min, Max };
enum class Wire : int { None, BF16, FP16 };

// own[i] = own[i] op recv[j * stride + i] for j < nPeers, i < n, accumulated
// in float (16-bit types), double, or 64-bit integers. `divisor` > 0 divides
// the result (AVG; integer division truncates). With a wire dtype (float32
// data, Sum only), `recv` holds wire values; the result is rounded to the
// wire dtype, stored in own[] (as float) and in wireOut[], so the owner keeps
// exactly what its peers will receive.
void reduce(Elem elem, Op op, Wire wire, void* own, const void* recv, int64_t stride, int nPeers,
            int64_t n, int64_t divisor, void* wireOut, cudaStream_t stream);

// Casts the pieces of chunk k that go to the peers (every node but `me`) from
// float32 `chunk` (the chunk's first element) into the packed wire buffer
// `out` of slots of l.qMax, and back (`unpack`).
void pack(Wire wire, const float* chunk, void* out, const HierLayout& l, int64_t k, int me,
          cudaStream_t stream);
void unpack(Wire wire, const void* in, float* chunk, const HierLayout& l, int64_t k, int me,
            cudaStream_t stream);

// The fused steps of the rail (plans/staged_rail.hpp, StagedDevice): one
// kernel each that reads or writes the staging in place, mapped pinned host
// memory or device memory alike. Staging slots lie `pitch` bytes apart, slot
// j for node peerNode(j, me); `chunk` is chunk k's first element of `esize`
// bytes (float32 with a wire dtype). 16-byte loads and stores where the
// addresses allow, else element by element.
//
// P(k): the pieces of chunk k the peers own -> `slots` (cast to the wire).
void packToStaging(Wire wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                   const HierLayout& l, int64_t k, int me, cudaStream_t stream);
// A(k): reduce() with peer j's piece read from recv + j * pitch bytes, the
// result stored in own[] and, as the element type or rounded to the wire
// dtype, in out[] (the staging slot the all-gather sends).
void reduceFromStaging(Elem elem, Op op, Wire wire, void* own, const void* recv, int64_t pitch,
                       int nPeers, int64_t n, int64_t divisor, void* out, cudaStream_t stream);
// B(k): the peers' reduced pieces of chunk k from `slots` into place in the
// chunk (from the wire dtype).
void gatherFromStaging(Wire wire, int64_t esize, const void* slots, int64_t pitch, void* chunk,
                       const HierLayout& l, int64_t k, int me, cudaStream_t stream);

// Loads every kernel above into the current device's context, so that none
// is loaded lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2 on
// Linux) at its first launch, which the rail issues behind stream waits on
// the network: "Loading kernels might require context synchronization"
// (CUDA C++ Programming Guide, Lazy Loading, Possible Issues: Concurrent
// Execution), and a context synchronization then waits for those waits,
// i.e. for the network, while it may hold up the CUDA work that moves the
// data (the ib emulation's copies of device staging: plans/staged_rail.hpp).
// Call at set-up, before any op is in flight. Throws std::runtime_error.
void preload();

}  // namespace hierk
}  // namespace fastcomm
