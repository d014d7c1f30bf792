#include "plans/wire_codec.hpp"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace fastcomm {
namespace {

int64_t blocksOf(int64_t n) { return (n + kScaleBlock - 1) / kScaleBlock; }

at::Tensor flat(const void* p, int64_t n, at::ScalarType t) {
  return at::from_blob(const_cast<void*>(p), {n}, at::TensorOptions().dtype(t));
}

// The scaled codes: the largest magnitude each holds, and their conversions
// of values already scaled into range. fp16 converts through ATen's
// vectorized copy (a scalar conversion is several times slower than the
// network).
struct HalfCode {
  using T = uint16_t;
  static constexpr float kMax = 65504.0f;
  static void to(const float* v, int64_t n, T* c) {
    flat(c, n, at::kHalf).copy_(flat(v, n, at::kFloat));
  }
  static void from(const T* c, int64_t n, float* v) {
    flat(v, n, at::kFloat).copy_(flat(c, n, at::kHalf));
  }
};

struct Int8Code {
  using T = int8_t;
  static constexpr float kMax = 127.0f;
  // Adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to the nearest
  // integer, ties to even (as std::nearbyint in the default rounding mode and
  // CUDA's __float2int_rn), in a loop the compiler vectorizes; a call to
  // nearbyint per element made the codec slower than a 1 Gbit/s link.
  static void to(const float* v, int64_t n, T* c) {
    constexpr float kRound = 12582912.0f;
    for (int64_t i = 0; i < n; ++i)
      c[i] = static_cast<T>(static_cast<int32_t>((v[i] + kRound) - kRound));
  }
  static void from(const T* c, int64_t n, float* v) {
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(c[i]);
  }
};

// The smallest e with amax <= kMax * 2^e (at least float's smallest normal
// exponent, so that 2^-e stays finite).
int scaleExponent(float amax, float kMax) {
  constexpr int kMinExp = std::numeric_limits<float>::min_exponent - 1;  // -126
  if (!(amax > 0.0f)) return kMinExp;
  int e = 0;
  if (std::frexp(static_cast<double>(amax) / kMax, &e) == 0.5) --e;
  while (std::ldexp(static_cast<double>(kMax), e) < amax) ++e;
  return std::max(e, kMinExp);
}

// Blocks coded at a time: their scaled values (64 KiB of floats) stay in the
// cache between the scale pass and the code's bulk conversion.
constexpr int64_t kGroupBlocks = 64;

// Values scaled into a code's range, between the scale pass and the
// conversion (per thread: pieces are coded on the lanes).
float* staging() {
  thread_local std::vector<float> buf(kGroupBlocks * kScaleBlock);
  return buf.data();
}

// The largest magnitude of x[0, m) as the bits of a float. With the sign
// cleared, floats order as their bit patterns and every inf or NaN lies at or
// above kInfBits: an integer maximum, which vectorizes (a float maximum that
// keeps NaN semantics does not).
constexpr uint32_t kInfBits = 0x7f800000u;
uint32_t maxMagnitudeBits(const float* x, int64_t m) {
  uint32_t most = 0;
  for (int64_t i = 0; i < m; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    b &= 0x7fffffffu;
    most = b > most ? b : most;
  }
  return most;
}

template <typename C>
void encodeScaled(const float* src, int64_t n, char* dst) {
  const int64_t nb = blocksOf(n);
  auto* codes = reinterpret_cast<typename C::T*>(dst + nb * sizeof(float));
  float* scaled = staging();
  for (int64_t g = 0; g < nb; g += kGroupBlocks) {
    const int64_t first = g * kScaleBlock;
    const int64_t count = std::min(kGroupBlocks * kScaleBlock, n - first);
    for (int64_t b = g; b < std::min(nb, g + kGroupBlocks); ++b) {
      const int64_t lo = b * kScaleBlock, m = std::min(kScaleBlock, n - lo);
      const float* x = src + lo;
      float* out = scaled + (lo - first);
      const uint32_t most = maxMagnitudeBits(x, m);
      float amax;
      std::memcpy(&amax, &most, sizeof amax);
      float scale;
      if (most >= kInfBits) {  // the block holds inf or NaN
        // Zeros, which the NaN scale decodes to NaN (inf * 0 would be NaN, no code).
        scale = std::numeric_limits<float>::quiet_NaN();
        std::fill(out, out + m, 0.0f);
      } else {
        const int e = scaleExponent(amax, C::kMax);
        scale = std::ldexp(1.0f, e);
        const float inv = std::ldexp(1.0f, -e);
        for (int64_t i = 0; i < m; ++i) out[i] = x[i] * inv;
      }
      std::memcpy(dst + b * sizeof(float), &scale, sizeof(float));
    }
    C::to(scaled, count, codes + first);
  }
}

template <typename C, bool kAdd>
void decodeScaled(const char* src, int64_t n, float* dst) {
  const int64_t nb = blocksOf(n);
  const auto* codes = reinterpret_cast<const typename C::T*>(src + nb * sizeof(float));
  float* unscaled = staging();
  for (int64_t g = 0; g < nb; g += kGroupBlocks) {
    const int64_t first = g * kScaleBlock;
    C::from(codes + first, std::min(kGroupBlocks * kScaleBlock, n - first), unscaled);
    for (int64_t b = g; b < std::min(nb, g + kGroupBlocks); ++b) {
      const int64_t lo = b * kScaleBlock, m = std::min(kScaleBlock, n - lo);
      const float* in = unscaled + (lo - first);
      float* out = dst + lo;
      float scale;
      std::memcpy(&scale, src + b * sizeof(float), sizeof(float));
      for (int64_t i = 0; i < m; ++i) {
        const float v = in[i] * scale;
        if constexpr (kAdd) {
          out[i] += v;
        } else {
          out[i] = v;
        }
      }
    }
  }
}

void encodeBf16(const float* src, int64_t n, char* dst) {
  flat(dst, n, at::kBFloat16).copy_(flat(src, n, at::kFloat));
}

template <bool kAdd>
void decodeBf16(const char* src, int64_t n, float* dst) {
  const auto* in = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const float v = c10::detail::f32_from_bits(in[i]);
    if constexpr (kAdd) {
      dst[i] += v;
    } else {
      dst[i] = v;
    }
  }
}

