// The block-scaled wire format (fp16, int8), shared by the host codec
// (plans/wire_codec.hpp) and the CUDA staging kernels (kernels/staged_kernels.*),
// which must code the same bytes: a run of n values is the float32 scales of
// its blocks of kScaleBlock values, then the n codes.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTCOMM_HD __host__ __device__
#else
#define FASTCOMM_HD
#endif

namespace fastcomm {

// Float32 values that share one power-of-two scale.
constexpr int64_t kScaleBlock = 256;

// Bytes of n values on a block-scaled wire of `codeBytes`-byte codes.
FASTCOMM_HD inline int64_t scaledWireBytes(int64_t n, int64_t codeBytes) {
  return (n + kScaleBlock - 1) / kScaleBlock * 4 + n * codeBytes;
}

}  // namespace fastcomm
