// Hopper GEMM kernels, cooperative schedule, float16: one
// translation unit per schedule and type so that the build compiles them in
// parallel (kernels/matmul_sm90_kernel.cuh has the code).
#include "matmul_sm90_kernel.cuh"

FASTCOMM_SM90_INSTANTIATE(__half, Sched::kCoop)
