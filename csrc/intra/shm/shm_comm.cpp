#include "intra/shm/shm_comm.hpp"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <random>
#include <thread>

#include "common/logging.hpp"
#include "common/store_util.hpp"

namespace fastcomm {

namespace {

constexpr uint64_t kMagic = 0x66617374636f6d6dULL;  // "fastcomm"
constexpr uint32_t kMsgMagic = 0xfc0dd00d;
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);

struct MsgHeader {
  uint64_t bytes;
  int32_t tag;
  uint32_t magic;
};

int64_t alignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, timeout,
                 nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Segment names carry the pid namespace and pid of their creator, so a later
// creator can remove segments whose creator died before unlinking them.
std::string pidNamespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? std::to_string(st.st_ino) : std::string("0");
}

std::string uniqueName() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "/fastcomm-%s-%d-%llu-%08x", pidNamespace().c_str(),
                static_cast<int>(getpid()), static_cast<unsigned long long>(counter++), rd());
  return buf;
}

void removeStaleSegments() {
  const std::string prefix = "fastcomm-" + pidNamespace() + "-";
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const int pid = std::atoi(name.c_str() + prefix.size());
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

std::string errnoText(int err) { return std::string(std::strerror(err)); }

}  // namespace

struct alignas(128) MemberCtl {
  std::atomic<uint64_t> arrived{0};  // the last barrier step this member reached
  std::atomic<int32_t> pid{0};
  // Threads of this member blocked in a fastcomm wait: such a member is a
  // victim of whoever it waits for, not the culprit of a timeout.
  std::atomic<uint32_t> waiting{0};
  std::atomic<uint32_t> failed{0};  // gave up on a collective; the group is broken
  OpSignature sig[2];               // by step parity, for FASTCOMM_CHECK
};

struct RingCtl {
  alignas(64) std::atomic<uint64_t> head{0};  // bytes produced by the sender
  alignas(64) std::atomic<uint64_t> tail{0};  // bytes consumed by the receiver
};

struct ShmHeader {
  std::atomic<uint64_t> magic{0};
  uint32_t members = 0;
  uint32_t reserved = 0;
  int64_t slotBytes = 0;
  int64_t p2pBytes = 0;
  alignas(64) std::atomic<uint32_t> bell{0};      // futex word, bumped on every event
  alignas(64) std::atomic<uint32_t> sleepers{0};  // waiters inside futexWait
  alignas(64) std::atomic<uint32_t> attached{0};  // followers that mapped the segment
  // Members a failed member named as the cause, so the others name them too.
  std::atomic<uint64_t> blame[4] = {};
};

namespace {
constexpr int kMaxMembers = 256;  // 4 x 64 blame bits
}

namespace {

struct Layout {
  int64_t ctl, rings, slots, p2p, total;
  Layout(int members, int64_t slotBytes, int64_t p2pBytes) {
    ctl = alignUp(sizeof(ShmHeader), 128);
    rings = ctl + members * static_cast<int64_t>(sizeof(MemberCtl));
    slots = alignUp(rings + members * members * static_cast<int64_t>(sizeof(RingCtl)), 4096);
    p2p = slots + members * 2 * slotBytes;
    total = p2p + static_cast<int64_t>(members) * members * p2pBytes;
  }
};

}  // namespace

