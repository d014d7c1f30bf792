#include "staged_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
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

// Unsigned integers of 1 to 16 bytes: what moves an element, or 16 bytes of
// them, without interpreting it.
template <int Bytes>
struct Bits;
template <>
struct Bits<1> {
  using T = unsigned char;
};
template <>
struct Bits<2> {
  using T = unsigned short;
};
template <>
struct Bits<4> {
  using T = unsigned int;
};
template <>
struct Bits<8> {
  using T = unsigned long long;
};
template <>
struct Bits<16> {
  using T = uint4;
};

// The staging may be host memory the proxy or the NIC rewrote since this GPU
// last read the same addresses (an earlier chunk on the slot), and what the
// kernels write there the proxy and the NIC read once the step's flag is set
// (cuda_hier.cpp, Resources, has the whole ordering argument). So loads are
// ld.global.cv, "don't cache and fetch again (consider cached system memory
// lines stale, fetch again)", and stores st.global.wt, "cache write-through
// (to system memory)" (PTX ISA, Cache Operators); on device staging they act
// as plain accesses.
template <typename E>
__device__ __forceinline__ E loadStaging(const E* p) {
  using U = typename Bits<sizeof(E)>::T;
  const U u = __ldcv(reinterpret_cast<const U*>(p));
  E e;
  memcpy(&e, &u, sizeof(E));
  return e;
}
template <typename E>
__device__ __forceinline__ void storeStaging(E* p, const E& e) {
  using U = typename Bits<sizeof(E)>::T;
  U u;
  memcpy(&u, &e, sizeof(E));
  __stwt(reinterpret_cast<U*>(p), u);
}

// V elements moved in 16-byte accesses.
template <typename E, int V>
struct alignas(16) Vec {
  E e[V];
};
// Elements per vector of a step that reads A and writes B (or the reverse):
// 16 bytes of the narrower type, so both sides move whole 16-byte words.
template <typename A, typename B>
constexpr int vecOf() {
  return 16 / static_cast<int>(sizeof(A) < sizeof(B) ? sizeof(A) : sizeof(B));
}

// `p` 16-byte aligned.
template <bool Staging, typename E, int V>
__device__ __forceinline__ Vec<E, V> loadVec(const E* p) {
  static_assert(sizeof(Vec<E, V>) == V * sizeof(E) && sizeof(Vec<E, V>) % 16 == 0,
                "whole 16-byte words");
  Vec<E, V> v;
  const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(v) / 16); ++q) {
    const uint4 w = Staging ? loadStaging(src + q) : src[q];
    memcpy(reinterpret_cast<char*>(&v) + 16 * q, &w, 16);
  }
  return v;
}
template <bool Staging, typename E, int V>
__device__ __forceinline__ void storeVec(E* p, const Vec<E, V>& v) {
  uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(v) / 16); ++q) {
    uint4 w;
    memcpy(&w, reinterpret_cast<const char*>(&v) + 16 * q, 16);
    if (Staging) {
      storeStaging(dst + q, w);
    } else {
      dst[q] = w;
    }
  }
}

