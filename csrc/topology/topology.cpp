#include "topology/topology.hpp"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>

#include "common/deadline.hpp"
#include "common/store_util.hpp"

namespace fastcomm {

namespace {

std::string readFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string readLink(const char* path) {
  char buf[256];
  ssize_t n = readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

}  // namespace

std::string localHostId(const Config& cfg) {
  if (!cfg.hostIdOverride.empty()) return "id:" + cfg.hostIdOverride;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return std::string(host) + "|" + readFirstLine("/proc/sys/kernel/random/boot_id") + "|" +
         readLink("/proc/self/ns/pid") + "|" + readLink("/proc/self/ns/mnt");
}

Topology Topology::fromHostIds(int rank, std::vector<std::string> hostOf) {
  Topology t;
  t.rank = rank;
  t.size = static_cast<int>(hostOf.size());
  t.hostOf = std::move(hostOf);
  std::map<std::string, int> nodeIndex;
  t.nodeOf.resize(t.size);
  for (int r = 0; r < t.size; ++r) {
    auto it = nodeIndex.find(t.hostOf[r]);
    if (it == nodeIndex.end()) {
      it = nodeIndex.emplace(t.hostOf[r], static_cast<int>(t.nodeRanks.size())).first;
      t.nodeRanks.emplace_back();
    }
    t.nodeOf[r] = it->second;
    t.nodeRanks[it->second].push_back(r);
  }
  t.myNode = t.nodeOf[rank];
  const auto& mine = t.nodeRanks[t.myNode];
  t.localSize = static_cast<int>(mine.size());
  for (int i = 0; i < t.localSize; ++i)
    if (mine[i] == rank) t.localRank = i;
  return t;
}

Topology Topology::exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                            const std::string& hostId, std::chrono::milliseconds timeout,
                            const std::string& settings, std::vector<std::string>* allSettings) {
  auto key = [](int r) { return "fastcomm/host/" + std::to_string(r); };
  // "<host id>\0<settings>": host ids (hostnames, FASTCOMM_HOST_ID) hold no NUL.
  std::string value = hostId;
  value.push_back('\0');
  value += settings;
  store->set(key(rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  try {
    store->wait(keys, timeout);
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!store->check({key(r)})) missing.push_back(r);
    throwCommError("fastcomm: process group creation failed on group rank " + std::to_string(rank) +
                   ": group rank(s) " + formatRanks(missing) +
                   " did not join within the timeout of " + std::to_string(timeout.count()) +
                   " ms");
  }
  std::vector<std::string> hosts(size);
  if (allSettings) allSettings->assign(size, std::string());
  for (int r = 0; r < size; ++r) {
    std::string v = storeGet(store, keys[r]);
    const size_t nul = v.find('\0');
    if (nul != std::string::npos) {
      if (allSettings) (*allSettings)[r] = v.substr(nul + 1);
      v.resize(nul);
    }
    hosts[r] = std::move(v);
  }
  return fromHostIds(rank, std::move(hosts));
}

std::string Topology::describe() const {
  std::ostringstream os;
  os << numNodes() << " node(s), local rank " << localRank << "/" << localSize << " on node "
     << myNode << "; ranks per node:";
  for (const auto& n : nodeRanks) {
    os << " [";
    for (size_t i = 0; i < n.size(); ++i) os << (i ? "," : "") << n[i];
    os << "]";
  }
  return os.str();
}

}  // namespace fastcomm
