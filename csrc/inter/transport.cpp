#include "inter/transport.hpp"

#include <algorithm>
#include <stdexcept>

#include "inter/ib/ib_transport.hpp"
#include "inter/tcp/tcp_transport.hpp"

namespace fastcomm {
namespace transport {

std::unique_ptr<MemoryRegion> Transport::registerDeviceMemory(void* data, int64_t bytes) {
  throw std::runtime_error("fastcomm: the " + name() +
                           " transport cannot register device memory (" + std::to_string(bytes) +
                           " bytes): only ib with GPUDirect RDMA moves GPU memory directly");
}

std::unique_ptr<Transport> createTransport(const std::string& name, const Config& cfg) {
  if (name == "tcp") return tcp::createTcpTransport(cfg);
  if (name == "ib") return ib::createIbTransport(cfg);
  throw std::invalid_argument("fastcomm: unknown transport '" + name + "' (known: tcp, ib)");
}

void checkPeerList(const char* transport, int rank, int size, const std::vector<int>& peers) {
  std::vector<int> sorted = peers;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= size || sorted[i] == rank ||
        (i > 0 && sorted[i] == sorted[i - 1])) {
      throw std::invalid_argument(std::string("fastcomm: ") + transport +
                                  " transport: bad peer list " + formatRanks(peers) + " for rank " +
                                  std::to_string(rank) + " of " + std::to_string(size));
    }
  }
}

bool transportUsable(const std::string& name, const Config& cfg, std::string* why) {
  if (name == "tcp") {
    *why = "sockets";
    return true;
  }
  if (name == "ib") return ib::ibUsable(cfg, why);
  *why = "unknown transport '" + name + "'";
  return false;
}

void waitAll(Transport& transport, const std::vector<Request*>& requests,
             const std::vector<int>& peers, const OpContext& ctx) {
  // `peers[i]` is the peer of `requests[i]`; only used for error messages.
  auto peerOf = [&](size_t i) { return i < peers.size() ? peers[i] : -1; };
  std::vector<bool> done(requests.size(), false);
  // Sleeps are capped so that a deadline is noticed soon after it passes.
  constexpr auto kMaxSleep = std::chrono::milliseconds(100);
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < requests.size(); ++i) {
      if (done[i] || requests[i] == nullptr) continue;
      try {
        done[i] = requests[i]->test();
      } catch (const TransportError& e) {
        throwCommError("fastcomm: " + ctx.describe() + " failed: communication with rank " +
                       std::to_string(e.peer()) + " broke: " + e.what());
      }
      all = all && done[i];
    }
    if (all) return;
    if (ctx.expired()) {
      std::vector<int> pending;
      for (size_t i = 0; i < requests.size(); ++i) {
        if (!done[i] && requests[i] != nullptr) pending.push_back(peerOf(i));
      }
      std::sort(pending.begin(), pending.end());
      pending.erase(std::unique(pending.begin(), pending.end()), pending.end());
      throwCommError("fastcomm: " + ctx.describe() + " timed out after " +
                     std::to_string(ctx.timeout.count()) + " ms waiting for rank(s) " +
                     formatRanks(pending));
    }
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(ctx.deadline - Clock::now());
    transport.waitForProgress(std::max(std::chrono::microseconds(1),
                                       std::min<std::chrono::microseconds>(left, kMaxSleep)));
  }
}

}  // namespace transport
}  // namespace fastcomm
