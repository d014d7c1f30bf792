#include "inter/ib/ib_transport.hpp"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <unistd.h>

#include "inter/ib/device.hpp"
#include "inter/ib/engine.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

namespace {

class IbConnection : public Connection {
 public:
  IbConnection(std::shared_ptr<Engine> engine, std::shared_ptr<Peer> peer)
      : engine_(std::move(engine)), peer_(std::move(peer)) {}
  int peer() const override { return peer_->rank; }
  std::unique_ptr<Request> isend(const void* data, int64_t bytes, const MemoryRegion* mr) override {
    // The buffer is only read; Op keeps one pointer type for both directions.
    return engine_->post(*peer_, true, static_cast<char*>(const_cast<void*>(data)), bytes, mr);
  }
  std::unique_ptr<Request> irecv(void* data, int64_t bytes, const MemoryRegion* mr) override {
    return engine_->post(*peer_, false, static_cast<char*>(data), bytes, mr);
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<Peer> peer_;
};

class IbTransport : public Transport {
 public:
  explicit IbTransport(const Config& cfg) : engine_(std::make_shared<Engine>(cfg)) {}
  ~IbTransport() override { close(); }

  std::string name() const override { return "ib"; }
  std::unique_ptr<MemoryRegion> registerMemory(void* data, int64_t bytes) override {
    return engine_->registerMemory(data, bytes);
  }
  std::unique_ptr<MemoryRegion> registerDeviceMemory(void* data, int64_t bytes) override {
    return engine_->registerDeviceMemory(data, bytes);
  }
  std::vector<std::unique_ptr<Connection>> connect(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size,
                                                   const std::vector<int>& peers,
                                                   const OpContext& ctx) override {
    std::vector<std::unique_ptr<Connection>> conns;
    for (auto& p : engine_->connect(store, rank, size, peers, ctx)) {
      conns.push_back(std::make_unique<IbConnection>(engine_, std::move(p)));
    }
    return conns;
  }
  void waitForProgress(std::chrono::microseconds max) override { engine_->waitForProgress(max); }
  void close() override { engine_->close(); }
  bool supportsDeviceMemory() const override { return engine_->deviceMemory(); }
  std::map<std::string, int64_t> counters() const override { return engine_->counters(); }

 private:
  std::shared_ptr<Engine> engine_;
};

}  // namespace

std::unique_ptr<Transport> createIbTransport(const Config& cfg) {
  return std::make_unique<IbTransport>(cfg);
}

bool ibUsable(const Config& cfg, std::string* why) {
  Probe p = probe(cfg);
  *why = p.reason;
  return p.usable;
}

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