ShmComm::ShmComm(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                 std::vector<int> groupRanks, int me, const Config& cfg, const OpContext& ctx)
    : groupRanks_(std::move(groupRanks)),
      size_(static_cast<int>(groupRanks_.size())),
      me_(me),
      cfg_(cfg),
      slotBytes_(cfg.chunkBytes),
      p2pBytes_(cfg.p2pBytes),
      sendLocks_(groupRanks_.size()),
      recvLocks_(groupRanks_.size()) {
  TORCH_CHECK(size_ <= kMaxMembers, "fastcomm: at most ", kMaxMembers, " ranks per node");
  int64_t spinUs = cfg.spinMicros;
  if (spinUs < 0) {
    // Spinning only pays when every member has a core of its own.
    spinUs = static_cast<int64_t>(std::thread::hardware_concurrency()) > size_ ? 20 : 0;
  }
  spinIters_ = spinUs * 50;
  const Layout layout(size_, slotBytes_, p2pBytes_);
  mapBytes_ = layout.total;

  std::string name;
  int fd = -1;
  if (me_ == 0) {
    removeStaleSegments();
    name = uniqueName();
    struct statvfs vfs {};
    if (statvfs("/dev/shm", &vfs) == 0) {
      const int64_t avail = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
      TORCH_CHECK(avail >= mapBytes_, "fastcomm: /dev/shm has ", avail >> 20, " MiB free but ",
                  size_, " local ranks need ", mapBytes_ >> 20,
                  " MiB; enlarge it (docker: --shm-size) or lower FASTCOMM_CHUNK_BYTES");
    }
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "fastcomm: shm_open(", name, ") failed: ", errnoText(errno));
    int rc = ftruncate(fd, mapBytes_);
    if (rc == 0) rc = posix_fallocate(fd, 0, mapBytes_);  // fail now, not SIGBUS later
    if (rc != 0) {
      int err = rc > 0 ? rc : errno;
      close(fd);
      shm_unlink(name.c_str());
      TORCH_CHECK(false, "fastcomm: cannot size shared memory segment to ", mapBytes_,
                  " bytes: ", errnoText(err), " (is /dev/shm large enough?)");
    }
  } else {
    try {
      store->wait({key}, ctx.remaining());
    } catch (const std::exception&) {
      fail(ctx, {0}, "shared-memory setup");
    }
    name = storeGet(store, key);
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "fastcomm: cannot open shared memory ", name,
                " of local rank 0: ", errnoText(errno));
    struct stat st {};
    fstat(fd, &st);
    if (st.st_size != mapBytes_) {
      close(fd);
      TORCH_CHECK(false, "fastcomm: shared memory segment is ", st.st_size,
                  " bytes but this rank "
                  "expects ",
                  mapBytes_,
                  ": FASTCOMM_CHUNK_BYTES / FASTCOMM_P2P_BYTES differ "
                  "between ranks");
    }
  }
  void* p = mmap(nullptr, mapBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmapErr = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (me_ == 0) shm_unlink(name.c_str());
    TORCH_CHECK(false, "fastcomm: mmap of ", mapBytes_, " bytes failed: ", errnoText(mmapErr));
  }
  base_ = static_cast<char*>(p);
  hdr_ = reinterpret_cast<ShmHeader*>(base_);
  ctl_ = reinterpret_cast<MemberCtl*>(base_ + layout.ctl);
  rings_ = reinterpret_cast<RingCtl*>(base_ + layout.rings);
  slots_ = base_ + layout.slots;
  p2p_ = base_ + layout.p2p;
  if (me_ == 0) {
    new (hdr_) ShmHeader();
    hdr_->members = static_cast<uint32_t>(size_);
    hdr_->slotBytes = slotBytes_;
    hdr_->p2pBytes = p2pBytes_;
    for (int i = 0; i < size_; ++i) new (&ctl_[i]) MemberCtl();
    for (int i = 0; i < size_ * size_; ++i) new (&rings_[i]) RingCtl();
    hdr_->magic.store(kMagic);
    store->set(key, std::vector<uint8_t>(name.begin(), name.end()));
    ctl_[0].pid.store(getpid());
    // The name is removed as soon as everyone mapped it, so nothing is left in
    // /dev/shm however the processes end later.
    try {
      waitFor([&] { return hdr_->attached.load() == static_cast<uint32_t>(size_ - 1); },
              [&] {
                std::vector<int> missing;
                for (int i = 1; i < size_; ++i)
                  if (ctl_[i].pid.load() == 0) missing.push_back(i);
                return missing;
              },
              ctx, "shared-memory setup");
    } catch (...) {
      shm_unlink(name.c_str());
      munmap(base_, mapBytes_);
      base_ = nullptr;
      throw;
    }
    shm_unlink(name.c_str());
  } else {
    TORCH_CHECK(hdr_->magic.load() == kMagic && hdr_->members == static_cast<uint32_t>(size_),
                "fastcomm: shared memory segment ", name, " is not ours or has another size");
    ctl_[me_].pid.store(getpid());
    hdr_->attached.fetch_add(1);
    wake();
  }
  FASTCOMM_LOG(Debug, "shm segment " << name << " mapped: " << (mapBytes_ >> 10) << " KiB for "
                                     << size_ << " local ranks, slot " << slotBytes_ << " B");
}

