#include "ops/matmul_config.hpp"

#include <c10/util/Exception.h>

#include <mutex>
#include <stdexcept>

#include "common/logging.hpp"

namespace fastcomm {
namespace ops {
namespace {

std::mutex gMu;
std::optional<MatmulConfig> gOverride;  // guarded by gMu

const MatmulConfig& fromEnvOnce() {
  // A throwing initialiser leaves the static uninitialised: the next call
  // reads the environment again and raises the same error.
  static const MatmulConfig env = [] {
    MatmulConfig c = MatmulConfig::fromEnv();
    FASTCOMM_LOG(Info, c.describe());
    return c;
  }();
  return env;
}

}  // namespace

MatmulConfig matmulConfig() {
  {
    std::lock_guard<std::mutex> lock(gMu);
    if (gOverride) return *gOverride;
  }
  try {
    return fromEnvOnce();
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(Error, e.what());  // RuntimeError in Python, as TORCH_CHECK
  }
}

void setMatmulConfigOverride(std::optional<MatmulConfig> config) {
  if (config) FASTCOMM_LOG(Info, config->describe() << " (override)");
  std::lock_guard<std::mutex> lock(gMu);
  gOverride = std::move(config);
}

}  // namespace ops
}  // namespace fastcomm
