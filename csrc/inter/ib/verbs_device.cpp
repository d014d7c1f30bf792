// The device layer on rdma-core's libibverbs, loaded at run time.
//
// Compiled against <infiniband/verbs.h> where the build finds it (Debian's
// libibverbs-dev; FASTCOMM_NO_VERBS leaves it out); the library itself is
// opened with dlopen("libibverbs.so.1") on first use, so the extension has no
// link-time dependency on rdma-core and imports where it is absent. Only the
// exported entry points go through dlsym (with their symbol versions, as the
// library keeps IBVERBS_1.0 compatibility twins); the fast-path verbs
// (post_send, post_recv, poll_cq, req_notify_cq) are inline calls through the
// provider's ops table and need no symbol. No verbs.h macro that expands to a
// library symbol (ibv_reg_mr, ibv_query_port) is used: tests check that the
// extension has no undefined ibv_* symbol.
#include "inter/ib/device.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <system_error>

#include "common/logging.hpp"
#include "inter/ib/gpu_memory.hpp"

#if !defined(FASTCOMM_NO_VERBS) && __has_include(<infiniband/verbs.h>)
#define FASTCOMM_HAVE_VERBS_H 1
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#endif

namespace fastcomm {
namespace transport {
namespace ib {
namespace verbs {

#ifndef FASTCOMM_HAVE_VERBS_H

namespace {
const char* kNoHeaders =
    "ib: built without rdma-core headers (<infiniband/verbs.h> was not found at build time; "
    "install libibverbs-dev or rdma-core-devel and rebuild fastcomm)";
}

bool load(std::string* why) {
  *why = kNoHeaders;
  return false;
}
std::vector<PortInfo> listPorts(std::string* why) {
  *why = kNoHeaders;
  return {};
}
std::unique_ptr<Device> open(const std::string&, int) { throw std::runtime_error(kNoHeaders); }

#else  // FASTCOMM_HAVE_VERBS_H

namespace {

// The entry points we take from libibverbs.so.1.
struct Api {
  ibv_device** (*getDeviceList)(int*) = nullptr;
  void (*freeDeviceList)(ibv_device**) = nullptr;
  const char* (*getDeviceName)(ibv_device*) = nullptr;
  ibv_context* (*openDevice)(ibv_device*) = nullptr;
  int (*closeDevice)(ibv_context*) = nullptr;
  int (*queryDevice)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*queryPort)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;
  int (*queryGid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*allocPd)(ibv_context*) = nullptr;
  int (*deallocPd)(ibv_pd*) = nullptr;
  ibv_mr* (*regMr)(ibv_pd*, void*, size_t, int) = nullptr;
  int (*deregMr)(ibv_mr*) = nullptr;
  ibv_comp_channel* (*createCompChannel)(ibv_context*) = nullptr;
  int (*destroyCompChannel)(ibv_comp_channel*) = nullptr;
  ibv_cq* (*createCq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroyCq)(ibv_cq*) = nullptr;
  int (*getCqEvent)(ibv_comp_channel*, ibv_cq**, void**) = nullptr;
  void (*ackCqEvents)(ibv_cq*, unsigned int) = nullptr;
  ibv_qp* (*createQp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*modifyQp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*destroyQp)(ibv_qp*) = nullptr;
  int (*getAsyncEvent)(ibv_context*, ibv_async_event*) = nullptr;
  void (*ackAsyncEvent)(ibv_async_event*) = nullptr;
  const char* (*eventTypeStr)(ibv_event_type) = nullptr;
  // Optional (rdma-core >= 34): GPUDirect through dma-buf.
  ibv_mr* (*regDmabufMr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;
};

Api gApi;
std::once_flag gOnce;
std::string gLoadError;  // empty once loaded

template <typename Fn>
bool bind(void* h, Fn* out, const char* name, const char* version) {
  void* p = version ? dlvsym(h, name, version) : nullptr;
  if (p == nullptr) p = dlsym(h, name);
  *out = reinterpret_cast<Fn>(p);
  return p != nullptr;
}

void loadOnce() {
  void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    gLoadError =
        std::string("libibverbs.so.1 could not be opened (rdma-core not installed?): ") + dlerror();
    return;
  }
  std::string missing;
  auto need = [&](auto* fn, const char* name, const char* version = "IBVERBS_1.1") {
    if (!bind(h, fn, name, version)) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  need(&gApi.getDeviceList, "ibv_get_device_list");
  need(&gApi.freeDeviceList, "ibv_free_device_list");
  need(&gApi.getDeviceName, "ibv_get_device_name");
  need(&gApi.openDevice, "ibv_open_device");
  need(&gApi.closeDevice, "ibv_close_device");
  need(&gApi.queryDevice, "ibv_query_device");
  need(&gApi.queryPort, "ibv_query_port");
  need(&gApi.queryGid, "ibv_query_gid");
  need(&gApi.allocPd, "ibv_alloc_pd");
  need(&gApi.deallocPd, "ibv_dealloc_pd");
  need(&gApi.regMr, "ibv_reg_mr");
  need(&gApi.deregMr, "ibv_dereg_mr");
  need(&gApi.createCompChannel, "ibv_create_comp_channel", "IBVERBS_1.0");
  need(&gApi.destroyCompChannel, "ibv_destroy_comp_channel", "IBVERBS_1.0");
  need(&gApi.createCq, "ibv_create_cq");
  need(&gApi.destroyCq, "ibv_destroy_cq");
  need(&gApi.getCqEvent, "ibv_get_cq_event");
  need(&gApi.ackCqEvents, "ibv_ack_cq_events");
  need(&gApi.createQp, "ibv_create_qp");
  need(&gApi.modifyQp, "ibv_modify_qp");
  need(&gApi.destroyQp, "ibv_destroy_qp");
  need(&gApi.getAsyncEvent, "ibv_get_async_event");
  need(&gApi.ackAsyncEvent, "ibv_ack_async_event");
  need(&gApi.eventTypeStr, "ibv_event_type_str");
  bind(h, &gApi.regDmabufMr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");
  if (!missing.empty()) {
    gLoadError = "libibverbs.so.1 lacks " + missing + " (rdma-core too old?)";
    dlclose(h);
    return;
  }
  // The library stays loaded for the life of the process: providers keep
  // pointers into it.
}

const Api* api(std::string* why) {
  std::call_once(gOnce, loadOnce);
  if (!gLoadError.empty()) {
    if (why) *why = gLoadError;
    return nullptr;
  }
  return &gApi;
}

[[noreturn]] void fail(const std::string& what, int err) {
  throw std::system_error(err, std::generic_category(), "fastcomm: ib (libibverbs): " + what);
}

int mtuBytes(ibv_mtu m) {
  switch (m) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
  }
  return 1024;
}

ibv_mtu mtuEnum(int bytes) {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  return IBV_MTU_256;
}

std::string rateText(const ibv_port_attr& a) {
  const char* width = a.active_width == 1    ? "1X"
                      : a.active_width == 2  ? "4X"
                      : a.active_width == 4  ? "8X"
                      : a.active_width == 8  ? "12X"
                      : a.active_width == 16 ? "2X"
                                             : "?X";
  const char* speed = "";
  switch (a.active_speed) {
    case 1:
      speed = "SDR";
      break;
    case 2:
      speed = "DDR";
      break;
    case 4:
    case 8:
      speed = "QDR/FDR10";
      break;
    case 16:
      speed = "FDR";
      break;
    case 32:
      speed = "EDR";
      break;
    case 64:
      speed = "HDR";
      break;
    case 128:
      speed = "NDR";
      break;
    default:
      speed = "";
  }
  return std::string(width) + " " + speed;
}

// RoCE GID types are only in sysfs (ibv_query_gid_ex is newer than many
// installs).
GidType gidTypeFromSysfs(const std::string& dev, int port, int index, LinkLayer link) {
  if (link == LinkLayer::InfiniBand) return GidType::IB;
  std::ifstream f("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) +
                  "/gid_attrs/types/" + std::to_string(index));
  std::string line;
  std::getline(f, line);
  return line.find("v2") != std::string::npos ? GidType::RoCEv2 : GidType::RoCEv1;
}

PortInfo describePort(const Api& a, ibv_context* ctx, const std::string& dev, int port,
                      const ibv_port_attr& attr) {
  PortInfo p;
  p.device = dev;
  p.port = port;
  p.link = attr.link_layer == IBV_LINK_LAYER_ETHERNET ? LinkLayer::Ethernet : LinkLayer::InfiniBand;
  p.active = attr.state == IBV_PORT_ACTIVE;
  p.lid = attr.lid;
  p.activeMtu = mtuBytes(attr.active_mtu);
  p.rate = rateText(attr);
  const int n = std::min(attr.gid_tbl_len, 64);
  for (int i = 0; i < n; ++i) {
    ibv_gid g{};
    if (a.queryGid(ctx, static_cast<uint8_t>(port), i, &g) != 0) continue;
    GidEntry e;
    e.index = i;
    std::memcpy(e.gid.raw, g.raw, 16);
    if (e.gid.zero()) continue;
    e.type = gidTypeFromSysfs(dev, port, i, p.link);
    p.gids.push_back(e);
  }
  return p;
}

WcStatus mapStatus(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS:
      return WcStatus::Success;
    case IBV_WC_LOC_LEN_ERR:
      return WcStatus::LocLenErr;
    case IBV_WC_LOC_QP_OP_ERR:
      return WcStatus::LocQpOpErr;
    case IBV_WC_LOC_PROT_ERR:
      return WcStatus::LocProtErr;
    case IBV_WC_WR_FLUSH_ERR:
      return WcStatus::WrFlushErr;
    case IBV_WC_REM_INV_REQ_ERR:
      return WcStatus::RemInvReqErr;
    case IBV_WC_REM_ACCESS_ERR:
      return WcStatus::RemAccessErr;
    case IBV_WC_REM_OP_ERR:
      return WcStatus::RemOpErr;
    case IBV_WC_RETRY_EXC_ERR:
      return WcStatus::RetryExcErr;
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return WcStatus::RnrRetryExcErr;
    case IBV_WC_GENERAL_ERR:
      return WcStatus::GeneralErr;
    default:
      return WcStatus::Other;
  }
}

void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) fail("fcntl O_NONBLOCK", errno);
}

class VMr : public Mr {
 public:
  VMr(const Api& a, ibv_mr* mr) : a_(a), mr_(mr) {
    addr = mr->addr;
    length = mr->length;
    lkey = mr->lkey;
    rkey = mr->rkey;
  }
  ~VMr() override { a_.deregMr(mr_); }

