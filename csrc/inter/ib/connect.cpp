#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <random>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <cstddef>
#include <mutex>

#include "common/logging.hpp"
#include "common/store_util.hpp"
#include "inter/ib/engine.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

namespace {

// What a rank publishes for each peer under handleKey(rank, peer).
struct PeerHandle {
  int qps = 0, fifo = 0;
  LinkLayer link = LinkLayer::InfiniBand;
  QpEndpoint ep;  // lid, gid, mtu (qpn/psn per QP below)
  uint64_t ctrlAddr = 0;
  uint32_t ctrlRkey = 0;
  std::vector<std::pair<uint32_t, uint32_t>> qpnPsn;
};

std::string encodeHandle(const PeerHandle& h) {
  std::ostringstream os;
  os << "fastcomm-ib " << kProtocolVersion << " " << h.qps << " " << h.fifo << " "
     << (h.link == LinkLayer::Ethernet ? "eth" : "ib") << " " << h.ep.lid << " " << h.ep.gid.str()
     << " " << h.ep.mtu << " " << std::hex << h.ctrlAddr << " " << h.ctrlRkey << std::dec;
  for (auto& [qpn, psn] : h.qpnPsn) os << " " << qpn << " " << psn;
  return os.str();
}

bool decodeHandle(const std::string& text, PeerHandle* h, std::string* why) {
  std::istringstream is(text);
  std::string tag, link, gid;
  uint32_t version = 0;
  is >> tag >> version;
  if (is.fail() || tag != "fastcomm-ib" || version != kProtocolVersion) {
    *why = "not a fastcomm ib handle of protocol version " + std::to_string(kProtocolVersion);
    return false;
  }
  is >> h->qps >> h->fifo >> link >> h->ep.lid >> gid >> h->ep.mtu >> std::hex >> h->ctrlAddr >>
      h->ctrlRkey >> std::dec;
  if (is.fail() || !Gid::parse(gid, &h->ep.gid) || h->qps < 1 || h->qps > 64) {
    *why = "malformed";
    return false;
  }
  h->link = link == "eth" ? LinkLayer::Ethernet : LinkLayer::InfiniBand;
  h->ep.link = h->link;
  for (int i = 0; i < h->qps; ++i) {
    uint32_t qpn = 0, psn = 0;
    is >> qpn >> psn;
    if (is.fail()) {
      *why = "malformed QP list";
      return false;
    }
    h->qpnPsn.emplace_back(qpn, psn);
  }
  return true;
}

std::string handleKey(int from, int to) {
  return "ib/" + std::to_string(from) + "/" + std::to_string(to);
}

}  // namespace

Engine::Engine(const Config& cfg)
    : qps_(std::max(1, cfg.ibQpsPerPeer)), notifier_(std::make_shared<Notifier>()) {
  spinMicros_ =
      cfg.spinMicros >= 0 ? cfg.spinMicros : (std::thread::hardware_concurrency() >= 8 ? 20 : 0);
  dev_ = openDevice(cfg);
  const PortInfo& port = dev_->port();
  rc_.gidIndex = chooseGid(port, cfg.ibGidIndex, &gidWhy_);
  rc_.useGrh = port.link == LinkLayer::Ethernet || cfg.ibGidIndex >= 0;
  if (port.link == LinkLayer::Ethernet && rc_.gidIndex < 0) {
    throw std::runtime_error("fastcomm: ib transport: " + port.device + " port " +
                             std::to_string(port.port) +
                             " is RoCE but has no GID (is an IP address configured on it?)");
  }
  regCache_ = std::make_shared<RegCache>(dev_.get());
  GdrSupport gdr = detectGdr(cfg, *dev_);
  // Every route registers device memory through Device::regMr (dma-buf,
  // nvidia-peermem, or the emulation's cudaMemcpy).
  deviceMemory_ = gdr.available;
  gdrHow_ = gdr.how;
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  FASTCOMM_LOG(Info, "ib transport on "
                         << port.device << " port " << port.port << " (" << linkLayerName(port.link)
                         << ", " << port.rate << ", MTU " << port.activeMtu << "), GID: " << gidWhy_
                         << "; " << qps_ << " QP(s) per peer, FIFO of " << kFifoDepth
                         << " slots, pieces of " << (kPieceBytes >> 10) << " KiB (staged) / "
                         << (kZeroCopyPieceBytes >> 20)
                         << " MiB (registered); GPUDirect RDMA: " << gdr.how);
}

