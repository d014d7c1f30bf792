#include "common/logging.hpp"

#include <execinfo.h>
#include <signal.h>
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

namespace {

struct sigaction gPreviousSegv {};

// Async-signal-safe: backtrace_symbols_fd writes straight to the fd.
void crashHandler(int sig, siginfo_t* info, void* uctx) {
  static const char msg[] = "[fastcomm] fatal signal; native backtrace of the crashing thread:\n";
  (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  // Hand over to whoever was there before (Python's faulthandler prints the
  // Python stacks), else die with the signal.
  if ((gPreviousSegv.sa_flags & SA_SIGINFO) && gPreviousSegv.sa_sigaction != nullptr) {
    gPreviousSegv.sa_sigaction(sig, info, uctx);
  } else if (gPreviousSegv.sa_handler != SIG_DFL && gPreviousSegv.sa_handler != SIG_IGN &&
             gPreviousSegv.sa_handler != nullptr) {
    gPreviousSegv.sa_handler(sig);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void installCrashBacktrace() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  struct sigaction sa {};
  sa.sa_sigaction = crashHandler;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &gPreviousSegv);
}

}  // namespace fastcomm
