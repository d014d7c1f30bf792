#include "common/logging.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <exception>

namespace fastcomm {
namespace {
int initialLevel() {
  try {
    return static_cast<int>(Config::fromEnv().logLevel);
  } catch (const std::exception&) {
    return static_cast<int>(LogLevel::Warn);  // the process group reports bad values
  }
}
std::atomic<int> gLevel{initialLevel()};
}  // namespace

LogLevel logLevel() { return static_cast<LogLevel>(gLevel.load(std::memory_order_relaxed)); }

void setLogLevel(LogLevel level) { gLevel.store(static_cast<int>(level)); }

void logLine(LogLevel level, const std::string& line) {
  static const char* names[] = {"WARN", "INFO", "DEBUG"};
  // One fprintf per line so lines of concurrent ranks do not interleave.
  std::fprintf(stderr, "[fastcomm %s pid %d] %s\n", names[static_cast<int>(level)],
               static_cast<int>(getpid()), line.c_str());
}

}  // namespace fastcomm
