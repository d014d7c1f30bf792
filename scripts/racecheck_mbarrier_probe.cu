// Does compute-sanitizer racecheck model mbarrier ordering? (docs/matmul.md,
// "offload"). Two handovers of a shared-memory buffer from a writer warp to a
// reader warp, each correct under the PTX memory model:
//   mode 0: writer st.shared; __syncwarp; lane 0 mbarrier.arrive (release.cta);
//           readers mbarrier.try_wait.parity (acquire.cta) in a loop, ld.shared.
//           The offload epilogue's tile_full handover, reduced to its pattern.
//   mode 1: the same handover through named barriers, the producer side
//           arriving (bar.arrive) and the consumer side waiting (bar.sync), as
//           a warp-specialised kernel would do it;
//   mode 2: the control: every handover a __syncthreads of both warps.
// Reports for modes 0 / 1 and none for mode 2 mean the tool does not see the
// one-sided orderings (only full barriers), and its report on the offload
// kernel is no evidence of a race. Each mode also checks the values it read (a real race would
// show up as wrong sums when run without the tool).
//
// Build and run on an sm_90 machine (scripts/device_check.sh ops stage does):
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/mbar_probe scripts/racecheck_mbarrier_probe.cu
//   compute-sanitizer --tool racecheck /tmp/mbar_probe 0
//   compute-sanitizer --tool racecheck /tmp/mbar_probe 1
//   compute-sanitizer --tool racecheck /tmp/mbar_probe 2
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kWords = 1024;
constexpr int kRounds = 8;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Warp 0 writes round r's values, warp 1 reads and sums them; buffer reuse
// across rounds is ordered by a second handover back (empty).
__global__ void probe(int mode, unsigned long long* sums) {
  __shared__ uint32_t buf[kWords];
  __shared__ __align__(8) uint64_t bars[2];
  const uint32_t full = smem_u32(&bars[0]), empty = smem_u32(&bars[1]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbar_init(full, 1);
    mbar_init(empty, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  unsigned long long sum = 0;
  for (int r = 0; r < kRounds; ++r) {
    if (mode == 2) {
      if (warp == 0)
        for (int i = lane; i < kWords; i += 32) buf[i] = static_cast<uint32_t>(r * kWords + i);
      __syncthreads();
      if (warp == 1)
        for (int i = lane; i < kWords; i += 32) sum += buf[i];
      __syncthreads();
      continue;
    }
    if (warp == 0) {
      if (mode == 0) {
        mbar_wait(empty, static_cast<uint32_t>(r & 1) ^ 1u);
      } else if (r > 0) {
        asm volatile("bar.sync 2, 64;\n" ::: "memory");  // the reader is done with r - 1
      }
      for (int i = lane; i < kWords; i += 32) buf[i] = static_cast<uint32_t>(r * kWords + i);
      __syncwarp();
      if (mode == 0) {
        if (lane == 0) mbar_arrive(full);
      } else {
        asm volatile("bar.arrive 1, 64;\n" ::: "memory");
      }
    } else if (warp == 1) {
      if (mode == 0) {
        mbar_wait(full, static_cast<uint32_t>(r & 1));
      } else {
        asm volatile("bar.sync 1, 64;\n" ::: "memory");
      }
      for (int i = lane; i < kWords; i += 32) sum += buf[i];
      __syncwarp();
      if (mode == 0) {
        if (lane == 0) mbar_arrive(empty);
      } else if (r + 1 < kRounds) {
        asm volatile("bar.arrive 2, 64;\n" ::: "memory");
      }
    }
  }
  if (warp == 1) atomicAdd(sums, sum);
}

}  // namespace

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  unsigned long long* sums = nullptr;
  if (cudaMalloc(&sums, sizeof(*sums)) != cudaSuccess) return 2;
  cudaMemset(sums, 0, sizeof(*sums));
  probe<<<1, 64>>>(mode, sums);
  unsigned long long got = 0;
  const cudaError_t err = cudaMemcpy(&got, sums, sizeof(got), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("mode %d: CUDA error %s\n", mode, cudaGetErrorString(err));
    return 2;
  }
  unsigned long long want = 0;
  for (int r = 0; r < kRounds; ++r)
    for (int i = 0; i < kWords; ++i) want += static_cast<unsigned long long>(r * kWords + i);
  std::printf("mode %d (%s handover): sum %llu, expected %llu: %s\n", mode,
              mode == 0   ? "mbarrier"
              : mode == 1 ? "named barrier"
                          : "__syncthreads",
              got, want, got == want ? "OK" : "WRONG");
  cudaFree(sums);
  return got == want ? 0 : 1;
}
