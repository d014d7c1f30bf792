// The device layer under the ib transport: the few verbs it needs, behind our
// own narrow interface, with two implementations:
//  - verbs_device.cpp: rdma-core's libibverbs, opened at run time with dlopen
//    (so fastcomm loads where rdma-core is absent) and compiled only when
//    <infiniband/verbs.h> is found at build time;
//  - emu_device.hpp: a software RC device (FASTCOMM_IB_EMULATE=1) that works
//    across the processes of one machine, so the whole ib protocol runs in CI
//    where there is no RDMA hardware.
//
// The shape follows verbs, reduced to what an RC transport with
// RDMA_WRITE_WITH_IMM needs: one opened port with its protection domain,
// memory regions, one completion queue with a pollable completion channel,
// RC queue pairs driven RESET -> INIT -> RTR -> RTS, signaled RDMA writes,
// zero-length receives (for the immediates), and affiliated async events.
// Everything is non-blocking; the transport's progress thread sleeps in
// poll() on the fds this layer exposes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

enum class LinkLayer { InfiniBand, Ethernet };
const char* linkLayerName(LinkLayer l);

enum class GidType { IB, RoCEv1, RoCEv2 };
const char* gidTypeName(GidType t);

struct Gid {
  uint8_t raw[16] = {};
  bool zero() const;
  bool linkLocal() const;   // fe80::/10
  bool ipv4Mapped() const;  // ::ffff:a.b.c.d (RoCE v2 over IPv4)
  std::string str() const;  // 32 hex digits
  static bool parse(const std::string& hex, Gid* out);
};

struct GidEntry {
  int index = 0;
  Gid gid;
  GidType type = GidType::IB;
};

// One port of one device, as the transport sees it.
struct PortInfo {
  std::string device;  // "mlx5_0", or "fcemu0" for the emulation
  int port = 1;
  LinkLayer link = LinkLayer::InfiniBand;
  bool active = false;
  uint16_t lid = 0;
  int activeMtu = 4096;  // bytes
  std::string rate;      // human readable, for the INFO log
  std::vector<GidEntry> gids;
};

// Work completion status, named as in verbs (wcStatusName gives IBV_WC_*).
enum class WcStatus : int {
  Success,
  LocLenErr,
  LocQpOpErr,
  LocProtErr,
  WrFlushErr,
  RemInvReqErr,
  RemAccessErr,
  RemOpErr,
  RetryExcErr,
  RnrRetryExcErr,
  GeneralErr,
  Other,
};
const char* wcStatusName(WcStatus s);
// What the status means to a user, e.g. "the peer closed or is unreachable".
const char* wcStatusMeaning(WcStatus s);

enum class WcOpcode { RdmaWrite, RecvRdmaWithImm, Other };

struct Completion {
  uint64_t wrId = 0;
  WcStatus status = WcStatus::Success;
  WcOpcode opcode = WcOpcode::Other;
  uint32_t byteLen = 0;  // receives: bytes the RDMA write carried
  uint32_t imm = 0;      // host byte order
  uint32_t qpn = 0;
  uint32_t vendorErr = 0;
};

// A signaled RDMA_WRITE (withImm: RDMA_WRITE_WITH_IMM) of one local range.
struct SendWr {
  uint64_t wrId = 0;
  bool withImm = false;
  uint32_t imm = 0;  // host byte order
  const void* local = nullptr;
  uint32_t length = 0;
  uint32_t lkey = 0;
  uint64_t remoteAddr = 0;
  uint32_t rkey = 0;
};

// What a peer needs to bring its QP to RTR against ours.
struct QpEndpoint {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  Gid gid;
  int mtu = 4096;
  LinkLayer link = LinkLayer::InfiniBand;
};

// RC timers and retries (verbs units: timeout 4.096 us * 2^timeout per try).
struct RcAttrs {
  int gidIndex = 0;
  bool useGrh = true;    // route by GID (RoCE always; IB only across subnets)
  uint8_t timeout = 16;  // ~268 ms per try
  uint8_t retryCnt = 7;  // tries after the first: ~2.1 s until IBV_WC_RETRY_EXC_ERR
  uint8_t rnrRetry = 7;  // 7 = retry forever while the receiver has no receive posted
  uint8_t minRnrTimer = 12;
  uint8_t serviceLevel = 0;
  uint8_t trafficClass = 0;
};

enum class AsyncKind {
  QpFatal,      // IBV_EVENT_QP_FATAL
  QpReqErr,     // IBV_EVENT_QP_REQ_ERR
  QpAccessErr,  // IBV_EVENT_QP_ACCESS_ERR
  CqErr,        // IBV_EVENT_CQ_ERR
  PortErr,      // IBV_EVENT_PORT_ERR
  DeviceFatal,  // IBV_EVENT_DEVICE_FATAL
  Harmless,     // COMM_EST, PORT_ACTIVE, LID_CHANGE, SQ_DRAINED, ...
};

