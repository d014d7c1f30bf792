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
    if (out != nullptr) storeVec<true, W, V>(out + v * V, w);
  }
  for (int64_t i = nv * V + first; i < n; i += step) {
    Acc acc = Num<T>::load(own[i]);
    for (int j = 0; j < nPeers; ++j)
      acc = combine<Acc>(
          op, acc, Num<W>::load(loadStaging(reinterpret_cast<const W*>(recv + j * pitch) + i)));
    if (divisor > 0) acc = acc / static_cast<Acc>(divisor);
    const W w = Num<W>::store(acc);
    own[i] = convert<T>(w);
    if (out != nullptr) storeStaging(out + i, w);
  }
}

// ----------------------------------------------------------------------------- block-scaled wires

// The codes of the block-scaled wires: their largest magnitude, and their
// round-to-nearest-even conversions (what plans/wire_codec.cpp does with
// ATen's float -> half and std::nearbyint).
struct HalfCode {
  using Bits = unsigned short;
  static constexpr float kMax = 65504.0f;
  static __device__ Bits encode(float v) { return __half_as_ushort(__float2half_rn(v)); }
  static __device__ float decode(Bits c) { return __half2float(__ushort_as_half(c)); }
};
struct Int8Code {
  using Bits = unsigned char;
  static constexpr float kMax = 127.0f;
  static __device__ Bits encode(float v) {
    return static_cast<Bits>(static_cast<signed char>(__float2int_rn(v)));
  }
  static __device__ float decode(Bits c) { return static_cast<float>(static_cast<signed char>(c)); }
};

constexpr int kWarp = 32;
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kBlock = static_cast<int>(kScaleBlock);
constexpr uint32_t kNanBits = 0x7fc00000u;  // std::numeric_limits<float>::quiet_NaN()

// One warp holds one block: lane l the values of the 4-byte code words
// q * 32 + l (q < kWords), kPer values each, so each access of the warp to
// the codes covers 128 contiguous bytes, and to the data 256 or 512.
template <typename Code>
struct Shape {
  static constexpr int kPer = 4 / static_cast<int>(sizeof(typename Code::Bits));
  static constexpr int kWords = kBlock / kPer / kWarp;
  using Values = float[kWords][kPer];
};

template <int N>
struct alignas(4 * N) Floats {
  float f[N];
};

__device__ __forceinline__ int64_t blocksOf(int64_t n) { return (n + kBlock - 1) / kBlock; }

// 2^e, exactly, for normal results (-126 <= e <= 127).
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }

// The smallest e >= -126 with amax <= kMax * 2^e (wire_codec.cpp's
// scaleExponent): the exponents' difference is the answer or one below it.
__device__ __forceinline__ int scaleExponent(float amax, float kMax) {
  if (!(amax > 0.0f)) return -126;
  int e = ilogbf(amax) - ilogbf(kMax);
  const double a = amax;
  while (ldexp(static_cast<double>(kMax), e) < a) ++e;
  while (ldexp(static_cast<double>(kMax), e - 1) >= a) --e;
  return e < -126 ? -126 : e;
}

// The lane's values of the block at x (m values; zero past them), from or to
// the data (device memory); `vec`: x is aligned for kPer floats at once.
template <typename Code>
__device__ __forceinline__ void loadValues(const float* x, int m, bool vec,
                                           typename Shape<Code>::Values& v) {
  using S = Shape<Code>;
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int q = 0; q < S::kWords; ++q) {
    const int e = (q * kWarp + lane) * S::kPer;
    if (vec && e + S::kPer <= m) {
      const Floats<S::kPer> f = *reinterpret_cast<const Floats<S::kPer>*>(x + e);
#pragma unroll
      for (int c = 0; c < S::kPer; ++c) v[q][c] = f.f[c];
    } else {
#pragma unroll
      for (int c = 0; c < S::kPer; ++c) v[q][c] = e + c < m ? x[e + c] : 0.0f;
    }
  }
}
template <typename Code>
__device__ __forceinline__ void storeValues(float* x, int m, bool vec,
                                            const typename Shape<Code>::Values& v) {
  using S = Shape<Code>;
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int q = 0; q < S::kWords; ++q) {
    const int e = (q * kWarp + lane) * S::kPer;
    if (vec && e + S::kPer <= m) {
      Floats<S::kPer> f;
#pragma unroll
      for (int c = 0; c < S::kPer; ++c) f.f[c] = v[q][c];
      *reinterpret_cast<Floats<S::kPer>*>(x + e) = f;
    } else {
#pragma unroll
      for (int c = 0; c < S::kPer; ++c)
        if (e + c < m) x[e + c] = v[q][c];
    }
  }
}

