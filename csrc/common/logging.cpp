#include "common/logging.hpp"

#include <dirent.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
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

// SIGUSR2: every thread's native stack, for a process that hangs (a test
// harness sends it before killing a rank; gdb is not on every machine). The
// thread the signal lands on prints its own stack, then signals the others
// one by one with the same signal and waits until each printed its own.
std::atomic<int> gDumpOwner{0};  // tid of the thread that runs the dump
std::atomic<int> gDumpDone{0};

void writeStr(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  (void)!write(STDERR_FILENO, s, n);
}

// The decimal digits of v >= 0 at the end of buf; returns their start.
const char* digits(long v, char* buf, int size) {
  int i = size;
  buf[--i] = '\0';
  do {
    buf[--i] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0 && i > 0);
  return buf + i;
}

void writeInt(long v) {
  char buf[24];
  writeStr(digits(v, buf, sizeof(buf)));
}

void printOwnStack(long tid) {
  char path[64] = "/proc/self/task/";
  char num[24];
  size_t at = 16;
  for (const char* c = digits(tid, num, sizeof(num)); *c != '\0'; ++c) path[at++] = *c;
  for (const char* c = "/comm"; *c != '\0'; ++c) path[at++] = *c;
  path[at] = '\0';
  char name[32] = "?";
  const int fd = open(path, O_RDONLY);
  if (fd >= 0) {
    const ssize_t n = read(fd, name, sizeof(name) - 1);
    name[n > 0 ? n - 1 : 0] = '\0';  // drop the newline
    close(fd);
  }
  writeStr("[fastcomm] --- thread ");
  writeInt(tid);
  writeStr(" (");
  writeStr(name);
  writeStr(")\n");
  void* frames[48];
  const int n = backtrace(frames, 48);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
}

void dumpHandler(int, siginfo_t*, void*) {
  const int self = static_cast<int>(syscall(SYS_gettid));
  int expected = 0;
  if (!gDumpOwner.compare_exchange_strong(expected, self)) {
    // Asked by the owner: print, then tell it.
    printOwnStack(self);
    gDumpDone.store(1);
    return;
  }
  writeStr("[fastcomm] native stacks of every thread (pid ");
  writeInt(getpid());
  writeStr(", SIGUSR2):\n");
  printOwnStack(self);
  DIR* dir = opendir("/proc/self/task");  // not async-signal-safe in theory; a debugging aid
  if (dir != nullptr) {
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
      long tid = 0;
      for (const char* c = e->d_name; *c >= '0' && *c <= '9'; ++c) tid = tid * 10 + (*c - '0');
      if (tid == self) continue;
      gDumpDone.store(0);
      if (syscall(SYS_tgkill, getpid(), tid, SIGUSR2) != 0) continue;
      // A thread blocking the signal never answers: give each 200 ms.
      for (int i = 0; i < 200 && gDumpDone.load() == 0; ++i) usleep(1000);
    }
    closedir(dir);
  }
  writeStr("[fastcomm] end of native stacks\n");
  gDumpOwner.store(0);
}

}  // namespace

void installCrashBacktrace() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  // backtrace() loads libgcc on its first call, which allocates: not in a handler.
  void* warm[1];
  (void)backtrace(warm, 1);
  struct sigaction sa {};
  sa.sa_sigaction = crashHandler;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &gPreviousSegv);
  struct sigaction dump {};
  dump.sa_sigaction = dumpHandler;
  dump.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&dump.sa_mask);
  sigaction(SIGUSR2, &dump, nullptr);
}

}  // namespace fastcomm
