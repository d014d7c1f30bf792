// Hopper GEMM kernels, ping-pong schedule, float32 operands multiplied as TF32
// (K-major operands only): one translation unit per schedule and type so that
// the build compiles them in parallel (kernels/matmul_sm90_kernel.cuh has the code).
#include "matmul_sm90_kernel.cuh"

FASTCOMM_SM90_INSTANTIATE(float, Sched::kPingpong)