// Codes the warp's block of m values (zero past them) into the staging: its
// scale to *scale, its codes from `codes` on (the block's first). v becomes
// the decoded values, what every receiver decodes.
template <typename Code>
__device__ __forceinline__ void encodeBlock(typename Shape<Code>::Values& v, int m, float* scale,
                                            char* codes) {
  using S = Shape<Code>;
  using Bits = typename Code::Bits;
  const int lane = threadIdx.x % kWarp;
  float amax = 0.0f;
  bool bad = false;  // inf or NaN in the block
#pragma unroll
  for (int q = 0; q < S::kWords; ++q)
#pragma unroll
    for (int c = 0; c < S::kPer; ++c) {
      amax = fmaxf(amax, fabsf(v[q][c]));
      bad = bad || !isfinite(v[q][c]);
    }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(kAllLanes, amax, o));
  bad = __any_sync(kAllLanes, bad);
  // A poisoned block: a NaN scale and zero codes, so it decodes to NaN.
  const int e = bad ? 0 : scaleExponent(amax, Code::kMax);
  const float s = bad ? __uint_as_float(kNanBits) : pow2(e);
  const float inv = pow2(-e);
  if (lane == 0) storeStaging(scale, s);
#pragma unroll
  for (int q = 0; q < S::kWords; ++q) {
    const int w = q * kWarp + lane;
    Bits b[S::kPer];
    uint32_t word = 0;
#pragma unroll
    for (int c = 0; c < S::kPer; ++c) {
      b[c] = bad ? Bits(0) : Code::encode(v[q][c] * inv);
      word |= static_cast<uint32_t>(b[c]) << (8 * sizeof(Bits) * c);
      v[q][c] = Code::decode(b[c]) * s;
    }
    const int first = w * S::kPer;
    if (first + S::kPer <= m) {
      storeStaging(reinterpret_cast<uint32_t*>(codes) + w, word);
    } else {
      // The piece's last word: not a byte past its codes.
#pragma unroll
      for (int c = 0; c < S::kPer; ++c)
        if (first + c < m) storeStaging(reinterpret_cast<Bits*>(codes) + first + c, b[c]);
    }
  }
}

// The warp's block of m values decoded from the staging (zero past them).
template <typename Code>
__device__ __forceinline__ void decodeBlock(const float* scale, const char* codes, int m,
                                            typename Shape<Code>::Values& v) {
  using S = Shape<Code>;
  using Bits = typename Code::Bits;
  const int lane = threadIdx.x % kWarp;
  const float s = loadStaging(scale);
#pragma unroll
  for (int q = 0; q < S::kWords; ++q) {
    const int w = q * kWarp + lane;
    const int first = w * S::kPer;
    if (first + S::kPer <= m) {
      const uint32_t word = loadStaging(reinterpret_cast<const uint32_t*>(codes) + w);
#pragma unroll
      for (int c = 0; c < S::kPer; ++c)
        v[q][c] = Code::decode(static_cast<Bits>(word >> (8 * sizeof(Bits) * c))) * s;
    } else {
#pragma unroll
      for (int c = 0; c < S::kPer; ++c)
        v[q][c] =
            first + c < m
                ? Code::decode(loadStaging(reinterpret_cast<const Bits*>(codes) + first + c)) * s
                : 0.0f;
    }
  }
}

// A coded piece of n values in a staging slot: its blocks' scales, then its codes.
template <typename Code>
struct CodedPiece {
  char* slot;
  int64_t n;
  __device__ float* scale(int64_t b) const { return reinterpret_cast<float*>(slot) + b; }
  __device__ char* codes(int64_t b) const {
    return slot + blocksOf(n) * 4 + b * kBlock * static_cast<int64_t>(sizeof(typename Code::Bits));
  }
};

// The warps of the grid's row, and this one's index among them.
__device__ __forceinline__ int64_t warpIndex() {
  return (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / kWarp;
}
__device__ __forceinline__ int64_t warpCount() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
}

// P and B on a block-scaled wire: one row of blocks per staging slot
// (blockIdx.y = j) codes chunk k's piece of node peerNode(j, me) into its
// slot, or decodes the slot into it; one warp per block of the piece.
template <typename Code, bool ToStaging>
__global__ void moveScaledKernel(float* chunk, char* slots, int64_t pitch, HierLayout l, int64_t k,
                                 int me) {
  constexpr int kPer = Shape<Code>::kPer;
  const int j = blockIdx.y;
  const int p = peerNode(j, me);
  const CodedPiece<Code> piece{slots + j * pitch, l.pieceLen(k, p)};
  float* x = chunk + l.pieceOff(k, p);
  const bool vec = reinterpret_cast<uintptr_t>(x) % (4 * kPer) == 0;
  for (int64_t b = warpIndex(); b < blocksOf(piece.n); b += warpCount()) {
    const int m = static_cast<int>(piece.n - b * kBlock < kBlock ? piece.n - b * kBlock : kBlock);
    typename Shape<Code>::Values v;
    if constexpr (ToStaging) {
      loadValues<Code>(x + b * kBlock, m, vec, v);
      encodeBlock<Code>(v, m, piece.scale(b), piece.codes(b));
    } else {
      decodeBlock<Code>(piece.scale(b), piece.codes(b), m, v);
      storeValues<Code>(x + b * kBlock, m, vec, v);
    }
  }
}

