// The ib transport's engine: the connections (Peer) and their requests (Op),
// and one progress thread that drives them all. Its parts: connect.cpp (the
// device, queue pairs and the handshake through the store), p2p.cpp (posting
// requests, advertising receive slots, serving them with RDMA writes),
// progress.cpp (completions, async events, keepalive, the progress thread,
// close), registration.cpp (registered memory).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>
#include <unistd.h>

#include "common/config.hpp"
#include "inter/ib/device.hpp"
#include "inter/ib/ib_memory.hpp"
#include "inter/ib/wire.hpp"
#include "inter/notifier.hpp"
#include "inter/request.hpp"
#include "inter/transport.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

struct Op {
  Op(bool send, char* data, int64_t bytes, uint64_t seq, bool zc, uint32_t lkey, uint32_t rkey)
      : isSend(send), data(data), bytes(bytes), seq(seq), zeroCopy(zc), lkey(lkey), rkey(rkey) {}

  const bool isSend;
  char* const data;
  const int64_t bytes;
  const uint64_t seq;
  const bool zeroCopy;  // registered: pieces go straight to/from `data`
  const uint32_t lkey, rkey;
  std::atomic<OpStatus> status{OpStatus::Pending};
  std::string error;  // written before status becomes Failed, never after

  // Under the engine's mutex.
  int64_t progressed = 0;  // receive: bytes advertised; send: bytes served
  bool allPosted = false;  // receive: no more slots to hand out; send: fully served
  int outstanding = 0;     // receive: slots in flight; send: pieces in flight
};

using IbRequest = OpRequest<Op>;

struct RecvSlot {
  bool used = false;
  std::shared_ptr<Op> op;
  int64_t off = 0, len = 0;
  int staging = -1;
  int stripesGot = 0;
  int64_t bytesGot = 0;
};

struct SendPiece {
  std::shared_ptr<Op> op;
  int staging = -1;
  int stripesLeft = 0;
};

// One connection's state; guarded by the engine's mutex.
struct Peer {
  int rank = -1;
  std::string where;  // device, port, QPNs: for error messages
  std::vector<std::unique_ptr<Qp>> qps;
  std::vector<int> sqUsed;  // send work requests outstanding per QP
  uint32_t psn = 0;
  AlignedBuffer ctrlMem;
  CtrlBlock* ctrl = nullptr;
  std::unique_ptr<Mr> ctrlMr;
  uint64_t remoteCtrl = 0;
  uint32_t remoteCtrlRkey = 0;

  // Receiving.
  std::list<std::shared_ptr<Op>> recvs;  // posted, not finished, in order
  uint64_t recvSeq = 0;
  uint64_t fifoNext = 0;  // next slot index this rank hands out
  RecvSlot rslots[kFifoDepth];
  Staging recvStaging;

  // Sending.
  std::deque<std::shared_ptr<Op>> sends;  // posted, not fully served, in order
  int sendOpsLive = 0;                    // posted and not finished
  uint64_t sendSeq = 0;
  uint64_t nextServe = 0;     // first message not fully served
  uint64_t fifoConsumed = 0;  // next slot index of the peer to use
  bool fifoArrived[kFifoDepth] = {};
  std::unordered_map<uint64_t, SendPiece> pieces;
  Staging sendStaging;

  // Health.
  bool failed = false;
  std::string error;
  Clock::time_point lastHeard{};
  bool keepaliveOut = false;

  std::string describe() const {
    return "ib connection to rank " + std::to_string(rank) + " (" + where + ")";
  }
  bool busy() const { return !recvs.empty() || sendOpsLive > 0; }
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  explicit Engine(const Config& cfg);
  ~Engine() { close(); }

  std::vector<std::shared_ptr<Peer>> connect(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                             int size, const std::vector<int>& peers,
                                             const OpContext& ctx);
  std::unique_ptr<Request> post(Peer& p, bool send, char* data, int64_t bytes,
                                const MemoryRegion* mr);
  std::unique_ptr<MemoryRegion> registerMemory(void* data, int64_t bytes);
  std::unique_ptr<MemoryRegion> registerDeviceMemory(void* data, int64_t bytes);
  void waitForProgress(std::chrono::microseconds max) { notifier_->wait(max, spinMicros_); }
  void close();
  bool deviceMemory() const { return deviceMemory_; }
  std::map<std::string, int64_t> counters();

 private:
  void run();
  void handle(const Completion* wcs, int n);
  void handleAsync();
  void timers();
  void pump(Peer& p);
  void advertise(Peer& p);
  void serve(Peer& p);
  void onData(Peer& p, int slot, int stripes, uint32_t bytes);
  void onMismatch(Peer& p, int slot);
  void finishRecvIfDone(Peer& p, const std::shared_ptr<Op>& op);
  void finishSendIfDone(Peer& p, const std::shared_ptr<Op>& op);
  void finish(const std::shared_ptr<Op>& op, OpStatus st, const std::string& err);
  void failPeer(Peer& p, const std::string& why);
  bool postWrite(Peer& p, int q, const SendWr& wr);
  bool sqRoom(const Peer& p, int q, int n) const { return p.sqUsed[q] + n <= kMaxSendWr; }
  [[noreturn]] void protocolError(Peer& p, const std::string& what);

  const int qps_;
  int64_t spinMicros_ = 0;
  RcAttrs rc_;
  std::string gidWhy_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<Cq> cq_;
  std::shared_ptr<RegCache> regCache_;
  bool deviceMemory_ = false;
  std::string gdrHow_;  // the GPUDirect RDMA route, or why there is none
  std::shared_ptr<Notifier> notifier_;

  std::mutex mu_;
  std::vector<std::shared_ptr<Peer>> peers_;
  std::unordered_map<uint32_t, std::pair<Peer*, int>> byQpn_;
  uint64_t nextPiece_ = 1;
  int64_t zeroCopyBytes_ = 0, stagedBytes_ = 0, keepalives_ = 0;

  std::thread thread_;
  std::atomic<bool> stop_{false};
  int wakeFd_ = -1;
  std::mutex closeMu_;
  bool closed_ = false, connected_ = false;
};

// Thrown inside the engine for a peer that broke the protocol; failPeer()
// has already run.
struct PeerFailed {};

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
