#include "common/reduce.hpp"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

namespace fastcomm {

const char* redOpName(RedOp op) {
  switch (op) {
    case RedOp::Sum:
      return "SUM";
    case RedOp::Avg:
      return "AVG";
    case RedOp::Product:
      return "PRODUCT";
    case RedOp::Min:
      return "MIN";
    case RedOp::Max:
      return "MAX";
    case RedOp::BAnd:
      return "BAND";
    case RedOp::BOr:
      return "BOR";
    case RedOp::BXor:
      return "BXOR";
  }
  return "?";
}

bool reducibleDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

namespace {

bool isIntegral(at::ScalarType t) { return at::isIntegralType(t, /*includeBool=*/false); }

template <typename T>
struct AccOf {
  using type = T;
};
template <>
struct AccOf<c10::Half> {
  using type = float;
};
template <>
struct AccOf<c10::BFloat16> {
  using type = float;
};
template <>
struct AccOf<int8_t> {
  using type = int64_t;
};
template <>
struct AccOf<uint8_t> {
  using type = int64_t;
};
template <>
struct AccOf<int16_t> {
  using type = int64_t;
};
template <>
struct AccOf<int32_t> {
  using type = int64_t;
};

// Blocks keep the accumulator in L1 while each input streams through once;
// the inner loops are plain element-wise loops the compiler vectorises.
constexpr int64_t kBlock = 1024;

template <typename T, typename F>
void reduceTyped(T* out, const void* const* ins, int nIn, int64_t count, F combine, bool average,
                 int divisor) {
  using Acc = typename AccOf<T>::type;
  Acc acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t n = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(ins[0]) + base;
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(first[i]);
    for (int j = 1; j < nIn; ++j) {
      const T* in = static_cast<const T*>(ins[j]) + base;
      for (int64_t i = 0; i < n; ++i) acc[i] = combine(acc[i], static_cast<Acc>(in[i]));
    }
    T* o = out + base;
    if (average) {
      // Integer division truncates toward zero, as torch.div(rounding_mode="trunc").
      const Acc d = static_cast<Acc>(divisor);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(acc[i] / d);
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(acc[i]);
    }
  }
}

template <typename T>
void reduceOp(void* out, const void* const* ins, int nIn, int64_t count, RedOp op, int divisor) {
  using Acc = typename AccOf<T>::type;
  T* o = static_cast<T*>(out);
  switch (op) {
    case RedOp::Sum:
      return reduceTyped<T>(
          o, ins, nIn, count, [](Acc a, Acc b) { return a + b; }, false, 1);
    case RedOp::Avg:
      return reduceTyped<T>(
          o, ins, nIn, count, [](Acc a, Acc b) { return a + b; }, true, divisor);
    case RedOp::Product:
      return reduceTyped<T>(
          o, ins, nIn, count, [](Acc a, Acc b) { return a * b; }, false, 1);
    case RedOp::Min:
      // NaN propagates, as torch.minimum does.
      return reduceTyped<T>(
          o, ins, nIn, count, [](Acc a, Acc b) { return (a < b || a != a) ? a : b; }, false, 1);
    case RedOp::Max:
      return reduceTyped<T>(
          o, ins, nIn, count, [](Acc a, Acc b) { return (a > b || a != a) ? a : b; }, false, 1);
    case RedOp::BAnd:
    case RedOp::BOr:
    case RedOp::BXor:
      if constexpr (std::is_integral_v<Acc>) {
        if (op == RedOp::BAnd)
          return reduceTyped<T>(
              o, ins, nIn, count, [](Acc a, Acc b) { return a & b; }, false, 1);
        if (op == RedOp::BOr)
          return reduceTyped<T>(
              o, ins, nIn, count, [](Acc a, Acc b) { return a | b; }, false, 1);
        return reduceTyped<T>(
            o, ins, nIn, count, [](Acc a, Acc b) { return a ^ b; }, false, 1);
      }
      break;
  }
  TORCH_CHECK(false, "fastcomm: internal error: reduction ", redOpName(op), " on a float type");
}

// bool is stored as one byte holding 0 or 1; the ops become logic.
void reduceBool(void* out, const void* const* ins, int nIn, int64_t count, RedOp op) {
  auto* o = static_cast<uint8_t*>(out);
  switch (op) {
    case RedOp::Sum:
    case RedOp::Max:
    case RedOp::BOr:
      return reduceTyped<uint8_t>(
          o, ins, nIn, count, [](int64_t a, int64_t b) { return a | b; }, false, 1);
    case RedOp::Product:
    case RedOp::Min:
    case RedOp::BAnd:
      return reduceTyped<uint8_t>(
          o, ins, nIn, count, [](int64_t a, int64_t b) { return a & b; }, false, 1);
    case RedOp::BXor:
      return reduceTyped<uint8_t>(
          o, ins, nIn, count, [](int64_t a, int64_t b) { return a ^ b; }, false, 1);
    case RedOp::Avg:
      break;
  }
  TORCH_CHECK(false, "fastcomm: internal error: AVG on bool");
}

}  // namespace