template <bool kAdd>
void decodeAny(WireDtype wire, const void* src, int64_t n, float* dst) {
  const char* s = static_cast<const char*>(src);
  switch (wire) {
    case WireDtype::BF16:
      return decodeBf16<kAdd>(s, n, dst);
    case WireDtype::FP16:
      return decodeScaled<HalfCode, kAdd>(s, n, dst);
    case WireDtype::INT8:
      return decodeScaled<Int8Code, kAdd>(s, n, dst);
    case WireDtype::None:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "fastcomm: no codec for wire dtype none");
}

}  // namespace

WireDtype parseWireDtype(const std::string& name) {
  if (name == "bf16") return WireDtype::BF16;
  if (name == "fp16") return WireDtype::FP16;
  if (name == "int8") return WireDtype::INT8;
  return WireDtype::None;
}

int64_t WireCodec::bytes(int64_t n) const {
  switch (wire_) {
    case WireDtype::BF16:
      return 2 * n;
    case WireDtype::FP16:
      return scaledWireBytes(n, 2);
    case WireDtype::INT8:
      return scaledWireBytes(n, 1);
    case WireDtype::None:
      break;
  }
  return 4 * n;
}

void WireCodec::encode(const float* src, int64_t n, void* dst) const {
  char* d = static_cast<char*>(dst);
  switch (wire_) {
    case WireDtype::BF16:
      return encodeBf16(src, n, d);
    case WireDtype::FP16:
      return encodeScaled<HalfCode>(src, n, d);
    case WireDtype::INT8:
      return encodeScaled<Int8Code>(src, n, d);
    case WireDtype::None:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "fastcomm: no codec for wire dtype none");
}

void WireCodec::decode(const void* src, int64_t n, float* dst) const {
  decodeAny<false>(wire_, src, n, dst);
}

void WireCodec::decodeAdd(const void* src, int64_t n, float* dst) const {
  decodeAny<true>(wire_, src, n, dst);
}

void WireCodec::round(float* data, int64_t n, void* scratch) const {
  encode(data, n, scratch);
  decode(scratch, n, data);
}

}  // namespace fastcomm
