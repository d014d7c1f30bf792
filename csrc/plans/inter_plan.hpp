// The multi-node choices of a group: the agreed settings (already group rank
// 0's on every rank, Config::adoptAgreed) and the transport that
// FASTCOMM_TRANSPORT=auto resolves to, which depends on every rank's devices:
// group rank 0 decides it and publishes it under the store key
// "fastcomm/inter_plan". The host plans (HierComm) and the CUDA plans
// (CudaHier) read the same record.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <string>

#include "common/config.hpp"
#include "common/deadline.hpp"

namespace fastcomm {

struct InterPlan {
  std::string transport;         // "tcp" or "ib" (FASTCOMM_TRANSPORT, "auto" resolved)
  std::string wireDtype;         // none | bf16 | fp16 | int8
  int64_t chunkBytes = 0;        // host pipeline chunk
  bool cudaHier = true;          // CUDA all_reduce across nodes: staged pipeline
  int64_t cudaChunkBytes = 0;    // its pipeline chunk
  int64_t cudaWindow = 0;        // its chunks in flight
  int64_t cudaHierMinBytes = 0;  // smaller all_reduces stay on the flat NCCL comm
  int tcpSocketsPerPeer = 0;     // FASTCOMM_TCP_SOCKETS, `auto` resolved for the hosts' ranks

  // Every rank reports whether ib is usable here; rank 0 decides (ib only
  // when all `size` ranks can use it) and publishes, everyone (rank 0 too)
  // reads back; waits at most until ctx's deadline. A forced ib that some
  // rank cannot use fails on every rank, naming those ranks. `ranksPerHost`:
  // the most ranks of the group on one host (the same on every rank).
  static InterPlan agree(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         int ranksPerHost, const Config& cfg, const OpContext& ctx);
  // `cfg` with the plan's transport settings, for creating its transports.
  Config transportConfig(const Config& cfg) const;
  std::string encode() const;
  static InterPlan decode(const std::string& text);
};

}  // namespace fastcomm