// A on a block-scaled wire: own[i] + every peer's decoded piece[i] in float32
// (divided by `divisor` > 0), coded into `out` and decoded back into own[].
template <typename Code>
__global__ void reduceScaledKernel(float* own, const char* recv, int64_t pitch, int nPeers,
                                   int64_t n, int64_t divisor, char* out) {
  constexpr int kPer = Shape<Code>::kPer;
  const CodedPiece<Code> result{out, n};
  const bool vec = reinterpret_cast<uintptr_t>(own) % (4 * kPer) == 0;
  for (int64_t b = warpIndex(); b < blocksOf(n); b += warpCount()) {
    const int m = static_cast<int>(n - b * kBlock < kBlock ? n - b * kBlock : kBlock);
    typename Shape<Code>::Values acc, in;
    loadValues<Code>(own + b * kBlock, m, vec, acc);
    for (int j = 0; j < nPeers; ++j) {
      const CodedPiece<Code> peer{const_cast<char*>(recv) + j * pitch, n};
      decodeBlock<Code>(peer.scale(b), peer.codes(b), m, in);
#pragma unroll
      for (int q = 0; q < Shape<Code>::kWords; ++q)
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[q][c] += in[q][c];
    }
    if (divisor > 0) {
#pragma unroll
      for (int q = 0; q < Shape<Code>::kWords; ++q)
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[q][c] = acc[q][c] / static_cast<float>(divisor);
    }
    encodeBlock<Code>(acc, m, result.scale(b), result.codes(b));
    storeValues<Code>(own + b * kBlock, m, vec, acc);
  }
}

bool aligned4(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

void checkScaledStaging(const void* a, const void* b, int64_t pitch) {
  if (!aligned4(a) || !aligned4(b) || pitch % 4 != 0)
    throw std::invalid_argument(
        "fastcomm: internal: block-scaled wire staging must be 4-byte aligned");
}

// Thread blocks for `blocks` wire blocks (one warp each) per row of `rows`.
int blocksForScaled(int64_t blocks, int rows) {
  const int64_t most = kMaxBlocks / rows > 0 ? kMaxBlocks / rows : 1;
  const int64_t b = (blocks + kThreads / kWarp - 1) / (kThreads / kWarp);
  return static_cast<int>(b < 1 ? 1 : (b > most ? most : b));
}

template <typename Code, bool ToStaging>
void launchMoveScaled(const void* chunk, void* slots, int64_t pitch, const HierLayout& l, int64_t k,
                      int me, cudaStream_t s) {
  checkScaledStaging(slots, slots, pitch);
  const int rows = l.rails - 1;
  const dim3 grid(blocksForScaled((l.q(k) + kBlock - 1) / kBlock, rows), rows);
  // The kernel writes `chunk` only when !ToStaging (B); P passes it to be read.
  moveScaledKernel<Code, ToStaging><<<grid, kThreads, 0, s>>>(
      static_cast<float*>(const_cast<void*>(chunk)), static_cast<char*>(slots), pitch, l, k, me);
}

template <typename Code>
void launchReduceScaled(void* own, const void* recv, int64_t pitch, int nPeers, int64_t n,
                        int64_t divisor, void* out, cudaStream_t s) {
  checkScaledStaging(recv, out, pitch);
  reduceScaledKernel<Code><<<blocksForScaled((n + kBlock - 1) / kBlock, 1), kThreads, 0, s>>>(
      static_cast<float*>(own), static_cast<const char*>(recv), pitch, nPeers, n, divisor,
      static_cast<char*>(out));
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
// staging holds the wire's codes when there is one). The kernels take the
// chunk as const and the slots as writable whatever the direction; which
// side they write follows kToStaging.
template <bool kToStaging>
void moveStaging(Wire wire, int64_t esize, const void* chunk, void* slots, int64_t pitch,
                 const HierLayout& l, int64_t k, int me, cudaStream_t s) {
  if (wire == Wire::BF16) {
    launchMove<float, __nv_bfloat16, kToStaging>(chunk, slots, pitch, l, k, me, s);
  } else if (wire == Wire::FP16) {
    launchMoveScaled<HalfCode, kToStaging>(chunk, slots, pitch, l, k, me, s);
  } else if (wire == Wire::INT8) {
    launchMoveScaled<Int8Code, kToStaging>(chunk, slots, pitch, l, k, me, s);
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
    } else if (wire == Wire::FP16) {
      launchReduceScaled<HalfCode>(own, recv, pitch, nPeers, n, divisor, out, s);
    } else {
      launchReduceScaled<Int8Code>(own, recv, pitch, nPeers, n, divisor, out, s);
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

template <typename Code>
void loadScaledWire() {
  load(reduceScaledKernel<Code>);
  load(moveScaledKernel<Code, true>);
  load(moveScaledKernel<Code, false>);
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
  loadScaledWire<HalfCode>();
  loadScaledWire<Int8Code>();
  loadMoves<1>();
  loadMoves<2>();
  loadMoves<4>();
  loadMoves<8>();
}

}  // namespace hierk
}  // namespace fastcomm