// Between the data type and the staging type: the same (bits), or float32
// and a wire type.
template <typename To, typename From>
__device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same<To, From>::value) {
    return v;
  } else if constexpr (std::is_same<To, float>::value) {
    return Num<From>::load(v);
  } else {
    return Num<To>::store(v);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// P and B: one row of blocks per staging slot (blockIdx.y = j) moves chunk
// k's piece of node peerNode(j, me), D elements in the chunk, S in the slot.
// `chunk` is only read when ToStaging.
template <typename D, typename S, bool ToStaging>
__global__ void moveKernel(D* chunk, char* slots, int64_t pitch, HierLayout l, int64_t k, int me,
                           bool vec) {
  constexpr int V = vecOf<D, S>();
  const int j = blockIdx.y;
  const int p = peerNode(j, me);
  const int64_t n = l.pieceLen(k, p);
  D* d = chunk + l.pieceOff(k, p);
  S* s = reinterpret_cast<S*>(slots + j * pitch);
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nv = vec ? n / V : 0;
  for (int64_t v = first; v < nv; v += step) {
    if constexpr (ToStaging) {
      const Vec<D, V> in = loadVec<false, D, V>(d + v * V);
      Vec<S, V> out;
#pragma unroll
      for (int i = 0; i < V; ++i) out.e[i] = convert<S>(in.e[i]);
      storeVec<true, S, V>(s + v * V, out);
    } else {
      const Vec<S, V> in = loadVec<true, S, V>(s + v * V);
      Vec<D, V> out;
#pragma unroll
      for (int i = 0; i < V; ++i) out.e[i] = convert<D>(in.e[i]);
      storeVec<false, D, V>(d + v * V, out);
    }
  }
  for (int64_t i = nv * V + first; i < n; i += step) {
    if constexpr (ToStaging) {
      storeStaging(s + i, convert<S>(d[i]));
    } else {
      d[i] = convert<D>(loadStaging(s + i));
    }
  }
}

// A: own[i] op the peers' pieces, read from the staging (W: T, or the wire
// type for float32 T); the result stored in own[] (through W, so the owner
// keeps what its peers receive) and in the staging, as W.
template <typename T, typename W>
__global__ void reduceStagedKernel(Op op, T* own, const char* recv, int64_t pitch, int nPeers,
                                   int64_t n, int64_t divisor, W* out, bool vec) {
  using Acc = typename Num<T>::Acc;
  constexpr int V = vecOf<T, W>();
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nv = vec ? n / V : 0;
  for (int64_t v = first; v < nv; v += step) {
    Vec<T, V> o = loadVec<false, T, V>(own + v * V);
    Acc acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = Num<T>::load(o.e[i]);
    for (int j = 0; j < nPeers; ++j) {
      const Vec<W, V> r = loadVec<true, W, V>(reinterpret_cast<const W*>(recv + j * pitch) + v * V);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = combine<Acc>(op, acc[i], Num<W>::load(r.e[i]));
    }
    Vec<W, V> w;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (divisor > 0) acc[i] = acc[i] / static_cast<Acc>(divisor);
      w.e[i] = Num<W>::store(acc[i]);
      o.e[i] = convert<T>(w.e[i]);
    }
    storeVec<false, T, V>(own + v * V, o);
    storeVec<true, W, V>(out + v * V, w);
  }
  for (int64_t i = nv * V + first; i < n; i += step) {
    Acc acc = Num<T>::load(own[i]);
    for (int j = 0; j < nPeers; ++j)
      acc = combine<Acc>(
          op, acc, Num<W>::load(loadStaging(reinterpret_cast<const W*>(recv + j * pitch) + i)));
    if (divisor > 0) acc = acc / static_cast<Acc>(divisor);
    const W w = Num<W>::store(acc);
    own[i] = convert<T>(w);
    storeStaging(out + i, w);
  }
}

// Blocks for `units` per row of `rows`, all rows together within kMaxBlocks.
int blocksPerRow(int64_t units, int rows) {
  const int64_t most = kMaxBlocks / rows > 0 ? kMaxBlocks / rows : 1;
  const int64_t b = (units + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > most ? most : b));
}

template <typename D, typename S, bool ToStaging>
void launchMove(const void* chunk, void* slots, int64_t pitch, const HierLayout& l, int64_t k,
                int me, cudaStream_t s) {
  constexpr int V = vecOf<D, S>();
  const int rows = l.rails - 1;
  // Pieces start 64 bytes apart in the chunk (HierLayout::align), slots on
  // multiples of `pitch` (256): the chunk's address decides.
  const bool vec = aligned16(chunk) && aligned16(slots) && pitch % 16 == 0;
  const int64_t q = l.q(k);
  const dim3 grid(blocksPerRow(vec ? (q + V - 1) / V : q, rows), rows);
  // The kernel writes `chunk` only when !ToStaging (B); P passes it to be read.
  moveKernel<D, S, ToStaging><<<grid, kThreads, 0, s>>>(
      static_cast<D*>(const_cast<void*>(chunk)), static_cast<char*>(slots), pitch, l, k, me, vec);
}

template <bool ToStaging>
void moveBits(int64_t esize, const void* chunk, void* slots, int64_t pitch, const HierLayout& l,
              int64_t k, int me, cudaStream_t s) {
  switch (esize) {
    case 1:
      launchMove<Bits<1>::T, Bits<1>::T, ToStaging>(chunk, slots, pitch, l, k, me, s);
      break;
    case 2:
      launchMove<Bits<2>::T, Bits<2>::T, ToStaging>(chunk, slots, pitch, l, k, me, s);
      break;
    case 4:
      launchMove<Bits<4>::T, Bits<4>::T, ToStaging>(chunk, slots, pitch, l, k, me, s);
      break;
    case 8:
      launchMove<Bits<8>::T, Bits<8>::T, ToStaging>(chunk, slots, pitch, l, k, me, s);
      break;
    default:
      throw std::invalid_argument("fastcomm: internal: no staging kernel for elements of " +
                                  std::to_string(esize) + " bytes");
  }
}

template <typename T, typename W>
void launchReduceStaged(Op op, void* own, const void* recv, int64_t pitch, int nPeers, int64_t n,
                        int64_t divisor, void* out, cudaStream_t s) {
  constexpr int V = vecOf<T, W>();
  const bool vec = aligned16(own) && aligned16(recv) && pitch % 16 == 0 && aligned16(out);
  reduceStagedKernel<T, W><<<blocksFor(vec ? (n + V - 1) / V : n), kThreads, 0, s>>>(
      op, static_cast<T*>(own), static_cast<const char*>(recv), pitch, nPeers, n, divisor,
      static_cast<W*>(out), vec);
}

