// NCCL helpers shared by the flat CUDA collectives and the CUDA multi-node
// plans.
#pragma once

#include <ATen/ATen.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "common/reduce.hpp"

namespace fastcomm {

// Throws a comm error naming `what` and NCCL's reason (ncclInProgress is not
// an error: non-blocking communicators return it).
void ncclCheck(ncclResult_t r, ncclComm_t comm, const char* what);

// The NCCL type of an arithmetic dtype; a clear error for others.
ncclDataType_t ncclType(at::ScalarType t);

// How an AVG reaches NCCL: as ncclAvg, or as ncclSum when the caller divides
// itself (the multi-node path sums across the node first and divides once,
// after the rail phase).
enum class NcclAvg { Native, AsSum };

// The NCCL reduction for `op` on `t` (bool travels as uint8 0/1: SUM and MAX
// are OR, i.e. ncclMax; PRODUCT and MIN are AND, i.e. ncclMin). A clear
// internal error for ops NCCL has no reduction for (the bitwise ones reduce
// locally).
ncclRedOp_t ncclRedOp(RedOp op, at::ScalarType t, NcclAvg avg = NcclAvg::Native);

// Aborts `comms` (null entries skipped) concurrently, one thread each.
// ncclCommAbort sets the communicator's abort flag and then frees its
// resources, which waits for the device (NCCL issues #829, #1013): one after
// the other, the first abort would wait forever on the kernels of a later
// communicator that are stuck on a dead peer. Concurrently, every flag gets
// set, every stuck kernel returns, and all the waits end.
void ncclAbortAll(const std::vector<ncclComm_t>& comms);

// Frees a communicator whose work has finished, without its peers.
// ncclCommDestroy is an intra-node collective, while torch tears a process's
// groups down in an order of its own, which can differ between ranks (it sorts
// by group name): a rank destroying group A while its peer destroys group B
// would wait forever. ncclCommAbort frees the same resources locally.
void ncclRelease(ncclComm_t comm);

// Before the first NCCL communicator that spans hosts: NCCL's socket
// transport with 4 threads x 4 sockets per connection (NCCL_SOCKET_NTHREADS,
// NCCL_NSOCKS_PERTHREAD) where the environment sets neither. NCCL reads both
// once per process, at its first socket connection, so this also reaches
// NCCL communicators the process creates later (ProcessGroupNCCL's) and none
// it already connected. Below the staged rail's sizes fastcomm's CUDA
// all_reduce across hosts is NCCL's, and on the shaped-link testbed the 4 x 4
// setting beat NCCL's default socket setting there on 100 Gbit/s and matched
// it on 25 Gbit/s (benchmarks/RESULTS.md). True on the one call that set them.
bool preferNcclSocketParallelism();

// Creates a communicator of `nranks` ranks (this one being `rank`) from a
// unique id that rank 0 publishes under `prefix` + "uid". Each of
// `readyRanks` (group ranks) announces itself under `prefix` + "ready/<r>"
// first, and the blocking ncclCommInitRank starts only once all did, so a
// rank that never comes is named (as `what` failing) instead of hanging the
// others. `groupRank` is this process's group rank.
ncclComm_t ncclCommFromStore(const c10::intrusive_ptr<c10d::Store>& store,
                             const std::string& prefix, int nranks, int rank,
                             const std::vector<int>& readyRanks, int groupRank,
                             std::chrono::milliseconds timeout, const std::string& what);

}  // namespace fastcomm
