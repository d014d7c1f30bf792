// Kernels of the CUDA multi-node all-reduce (plans/cuda/cuda_hier.*): the
// steps of the rail, each reading and writing the staging in place (the
// pieces for the peers staged, coded for a wire dtype if asked; the peers'
// pieces reduced into this rank's own; the reduced pieces put in place).
// Host-callable launchers with plain types, so this header needs no ATen.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "staged_layout.hpp"

namespace fastcomm {
namespace hierk {

// Element types the path reduces (the NCCL arithmetic types but bool).
enum class Elem : int { F32, F64, F16, BF16, I8, U8, I32, I64 };
enum class Op : int { Sum, Prod, Min, Max };
// How float32 sums travel: as they are; bf16 (each value rounded); fp16 or
// int8 codes, block-scaled in plans/wire_codec.hpp's format, bit for bit
// (each block of kScaleBlock values with the float32 power-of-two scale that
// brings its largest magnitude into the code's range; a block holding inf or
// NaN has a NaN scale and zero codes). A piece of n values in the staging is
// then its blocks' scales followed by its codes (scaledWireBytes(n, 2 or 1)
// bytes), so staging slots must be 4-byte aligned.
enum class Wire : int { None, BF16, FP16, INT8 };

// The steps of the rail (plans/staged_rail.hpp, StagedDevice): one
// kernel each that reads or writes the staging in place, mapped pinned host
// memory or device memory alike. Staging slots lie `pitch` bytes apart, slot
// j for node peerNode(j, me); `chunk` is chunk k's first element of `esize`
// bytes (float32 with a wire dtype). 16-byte loads and stores where the
// addresses allow, else element by element (block-scaled wires: one warp per
// block, 4-byte words of codes, the data in 8- or 16-byte vectors where
// aligned).
//
// P(k): the pieces of chunk k the peers own -> `slots` (coded for the wire).
void packToStaging(Wire wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                   const HierLayout& l, int64_t k, int me, cudaStream_t stream);
// A(k): own[i] = own[i] op peer j's piece[i] for j < nPeers, i < n, peer
// j's piece read from recv + j * pitch bytes, accumulated in float (16-bit
// types), double, or 64-bit integers; `divisor` > 0 divides the result (AVG;
// integer division truncates). The result is stored in own[] and, as the
// element type or coded for the wire, in out[] (the staging slot the
// all-gather sends; null: none, without a wire dtype only). With a wire dtype
// (float32 data, Sum only) the peers' pieces are coded, and own[] gets the
// decoded result, so the owner keeps exactly what its peers receive.
void reduceFromStaging(Elem elem, Op op, Wire wire, void* own, const void* recv, int64_t pitch,
                       int nPeers, int64_t n, int64_t divisor, void* out, cudaStream_t stream);
// B(k): the peers' reduced pieces of chunk k from `slots` into place in the
// chunk (decoded from the wire).
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