RedOp toRedOp(const c10d::ReduceOp& op, at::ScalarType dtype, const char* collective) {
  TORCH_CHECK(reducibleDtype(dtype), "fastcomm: ", collective, " does not support dtype ", dtype,
              " (supported: float32, float64, float16, bfloat16, int8, uint8, int16, int32, "
              "int64, bool)");
  RedOp r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      r = RedOp::Sum;
      break;
    case c10d::ReduceOp::AVG:
      r = RedOp::Avg;
      break;
    case c10d::ReduceOp::PRODUCT:
      r = RedOp::Product;
      break;
    case c10d::ReduceOp::MIN:
      r = RedOp::Min;
      break;
    case c10d::ReduceOp::MAX:
      r = RedOp::Max;
      break;
    case c10d::ReduceOp::BAND:
      r = RedOp::BAnd;
      break;
    case c10d::ReduceOp::BOR:
      r = RedOp::BOr;
      break;
    case c10d::ReduceOp::BXOR:
      r = RedOp::BXor;
      break;
    default:
      TORCH_CHECK(false, "fastcomm: ", collective, " does not support this reduce op (",
                  static_cast<int>(op.op_),
                  "); supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR");
  }
  const bool bitwise = r == RedOp::BAnd || r == RedOp::BOr || r == RedOp::BXor;
  TORCH_CHECK(!bitwise || isIntegral(dtype) || dtype == at::kBool, "fastcomm: ", collective,
              ": ReduceOp.", redOpName(r), " needs an integer or bool tensor, got ", dtype);
  TORCH_CHECK(!(r == RedOp::Avg && dtype == at::kBool), "fastcomm: ", collective,
              ": ReduceOp.AVG is not defined for bool tensors");
  return r;
}

void reduceInto(void* out, const void* const* ins, int nIn, int64_t count, at::ScalarType dtype,
                RedOp op, int divisor) {
  if (count <= 0) return;
  switch (dtype) {
    case at::kFloat:
      return reduceOp<float>(out, ins, nIn, count, op, divisor);
    case at::kDouble:
      return reduceOp<double>(out, ins, nIn, count, op, divisor);
    case at::kHalf:
      return reduceOp<c10::Half>(out, ins, nIn, count, op, divisor);
    case at::kBFloat16:
      return reduceOp<c10::BFloat16>(out, ins, nIn, count, op, divisor);
    case at::kChar:
      return reduceOp<int8_t>(out, ins, nIn, count, op, divisor);
    case at::kByte:
      return reduceOp<uint8_t>(out, ins, nIn, count, op, divisor);
    case at::kShort:
      return reduceOp<int16_t>(out, ins, nIn, count, op, divisor);
    case at::kInt:
      return reduceOp<int32_t>(out, ins, nIn, count, op, divisor);
    case at::kLong:
      return reduceOp<int64_t>(out, ins, nIn, count, op, divisor);
    case at::kBool:
      return reduceBool(out, ins, nIn, count, op);
    default:
      TORCH_CHECK(false, "fastcomm: unsupported dtype ", dtype);
  }
}

}  // namespace fastcomm
