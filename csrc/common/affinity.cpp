#include "common/affinity.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>

#include "common/logging.hpp"

namespace fastcomm {
namespace affinity {
namespace {

std::mutex gMu;
bool gConfigured = false;
std::vector<int> gSlice;  // empty: fastcomm's threads are not pinned

}  // namespace

std::pair<int, int> sysfsCoreOf(int cpu) {
  const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  std::ifstream pkgFile(dir + "physical_package_id"), coreFile(dir + "core_id");
  int pkg = 0, core = 0;
  if (pkgFile >> pkg && coreFile >> core) return {pkg, core};
  return {-1, cpu};
}

std::vector<int> sliceOfCores(const std::vector<int>& allowed, int localRank, int localSize,
                              const std::function<std::pair<int, int>(int)>& coreOf) {
  if (localSize < 1 || localRank < 0 || localRank >= localSize) {
    throw std::invalid_argument("fastcomm: local rank " + std::to_string(localRank) +
                                " is outside 0.." + std::to_string(localSize - 1));
  }
  std::vector<int> cpus(allowed);
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::map<std::pair<int, int>, std::vector<int>> byCore;
  for (int cpu : cpus) byCore[coreOf(cpu)].push_back(cpu);
  std::vector<const std::vector<int>*> cores;
  for (const auto& kv : byCore) cores.push_back(&kv.second);
  std::sort(cores.begin(), cores.end(), [](const std::vector<int>* a, const std::vector<int>* b) {
    return a->front() < b->front();
  });
  const size_t n = cores.size(), r = static_cast<size_t>(localRank),
               size = static_cast<size_t>(localSize);
  std::vector<int> mine;
  for (size_t i = r * n / size; i < (r + 1) * n / size; ++i) {
    mine.insert(mine.end(), cores[i]->begin(), cores[i]->end());
  }
  // More ranks than cores: share them all rather than leave a rank none.
  if (mine.empty()) return cpus;
  std::sort(mine.begin(), mine.end());
  return mine;
}

std::string compactList(const std::vector<int>& cpus) {
  std::vector<int> v(cpus);
  std::sort(v.begin(), v.end());
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(v[i]);
    if (j > i) out += "-" + std::to_string(v[j]);
    i = j + 1;
  }
  return out;
}

void configure(const Config& cfg) {
  std::lock_guard<std::mutex> lock(gMu);
  if (gConfigured) return;
  gConfigured = true;
  if (cfg.cpuAffinity != "local") return;
  const int r = cfg.launcherLocalRank, n = cfg.launcherLocalWorldSize;
  if (r < 0 || n < 1 || r >= n) {
    FASTCOMM_LOG(Warn,
                 "FASTCOMM_CPU_AFFINITY=local needs LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun "
                 "sets them); fastcomm's threads are not pinned");
    return;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) {
    FASTCOMM_LOG(Warn,
                 "FASTCOMM_CPU_AFFINITY=local: sched_getaffinity failed; fastcomm's threads "
                 "are not pinned");
    return;
  }
  std::vector<int> allowed;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) allowed.push_back(cpu);
  }
  gSlice = sliceOfCores(allowed, r, n, sysfsCoreOf);
  FASTCOMM_LOG(Info, "local rank " << r << " of " << n << ": fastcomm's threads run on CPUs "
                                   << compactList(gSlice) << " (the process may use "
                                   << compactList(allowed) << "; FASTCOMM_CPU_AFFINITY=local)");
}

void pinThisThread() {
  std::vector<int> slice;
  {
    std::lock_guard<std::mutex> lock(gMu);
    slice = gSlice;
  }
  if (slice.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : slice) CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  if (rc != 0) {
    FASTCOMM_LOG(Warn, "FASTCOMM_CPU_AFFINITY=local: pthread_setaffinity_np failed (error "
                           << rc << "); this thread stays unpinned");
  }
}

void enterBusyThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  pinThisThread();
}

}  // namespace affinity
}  // namespace fastcomm
