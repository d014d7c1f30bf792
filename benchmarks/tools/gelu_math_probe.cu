// The cost of the fused gelu_tanh's math on sm_90, apart from any GEMM: issue rate of the
// special-function unit's (MUFU) forms, the time per element of four ways to compute
// 0.5 x (1 + tanh(u)) in float32 (the ex2 + rcp form with a software reciprocal for every other
// element, tanh.approx.f32 as activate_lean has it, tanh.approx.f16x2 on a packed pair, and ex2
// with one reciprocal per four elements), 8 warps per SM like the Hopper kernel's epilogue, and
// each form's largest error against float64 over [-20, 20]. Why kernels/matmul_device.cuh's
// activate_lean takes the hardware tanh.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I.
//       benchmarks/tools/gelu_math_probe.cu -o probe   (from the repository root)
//   ./probe
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/matmul_device.cuh"

using fastcomm::ops::cuda::Act;
namespace lean = fastcomm::ops::cuda::detail;

// ---- MUFU issue rates: one instruction applied in a dependent chain --------------------------

struct Tanh32 {
  static constexpr const char* kName = "tanh.f32";
  __device__ static float f(float x) { return lean::tanh_approx(x); }
};
struct Ex232 {
  static constexpr const char* kName = "ex2.f32";
  __device__ static float f(float x) { return lean::ex2_ftz(x); }
};

template <typename Op, typename V>
__global__ void mufu_chain(float* out, int iters) {
  V v[8];
  for (int i = 0; i < 8; ++i) {
    if constexpr (std::is_same<V, float>::value) {
      v[i] = 0.001f * static_cast<float>(threadIdx.x + i);
    } else {
      v[i] = 0x3c003c00u + threadIdx.x + i;  // two half-precision values near 1
    }
  }
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = Op::f(v[i]);
  }
  float s = 0;
  for (int i = 0; i < 8; ++i) s += static_cast<float>(v[i]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__device__ __forceinline__ uint32_t tanh_f16x2(uint32_t x) {
  uint32_t y;
  asm volatile("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
struct TanhF16x2 {
  static constexpr const char* kName = "tanh.f16x2";
  __device__ static uint32_t f(uint32_t x) { return tanh_f16x2(x); }
};
struct TanhBf16x2 {
  static constexpr const char* kName = "tanh.bf16x2";
  __device__ static uint32_t f(uint32_t x) {
    uint32_t y;
    asm volatile("tanh.approx.bf16x2 %0, %1;" : "=r"(y) : "r"(x));
    return y;
  }
};
struct Ex2F16x2 {
  static constexpr const char* kName = "ex2.f16x2";
  __device__ static uint32_t f(uint32_t x) {
    uint32_t y;
    asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
    return y;
  }
};

// ---- the forms of gelu_tanh, each on four elements -------------------------------------------

// -2 log2(e) sqrt(2 / pi) (1 + 0.044715 v^2): the ex2 forms' argument over v.
constexpr float kA = -2.3022081983f, kB = kA * 0.044715f;
__device__ __forceinline__ float ex2_arg(float v) { return v * fmaf(kB, v * v, kA); }
// sqrt(2 / pi) (v + 0.044715 v^3): the tanh forms' argument.
__device__ __forceinline__ float tanh_arg(float v) {
  return v * fmaf(0.79788456080286536f * 0.044715f, v * v, 0.79788456080286536f);
}

// A form computed on pairs, applied to four elements as two pairs.
template <typename Form>
struct Pairwise {
  __device__ static void quad(float& a, float& b, float& c, float& d) {
    Form::pair(a, b);
    Form::pair(c, d);
  }
};

// x / (1 + 2^arg), the hardware reciprocal on the first of a pair, the software one on the second.
struct FormEx2Rcp : Pairwise<FormEx2Rcp> {
  static constexpr const char* kName = "ex2 + rcp (3 MUFU/pair)";
  __device__ static void pair(float& v0, float& v1) {
    v0 = v0 * lean::rcp_ftz(1.0f + lean::ex2_ftz(ex2_arg(v0)));
    v1 = v1 * lean::rcp_soft(1.0f + lean::ex2_ftz(ex2_arg(v1)));
  }
};

// The kernels' form (activate_lean).
struct FormTanh {
  static constexpr const char* kName = "tanh.f32 (activate_lean)";
  __device__ static void quad(float& a, float& b, float& c, float& d) {
    a = lean::activate_lean<Act::kGeluTanh, false>(a);
    b = lean::activate_lean<Act::kGeluTanh, true>(b);
    c = lean::activate_lean<Act::kGeluTanh, false>(c);
    d = lean::activate_lean<Act::kGeluTanh, true>(d);
  }
};

// tanh.approx.f16x2 on the pair's arguments rounded to half precision.
struct FormTanhF16x2 : Pairwise<FormTanhF16x2> {
  static constexpr const char* kName = "tanh.f16x2";
  __device__ static void pair(float& v0, float& v1) {
    uint32_t h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(tanh_arg(v1)), "f"(tanh_arg(v0)));
    const uint32_t t = tanh_f16x2(h);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&t));
    const float h0 = 0.5f * v0, h1 = 0.5f * v1;
    v0 = fmaf(h0, f.x, h0);
    v1 = fmaf(h1, f.y, h1);
  }
};

