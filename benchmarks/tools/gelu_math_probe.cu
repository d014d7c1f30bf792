// The cost of the fused gelu_tanh's math on sm_90, apart from any GEMM: issue rate of the
// special-function unit's (MUFU) forms, the time per element of four ways to compute
// 0.5 x (1 + tanh(u)) in float32 (the ex2 + rcp form with a software reciprocal for every other
// element, tanh.approx.f32, tanh.approx.f16x2 on a packed pair, and ex2 with one reciprocal per
// four elements), 8 warps per SM like the Hopper kernel's epilogue, and each form's largest
// error against float64 over [-20, 20]. Why kernels/matmul_device.cuh's activate_lean takes
// the hardware tanh.
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a benchmarks/tools/gelu_math_probe.cu -o probe
//   ./probe
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>

__device__ __forceinline__ float ex2f(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcpf(float x) {
  float y;
  asm volatile("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tanhf_a(float x) {
  float y;
  asm volatile("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t tanh_h2(uint32_t x) {
  uint32_t y;
  asm volatile("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t tanh_b2(uint32_t x) {
  uint32_t y;
  asm volatile("tanh.approx.bf16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t ex2_h2(uint32_t x) {
  uint32_t y;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

template <int MODE>
__global__ void thr(float* out, int iters) {
  float v[8];
  uint32_t h[8];
  for (int i = 0; i < 8; ++i) {
    v[i] = 0.001f * (threadIdx.x + i);
    h[i] = 0x3c003c00u + threadIdx.x + i;
  }
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (MODE == 0) v[i] = tanhf_a(v[i]);
      if (MODE == 1) v[i] = ex2f(v[i]);
      if (MODE == 2) v[i] = rcpf(v[i]);
      if (MODE == 3) h[i] = tanh_h2(h[i]);
      if (MODE == 4) h[i] = tanh_b2(h[i]);
      if (MODE == 5) h[i] = ex2_h2(h[i]);
    }
  }
  float s = 0;
  for (int i = 0; i < 8; ++i) s += v[i] + __uint_as_float(h[i]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__device__ __forceinline__ float rcp_soft(float d) {
  d = fminf(d, 8.50705917e37f);
  float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
  for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.0f), r);
  return r;
}
constexpr float kA = -2.3022081983f, kB = kA * 0.044715f;
__device__ __forceinline__ void g_cur(float& v0, float& v1) {
  float d0 = 1.0f + ex2f(v0 * fmaf(kB, v0 * v0, kA));
  float d1 = 1.0f + ex2f(v1 * fmaf(kB, v1 * v1, kA));
  v0 = v0 * rcpf(d0);
  v1 = v1 * rcp_soft(d1);
}
__device__ __forceinline__ void g_t32(float& v0, float& v1) {
  float u0 = 0.79788456f * v0 * fmaf(0.044715f * v0, v0, 1.0f);
  float u1 = 0.79788456f * v1 * fmaf(0.044715f * v1, v1, 1.0f);
  float h0 = 0.5f * v0, h1 = 0.5f * v1;
  v0 = fmaf(h0, tanhf_a(u0), h0);
  v1 = fmaf(h1, tanhf_a(u1), h1);
}
__device__ __forceinline__ void g_t16(float& v0, float& v1) {
  float u0 = 0.79788456f * v0 * fmaf(0.044715f * v0, v0, 1.0f);
  float u1 = 0.79788456f * v1 * fmaf(0.044715f * v1, v1, 1.0f);
  uint32_t h;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(u1), "f"(u0));
  uint32_t t = tanh_h2(h);
  float2 f = __half22float2(*reinterpret_cast<__half2*>(&t));
  float h0 = 0.5f * v0, h1 = 0.5f * v1;
  v0 = fmaf(h0, f.x, h0);
  v1 = fmaf(h1, f.y, h1);
}
// 4 elements, one reciprocal of the product of the clamped denominators
__device__ __forceinline__ void g_quad(float& a, float& b, float& c, float& d) {
  float da = 1.0f + ex2f(fminf(a * fmaf(kB, a * a, kA), 31.0f));
  float db = 1.0f + ex2f(fminf(b * fmaf(kB, b * b, kA), 31.0f));
  float dc = 1.0f + ex2f(fminf(c * fmaf(kB, c * c, kA), 31.0f));
  float dd = 1.0f + ex2f(fminf(d * fmaf(kB, d * d, kA), 31.0f));
  float ab = da * db, cd = dc * dd;
  float r = rcpf(ab * cd);
  float rab = r * cd, rcd = r * ab;
  a = a * (rab * db);
  b = b * (rab * da);
  c = c * (rcd * dd);
  d = d * (rcd * dc);
}
template <int F>
__global__ void gthr(float* out, int iters) {
  float v[32];
  for (int i = 0; i < 32; ++i) v[i] = 0.01f * (threadIdx.x % 64) - 0.3f + 0.02f * i;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 32; i += 4) {
      if (F == 0) {
        g_cur(v[i], v[i + 1]);
        g_cur(v[i + 2], v[i + 3]);
      }
      if (F == 1) {
        g_t32(v[i], v[i + 1]);
        g_t32(v[i + 2], v[i + 3]);
      }
      if (F == 2) {
        g_t16(v[i], v[i + 1]);
        g_t16(v[i + 2], v[i + 3]);
      }
      if (F == 3) {
        g_quad(v[i], v[i + 1], v[i + 2], v[i + 3]);
      }
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = fmaf(v[i], 0.9f, 0.05f);
  }
  float s = 0;
  for (int i = 0; i < 32; ++i) s += v[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// gelu_tanh, three forms, over xs
__global__ void gelu_forms(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  // lean (current): x / (1 + 2^(a v (1 + c v^2)))
  constexpr float a = -2.3022081983f, b = a * 0.044715f;
  float arg = v * fmaf(b, v * v, a);
  float cur = v * rcpf(1.0f + ex2f(arg));
  // tanh.approx.f32
  float u = 0.79788456080286536f * v * fmaf(0.044715f * v, v, 1.0f);
  float hv = 0.5f * v;
  float t32 = fmaf(hv, tanhf_a(u), hv);
  // tanh.approx.f16x2 (u rounded to half)
  __half2 uh = __floats2half2_rn(u, u);
  uint32_t r = tanh_h2(*reinterpret_cast<uint32_t*>(&uh));
  __half2 th = *reinterpret_cast<__half2*>(&r);
  float t16 = fmaf(hv, __low2float(th), hv);
  y[3 * i] = cur;
  y[3 * i + 1] = t32;
  y[3 * i + 2] = t16;
}

int main() {
  float* out;
  cudaMalloc(&out, 132 * 8 * 1024 * sizeof(float));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  int clk;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  const char* names[] = {"tanh.f32",   "ex2.f32",     "rcp.f32",
                         "tanh.f16x2", "tanh.bf16x2", "ex2.f16x2"};
  int iters = 4096, blocks = 132 * 4, threads = 512;
  for (int rep = 0; rep < 2; ++rep)
    for (int m = 0; m < 6; ++m) {
      if (m == 2) continue;  // rcp of rcp: not timed as a chain by this loop (folded)
      cudaEventRecord(e0);
      switch (m) {
        case 0:
          thr<0><<<blocks, threads>>>(out, iters);
          break;
        case 1:
          thr<1><<<blocks, threads>>>(out, iters);
          break;
        case 2:
          thr<2><<<blocks, threads>>>(out, iters);
          break;
        case 3:
          thr<3><<<blocks, threads>>>(out, iters);
          break;
        case 4:
          thr<4><<<blocks, threads>>>(out, iters);
          break;
        case 5:
          thr<5><<<blocks, threads>>>(out, iters);
          break;
      }
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      double ops = double(blocks) * threads * iters * 8;  // instructions (lane ops)
      double per_ns = ops / (ms * 1e6);
      if (rep)
        printf("%-12s %8.3f ms  %.1f lane-ops/ns  per SM per clk (at %d MHz max): %.2f\n", names[m],
               ms, per_ns, clk / 1000, per_ns / 132 / (clk / 1e6));
    }

  {
    const char* gn[] = {"gelu cur (3 MUFU/pair)", "gelu tanh.f32", "gelu tanh.f16x2",
                        "gelu quad-rcp"};
    int gi = 512, gb = 132 * 2, gt = 256;  // 8 warps per SM, like the epilogue
    for (int rep = 0; rep < 2; ++rep)
      for (int f = 0; f < 4; ++f) {
        cudaEventRecord(e0);
        if (f == 0) gthr<0><<<gb, gt>>>(out, gi);
        if (f == 1) gthr<1><<<gb, gt>>>(out, gi);
        if (f == 2) gthr<2><<<gb, gt>>>(out, gi);
        if (f == 3) gthr<3><<<gb, gt>>>(out, gi);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        double elems = double(gb) * gt * gi * 32;
        if (rep)
          printf(
              "%-24s %.3f ms  clk per element per SM: %.4f  (per 128x256 tile of 32768: %.0f "
              "clk)\n",
              gn[f], ms, ms * 1e-3 * (clk * 1e3) / (elems / 132),
              ms * 1e-3 * (clk * 1e3) / (elems / 132) * 32768);
      }
  }
  const int n = 1 << 22;
  std::vector<float> hx(n);
  for (int i = 0; i < n; ++i) hx[i] = -20.0f + 40.0f * i / (n - 1);
  float *dx, *dy;
  cudaMalloc(&dx, n * 4);
  cudaMalloc(&dy, 3 * n * 4);
  cudaMemcpy(dx, hx.data(), n * 4, cudaMemcpyHostToDevice);
  gelu_forms<<<(n + 255) / 256, 256>>>(dx, dy, n);
  std::vector<float> hy(3 * n);
  cudaMemcpy(hy.data(), dy, 3 * n * 4, cudaMemcpyDeviceToHost);
  const char* fn[] = {"ex2+rcp", "tanh.f32", "tanh.f16x2"};
  for (int f = 0; f < 3; ++f) {
    double worst = 0, wx = 0, worst_rel = 0, wrx = 0;
    for (int i = 0; i < n; ++i) {
      double v = hx[i];
      double ref = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      double e = fabs(hy[3 * i + f] - ref) / fmax(fabs(ref), 1.0);
      if (e > worst) {
        worst = e;
        wx = v;
      }
      double er = fabs(hy[3 * i + f] - ref) / fmax(fabs(ref), 1e-3);
      if (er > worst_rel) {
        worst_rel = er;
        wrx = v;
      }
    }
    printf("%-10s err/max(|y|,1) %.3g at x=%.3f   err/max(|y|,1e-3) %.3g at x=%.3f\n", fn[f], worst,
           wx, worst_rel, wrx);
  }
  return 0;
}