 private:
  const Api& a_;
  ibv_mr* mr_;
};

class VCq : public Cq {
 public:
  VCq(const Api& a, ibv_context* ctx, int depth) : a_(a) {
    ch_ = a_.createCompChannel(ctx);
    if (ch_ == nullptr) fail("ibv_create_comp_channel", errno);
    setNonBlocking(ch_->fd);
    cq_ = a_.createCq(ctx, depth, nullptr, ch_, 0);
    if (cq_ == nullptr) {
      int err = errno;
      a_.destroyCompChannel(ch_);
      fail("ibv_create_cq of " + std::to_string(depth) + " entries", err);
    }
  }
  ~VCq() override {
    drainEvents();
    if (unacked_ > 0) a_.ackCqEvents(cq_, unacked_);
    a_.destroyCq(cq_);
    a_.destroyCompChannel(ch_);
  }
  ibv_cq* raw() { return cq_; }

  int poll(Completion* out, int max) override {
    ibv_wc wc[32];
    const int n = ibv_poll_cq(cq_, std::min(max, 32), wc);
    if (n < 0) fail("ibv_poll_cq", EIO);
    for (int i = 0; i < n; ++i) {
      Completion& c = out[i];
      c.wrId = wc[i].wr_id;
      c.status = mapStatus(wc[i].status);
      c.opcode = wc[i].opcode == IBV_WC_RDMA_WRITE           ? WcOpcode::RdmaWrite
                 : wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM ? WcOpcode::RecvRdmaWithImm
                                                             : WcOpcode::Other;
      c.byteLen = wc[i].byte_len;
      c.imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc[i].imm_data) : 0;
      c.qpn = wc[i].qp_num;
      c.vendorErr = wc[i].vendor_err;
    }
    return n;
  }
  void arm() override {
    if (ibv_req_notify_cq(cq_, 0) != 0) fail("ibv_req_notify_cq", EIO);
  }
  int fd() const override { return ch_->fd; }
  void drainEvents() override {
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (a_.getCqEvent(ch_, &cq, &ctx) == 0) ++unacked_;
    // Acknowledging takes a mutex in libibverbs: batch it.
    if (unacked_ >= 64) {
      a_.ackCqEvents(cq_, unacked_);
      unacked_ = 0;
    }
  }