struct AsyncEvent {
  AsyncKind kind = AsyncKind::Harmless;
  std::string name;  // IBV_EVENT_*
  uint32_t qpn = 0;  // for QP-affiliated events
};

// What a memory region is: host memory, or CUDA device memory (GPUDirect
// RDMA: the HCA reads and writes GPU memory directly).
enum class MemKind { Host, Device };

class Mr {
 public:
  virtual ~Mr() = default;  // deregisters
  void* addr = nullptr;
  size_t length = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

class Cq {
 public:
  virtual ~Cq() = default;
  // Up to `max` completions; never blocks.
  virtual int poll(Completion* out, int max) = 0;
  // Requests an event on the channel for the next completion (req_notify_cq).
  virtual void arm() = 0;
  // Readable once an armed CQ got a completion (the completion channel's fd).
  virtual int fd() const = 0;
  // Takes (and acknowledges) pending channel events; never blocks.
  virtual void drainEvents() = 0;
};

class Qp {
 public:
  virtual ~Qp() = default;
  virtual uint32_t qpn() const = 0;
  virtual void toInit() = 0;
  virtual void toRtr(const QpEndpoint& remote, const RcAttrs& attrs) = 0;
  virtual void toRts(uint32_t psn, const RcAttrs& attrs) = 0;
  // Moves the QP to the error state: outstanding work completes flushed and
  // no more data lands in local memory once this returns.
  virtual void toError() = 0;
  // 0, or an errno (ENOMEM: the send queue is full).
  virtual int postSend(const SendWr* wrs, int n) = 0;
  // Zero-length receives, consumed by incoming RDMA_WRITE_WITH_IMM.
  virtual int postRecv(const uint64_t* wrIds, int n) = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const PortInfo& port() const = 0;
  virtual bool emulated() const = 0;
  // Local write + remote write access. Device memory: verbs through dma-buf
  // (ibv_reg_dmabuf_mr) where the kernel, libibverbs and the CUDA driver
  // support it, else plain ibv_reg_mr (nvidia-peermem); the emulation copies
  // it with cudaMemcpy. Throws std::runtime_error saying why on failure.
  virtual std::unique_ptr<Mr> regMr(void* addr, size_t length, MemKind kind) = 0;
  // Whether regMr registers device memory through dma-buf (false: through
  // ibv_reg_mr, which needs nvidia-peermem; or the emulation).
  virtual bool dmaBufRegistration() const { return false; }
  virtual std::unique_ptr<Cq> createCq(int depth) = 0;
  virtual std::unique_ptr<Qp> createQp(Cq& cq, int maxSendWr, int maxRecvWr) = 0;
  // Readable when an async event is pending; nextAsyncEvent takes one.
  virtual int asyncFd() const = 0;
  virtual bool nextAsyncEvent(AsyncEvent* out) = 0;
};

// ----------------------------------------------------------------------------- discovery

// Whether this rank can run the ib transport, and on which device, under
// FASTCOMM_IB_EMULATE / FASTCOMM_IB_HCA. `reason` says why not (or, when
// usable, which device and port).
struct Probe {
  bool usable = false;
  bool emulated = false;
  std::string device;
  int port = 0;
  std::string reason;
};
Probe probe(const Config& cfg);

// Opens the device probe() chose; throws std::runtime_error saying why not.
std::unique_ptr<Device> openDevice(const Config& cfg);

// FASTCOMM_IB_HCA: "mlx5_0:1,mlx5_1" (device[:port], prefix match), "=mlx5_0"
// (exact names), "^mlx5_1" (every device but these). Empty matches all.
bool hcaMatches(const std::string& filter, const std::string& device, int port);

// FASTCOMM_IB_GID_INDEX (>= 0) or, with -1, the automatic choice: RoCE v2
// with an IPv4-mapped address, then any other RoCE v2 GID that is not
// link-local, then RoCE v2 link-local, then RoCE v1; IB ports use index 0.
// Returns -1 when the port has no usable GID (IB: then the LID is used).
int chooseGid(const PortInfo& port, int configured, std::string* why);

// GPUDirect RDMA: whether registered memory may be GPU memory here.
enum class GdrRoute { None, DmaBuf, PeerMem, Emulated };
struct GdrSupport {
  bool available = false;
  GdrRoute route = GdrRoute::None;
  std::string how;  // "dma-buf ...", "nvidia-peermem ...", "emulated ...", or why not
};
GdrSupport detectGdr(const Config& cfg, const Device& dev);

// The two implementations (verbs_device.cpp, emu_device.hpp).
namespace verbs {
// False with the reason when libibverbs cannot be used on this machine.
bool load(std::string* why);
std::vector<PortInfo> listPorts(std::string* why);
std::unique_ptr<Device> open(const std::string& device, int port);
}  // namespace verbs

namespace emu {
PortInfo portInfo();
std::unique_ptr<Device> open(const Config& cfg);
}  // namespace emu

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