ShmComm::~ShmComm() {
  if (base_ != nullptr) munmap(base_, mapBytes_);
}

char* ShmComm::slot(int rank, uint64_t step) const {
  return slots_ + (static_cast<int64_t>(rank) * 2 + static_cast<int64_t>(step & 1)) * slotBytes_;
}

void ShmComm::wake() {
  hdr_->bell.fetch_add(1);
  if (hdr_->sleepers.load() != 0) futexWakeAll(&hdr_->bell);
}

namespace {

// A process that exited but was not reaped yet (a zombie, e.g. a rank whose
// launcher has not waited for it) still answers kill(pid, 0): read its state.
bool processAlive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: trust kill()
  char buf[256] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  // "pid (comm) S ...": the state follows the last ')'.
  const char* close = std::strrchr(buf, ')');
  if (n == 0 || close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  return close[2] != 'Z' && close[2] != 'X';
}

}  // namespace

std::vector<int> ShmComm::deadMembers(const std::vector<int>& among) const {
  std::vector<int> dead;
  for (int i : among) {
    const int pid = ctl_[i].pid.load();
    if (pid > 0 && !processAlive(pid)) dead.push_back(i);
  }
  return dead;
}

void ShmComm::fail(const OpContext& ctx, const std::vector<int>& missing, const char* phase) const {
  std::vector<int> culprits;
  std::vector<int> dead;
  if (base_ != nullptr) {
    dead = deadMembers(missing);
    if (!dead.empty()) {
      culprits = dead;
    } else {
      // Members stuck in a fastcomm wait of their own, or that already failed,
      // are waiting for the same culprits; name those instead.
      for (int i : missing)
        if (ctl_[i].waiting.load() == 0 && ctl_[i].failed.load() == 0) culprits.push_back(i);
      if (culprits.empty()) {
        for (int i = 0; i < size_; ++i)
          if (hdr_->blame[i / 64].load() & (uint64_t{1} << (i % 64))) culprits.push_back(i);
      }
    }
    if (culprits.empty()) culprits = missing;
    for (int i : culprits) hdr_->blame[i / 64].fetch_or(uint64_t{1} << (i % 64));
    ctl_[me_].failed.store(1);
    const_cast<ShmComm*>(this)->wake();
  } else {
    culprits = missing;
  }
  std::vector<int> ranks;
  for (int i : culprits) ranks.push_back(groupRanks_[i]);
  std::string msg = "fastcomm: " + ctx.describe() + " failed on group rank " +
                    std::to_string(groupRanks_[me_]) + ": ";
  if (!dead.empty()) {
    msg += "group rank(s) " + formatRanks(ranks) + " exited (process gone) during " + phase +
           ", before the timeout of " + std::to_string(ctx.timeout.count()) + " ms";
  } else {
    msg += "timeout after " + std::to_string(ctx.timeout.count()) +
           " ms waiting for group rank(s) " + formatRanks(ranks) + " in " + phase;
  }
  throwCommError(msg);
}