 private:
  const Api& a_;
  ibv_comp_channel* ch_ = nullptr;
  ibv_cq* cq_ = nullptr;
  unsigned unacked_ = 0;
};

class VQp : public Qp {
 public:
  VQp(const Api& a, ibv_pd* pd, VCq& cq, int port, int maxSend, int maxRecv, int localMtu)
      : a_(a), port_(port), localMtu_(localMtu) {
    ibv_qp_init_attr init{};
    init.send_cq = cq.raw();
    init.recv_cq = cq.raw();
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = static_cast<uint32_t>(maxSend);
    init.cap.max_recv_wr = static_cast<uint32_t>(maxRecv);
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.sq_sig_all = 0;
    qp_ = a_.createQp(pd, &init);
    if (qp_ == nullptr) fail("ibv_create_qp (RC)", errno);
  }
  ~VQp() override { a_.destroyQp(qp_); }

  uint32_t qpn() const override { return qp_->qp_num; }

  void toInit() override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = static_cast<uint8_t>(port_);
    attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    modify(attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
  }

  void toRtr(const QpEndpoint& remote, const RcAttrs& rc) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = mtuEnum(std::min(localMtu_, remote.mtu));
    attr.dest_qp_num = remote.qpn;
    attr.rq_psn = remote.psn & 0xffffff;
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = rc.minRnrTimer;
    attr.ah_attr.port_num = static_cast<uint8_t>(port_);
    attr.ah_attr.sl = rc.serviceLevel;
    if (rc.useGrh) {
      // RoCE always routes by GID (and IB does across subnets).
      attr.ah_attr.is_global = 1;
      std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.raw, 16);
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(std::max(0, rc.gidIndex));
      attr.ah_attr.grh.hop_limit = 255;
      attr.ah_attr.grh.traffic_class = rc.trafficClass;
    }
    attr.ah_attr.dlid = remote.lid;
    modify(attr,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
           "RTR");
  }

  void toRts(uint32_t psn, const RcAttrs& rc) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = rc.timeout;
    attr.retry_cnt = rc.retryCnt;
    attr.rnr_retry = rc.rnrRetry;
    attr.sq_psn = psn & 0xffffff;
    attr.max_rd_atomic = 1;
    modify(attr,
           IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
               IBV_QP_MAX_QP_RD_ATOMIC,
           "RTS");
  }

  void toError() override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    a_.modifyQp(qp_, &attr, IBV_QP_STATE);  // best effort: the QP may be gone already
  }

  int postSend(const SendWr* wrs, int n) override {
    ibv_send_wr w[8];
    ibv_sge s[8];
    for (int off = 0; off < n; off += 8) {
      const int k = std::min(8, n - off);
      for (int i = 0; i < k; ++i) {
        const SendWr& in = wrs[off + i];
        s[i] = ibv_sge{reinterpret_cast<uint64_t>(in.local), in.length, in.lkey};
        w[i] = ibv_send_wr{};
        w[i].wr_id = in.wrId;
        w[i].sg_list = &s[i];
        w[i].num_sge = in.length > 0 ? 1 : 0;
        w[i].opcode = in.withImm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        w[i].send_flags = IBV_SEND_SIGNALED;
        w[i].imm_data = htonl(in.imm);
        w[i].wr.rdma.remote_addr = in.remoteAddr;
        w[i].wr.rdma.rkey = in.rkey;
        w[i].next = i + 1 < k ? &w[i + 1] : nullptr;
      }
      ibv_send_wr* bad = nullptr;
      int rc = ibv_post_send(qp_, w, &bad);
      if (rc != 0) return rc;
    }
    return 0;
  }

  int postRecv(const uint64_t* ids, int n) override {
    ibv_recv_wr w[16];
    for (int off = 0; off < n; off += 16) {
      const int k = std::min(16, n - off);
      for (int i = 0; i < k; ++i) {
        w[i] = ibv_recv_wr{};
        w[i].wr_id = ids[off + i];
        w[i].num_sge = 0;
        w[i].next = i + 1 < k ? &w[i + 1] : nullptr;
      }
      ibv_recv_wr* bad = nullptr;
      int rc = ibv_post_recv(qp_, w, &bad);
      if (rc != 0) return rc;
    }
    return 0;
  }

 private:
  void modify(ibv_qp_attr& attr, int mask, const char* state) {
    int rc = a_.modifyQp(qp_, &attr, mask);
    if (rc != 0) fail(std::string("ibv_modify_qp to ") + state, rc);
  }

  const Api& a_;
  ibv_qp* qp_ = nullptr;
  int port_;
  int localMtu_;
};

