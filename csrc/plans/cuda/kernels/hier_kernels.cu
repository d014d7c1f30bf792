#include "plans/cuda/kernels/hier_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace fastcomm {
namespace hierk {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

int blocksFor(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("fastcomm: CUDA multi-node all_reduce: ") + what + ": " +
                             cudaGetErrorString(e));
  }
}

// How an element type is loaded into its accumulator and stored back.
template <typename T>
struct Num {
  using Acc = T;
  static __device__ Acc load(T v) { return v; }
  static __device__ T store(Acc v) { return v; }
};
template <>
struct Num<__half> {
  using Acc = float;
  static __device__ float load(__half v) { return __half2float(v); }
  static __device__ __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Num<__nv_bfloat16> {
  using Acc = float;
  static __device__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
// Integers accumulate in 64 bits with wrapping arithmetic, so sums and
// products wrap as the element type would (as the host path does).
template <typename T, typename Wide>
struct IntNum {
  using Acc = Wide;
  static __device__ Wide load(T v) { return static_cast<Wide>(v); }
  static __device__ T store(Wide v) { return static_cast<T>(v); }
};
template <>
struct Num<int8_t> : IntNum<int8_t, int64_t> {};
template <>
struct Num<uint8_t> : IntNum<uint8_t, uint64_t> {};
template <>
struct Num<int32_t> : IntNum<int32_t, int64_t> {};
template <>
struct Num<int64_t> : IntNum<int64_t, int64_t> {};

template <typename A>
__device__ A combine(Op op, A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    using U = typename std::make_unsigned<A>::type;
    switch (op) {
      case Op::Sum:
        return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
      case Op::Prod:
        return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
      case Op::Min:
        return b < a ? b : a;
      default:
        return b > a ? b : a;
    }
  } else {
    switch (op) {
      case Op::Sum:
        return a + b;
      case Op::Prod:
        return a * b;
      case Op::Min:
        return b < a ? b : a;
      default:
        return b > a ? b : a;
    }
  }
}

// In: the type received from the peers (T, or the wire type for float data).
template <typename T, typename In>
__global__ void reduceKernel(Op op, T* own, const In* recv, int64_t stride, int nPeers, int64_t n,
                             int64_t divisor) {
  using Acc = typename Num<T>::Acc;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Acc acc = Num<T>::load(own[i]);
    for (int j = 0; j < nPeers; ++j)
      acc = combine<Acc>(op, acc, Num<In>::load(recv[j * stride + i]));
    if (divisor > 0) acc = acc / static_cast<Acc>(divisor);
    own[i] = Num<T>::store(acc);
  }
}

// float32 data, 16-bit wire: the result is rounded to the wire type for both
// the owner's copy and the outgoing one.
template <typename W>
__global__ void reduceWireKernel(float* own, const W* recv, int64_t stride, int nPeers, int64_t n,
                                 int64_t divisor, W* wireOut) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = own[i];
    for (int j = 0; j < nPeers; ++j) acc += Num<W>::load(recv[j * stride + i]);
    if (divisor > 0) acc = acc / static_cast<float>(divisor);
    const W w = Num<W>::store(acc);
    wireOut[i] = w;
    own[i] = Num<W>::load(w);
  }
}

template <typename W>
__global__ void packKernel(const float* chunk, W* out, HierLayout l, int64_t k, int me) {
  const int64_t total = static_cast<int64_t>(l.rails - 1) * l.qMax;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t src = packedToChunk(l, k, me, i);
    if (src >= 0) out[i] = Num<W>::store(chunk[src]);
  }
}

template <typename W>
__global__ void unpackKernel(const W* in, float* chunk, HierLayout l, int64_t k, int me) {
  const int64_t total = static_cast<int64_t>(l.rails - 1) * l.qMax;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t dst = packedToChunk(l, k, me, i);
    if (dst >= 0) chunk[dst] = Num<W>::load(in[i]);
  }
}

template <typename T>
void reduceAs(Op op, void* own, const void* recv, int64_t stride, int nPeers, int64_t n,
              int64_t divisor, cudaStream_t s) {
  reduceKernel<T, T><<<blocksFor(n), kThreads, 0, s>>>(
      op, static_cast<T*>(own), static_cast<const T*>(recv), stride, nPeers, n, divisor);
}

}  // namespace

void reduce(Elem elem, Op op, Wire wire, void* own, const void* recv, int64_t stride, int nPeers,
            int64_t n, int64_t divisor, void* wireOut, cudaStream_t s) {
  if (n <= 0) return;
  if (wire != Wire::None) {
    if (elem != Elem::F32 || op != Op::Sum)
      throw std::invalid_argument("fastcomm: wire dtype for float32 sums only");
    if (wire == Wire::BF16) {
      reduceWireKernel<__nv_bfloat16><<<blocksFor(n), kThreads, 0, s>>>(
          static_cast<float*>(own), static_cast<const __nv_bfloat16*>(recv), stride, nPeers, n,
          divisor, static_cast<__nv_bfloat16*>(wireOut));
    } else {
      reduceWireKernel<__half><<<blocksFor(n), kThreads, 0, s>>>(
          static_cast<float*>(own), static_cast<const __half*>(recv), stride, nPeers, n, divisor,
          static_cast<__half*>(wireOut));
    }
    check(cudaGetLastError(), "reduction kernel launch");
    return;
  }
  switch (elem) {
    case Elem::F32:
      reduceAs<float>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::F64:
      reduceAs<double>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::F16:
      reduceAs<__half>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::BF16:
      reduceAs<__nv_bfloat16>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::I8:
      reduceAs<int8_t>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::U8:
      reduceAs<uint8_t>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::I32:
      reduceAs<int32_t>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
    case Elem::I64:
      reduceAs<int64_t>(op, own, recv, stride, nPeers, n, divisor, s);
      break;
  }
  check(cudaGetLastError(), "reduction kernel launch");
}

void pack(Wire wire, const float* chunk, void* out, const HierLayout& l, int64_t k, int me,
          cudaStream_t s) {
  const int64_t total = static_cast<int64_t>(l.rails - 1) * l.qMax;
  if (wire == Wire::BF16) {
    packKernel<__nv_bfloat16>
        <<<blocksFor(total), kThreads, 0, s>>>(chunk, static_cast<__nv_bfloat16*>(out), l, k, me);
  } else {
    packKernel<__half>
        <<<blocksFor(total), kThreads, 0, s>>>(chunk, static_cast<__half*>(out), l, k, me);
  }
  check(cudaGetLastError(), "wire cast kernel launch");
}

void unpack(Wire wire, const void* in, float* chunk, const HierLayout& l, int64_t k, int me,
            cudaStream_t s) {
  const int64_t total = static_cast<int64_t>(l.rails - 1) * l.qMax;
  if (wire == Wire::BF16) {
    unpackKernel<__nv_bfloat16><<<blocksFor(total), kThreads, 0, s>>>(
        static_cast<const __nv_bfloat16*>(in), chunk, l, k, me);
  } else {
    unpackKernel<__half>
        <<<blocksFor(total), kThreads, 0, s>>>(static_cast<const __half*>(in), chunk, l, k, me);
  }
  check(cudaGetLastError(), "wire cast kernel launch");
}

}  // namespace hierk
}  // namespace fastcomm