template <typename Ready, typename Pending>
void ShmComm::waitFor(Ready ready, Pending pending, const OpContext& ctx, const char* phase) {
  for (int64_t i = 0; i < spinIters_; ++i) {
    if (ready()) return;
    cpuRelax();
  }
  struct Waiting {
    std::atomic<uint32_t>& n;
    explicit Waiting(std::atomic<uint32_t>& c) : n(c) { n.fetch_add(1); }
    ~Waiting() { n.fetch_sub(1); }
  } waiting(ctl_[me_].waiting);
  auto nextLiveness = Clock::now() + kLivenessPeriod;
  while (true) {
    const uint32_t bell = hdr_->bell.load();
    hdr_->sleepers.fetch_add(1);
    if (ready()) {
      hdr_->sleepers.fetch_sub(1);
      return;
    }
    const auto now = Clock::now();
    if (now >= ctx.deadline) {
      hdr_->sleepers.fetch_sub(1);
      fail(ctx, pending(), phase);
    }
    const auto until = std::min(ctx.deadline, nextLiveness);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(until - now).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futexWait(&hdr_->bell, bell, &ts);
    hdr_->sleepers.fetch_sub(1);
    if (ready()) return;
    // A member we wait for gave up: it will never arrive, so neither fail nor
    // wait out the timeout; name the members it blamed.
    const auto waitingFor = pending();
    for (int i : waitingFor) {
      if (ctl_[i].failed.load() != 0) fail(ctx, waitingFor, phase);
    }
    if (Clock::now() >= nextLiveness) {
      if (!deadMembers(waitingFor).empty()) fail(ctx, waitingFor, phase);
      nextLiveness = Clock::now() + kLivenessPeriod;
    }
  }
}

void ShmComm::arriveAndWait(const OpContext& ctx) {
  const uint64_t target = step_ + 1;
  ctl_[me_].arrived.store(target);
  wake();
  waitFor(
      [&] {
        for (int i = 0; i < size_; ++i)
          if (ctl_[i].arrived.load() < target) return false;
        return true;
      },
      [&] {
        std::vector<int> missing;
        for (int i = 0; i < size_; ++i)
          if (ctl_[i].arrived.load() < target) missing.push_back(i);
        return missing;
      },
      ctx, ctx.name);
}

void ShmComm::barrier(const OpContext& ctx) {
  arriveAndWait(ctx);
  ++step_;
}

void ShmComm::checkSignatures(const OpSignature& mine, const OpContext& ctx) {
  const int parity = static_cast<int>(step_ & 1);
  ctl_[me_].sig[parity] = mine;
  arriveAndWait(ctx);
  std::vector<OpSignature> all(size_);
  for (int i = 0; i < size_; ++i) all[i] = ctl_[i].sig[parity];
  ++step_;
  checkSignatureVotes(all, groupRanks_, ctx);
}

void ShmComm::allreduce(void* data, int64_t count, at::ScalarType dt, RedOp op,
                        const OpContext& ctx) {
  reduce(data, count, dt, op, /*root=*/-1, ctx);
}

void ShmComm::reduce(void* data, int64_t count, at::ScalarType dt, RedOp op, int root,
                     const OpContext& ctx) {
  // root < 0: every member receives the result (all-reduce).
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t half = slotBytes_ / 2;  // a slot holds [input chunk | reduced segment]
  char* bytes = static_cast<char*>(data);
  std::vector<const void*> ins(size_);
  const bool wantsResult = root < 0 || root == me_;

  if (count * esize <= std::min<int64_t>(cfg_.oneShotBytes, half)) {
    // One exchange; each receiving member reduces the whole buffer itself.
    std::memcpy(slot(me_, step_), bytes, count * esize);
    arriveAndWait(ctx);
    if (wantsResult) {
      for (int i = 0; i < size_; ++i) ins[i] = slot(i, step_);
      reduceInto(bytes, ins.data(), size_, count, dt, op, size_);
    }
    ++step_;
    return;
  }

  // Pipelined reduce-scatter + all-gather. Step k copies chunk k in and
  // reduces this member's segment of chunk k-1 (written in step k-1); after
  // the barrier everyone copies the reduced segments of chunk k-1 out.
  const int64_t chunkElems = half / esize;
  const int64_t chunks = (count + chunkElems - 1) / chunkElems;
  const int64_t lineElems = std::max<int64_t>(1, 64 / esize);
  auto segment = [&](int64_t chunkLen, int member, int64_t& begin, int64_t& len) {
    int64_t seg = alignUp((chunkLen + size_ - 1) / size_, lineElems);
    begin = std::min<int64_t>(chunkLen, member * seg);
    len = std::min<int64_t>(chunkLen, begin + seg) - begin;
  };
  for (int64_t k = 0; k <= chunks; ++k) {
    if (k < chunks) {
      const int64_t len = std::min(chunkElems, count - k * chunkElems);
      std::memcpy(slot(me_, step_), bytes + k * chunkElems * esize, len * esize);
    }
    if (k > 0) {
      const int64_t prevLen = std::min(chunkElems, count - (k - 1) * chunkElems);
      int64_t b, n;
      segment(prevLen, me_, b, n);
      for (int i = 0; i < size_; ++i) ins[i] = slot(i, step_ - 1) + b * esize;
      reduceInto(slot(me_, step_) + half, ins.data(), size_, n, dt, op, size_);
    }
    arriveAndWait(ctx);
    if (k > 0 && wantsResult) {
      const int64_t prevLen = std::min(chunkElems, count - (k - 1) * chunkElems);
      char* out = bytes + (k - 1) * chunkElems * esize;
      for (int i = 0; i < size_; ++i) {
        int64_t b, n;
        segment(prevLen, i, b, n);
        std::memcpy(out + b * esize, slot(i, step_) + half, n * esize);
      }
    }
    ++step_;
  }
}