class VDevice : public Device {
 public:
  VDevice(const Api& a, ibv_context* ctx, PortInfo port)
      : a_(a), ctx_(ctx), port_(std::move(port)) {
    pd_ = a_.allocPd(ctx_);
    if (pd_ == nullptr) {
      int err = errno;
      a_.closeDevice(ctx_);
      fail("ibv_alloc_pd on " + port_.device, err);
    }
    setNonBlocking(ctx_->async_fd);
    dmaBuf_ = probeDmaBuf();
  }
  ~VDevice() override {
    a_.deallocPd(pd_);
    a_.closeDevice(ctx_);
  }

  const PortInfo& port() const override { return port_; }
  bool emulated() const override { return false; }

  std::unique_ptr<Mr> regMr(void* addr, size_t length, MemKind kind) override {
    constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (kind == MemKind::Device) {
      const int device = gpu::deviceOf(addr, length);
      if (dmaBuf_ && gpu::dmaBufExportSupported(nullptr)) return regDmaBuf(addr, length, device);
      // nvidia-peermem: the kernel resolves device pointers inside ibv_reg_mr.
      ibv_mr* mr = a_.regMr(pd_, addr, length, kAccess);
      if (mr == nullptr) {
        fail("ibv_reg_mr of " + std::to_string(length) + " bytes of CUDA device " +
                 std::to_string(device) +
                 " memory (GPUDirect RDMA without dma-buf needs the nvidia-peermem module)",
             errno);
      }
      return std::make_unique<VMr>(a_, mr);
    }
    ibv_mr* mr = a_.regMr(pd_, addr, length, kAccess);
    if (mr == nullptr) {
      fail("ibv_reg_mr of " + std::to_string(length) +
               " bytes (is the locked-memory limit, ulimit -l, high enough?)",
           errno);
    }
    return std::make_unique<VMr>(a_, mr);
  }