// fn(T{}) with T the element type of `elem`: one dtype switch for every
// host-side launcher.
template <typename F>
void forElem(Elem elem, F&& fn) {
  switch (elem) {
    case Elem::F32:
      return fn(float{});
    case Elem::F64:
      return fn(double{});
    case Elem::F16:
      return fn(__half{});
    case Elem::BF16:
      return fn(__nv_bfloat16{});
    case Elem::I8:
      return fn(int8_t{});
    case Elem::U8:
      return fn(uint8_t{});
    case Elem::I32:
      return fn(int32_t{});
    case Elem::I64:
      return fn(int64_t{});
  }
}

// Chunk k's pieces between the shard and the staging slots, either way (the
// staging holds the wire dtype when there is one). The kernels take the
// chunk as const and the slots as writable whatever the direction; which
// side they write follows kToStaging.
template <bool kToStaging>
void moveStaging(Wire wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                 const HierLayout& l, int64_t k, int me, cudaStream_t s) {
  if (wire == Wire::BF16) {
    launchMove<float, __nv_bfloat16, kToStaging>(chunk, slots, pitch, l, k, me, s);
  } else if (wire == Wire::FP16) {
    launchMove<float, __half, kToStaging>(chunk, slots, pitch, l, k, me, s);
  } else {
    moveBits<kToStaging>(esize, chunk, slots, pitch, l, k, me, s);
  }
  check(cudaGetLastError(), "staging kernel launch");
}
}  // namespace

void packToStaging(Wire wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                   const HierLayout& l, int64_t k, int me, cudaStream_t s) {
  moveStaging<true>(wire, esize, chunk, slots, pitch, l, k, me, s);
}

void gatherFromStaging(Wire wire, int64_t esize, const void* slots, int64_t pitch, void* chunk,
                       const HierLayout& l, int64_t k, int me, cudaStream_t s) {
  moveStaging<false>(wire, esize, chunk, const_cast<void*>(slots), pitch, l, k, me, s);
}

void reduceFromStaging(Elem elem, Op op, Wire wire, void* own, const void* recv, int64_t pitch,
                       int nPeers, int64_t n, int64_t divisor, void* out, cudaStream_t s) {
  if (n <= 0) return;
  if (wire != Wire::None) {
    if (elem != Elem::F32 || op != Op::Sum)
      throw std::invalid_argument("fastcomm: wire dtype for float32 sums only");
    if (wire == Wire::BF16) {
      launchReduceStaged<float, __nv_bfloat16>(op, own, recv, pitch, nPeers, n, divisor, out, s);
    } else {
      launchReduceStaged<float, __half>(op, own, recv, pitch, nPeers, n, divisor, out, s);
    }
    check(cudaGetLastError(), "reduction kernel launch");
    return;
  }
  forElem(elem, [&](auto tag) {
    using T = decltype(tag);
    launchReduceStaged<T, T>(op, own, recv, pitch, nPeers, n, divisor, out, s);
  });
  check(cudaGetLastError(), "reduction kernel launch");
}

// ----------------------------------------------------------------------------- preloading

namespace {

// Loads `kernel` into the current device's context now (CUDA C++
// Programming Guide, Lazy Loading: "CUDA Runtime API manages module
// management automatically, so we recommend simply using
// cudaFuncGetAttributes() to reference the kernel. This will ensure that the
// kernel is loaded without changing the state.").
template <typename K>
void load(K* kernel) {
  cudaFuncAttributes attr{};
  check(cudaFuncGetAttributes(&attr, kernel), "loading a kernel (cudaFuncGetAttributes)");
}

template <typename T>
void loadReductions() {
  load(reduceStagedKernel<T, T>);
}

template <typename W>
void loadWire() {
  load(reduceStagedKernel<float, W>);
  load(moveKernel<float, W, true>);
  load(moveKernel<float, W, false>);
}

template <int Bytes>
void loadMoves() {
  using B = typename Bits<Bytes>::T;
  load(moveKernel<B, B, true>);
  load(moveKernel<B, B, false>);
}

}  // namespace

void preload() {
  // Every kernel the launchers above can launch (keep in step with them).
  loadReductions<float>();
  loadReductions<double>();
  loadReductions<__half>();
  loadReductions<__nv_bfloat16>();
  loadReductions<int8_t>();
  loadReductions<uint8_t>();
  loadReductions<int32_t>();
  loadReductions<int64_t>();
  loadWire<__nv_bfloat16>();
  loadWire<__half>();
  loadMoves<1>();
  loadMoves<2>();
  loadMoves<4>();
  loadMoves<8>();
}

}  // namespace hierk
}  // namespace fastcomm