void ShmComm::broadcast(void* data, int64_t bytes, int root, const OpContext& ctx) {
  char* p = static_cast<char*>(data);
  const int64_t steps = std::max<int64_t>(1, (bytes + slotBytes_ - 1) / slotBytes_);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t off = k * slotBytes_, len = std::min(slotBytes_, bytes - off);
    if (me_ == root && len > 0) std::memcpy(slot(me_, step_), p + off, len);
    arriveAndWait(ctx);
    if (me_ != root && len > 0) std::memcpy(p + off, slot(root, step_), len);
    ++step_;
  }
}

void ShmComm::allgather(const void* in, void* out, int64_t bytes, const OpContext& ctx) {
  gather(in, out, bytes, /*root=*/-1, ctx);
}

void ShmComm::gather(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) {
  // root < 0: every member receives everything (all-gather).
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t steps = std::max<int64_t>(1, (bytes + slotBytes_ - 1) / slotBytes_);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t off = k * slotBytes_, len = std::min(slotBytes_, bytes - off);
    if (len > 0) std::memcpy(slot(me_, step_), src + off, len);
    arriveAndWait(ctx);
    if ((root < 0 || root == me_) && len > 0) {
      for (int i = 0; i < size_; ++i) std::memcpy(dst + i * bytes + off, slot(i, step_), len);
    }
    ++step_;
  }
}

void ShmComm::scatter(const void* in, void* out, int64_t bytes, int root, const OpContext& ctx) {
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t per = std::max<int64_t>(64, slotBytes_ / size_ / 64 * 64);
  const int64_t steps = std::max<int64_t>(1, (bytes + per - 1) / per);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t off = k * per, len = std::min(per, bytes - off);
    if (me_ == root && len > 0) {
      for (int i = 0; i < size_; ++i)
        std::memcpy(slot(me_, step_) + i * per, src + i * bytes + off, len);
    }
    arriveAndWait(ctx);
    if (len > 0) std::memcpy(dst + off, slot(root, step_) + me_ * per, len);
    ++step_;
  }
}

void ShmComm::reduceScatter(const void* in, void* out, int64_t count, at::ScalarType dt, RedOp op,
                            const OpContext& ctx) {
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dt));
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t perBytes = std::max<int64_t>(64, slotBytes_ / size_ / 64 * 64);
  const int64_t per = perBytes / esize;
  const int64_t steps = std::max<int64_t>(1, (count + per - 1) / per);
  std::vector<const void*> ins(size_);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t off = k * per, len = std::min(per, count - off);
    if (len > 0) {
      for (int i = 0; i < size_; ++i)
        std::memcpy(slot(me_, step_) + i * perBytes, src + (i * count + off) * esize, len * esize);
    }
    arriveAndWait(ctx);
    if (len > 0) {
      for (int i = 0; i < size_; ++i) ins[i] = slot(i, step_) + me_ * perBytes;
      reduceInto(dst + off * esize, ins.data(), size_, len, dt, op, size_);
    }
    ++step_;
  }
}