  bool dmaBufRegistration() const override { return dmaBuf_; }

  std::unique_ptr<Cq> createCq(int depth) override {
    return std::make_unique<VCq>(a_, ctx_, depth);
  }

  std::unique_ptr<Qp> createQp(Cq& cq, int maxSend, int maxRecv) override {
    return std::make_unique<VQp>(a_, pd_, static_cast<VCq&>(cq), port_.port, maxSend, maxRecv,
                                 port_.activeMtu);
  }

  int asyncFd() const override { return ctx_->async_fd; }

  bool nextAsyncEvent(AsyncEvent* out) override {
    ibv_async_event ev{};
    if (a_.getAsyncEvent(ctx_, &ev) != 0) return false;
    out->name = a_.eventTypeStr(ev.event_type);
    out->qpn = 0;
    switch (ev.event_type) {
      case IBV_EVENT_QP_FATAL:
        out->kind = AsyncKind::QpFatal;
        break;
      case IBV_EVENT_QP_REQ_ERR:
        out->kind = AsyncKind::QpReqErr;
        break;
      case IBV_EVENT_QP_ACCESS_ERR:
        out->kind = AsyncKind::QpAccessErr;
        break;
      case IBV_EVENT_CQ_ERR:
        out->kind = AsyncKind::CqErr;
        break;
      case IBV_EVENT_PORT_ERR:
        out->kind = AsyncKind::PortErr;
        break;
      case IBV_EVENT_DEVICE_FATAL:
        out->kind = AsyncKind::DeviceFatal;
        break;
      default:
        out->kind = AsyncKind::Harmless;
    }
    if (out->kind == AsyncKind::QpFatal || out->kind == AsyncKind::QpReqErr ||
        out->kind == AsyncKind::QpAccessErr) {
      out->qpn = ev.element.qp->qp_num;
    }
    a_.ackAsyncEvent(&ev);
    return true;
  }

