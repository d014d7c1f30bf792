// Discovery and choices shared by both device implementations: which device
// and port (FASTCOMM_IB_HCA), which GID (FASTCOMM_IB_GID_INDEX), and whether
// GPUDirect RDMA is possible (FASTCOMM_IB_GDR).
#include "inter/ib/device.hpp"

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "common/logging.hpp"
#include "inter/ib/gpu_memory.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

const char* linkLayerName(LinkLayer l) {
  return l == LinkLayer::InfiniBand ? "InfiniBand" : "Ethernet (RoCE)";
}

const char* gidTypeName(GidType t) {
  switch (t) {
    case GidType::IB:
      return "IB";
    case GidType::RoCEv1:
      return "RoCE v1";
    case GidType::RoCEv2:
      return "RoCE v2";
  }
  return "?";
}

bool Gid::zero() const {
  for (uint8_t b : raw)
    if (b != 0) return false;
  return true;
}

bool Gid::linkLocal() const { return raw[0] == 0xfe && (raw[1] & 0xc0) == 0x80; }

bool Gid::ipv4Mapped() const {
  for (int i = 0; i < 10; ++i)
    if (raw[i] != 0) return false;
  return raw[10] == 0xff && raw[11] == 0xff;
}

std::string Gid::str() const {
  char buf[33];
  for (int i = 0; i < 16; ++i) std::snprintf(buf + 2 * i, 3, "%02x", raw[i]);
  return std::string(buf, 32);
}

bool Gid::parse(const std::string& hex, Gid* out) {
  if (hex.size() != 32) return false;
  for (int i = 0; i < 16; ++i) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1) return false;
    out->raw[i] = static_cast<uint8_t>(v);
  }
  return true;
}

const char* wcStatusName(WcStatus s) {
  switch (s) {
    case WcStatus::Success:
      return "IBV_WC_SUCCESS";
    case WcStatus::LocLenErr:
      return "IBV_WC_LOC_LEN_ERR";
    case WcStatus::LocQpOpErr:
      return "IBV_WC_LOC_QP_OP_ERR";
    case WcStatus::LocProtErr:
      return "IBV_WC_LOC_PROT_ERR";
    case WcStatus::WrFlushErr:
      return "IBV_WC_WR_FLUSH_ERR";
    case WcStatus::RemInvReqErr:
      return "IBV_WC_REM_INV_REQ_ERR";
    case WcStatus::RemAccessErr:
      return "IBV_WC_REM_ACCESS_ERR";
    case WcStatus::RemOpErr:
      return "IBV_WC_REM_OP_ERR";
    case WcStatus::RetryExcErr:
      return "IBV_WC_RETRY_EXC_ERR";
    case WcStatus::RnrRetryExcErr:
      return "IBV_WC_RNR_RETRY_EXC_ERR";
    case WcStatus::GeneralErr:
      return "IBV_WC_GENERAL_ERR";
    case WcStatus::Other:
      break;
  }
  return "IBV_WC_(other error)";
}

const char* wcStatusMeaning(WcStatus s) {
  switch (s) {
    case WcStatus::RetryExcErr:
      return "the peer closed or is unreachable (no acknowledgement within the retry budget)";
    case WcStatus::RnrRetryExcErr:
      return "the peer posted no receive within the RNR retry budget";
    case WcStatus::RemAccessErr:
      return "the peer rejected an RDMA write (bad rkey or out of the registered region)";
    case WcStatus::RemInvReqErr:
      return "the peer rejected a request as invalid";
    case WcStatus::RemOpErr:
      return "the peer failed to carry out a request";
    case WcStatus::LocProtErr:
      return "a local buffer is not covered by its memory region";
    case WcStatus::LocLenErr:
      return "a local length error";
    case WcStatus::LocQpOpErr:
      return "a local queue pair error";
    case WcStatus::WrFlushErr:
      return "flushed: the queue pair is in the error state";
    case WcStatus::GeneralErr:
      return "a general queue pair error";
    default:
      return "an unknown completion error";
  }
}

// ----------------------------------------------------------------------------- FASTCOMM_IB_HCA

bool hcaMatches(const std::string& filter, const std::string& device, int port) {
  std::string f = filter;
  if (f.empty()) return true;
  bool exclude = false, exact = false;
  if (f[0] == '^') {
    exclude = true;
    f.erase(0, 1);
  }
  if (!f.empty() && f[0] == '=') {
    exact = true;
    f.erase(0, 1);
  }
  bool listed = false;
  std::istringstream is(f);
  std::string item;
  while (std::getline(is, item, ',')) {
    if (item.empty()) continue;
    std::string name = item;
    int wantPort = -1;
    auto colon = item.find(':');
    if (colon != std::string::npos) {
      name = item.substr(0, colon);
      wantPort = std::atoi(item.c_str() + colon + 1);
    }
    const bool nameOk = exact ? device == name : device.compare(0, name.size(), name) == 0;
    if (nameOk && (wantPort < 0 || wantPort == port)) listed = true;
  }
  return exclude ? !listed : listed;
}

// ----------------------------------------------------------------------------- GID choice