void ShmComm::alltoall(const void* in, const std::vector<int64_t>& sendBytes,
                       const std::vector<int64_t>& sendOffsets, void* out,
                       const std::vector<int64_t>& recvBytes,
                       const std::vector<int64_t>& recvOffsets, const OpContext& ctx) {
  // Step 0: every member publishes what it sends and expects, so all members
  // check the whole matrix and fail (or proceed) together.
  auto* sizes = reinterpret_cast<int64_t*>(slot(me_, step_));
  for (int i = 0; i < size_; ++i) {
    sizes[i] = sendBytes[i];
    sizes[size_ + i] = recvBytes[i];
  }
  arriveAndWait(ctx);
  int64_t maxPair = 0;
  std::string mismatch;
  for (int s = 0; s < size_; ++s) {
    const auto* ss = reinterpret_cast<const int64_t*>(slot(s, step_));
    for (int d = 0; d < size_; ++d) {
      const auto* ds = reinterpret_cast<const int64_t*>(slot(d, step_));
      maxPair = std::max(maxPair, ss[d]);
      if (ss[d] != ds[size_ + s] && mismatch.empty()) {
        mismatch = "group rank " + std::to_string(groupRanks_[s]) + " sends " +
                   std::to_string(ss[d]) + " bytes to group rank " +
                   std::to_string(groupRanks_[d]) + ", which expects " +
                   std::to_string(ds[size_ + s]);
      }
    }
  }
  ++step_;
  if (!mismatch.empty()) {
    throwCommError("fastcomm: " + ctx.describe() + ": split sizes disagree: " + mismatch);
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const int64_t per = std::max<int64_t>(64, slotBytes_ / size_ / 64 * 64);
  const int64_t rounds = (maxPair + per - 1) / per;
  for (int64_t t = 0; t < rounds; ++t) {
    const int64_t off = t * per;
    for (int d = 0; d < size_; ++d) {
      const int64_t len = std::min(per, sendBytes[d] - off);
      if (len > 0) std::memcpy(slot(me_, step_) + d * per, src + sendOffsets[d] + off, len);
    }
    arriveAndWait(ctx);
    for (int s = 0; s < size_; ++s) {
      const int64_t len = std::min(per, recvBytes[s] - off);
      if (len > 0) std::memcpy(dst + recvOffsets[s] + off, slot(s, step_) + me_ * per, len);
    }
    ++step_;
  }
}

// ---- point to point ----------------------------------------------------------

void ShmComm::ringWrite(int peer, const void* data, int64_t bytes, const OpContext& ctx) {
  const int64_t idx = static_cast<int64_t>(me_) * size_ + peer;
  auto* ring = rings_ + idx;
  char* buf = p2p_ + idx * p2pBytes_;
  const auto cap = static_cast<uint64_t>(p2pBytes_);
  const char* src = static_cast<const char*>(data);
  uint64_t head = ring->head.load();
  while (bytes > 0) {
    waitFor([&] { return head - ring->tail.load() < cap; }, [&] { return std::vector<int>{peer}; },
            ctx, "send (receiver not draining)");
    const uint64_t space = cap - (head - ring->tail.load());
    const uint64_t n = std::min<uint64_t>({static_cast<uint64_t>(bytes), space, cap - head % cap});
    std::memcpy(buf + head % cap, src, n);
    head += n;
    ring->head.store(head);
    wake();
    src += n;
    bytes -= static_cast<int64_t>(n);
  }
}

void ShmComm::ringRead(int peer, void* data, int64_t bytes, const OpContext& ctx) {
  const int64_t idx = static_cast<int64_t>(peer) * size_ + me_;
  auto* ring = rings_ + idx;
  const char* buf = p2p_ + idx * p2pBytes_;
  const auto cap = static_cast<uint64_t>(p2pBytes_);
  char* dst = static_cast<char*>(data);
  uint64_t tail = ring->tail.load();
  while (bytes > 0) {
    waitFor([&] { return ring->head.load() != tail; }, [&] { return std::vector<int>{peer}; }, ctx,
            "recv (no message from sender)");
    const uint64_t avail = ring->head.load() - tail;
    const uint64_t n = std::min<uint64_t>({static_cast<uint64_t>(bytes), avail, cap - tail % cap});
    std::memcpy(dst, buf + tail % cap, n);
    tail += n;
    ring->tail.store(tail);
    wake();
    dst += n;
    bytes -= static_cast<int64_t>(n);
  }
}

bool ShmComm::ringPeek(int peer, void* data, int64_t bytes) const {
  const int64_t idx = static_cast<int64_t>(peer) * size_ + me_;
  auto* ring = rings_ + idx;
  const char* buf = p2p_ + idx * p2pBytes_;
  const auto cap = static_cast<uint64_t>(p2pBytes_);
  const uint64_t tail = ring->tail.load();
  if (ring->head.load() - tail < static_cast<uint64_t>(bytes)) return false;
  char* dst = static_cast<char*>(data);
  for (int64_t i = 0; i < bytes; ++i) dst[i] = buf[(tail + i) % cap];
  return true;
}

void ShmComm::send(const void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) {
  std::lock_guard<std::mutex> lock(sendLocks_[peer]);
  MsgHeader h{static_cast<uint64_t>(bytes), tag, kMsgMagic};
  ringWrite(peer, &h, sizeof(h), ctx);
  ringWrite(peer, data, bytes, ctx);
}

namespace {
void checkHeader(const MsgHeader& h, int64_t bytes, int tag, int srcRank, const OpContext& ctx) {
  if (h.magic != kMsgMagic) {
    throwCommError("fastcomm: " + ctx.describe() + ": corrupt message from group rank " +
                   std::to_string(srcRank));
  }
  if (h.tag != tag || static_cast<int64_t>(h.bytes) != bytes) {
    throwCommError("fastcomm: " + ctx.describe() + ": the next message from group rank " +
                   std::to_string(srcRank) + " has tag " + std::to_string(h.tag) + " and " +
                   std::to_string(h.bytes) + " bytes, but this recv expects tag " +
                   std::to_string(tag) + " and " + std::to_string(bytes) +
                   " bytes (messages between two ranks are matched in order)");
  }
}
}  // namespace

void ShmComm::recv(void* data, int64_t bytes, int peer, int tag, const OpContext& ctx) {
  std::lock_guard<std::mutex> lock(recvLocks_[peer]);
  MsgHeader h{};
  ringRead(peer, &h, sizeof(h), ctx);
  checkHeader(h, bytes, tag, groupRanks_[peer], ctx);
  ringRead(peer, data, bytes, ctx);
}

int ShmComm::tryRecvAny(void* data, int64_t bytes, int tag, const OpContext& ctx) {
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == me_) continue;
    // A peer whose ring a recv(src=peer) is reading belongs to that recv.
    std::unique_lock<std::mutex> lock(recvLocks_[peer], std::try_to_lock);
    if (!lock.owns_lock()) continue;
    MsgHeader h{};
    if (!ringPeek(peer, &h, sizeof(h)) || h.tag != tag) continue;
    ringRead(peer, &h, sizeof(h), ctx);
    checkHeader(h, bytes, tag, groupRanks_[peer], ctx);
    ringRead(peer, data, bytes, ctx);
    return peer;
  }
  return -1;
}

int ShmComm::recvAny(void* data, int64_t bytes, int tag, const OpContext& ctx) {
  std::vector<int> peers;
  for (int i = 0; i < size_; ++i)
    if (i != me_) peers.push_back(i);
  while (true) {
    const int peer = tryRecvAny(data, bytes, tag, ctx);
    if (peer >= 0) return peer;
    waitFor(
        [&] {
          for (int peer : peers) {
            MsgHeader h{};
            if (ringPeek(peer, &h, sizeof(h)) && h.tag == tag) return true;
          }
          return false;
        },
        [&] { return peers; }, ctx, "recv from any source");
  }
}

}  // namespace fastcomm