 private:
  // Whether ibv_reg_dmabuf_mr works here: the symbol (rdma-core >= 34) is
  // not enough, the kernel and the provider must support it too. A call
  // with fd -1 tells them apart without registering anything: EOPNOTSUPP
  // or EPROTONOSUPPORT means no support, any other failure (EBADF) that the
  // call got as far as the fd.
  bool probeDmaBuf() {
    if (a_.regDmabufMr == nullptr) return false;
    errno = 0;
    ibv_mr* mr = a_.regDmabufMr(pd_, 0, 0, 0, -1, 0);
    if (mr != nullptr) {
      a_.deregMr(mr);
      return true;
    }
    return errno != EOPNOTSUPP && errno != EPROTONOSUPPORT;
  }

  // [addr, addr + length) is page-aligned (the registration cache aligns
  // every range). The MR's I/O virtual address is the device pointer, so the
  // peer addresses it by the same numbers as host registrations. The fd is
  // only needed while registering: the MR holds its own reference.
  std::unique_ptr<Mr> regDmaBuf(void* addr, size_t length, int device) {
    const int fd = gpu::dmaBufFd(addr, length, device);
    ibv_mr* mr = a_.regDmabufMr(pd_, 0, length, reinterpret_cast<uint64_t>(addr), fd,
                                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    const int err = errno;
    ::close(fd);
    if (mr == nullptr) {
      fail("ibv_reg_dmabuf_mr of " + std::to_string(length) + " bytes of CUDA device " +
               std::to_string(device) + " memory",
           err);
    }
    return std::make_unique<VMr>(a_, mr);
  }

  const Api& a_;
  ibv_context* ctx_;
  ibv_pd* pd_ = nullptr;
  PortInfo port_;
  bool dmaBuf_ = false;
};

}  // namespace

bool load(std::string* why) { return api(why) != nullptr; }

std::vector<PortInfo> listPorts(std::string* why) {
  std::vector<PortInfo> out;
  const Api* a = api(why);
  if (a == nullptr) return out;
  int n = 0;
  ibv_device** list = a->getDeviceList(&n);
  if (list == nullptr) {
    const int err = errno;
    *why = std::string("libibverbs found no RDMA device (ibv_get_device_list: ") +
           std::strerror(err) +
           (err == ENOSYS ? "; the kernel, or this container, has no RDMA subsystem)" : ")");
    return out;
  }
  for (int i = 0; i < n; ++i) {
    const std::string name = a->getDeviceName(list[i]);
    ibv_context* ctx = a->openDevice(list[i]);
    if (ctx == nullptr) {
      FASTCOMM_LOG(Info, "ib: cannot open " << name << ": " << std::strerror(errno));
      continue;
    }
    ibv_device_attr dattr{};
    if (a->queryDevice(ctx, &dattr) == 0) {
      for (int p = 1; p <= dattr.phys_port_cnt; ++p) {
        ibv_port_attr pattr{};
        if (a->queryPort(ctx, static_cast<uint8_t>(p), &pattr) != 0) continue;
        out.push_back(describePort(*a, ctx, name, p, pattr));
      }
    }
    a->closeDevice(ctx);
  }
  a->freeDeviceList(list);
  if (out.empty() && why->empty()) *why = "libibverbs found no RDMA device";
  return out;
}

std::unique_ptr<Device> open(const std::string& device, int port) {
  std::string why;
  const Api* a = api(&why);
  if (a == nullptr) throw std::runtime_error("fastcomm: ib: " + why);
  int n = 0;
  ibv_device** list = a->getDeviceList(&n);
  if (list == nullptr) fail("ibv_get_device_list", errno);
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n && ctx == nullptr; ++i) {
    if (device == a->getDeviceName(list[i])) ctx = a->openDevice(list[i]);
  }
  a->freeDeviceList(list);
  if (ctx == nullptr) throw std::runtime_error("fastcomm: ib: cannot open device " + device);
  ibv_port_attr pattr{};
  if (a->queryPort(ctx, static_cast<uint8_t>(port), &pattr) != 0) {
    int err = errno;
    a->closeDevice(ctx);
    fail("ibv_query_port " + device + ":" + std::to_string(port), err);
  }
  return std::make_unique<VDevice>(*a, ctx, describePort(*a, ctx, device, port, pattr));
}

#endif  // FASTCOMM_HAVE_VERBS_H

}  // namespace verbs
}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
