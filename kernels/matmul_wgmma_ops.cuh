// wgmma.mma_async wrapper used by the Hopper kernel (kernels/matmul_sm90_kernel.cuh;
// sm_90a only).
//
// D[64 x N] (+)= A[64 x k] * B[k x N], A and B read from shared memory via
// matrix descriptors, float32 accumulators in registers, N = 64, 128, 192 (16-bit types) or 256.
// One instruction covers 32 bytes of K: k = 16 for float16 / bfloat16 inputs,
// k = 8 for float32 inputs multiplied as TF32 (the tensor cores read the
// float32 words and use their TF32 bits). TA / TB are the transpose
// immediates: 0 = K-major, 1 = M-major (A) / N-major (B); the TF32 form has
// none (PTX: 32-bit operands must be K-major in shared memory), so TA = TB = 0
// there. scale_d = 0 ignores the old accumulator (D = A * B).
//
// Every accumulator register is a separate asm operand, so the operand lists
// are spelled out once below (FASTCOMM_WGMMA_D*, FASTCOMM_WGMMA_ACC*) and one
// macro, FASTCOMM_WGMMA_ASM, writes the instruction for each shape and type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fastcomm {
namespace ops {
namespace cuda {
namespace sm90 {

// Placeholders of the first 32, 64, 96 and all 128 accumulator operands.
#define FASTCOMM_WGMMA_D32                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17," \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FASTCOMM_WGMMA_D64                                                          \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17," \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33," \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49," \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FASTCOMM_WGMMA_D96                                                            \
  FASTCOMM_WGMMA_D64                                                                  \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define FASTCOMM_WGMMA_D128                                                           \
  FASTCOMM_WGMMA_D96                                                                  \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109," \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122,"     \
  "%123, %124, %125, %126, %127"

// Sixteen accumulators d[i .. i + 15] as read-write operands.
#define FASTCOMM_WGMMA_ACC16(i)                                                                   \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7]), "+f"(d[i + 8]), "+f"(d[i + 9]), "+f"(d[i + 10]),            \
      "+f"(d[i + 11]), "+f"(d[i + 12]), "+f"(d[i + 13]), "+f"(d[i + 14]), "+f"(d[i + 15])
#define FASTCOMM_WGMMA_ACC32 FASTCOMM_WGMMA_ACC16(0), FASTCOMM_WGMMA_ACC16(16)
#define FASTCOMM_WGMMA_ACC64                                                   \
  FASTCOMM_WGMMA_ACC16(0), FASTCOMM_WGMMA_ACC16(16), FASTCOMM_WGMMA_ACC16(32), \
      FASTCOMM_WGMMA_ACC16(48)
#define FASTCOMM_WGMMA_ACC96 \
  FASTCOMM_WGMMA_ACC64, FASTCOMM_WGMMA_ACC16(64), FASTCOMM_WGMMA_ACC16(80)
#define FASTCOMM_WGMMA_ACC128 \
  FASTCOMM_WGMMA_ACC96, FASTCOMM_WGMMA_ACC16(96), FASTCOMM_WGMMA_ACC16(112)

// One wgmma.mma_async. SHAPE and TYPE name the instruction, REGS / ACCS are
// the accumulator placeholders and operands, and SCALE / TAIL the placeholders
// of the operands after them: desc_a, desc_b, scale_d, TA, TB (numbered from
// the accumulator count on).
#define FASTCOMM_WGMMA_ASM(SHAPE, TYPE, REGS, ACCS, SCALE, TAIL)  \
  asm volatile(                                                   \
      "{\n"                                                       \
      ".reg .pred p;\n"                                           \
      "setp.ne.b32 p, " SCALE                                     \
      ", 0;\n"                                                    \
      "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE \
      "\n"                                                        \
      "{" REGS "},\n" TAIL                                        \
      ";\n"                                                       \
      "}\n"                                                       \
      : ACCS                                                      \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB)  \
      : "memory")

// T: __nv_bfloat16, __half or float (TF32).
template <int N, typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_m64(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                          int scale_d) {
  static_assert(N == 64 || N == 128 || N == 192 || N == 256,
                "wgmma_m64: N must be 64, 128, 192 or 256");
  constexpr bool TF32 = std::is_same<T, float>::value;
  static_assert(!TF32 || N != 192, "wgmma_m64: N = 192 for 16-bit types only");
  constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
  static_assert(TF32 || BF16 || std::is_same<T, __half>::value, "wgmma_m64: unsupported type");
  static_assert(!TF32 || (TA == 0 && TB == 0), "wgmma_m64: TF32 operands must be K-major");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // The TF32 forms name no transpose immediates; TA / TB stay unused operands.
  if constexpr (N == 256 && TF32) {
    FASTCOMM_WGMMA_ASM("m64n256k8", "tf32", FASTCOMM_WGMMA_D128, FASTCOMM_WGMMA_ACC128, "%130",
                       "%128, %129, p, 1, 1");
  } else if constexpr (N == 64 && TF32) {
    FASTCOMM_WGMMA_ASM("m64n64k8", "tf32", FASTCOMM_WGMMA_D32, FASTCOMM_WGMMA_ACC32, "%34",
                       "%32, %33, p, 1, 1");
  } else if constexpr (TF32) {
    FASTCOMM_WGMMA_ASM("m64n128k8", "tf32", FASTCOMM_WGMMA_D64, FASTCOMM_WGMMA_ACC64, "%66",
                       "%64, %65, p, 1, 1");
  } else if constexpr (N == 256 && BF16) {
    FASTCOMM_WGMMA_ASM("m64n256k16", "bf16", FASTCOMM_WGMMA_D128, FASTCOMM_WGMMA_ACC128, "%130",
                       "%128, %129, p, 1, 1, %131, %132");
  } else if constexpr (N == 256) {
    FASTCOMM_WGMMA_ASM("m64n256k16", "f16", FASTCOMM_WGMMA_D128, FASTCOMM_WGMMA_ACC128, "%130",
                       "%128, %129, p, 1, 1, %131, %132");
  } else if constexpr (N == 192 && BF16) {
    FASTCOMM_WGMMA_ASM("m64n192k16", "bf16", FASTCOMM_WGMMA_D96, FASTCOMM_WGMMA_ACC96, "%98",
                       "%96, %97, p, 1, 1, %99, %100");
  } else if constexpr (N == 192) {
    FASTCOMM_WGMMA_ASM("m64n192k16", "f16", FASTCOMM_WGMMA_D96, FASTCOMM_WGMMA_ACC96, "%98",
                       "%96, %97, p, 1, 1, %99, %100");
  } else if constexpr (N == 64 && BF16) {
    FASTCOMM_WGMMA_ASM("m64n64k16", "bf16", FASTCOMM_WGMMA_D32, FASTCOMM_WGMMA_ACC32, "%34",
                       "%32, %33, p, 1, 1, %35, %36");
  } else if constexpr (N == 64) {
    FASTCOMM_WGMMA_ASM("m64n64k16", "f16", FASTCOMM_WGMMA_D32, FASTCOMM_WGMMA_ACC32, "%34",
                       "%32, %33, p, 1, 1, %35, %36");
  } else if constexpr (BF16) {
    FASTCOMM_WGMMA_ASM("m64n128k16", "bf16", FASTCOMM_WGMMA_D64, FASTCOMM_WGMMA_ACC64, "%66",
                       "%64, %65, p, 1, 1, %67, %68");
  } else {
    FASTCOMM_WGMMA_ASM("m64n128k16", "f16", FASTCOMM_WGMMA_D64, FASTCOMM_WGMMA_ACC64, "%66",
                       "%64, %65, p, 1, 1, %67, %68");
  }
#endif
}

// One wgmma.mma_async .tf32 with A from registers (the RS form): a[0..3] hold
// the thread's part of the 64 x 8 A slice as float32 words, (row, k) =
// (16 w + l / 4, l % 4), (+8, l % 4), (l / 4, l % 4 + 4), (+8, l % 4 + 4) for
// lane l of warp w of the warpgroup; B K-major from shared memory. The
// registers must stay unchanged until a wgmma.wait_group retires this one.
template <int N>
__device__ __forceinline__ void wgmma_m64_tf32_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                                  uint64_t desc_b, int scale_d) {
  static_assert(N == 64 || N == 128 || N == 256, "wgmma_m64_tf32_rs: N must be 64, 128 or 256");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // SCALE: the scale_d placeholder; TAIL: those of a[0..3] and desc_b.
#define FASTCOMM_WGMMA_RS_ASM(SHAPE, REGS, ACCS, SCALE, TAIL)                 \
  asm volatile(                                                               \
      "{\n"                                                                   \
      ".reg .pred p;\n"                                                       \
      "setp.ne.b32 p, " SCALE                                                 \
      ", 0;\n"                                                                \
      "wgmma.mma_async.sync.aligned." SHAPE                                   \
      ".f32.tf32.tf32\n"                                                      \
      "{" REGS "},\n" TAIL                                                    \
      ", p, 1, 1;\n"                                                          \
      "}\n"                                                                   \
      : ACCS                                                                  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d) \
      : "memory")
  if constexpr (N == 256) {
    FASTCOMM_WGMMA_RS_ASM("m64n256k8", FASTCOMM_WGMMA_D128, FASTCOMM_WGMMA_ACC128, "%133",
                          "{%128, %129, %130, %131}, %132");
  } else if constexpr (N == 128) {
    FASTCOMM_WGMMA_RS_ASM("m64n128k8", FASTCOMM_WGMMA_D64, FASTCOMM_WGMMA_ACC64, "%69",
                          "{%64, %65, %66, %67}, %68");
  } else {
    FASTCOMM_WGMMA_RS_ASM("m64n64k8", FASTCOMM_WGMMA_D32, FASTCOMM_WGMMA_ACC32, "%37",
                          "{%32, %33, %34, %35}, %36");
  }
#undef FASTCOMM_WGMMA_RS_ASM
#endif
}

#undef FASTCOMM_WGMMA_ASM
#undef FASTCOMM_WGMMA_ACC128
#undef FASTCOMM_WGMMA_ACC96
#undef FASTCOMM_WGMMA_ACC64
#undef FASTCOMM_WGMMA_ACC32
#undef FASTCOMM_WGMMA_ACC16
#undef FASTCOMM_WGMMA_D128
#undef FASTCOMM_WGMMA_D96
#undef FASTCOMM_WGMMA_D64
#undef FASTCOMM_WGMMA_D32

}  // namespace sm90
}  // namespace cuda
}  // namespace ops
}  // namespace fastcomm
