// The kernel choices of the fused matmul ops (common/config.hpp,
// MatmulConfig): read from the FASTCOMM_MATMUL_* environment once per process,
// at the first matmul, so that a call costs no environment lookups. Tests and
// benchmarks switch kernels inside one process through an override
// (torchext._testing.set_matmul_config / reset_matmul_config).
#pragma once

#include <optional>

#include "common/config.hpp"

namespace fastcomm {
namespace ops {

// The override if one is set, else the environment's settings (read at the
// first call; a bad value raises, naming the variable, on every call).
MatmulConfig matmulConfig();

// Replaces the environment's settings until reset with std::nullopt. Logged
// at INFO, as the environment's settings are when first read.
void setMatmulConfigOverride(std::optional<MatmulConfig> config);

}  // namespace ops
}  // namespace fastcomm
