// Minimal leveled logging to stderr, prefixed with the rank.
#pragma once

#include <sstream>
#include <string>

#include "common/config.hpp"

namespace fastcomm {

LogLevel logLevel();
void setLogLevel(LogLevel level);
void logLine(LogLevel level, const std::string& line);
// FASTCOMM_CRASH_BACKTRACE=1: a segfault prints the native stack of the
// crashing thread (Python's faulthandler shows only Python frames), and
// SIGUSR2 prints every thread's native stack (for a hung process).
void installCrashBacktrace();

}  // namespace fastcomm

#define FASTCOMM_LOG(level, expr)                                               \
  do {                                                                          \
    if (static_cast<int>(::fastcomm::LogLevel::level) <=                        \
        static_cast<int>(::fastcomm::logLevel())) {                             \
      std::ostringstream fastcomm_log_os_;                                      \
      fastcomm_log_os_ << expr;                                                 \
      ::fastcomm::logLine(::fastcomm::LogLevel::level, fastcomm_log_os_.str()); \
    }                                                                           \
  } while (0)