// One reciprocal of the product of four denominators (each clamped to 2^31 so that the
// product stays finite), then each one's reciprocal as the product of the other three times it.
struct FormQuadRcp {
  static constexpr const char* kName = "ex2 + one rcp per 4";
  __device__ static void quad(float& a, float& b, float& c, float& d) {
    auto den = [](float v) { return 1.0f + lean::ex2_ftz(fminf(ex2_arg(v), 31.0f)); };
    const float da = den(a), db = den(b), dc = den(c), dd = den(d);
    const float ab = da * db, cd = dc * dd;
    const float r = lean::rcp_ftz(ab * cd);
    const float rab = r * cd, rcd = r * ab;
    a *= rab * db;
    b *= rab * da;
    c *= rcd * dd;
    d *= rcd * dc;
  }
};

template <typename Form>
__global__ void form_throughput(float* out, int iters) {
  float v[32];
  for (int i = 0; i < 32; ++i) v[i] = 0.01f * (threadIdx.x % 64) - 0.3f + 0.02f * i;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 32; i += 4) Form::quad(v[i], v[i + 1], v[i + 2], v[i + 3]);
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = fmaf(v[i], 0.9f, 0.05f);  // keep values in range
  }
  float s = 0;
  for (int i = 0; i < 32; ++i) s += v[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <typename Form>
__global__ void form_values(const float* x, float* y, int n) {
  const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
  if (i + 3 >= n) return;
  float a = x[i], b = x[i + 1], c = x[i + 2], d = x[i + 3];
  Form::quad(a, b, c, d);
  y[i] = a;
  y[i + 1] = b;
  y[i + 2] = c;
  y[i + 3] = d;
}

// ---- host -----------------------------------------------------------------------------------

struct Timer {
  cudaEvent_t e0, e1;
  Timer() {
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
  }
  // Milliseconds of launch() (called twice: the first run warms up).
  template <typename F>
  float ms(F launch) {
    float t = 0;
    for (int rep = 0; rep < 2; ++rep) {
      cudaEventRecord(e0);
      launch();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      cudaEventElapsedTime(&t, e0, e1);
    }
    return t;
  }
};

struct Device {
  int sms, clock_khz;
  double clocks(float ms) const { return ms * 1e-3 * clock_khz * 1e3; }
};

template <typename Op, typename V>
void report_mufu(Timer& timer, const Device& dev, float* out) {
  const int iters = 4096, blocks = dev.sms * 4, threads = 512;
  const float ms = timer.ms([&] { mufu_chain<Op, V><<<blocks, threads>>>(out, iters); });
  const double per_sm_clock = double(blocks) * threads * iters * 8 / dev.sms / dev.clocks(ms);
  printf("%-12s %8.3f ms  lane instructions per SM per clock (at %d MHz): %.2f\n", Op::kName, ms,
         dev.clock_khz / 1000, per_sm_clock);
}

template <typename Form>
void report_form(Timer& timer, const Device& dev, float* out, const std::vector<float>& hx,
                 float* dx, float* dy) {
  const int iters = 512, blocks = dev.sms * 2, threads = 256;  // 8 warps per SM
  const float ms = timer.ms([&] { form_throughput<Form><<<blocks, threads>>>(out, iters); });
  const double per_element = dev.clocks(ms) / (double(blocks) * threads * iters * 32 / dev.sms);
  const int n = static_cast<int>(hx.size());
  form_values<Form><<<(n / 4 + 255) / 256, 256>>>(dx, dy, n);
  std::vector<float> hy(n);
  cudaMemcpy(hy.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost);
  double worst = 0, wx = 0, worst_small = 0, wsx = 0;
  for (int i = 0; i < n; ++i) {
    const double v = hx[i];
    const double ref = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
    const double e = fabs(hy[i] - ref);
    if (e / fmax(fabs(ref), 1.0) > worst) worst = e / fmax(fabs(ref), 1.0), wx = v;
    if (e / fmax(fabs(ref), 1e-3) > worst_small) worst_small = e / fmax(fabs(ref), 1e-3), wsx = v;
  }
  printf(
      "%-26s %.3f ms  clocks per element per SM %.4f (a 128 x 256 tile: %.0f)  "
      "err/max(|y|,1) %.3g at x=%.3f  err/max(|y|,1e-3) %.3g at x=%.3f\n",
      Form::kName, ms, per_element, per_element * 32768, worst, wx, worst_small, wsx);
}

int main() {
  Device dev;
  cudaDeviceGetAttribute(&dev.sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&dev.clock_khz, cudaDevAttrClockRate, 0);
  float* out;
  cudaMalloc(&out, dev.sms * 4 * 512 * sizeof(float));
  Timer timer;
  report_mufu<Tanh32, float>(timer, dev, out);
  report_mufu<Ex232, float>(timer, dev, out);
  report_mufu<TanhF16x2, uint32_t>(timer, dev, out);
  report_mufu<TanhBf16x2, uint32_t>(timer, dev, out);
  report_mufu<Ex2F16x2, uint32_t>(timer, dev, out);

  const int n = 1 << 22;
  std::vector<float> hx(n);
  for (int i = 0; i < n; ++i) hx[i] = -20.0f + 40.0f * i / (n - 1);
  float *dx, *dy;
  cudaMalloc(&dx, n * sizeof(float));
  cudaMalloc(&dy, n * sizeof(float));
  cudaMemcpy(dx, hx.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  report_form<FormEx2Rcp>(timer, dev, out, hx, dx, dy);
  report_form<FormTanh>(timer, dev, out, hx, dx, dy);
  report_form<FormTanhF16x2>(timer, dev, out, hx, dx, dy);
  report_form<FormQuadRcp>(timer, dev, out, hx, dx, dy);
  return 0;
}