std::vector<std::shared_ptr<Peer>> Engine::connect(const c10::intrusive_ptr<c10d::Store>& store,
                                                   int rank, int size,
                                                   const std::vector<int>& peers,
                                                   const OpContext& ctx) {
  if (connected_ || closed_) {
    throw std::logic_error("fastcomm: ib transport: connect() may be called once, before close()");
  }
  connected_ = true;
  checkPeerList("ib", rank, size, peers);
  const PortInfo& port = dev_->port();
  QpEndpoint local;
  local.lid = port.lid;
  local.mtu = port.activeMtu;
  local.link = port.link;
  for (const auto& g : port.gids)
    if (g.index == rc_.gidIndex) local.gid = g.gid;

  if (!peers.empty()) {
    const int depth = static_cast<int>(peers.size()) * qps_ * (kMaxSendWr + kMaxRecvWr) + 64;
    cq_ = dev_->createCq(depth);
  }
  std::mt19937 rng(std::random_device{}());
  std::vector<std::shared_ptr<Peer>> out;
  for (int r : peers) {
    auto p = std::make_shared<Peer>();
    p->rank = r;
    p->ctrlMem = AlignedBuffer(sizeof(CtrlBlock));
    p->ctrl = reinterpret_cast<CtrlBlock*>(p->ctrlMem.get());
    p->ctrlMr = dev_->regMr(p->ctrlMem.get(), p->ctrlMem.size(), MemKind::Host);
    p->psn = rng() & 0xffffff;
    p->where = port.device + " port " + std::to_string(port.port) + ", QP";
    for (int q = 0; q < qps_; ++q) {
      auto qp = dev_->createQp(*cq_, kMaxSendWr, kMaxRecvWr);
      qp->toInit();
      std::vector<uint64_t> ids(kMaxRecvWr, wrId(kWrRecv, 0));
      if (int rc = qp->postRecv(ids.data(), kMaxRecvWr)) {
        throw std::system_error(rc, std::generic_category(), "fastcomm: ib: post receives");
      }
      p->where += (q ? "," : "") + std::string(" ") + std::to_string(qp->qpn());
      byQpn_[qp->qpn()] = {p.get(), q};
      p->qps.push_back(std::move(qp));
      p->sqUsed.push_back(0);
    }
    PeerHandle h;
    h.qps = qps_;
    h.fifo = kFifoDepth;
    h.link = port.link;
    h.ep = local;
    h.ctrlAddr = reinterpret_cast<uint64_t>(p->ctrl);
    h.ctrlRkey = p->ctrlMr->rkey;
    for (auto& qp : p->qps) h.qpnPsn.emplace_back(qp->qpn(), p->psn);
    const std::string text = encodeHandle(h);
    store->set(handleKey(rank, r), std::vector<uint8_t>(text.begin(), text.end()));
    out.push_back(p);
  }

  auto missing = [&](const std::vector<bool>& have, const char* what) {
    std::vector<int> m;
    std::string details;
    for (size_t i = 0; i < peers.size(); ++i) {
      if (have[i]) continue;
      m.push_back(peers[i]);
      details += "; rank " + std::to_string(peers[i]) + " " + what;
    }
    throwCommError("fastcomm: " + ctx.describe() + ": ib transport of rank " +
                   std::to_string(rank) + " could not connect to rank(s) " + formatRanks(m) +
                   " within the timeout of " + std::to_string(ctx.timeout.count()) + " ms" +
                   details);
  };

  // 1. The peers' handles: bring our QPs to RTR and RTS against theirs.
  std::vector<bool> have(peers.size(), false);
  for (size_t done = 0; done < peers.size();) {
    bool progressed = false;
    for (size_t i = 0; i < peers.size(); ++i) {
      if (have[i]) continue;
      const std::string key = handleKey(peers[i], rank);
      if (!store->check({key})) continue;
      const std::string text = storeGet(store, key);
      PeerHandle h;
      std::string why;
      if (!decodeHandle(text, &h, &why)) {
        throwCommError("fastcomm: " + ctx.describe() + ": ib transport: the handle of rank " +
                       std::to_string(peers[i]) + " in the store (" + key + ") is " + why + ": '" +
                       text + "'");
      }
      if (h.qps != qps_) {
        throwCommError("fastcomm: " + ctx.describe() + ": rank " + std::to_string(peers[i]) +
                       " uses FASTCOMM_IB_QPS_PER_PEER=" + std::to_string(h.qps) + " but rank " +
                       std::to_string(rank) + " uses " + std::to_string(qps_) +
                       "; it must be the same on every rank");
      }
      if (h.link != port.link) {
        throwCommError("fastcomm: " + ctx.describe() + ": rank " + std::to_string(peers[i]) +
                       " is on " + linkLayerName(h.link) + " but rank " + std::to_string(rank) +
                       " is on " + linkLayerName(port.link) + "; RC needs one fabric");
      }
      Peer& p = *out[i];
      p.remoteCtrl = h.ctrlAddr;
      p.remoteCtrlRkey = h.ctrlRkey;
      for (int q = 0; q < qps_; ++q) {
        QpEndpoint remote = h.ep;
        remote.qpn = h.qpnPsn[q].first;
        remote.psn = h.qpnPsn[q].second;
        p.qps[q]->toRtr(remote, rc_);
        p.qps[q]->toRts(p.psn, rc_);
      }
      store->set(handleKey(rank, peers[i]) + "/ready", std::vector<uint8_t>{'1'});
      have[i] = true;
      ++done;
      progressed = true;
    }
    if (done == peers.size()) break;
    if (ctx.expired()) missing(have, "never published its queue pairs");
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // 2. Every peer's QPs are ready to receive before anything is written.
  std::vector<bool> ready(peers.size(), false);
  for (size_t done = 0; done < peers.size();) {
    for (size_t i = 0; i < peers.size(); ++i) {
      if (!ready[i] && store->check({handleKey(peers[i], rank) + "/ready"})) {
        ready[i] = true;
        ++done;
      }
    }
    if (done == peers.size()) break;
    if (ctx.expired()) missing(ready, "did not bring its queue pairs to RTR");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& p : out) {
      p->lastHeard = Clock::now();
      peers_.push_back(p);
    }
  }
  if (!peers.empty()) thread_ = std::thread([this] { run(); });
  return out;
}

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
