// Hopper GEMM kernels, cooperative schedule, float32 operands multiplied as TF32
// (a K-major; b K-major, or N-major through registers): one translation unit per schedule and type
// so that the build compiles them in parallel (kernels/matmul_sm90_kernel.cuh has the code).
#include "matmul_sm90_kernel.cuh"

FASTCOMM_SM90_INSTANTIATE(float, Sched::kCoop)
