#include "inter/ib/emu_segment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <atomic>
#include <chrono>
#include <mutex>

namespace fastcomm {
namespace transport {
namespace ib {
namespace emu {

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, timeout,
                 nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint32_t pidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint32_t>(st.st_ino) : 0;
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks), and whether the
// process is a zombie; 0 when the process does not exist.
uint64_t processStart(int pid, bool* zombie) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return 0;
  auto paren = s.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream is(s.substr(paren + 2));
  std::string field;
  uint64_t start = 0;
  for (int i = 3; i <= 22 && is >> field; ++i) {
    if (i == 3 && zombie) *zombie = field == "Z" || field == "X";
    if (i == 22) start = std::strtoull(field.c_str(), nullptr, 10);
  }
  return start;
}

std::string segmentName(uint32_t ns, int pid, uint32_t ctx) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "/fastcomm-ibemu-%u-%d-%u", ns, pid, ctx);
  return buf;
}

void putBe32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

uint32_t getBe32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}

// GID layout of an emulated port: prefix (2 bytes), 0, pid namespace, pid, ctx.
Gid makeGid(uint16_t prefix, uint32_t ns, int pid, uint32_t ctx) {
  Gid g;
  g.raw[0] = static_cast<uint8_t>(prefix >> 8);
  g.raw[1] = static_cast<uint8_t>(prefix);
  putBe32(g.raw + 4, ns);
  putBe32(g.raw + 8, static_cast<uint32_t>(pid));
  putBe32(g.raw + 12, ctx);
  return g;
}

// Removes segments whose owner died without unlinking them (killed).
void removeStaleSegments(uint32_t ns) {
  const std::string prefix = "fastcomm-ibemu-" + std::to_string(ns) + "-";
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    int pid = std::atoi(name.c_str() + prefix.size());
    bool zombie = false;
    if (pid > 0 && (processStart(pid, &zombie) == 0 || zombie)) shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

bool Segment::ownerAlive() {
  if (hdr()->closed.load(std::memory_order_acquire) != 0) return false;
  std::lock_guard<std::mutex> lock(mu_);  // devices of this process share the mapping
  auto now = Clock::now();
  if (now < nextCheck_) return alive_;
  nextCheck_ = now + std::chrono::milliseconds(50);
  bool zombie = false;
  uint64_t start = processStart(hdr()->pid, &zombie);
  alive_ = start != 0 && !zombie && start == hdr()->startTime;
  if (!alive_ && !unlinked_) {
    // The owner was killed: nobody else will remove its name.
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
  return alive_;
}

std::shared_ptr<Segment> mapPeer(const Gid& gid) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<Segment>> cache;
  const uint32_t ns = getBe32(gid.raw + 4), ctx = getBe32(gid.raw + 12);
  const int pid = static_cast<int>(getBe32(gid.raw + 8));
  const std::string name = segmentName(ns, pid, ctx);
  std::lock_guard<std::mutex> lock(mu);
  if (auto s = cache[name].lock()) return s;
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw std::runtime_error("fastcomm: ib emulation: no emulated port with GID " + gid.str() +
                             " (" + name + ": " + std::strerror(errno) +
                             "; did the peer's process exit, or is FASTCOMM_IB_EMULATE not set "
                             "on every rank?)");
  }
  void* p = mmap(nullptr, segmentBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    throw std::system_error(err, std::generic_category(), "fastcomm: ib emulation: mmap " + name);
  }
  auto seg = std::make_shared<Segment>(name, p);
  if (seg->hdr()->magic != kSegMagic || seg->hdr()->version != kVersion) {
    throw std::runtime_error("fastcomm: ib emulation: " + name + " is not an emulated port");
  }
  cache[name] = seg;
  return seg;
}

}  // namespace emu
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
