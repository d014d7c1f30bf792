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

int64_t blocksOf(int64_t n) { return (n + kWireBlock - 1) / kWireBlock; }

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
  static void to(const float* v, int64_t n, T* c) {
    for (int64_t i = 0; i < n; ++i) c[i] = static_cast<T>(std::nearbyint(v[i]));
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

// Values scaled into a code's range, between the scale pass and the
// conversion (per thread: pieces are coded on the lanes).
float* staging(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

template <typename C>
void encodeScaled(const float* src, int64_t n, char* dst) {
  const int64_t nb = blocksOf(n);
  float* scaled = staging(n);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kWireBlock, m = std::min(kWireBlock, n - lo);
    const float* x = src + lo;
    float amax = 0.0f, poison = 0.0f;  // poison: NaN iff the block holds inf or NaN
    for (int64_t i = 0; i < m; ++i) {
      const float a = std::fabs(x[i]);
      amax = a > amax ? a : amax;
      poison += x[i] * 0.0f;
    }
    float scale;
    if (std::isnan(poison)) {
      // Zeros, which the NaN scale decodes to NaN (inf * 0 would be NaN, no code).
      scale = std::numeric_limits<float>::quiet_NaN();
      std::fill(scaled + lo, scaled + lo + m, 0.0f);
    } else {
      const int e = scaleExponent(amax, C::kMax);
      scale = std::ldexp(1.0f, e);
      const float inv = std::ldexp(1.0f, -e);
      for (int64_t i = 0; i < m; ++i) scaled[lo + i] = x[i] * inv;
    }
    std::memcpy(dst + b * sizeof(float), &scale, sizeof(float));
  }
  C::to(scaled, n, reinterpret_cast<typename C::T*>(dst + nb * sizeof(float)));
}

template <typename C, bool kAdd>
void decodeScaled(const char* src, int64_t n, float* dst) {
  const int64_t nb = blocksOf(n);
  float* unscaled = staging(n);
  C::from(reinterpret_cast<const typename C::T*>(src + nb * sizeof(float)), n, unscaled);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kWireBlock, m = std::min(kWireBlock, n - lo);
    float scale;
    std::memcpy(&scale, src + b * sizeof(float), sizeof(float));
    for (int64_t i = 0; i < m; ++i) {
      const float v = unscaled[lo + i] * scale;
      if constexpr (kAdd) {
        dst[lo + i] += v;
      } else {
        dst[lo + i] = v;
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
      return blocksOf(n) * static_cast<int64_t>(sizeof(float)) + 2 * n;
    case WireDtype::INT8:
      return blocksOf(n) * static_cast<int64_t>(sizeof(float)) + n;
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
