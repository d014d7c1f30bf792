// Element-wise reductions of host buffers, used by the shared-memory and
// network paths. Half and bfloat16 accumulate in float; integers in int64, so
// results wrap exactly as the element type would.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <string>

namespace fastcomm {

enum class RedOp : uint8_t { Sum, Avg, Product, Min, Max, BAnd, BOr, BXor };

const char* redOpName(RedOp op);

// The dtypes reduceInto() handles (every arithmetic type but complex, and bool).
bool reducibleDtype(at::ScalarType t);

// Maps a c10d ReduceOp to ours, or throws a clear error when the op or the
// (op, dtype) pair is unsupported. `collective` names the caller in errors.
RedOp toRedOp(const c10d::ReduceOp& op, at::ScalarType dtype, const char* collective);

// out[i] = ins[0][i] op ins[1][i] op ... for i < count. `out` may alias any
// input. With Avg the sum is divided by `divisor` (truncating for integers).
void reduceInto(void* out, const void* const* ins, int nIn, int64_t count, at::ScalarType dtype,
                RedOp op, int divisor);

}  // namespace fastcomm
