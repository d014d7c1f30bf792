// The inter-node transport: one narrow, non-blocking interface with one
// folder per implementation (tcp/, ib/), modelled on NCCL's network
// plugin API and Gloo's transport/ (device, pair, buffer).
//
// Semantics every implementation keeps (tests/test_transport.py checks them):
// - A Connection joins this rank with one peer. Each direction carries
//   messages in order: the k-th isend on one side matches the k-th irecv on
//   the other. Sizes must agree; a mismatch fails both requests with an error
//   naming the peer.
// - Receiver-driven: bytes of a message land only in the buffer the receiver
//   posted (no unexpected-message copies). A sender whose receiver has not
//   posted yet simply does not progress (TCP: the socket's window; ib: the
//   receiver hands out credits for slots).
// - isend/irecv never block. They return nullptr ("retry later") when the
//   connection already has kMaxRequestsInFlight requests of that direction
//   outstanding; the caller tests earlier requests and retries.
// - Request::test() never blocks either; it returns true once the data is in
//   place (receive) or the buffer may be reused (send), and throws
//   TransportError naming the peer when the connection broke (reset, peer
//   exit, size mismatch, or a broken queue pair).
// - Transport::waitForProgress() sleeps until some request of this transport
//   may have completed (or the time passes), so callers never busy-wait on
//   machines with few cores.
// - Buffers given to isend/irecv stay valid until the request completed.
//   Memory passed through registerMemory() may be sent from and received into
//   without extra copies (ib pins and registers it; tcp needs nothing).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/config.hpp"
#include "common/deadline.hpp"

namespace fastcomm {
namespace transport {

constexpr int kMaxRequestsInFlight = 16;  // per connection and direction

// A failure of the connection to `peer` (a group rank).
class TransportError : public std::runtime_error {
 public:
  TransportError(int peer, const std::string& what) : std::runtime_error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual void* data() const = 0;
  virtual int64_t bytes() const = 0;
};

class Request {
 public:
  virtual ~Request() = default;
  // True once complete; throws TransportError on failure. Never blocks.
  virtual bool test() = 0;
};

class Connection {
 public:
  virtual ~Connection() = default;
  virtual int peer() const = 0;  // group rank of the other side
  // `mr` is the registered region containing [data, data + bytes), or null.
  // nullptr means "retry later" (too many requests in flight).
  virtual std::unique_ptr<Request> isend(const void* data, int64_t bytes,
                                         const MemoryRegion* mr) = 0;
  virtual std::unique_ptr<Request> irecv(void* data, int64_t bytes, const MemoryRegion* mr) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;

  // ib in a CUDA build sends device pointers (cudaPointerGetAttributes) on to
  // registerDeviceMemory; everything else is registered as host memory.
  virtual std::unique_ptr<MemoryRegion> registerMemory(void* data, int64_t bytes) = 0;
  // Registers CUDA device memory, which then moves without host staging
  // (GPUDirect RDMA; NCCL's regMr with NCCL_PTR_CUDA). Throws
  // std::runtime_error saying why where supportsDeviceMemory() is false.
  // Device buffers must always be sent and received with their registration.
  virtual std::unique_ptr<MemoryRegion> registerDeviceMemory(void* data, int64_t bytes);

  // Connects this rank (`rank` of `size`) with each rank in `peers`, exchanging
  // the listen handles through `store` (already prefixed for the group). Every
  // listed peer must call connect() listing this rank. Returns the connections
  // in the order of `peers`. Fails naming the peers that did not show up
  // before ctx's deadline.
  virtual std::vector<std::unique_ptr<Connection>> connect(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      const std::vector<int>& peers, const OpContext& ctx) = 0;

  // Sleeps until a request may have completed, at most `max`.
  virtual void waitForProgress(std::chrono::microseconds max) = 0;

  // Stops progress threads and closes every connection; outstanding requests
  // fail. Idempotent; the destructor calls it.
  virtual void close() = 0;

  // Whether registerDeviceMemory() works: ib with GPUDirect RDMA (dma-buf,
  // nvidia-peermem, or its emulation on a machine with a GPU), unless
  // FASTCOMM_IB_GDR=0.
  virtual bool supportsDeviceMemory() const { return false; }
  // Implementation counters for tests and logs (ib: bytes sent zero-copy or
  // staged, registration cache hits and misses).
  virtual std::map<std::string, int64_t> counters() const { return {}; }
};

// For connect(): throws std::invalid_argument unless `peers` are distinct
// ranks of [0, size) other than `rank`.
void checkPeerList(const char* transport, int rank, int size, const std::vector<int>& peers);

// `name` is "tcp" or "ib". Reads its settings from `cfg`.
std::unique_ptr<Transport> createTransport(const std::string& name, const Config& cfg);

// Whether this rank can run transport `name` (ib: a usable RDMA device under
// FASTCOMM_IB_HCA, or FASTCOMM_IB_EMULATE=1); `why` names the device or says
// why not. Cheap enough to call once per process group.
bool transportUsable(const std::string& name, const Config& cfg, std::string* why);

// Waits for all `requests` (null entries are skipped), sleeping through
// waitForProgress. On ctx's deadline throws a comm error naming the
// collective, the peers still pending and the timeout; a TransportError
// becomes a comm error naming the collective and the peer.
void waitAll(Transport& transport, const std::vector<Request*>& requests,
             const std::vector<int>& peers, const OpContext& ctx);

}  // namespace transport
}  // namespace fastcomm
