// Which group ranks share a host: nodes, local ranks and rails.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "common/config.hpp"

namespace fastcomm {

// This process's host identity: FASTCOMM_HOST_ID if set, else hostname, boot
// id and the pid/mount namespaces (ranks in different containers of one host
// cannot share /dev/shm or see each other's pids, so they are different nodes).
std::string localHostId(const Config& cfg);

struct Topology {
  int rank = 0;
  int size = 1;
  std::vector<std::string> hostOf;          // by group rank
  std::vector<int> nodeOf;                  // node index by group rank
  std::vector<std::vector<int>> nodeRanks;  // group ranks of each node, ascending
  int myNode = 0;
  int localRank = 0;  // index of `rank` in nodeRanks[myNode]
  int localSize = 1;

  int numNodes() const { return static_cast<int>(nodeRanks.size()); }
  // The most ranks on one node.
  int maxLocalSize() const {
    size_t most = 1;
    for (const auto& node : nodeRanks) most = std::max(most, node.size());
    return static_cast<int>(most);
  }
  std::string describe() const;

  // Publishes this rank's host id in `store` and reads everyone's; fails with
  // the missing ranks named when they do not appear within `timeout`.
  // `settings` rides along in the same key (the ranks' choices that must
  // agree, checked by the caller at no extra store round); every rank's comes
  // back in `allSettings` when given.
  static Topology exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           const std::string& hostId, std::chrono::milliseconds timeout,
                           const std::string& settings = "",
                           std::vector<std::string>* allSettings = nullptr);
  // Nodes are ordered by their lowest group rank.
  static Topology fromHostIds(int rank, std::vector<std::string> hostOf);
};

}  // namespace fastcomm