int chooseGid(const PortInfo& port, int configured, std::string* why) {
  if (configured >= 0) {
    for (const auto& g : port.gids) {
      if (g.index == configured && !g.gid.zero()) {
        *why = "FASTCOMM_IB_GID_INDEX=" + std::to_string(configured) + " (" + gidTypeName(g.type) +
               ")";
        return configured;
      }
    }
    throw std::runtime_error("fastcomm: ib: FASTCOMM_IB_GID_INDEX=" + std::to_string(configured) +
                             " is not a valid GID of " + port.device + " port " +
                             std::to_string(port.port));
  }
  if (port.link == LinkLayer::InfiniBand) {
    *why = "InfiniBand: GID index 0, routed by LID " + std::to_string(port.lid);
    return port.gids.empty() ? -1 : port.gids.front().index;
  }
  // RoCE: the first GID of the best class.
  auto rank = [](const GidEntry& g) {
    if (g.gid.zero()) return 0;
    if (g.type == GidType::RoCEv2 && g.gid.ipv4Mapped()) return 4;
    if (g.type == GidType::RoCEv2 && !g.gid.linkLocal()) return 3;
    if (g.type == GidType::RoCEv2) return 2;
    return 1;
  };
  const GidEntry* best = nullptr;
  for (const auto& g : port.gids)
    if (rank(g) > 0 && (best == nullptr || rank(g) > rank(*best))) best = &g;
  if (best == nullptr) {
    *why = "no GID configured on the port";
    return -1;
  }
  *why = std::string("automatic: ") + gidTypeName(best->type) +
         (best->gid.ipv4Mapped()  ? " IPv4-mapped"
          : best->gid.linkLocal() ? " link-local"
                                  : "") +
         " GID index " + std::to_string(best->index);
  return best->index;
}

// ----------------------------------------------------------------------------- discovery

Probe probe(const Config& cfg) {
  Probe p;
  if (cfg.ibEmulate) {
    PortInfo port = emu::portInfo();
    if (!hcaMatches(cfg.ibHca, port.device, port.port)) {
      p.reason = "FASTCOMM_IB_HCA=" + cfg.ibHca + " does not match the emulated device " +
                 port.device + ":" + std::to_string(port.port);
      return p;
    }
    p.usable = p.emulated = true;
    p.device = port.device;
    p.port = port.port;
    p.reason = port.device + " port 1 (software RC emulation, FASTCOMM_IB_EMULATE=1)";
    return p;
  }
  std::string why;
  if (!verbs::load(&why)) {
    p.reason = why;
    return p;
  }
  std::vector<PortInfo> ports = verbs::listPorts(&why);
  if (ports.empty()) {
    p.reason = why.empty() ? "libibverbs found no RDMA device" : why;
    return p;
  }
  std::string seen;
  bool anyMatch = false;
  for (const auto& port : ports) {
    seen += (seen.empty() ? "" : ", ") + port.device + ":" + std::to_string(port.port) +
            (port.active ? "" : " (down)");
    if (!hcaMatches(cfg.ibHca, port.device, port.port)) continue;
    anyMatch = true;
    if (!port.active) continue;
    p.usable = true;
    p.device = port.device;
    p.port = port.port;
    p.reason = port.device + " port " + std::to_string(port.port) + " (" +
               linkLayerName(port.link) + (port.rate.empty() ? "" : ", " + port.rate) + ")";
    return p;
  }
  p.reason = anyMatch ? "no active port among " + seen
                      : "FASTCOMM_IB_HCA=" + cfg.ibHca + " matches none of " + seen;
  return p;
}

std::unique_ptr<Device> openDevice(const Config& cfg) {
  Probe p = probe(cfg);
  if (!p.usable) {
    throw std::runtime_error(
        "fastcomm: ib transport: no usable RDMA device on this rank: " + p.reason +
        " (set FASTCOMM_TRANSPORT=tcp, or FASTCOMM_IB_EMULATE=1 for the software emulation)");
  }
  if (p.emulated) return emu::open(cfg);
  return verbs::open(p.device, p.port);
}

// ----------------------------------------------------------------------------- GPUDirect

namespace {

bool exists(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0;
}

}  // namespace

GdrSupport detectGdr(const Config& cfg, const Device& dev) {
  GdrSupport g;
  if (!cfg.ibGdr) {
    g.how = "off (FASTCOMM_IB_GDR=0): GPU data is staged through pinned host memory";
    return g;
  }
  std::string why;
  if (!gpu::usable(&why)) {
    g.how = "not available: " + why;
    return g;
  }
  if (dev.emulated()) {
    // The software HCA reads and writes device memory with cudaMemcpy, so
    // the GPUDirect code paths run end to end on a GPU machine without a NIC.
    g.available = true;
    g.route = GdrRoute::Emulated;
    g.how = "emulated (the software HCA copies device memory with cudaMemcpy)";
    return g;
  }
  std::string dmaWhy;
  if (dev.dmaBufRegistration() && gpu::dmaBufExportSupported(&dmaWhy)) {
    g.available = true;
    g.route = GdrRoute::DmaBuf;
    g.how = "dma-buf (ibv_reg_dmabuf_mr with cuMemGetHandleForAddressRange)";
    return g;
  }
  if (!dev.dmaBufRegistration()) {
    dmaWhy = "libibverbs, the kernel or the RDMA driver has no ibv_reg_dmabuf_mr";
  }
  if (exists("/sys/module/nvidia_peermem") || exists("/sys/module/nv_peer_mem") ||
      exists("/sys/kernel/mm/memory_peers/nv_mem/version")) {
    g.available = true;
    g.route = GdrRoute::PeerMem;
    g.how = "nvidia-peermem (ibv_reg_mr on device pointers; no dma-buf: " + dmaWhy + ")";
    return g;
  }
  g.how = "not available (no dma-buf: " + dmaWhy +
          "; no nvidia-peermem module): GPU data is staged through pinned host memory";
  return g;
}

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
