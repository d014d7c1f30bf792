// How float32 partial sums travel between nodes when FASTCOMM_WIRE_DTYPE asks
// for a lossy wire (the reduction itself always accumulates in float32).
//
// bf16 rounds each element; it has float32's range, so it never overflows.
// fp16 and int8 code blocks of kScaleBlock elements, each with a float32
// scale: the power of two that brings the block's largest magnitude into the
// code's range (kernels/wire_format.hpp; the CUDA kernels code the same
// bytes). A partial sum can then never overflow, and decoding is exact, so
// decode(encode(decode(encode(x)))) == decode(encode(x)): a block its owner
// rounded and the same block forwarded along a ring hold the same values on
// every rank. A block holding inf or NaN decodes to non-finite values, so
// overflow checks downstream (a grad scaler) still see it.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/wire_format.hpp"

namespace fastcomm {

enum class WireDtype { None, BF16, FP16, INT8 };
WireDtype parseWireDtype(const std::string& name);

class WireCodec {
 public:
  explicit WireCodec(WireDtype wire) : wire_(wire) {}

  WireDtype dtype() const { return wire_; }
  // Bytes that `n` elements take on the wire (scales first, then the codes).
  int64_t bytes(int64_t n) const;
  void encode(const float* src, int64_t n, void* dst) const;
  void decode(const void* src, int64_t n, float* dst) const;
  // dst[i] += the decoded value.
  void decodeAdd(const void* src, int64_t n, float* dst) const;
  // data = decode(encode(data)), using `scratch` of bytes(n).
  void round(float* data, int64_t n, void* scratch) const;

 private:
  WireDtype wire_;
};

}  // namespace fastcomm
