#include "backend/host_path.hpp"

#include <ATen/ATen.h>

#include <cstring>
#include <future>
#include <numeric>

#include "intra/shm/shm_comm.hpp"
#include "plans/hier_comm.hpp"

namespace fastcomm {

namespace {

// Runs one host job for `work`: `run` (after the group's usability check)
// completes it, an exception fails it and marks the group broken. The flight
// recorder's entry `trace` (0: none) follows; the group's first failure is
// dumped before the caller can see it.
template <typename Run>
void completeOrFail(GroupState& g, HostWork& work, uint64_t trace, Run&& run) {
  try {
    g.checkUsable();
    if (trace) g.trace->started(trace);
    run();
    if (trace) g.trace->completed(trace);
    work.complete();
  } catch (...) {
    auto error = std::current_exception();
    if (trace) g.trace->retire(trace);
    if (g.markBroken(error) && g.trace) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        g.trace->groupFailed(errorText(e));
      } catch (...) {
        g.trace->groupFailed("unknown error");
      }
    }
    work.fail(error);
  }
}

// The flight recorder's entry of a call, 0 when the group records none.
uint64_t traceCall(GroupState& g, const TraceOp& op, const std::vector<at::Tensor>& inputs,
                   const std::vector<at::Tensor>& outputs) {
  return g.trace ? g.trace->record(op, inputs, outputs, g.timeout) : 0;
}

// `body()`, its time added to the stats of collective `name`.
template <typename Body>
void timed(GroupState& g, const char* name, Body&& body) {
  const auto t0 = Clock::now();
  body();
  g.stats.addTime(name, std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
}

using Tensors = std::vector<at::Tensor>;
using Staged = HostPath::Staged;

// A contiguous tensor to run on: `t` itself, or a copy written back by
// `finish()` after the collective.
struct Contig {
  at::Tensor orig, work;
  explicit Contig(const at::Tensor& t) : orig(t), work(t.is_contiguous() ? t : t.contiguous()) {}
  void finish() const {
    if (!work.is_same(orig)) orig.copy_(work);
  }
};

// The tensors back to back in one new contiguous 1-D tensor.
at::Tensor catFlat(const Tensors& tensors) {
  Tensors flats;
  for (const auto& t : tensors) flats.push_back(t.reshape({-1}));
  return at::cat(flats);
}

// The host mirror of `t` when the call is staged through host memory.
at::Tensor onHost(const Staged& staged, const at::Tensor& t) {
  return staged ? staged->host(t) : t;
}

Tensors onHost(const Staged& staged, const Tensors& tensors) {
  Tensors out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(onHost(staged, t));
  return out;
}

OpSignature signature(const char* name, const at::Tensor& t, int root = -1, int redop = -1,
                      int64_t aux = 0) {
  OpSignature s;
  std::strncpy(s.name, name, sizeof(s.name) - 1);
  s.dtype = t.defined() ? static_cast<int32_t>(t.scalar_type()) : -1;
  s.numel = t.defined() ? t.numel() : 0;
  s.root = root;
  s.redop = redop;
  s.aux = aux;
  return s;
}

// Byte sizes and offsets of consecutive blocks of `counts` elements.
void blocks(const std::vector<int64_t>& counts, int64_t elementSize, std::vector<int64_t>& bytes,
            std::vector<int64_t>& offsets) {
  bytes.resize(counts.size());
  offsets.resize(counts.size());
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    bytes[i] = counts[i] * elementSize;
    offsets[i] = off;
    off += bytes[i];
  }
}

}  // namespace

HostPath::HostPath(GroupState& group) : g_(group), lane_(std::make_unique<SerialLane>("fc-host")) {}

HostPath::~HostPath() { shutdown(); }

std::string HostPath::describe() const {
  return g_.topo.numNodes() > 1 ? "hierarchical (shared memory + transport)" : "shared memory";
}

void HostPath::shutdown() {
  {
    std::lock_guard<std::mutex> lock(lanesMu_);
    p2pLanes_.clear();
  }
  lane_.reset();
  comm_.reset();
}

HostComm& HostPath::comm(const OpContext& ctx) {
  if (!comm_) {
    if (g_.topo.numNodes() > 1) {
      comm_ = std::make_unique<HierComm>(g_.store, g_.topo, g_.cfg, ctx);
    } else {
      std::vector<int> members = g_.topo.nodeRanks[g_.topo.myNode];
      comm_ = std::make_unique<ShmComm>(g_.store, "fastcomm/shm", members, g_.topo.localRank,
                                        g_.cfg, ctx);
    }
  }
  return *comm_;
}

SerialLane& HostPath::p2pLane(int peer, bool sending) {
  std::lock_guard<std::mutex> lock(lanesMu_);
  auto& lane = p2pLanes_[{peer, sending}];
  if (!lane)
    lane = std::make_unique<SerialLane>((sending ? "fc-send" : "fc-recv") + std::to_string(peer));
  return *lane;
}

DevicePath::WorkPtr HostPath::run(const OpCall& call, const Tensors& inputs, Tensors outputs,
                                  const OpSignature& sig, Body body, const Staged& staged) {
  g_.checkUsable();
  if (staged) {
    body = [staged, body = std::move(body)](HostComm& comm, const OpContext& ctx) {
      staged->waitForInputs(ctx);
      body(comm, ctx);
      staged->copyOutputsBack(ctx);
    };
  }
  const uint64_t seq = ++g_.seq;
  const auto ctx = OpContext::start(call.name, seq, g_.timeout);
  const uint64_t trace =
      traceCall(g_, TraceOp{call.name, false, seq, sig.redop, sig.root}, inputs, outputs);
  auto work = c10::make_intrusive<HostWork>(g_.rank, call.type, call.title, seq, inputs,
                                            std::move(outputs));
  g_.stats.addCall(call.name, static_cast<uint64_t>(call.bytes));
  lane_->submit([this, work, ctx, sig, trace, body = std::move(body)] {
    completeOrFail(g_, *work, trace, [&] {
      HostComm& c = comm(ctx);
      if (g_.cfg.check) c.checkSignatures(sig, ctx);
      timed(g_, ctx.name, [&] { body(c, ctx); });
    });
  });
  return g_.block.remember(work);
}

DevicePath::WorkPtr HostPath::runP2P(const OpCall& call, SerialLane& lane, const at::Tensor& tensor,
                                     int peer, P2PBody body, const Staged& staged) {
  g_.checkUsable();
  if (staged) {
    body = [staged, body = std::move(body)](HostComm* comm, const OpContext& ctx, HostWork& work) {
      staged->waitForInputs(ctx);
      body(comm, ctx, work);
      staged->copyOutputsBack(ctx);
    };
  }
  const auto ctx = OpContext::start(call.name, ++g_.p2pSeq, g_.timeout);
  const bool sending = call.type == c10d::OpType::SEND;
  const uint64_t trace =
      traceCall(g_, TraceOp{call.name, true, ctx.seq, -1, -1, peer},
                sending ? Tensors{tensor} : Tensors{}, sending ? Tensors{} : Tensors{tensor});
  auto work = c10::make_intrusive<HostWork>(g_.rank, call.type, call.title, ctx.seq,
                                            Tensors{tensor}, Tensors{tensor});
  g_.stats.addCall(call.name, static_cast<uint64_t>(call.bytes));
  // The host communicator (shm segment, transports) is created by the host
  // lane (a collective step); wait for it there so point-to-point lanes never
  // race its creation. A message to the rank itself needs none: it must not
  // wait for ranks that take no part in it.
  const bool toSelf = peer == g_.rank;
  if (!toSelf && !comm_) {
    std::lock_guard<std::mutex> lock(commInitMu_);
    if (!comm_) {
      auto ready = std::make_shared<std::promise<void>>();
      auto done = ready->get_future();
      lane_->submit([this, ctx, ready] {
        try {
          comm(ctx);
          ready->set_value();
        } catch (...) {
          ready->set_exception(std::current_exception());
        }
      });
      done.get();
    }
  }
  auto job = [this, work, ctx, trace, toSelf, body = std::move(body)] {
    completeOrFail(g_, *work, trace, [&] {
      timed(g_, ctx.name, [&] { body(toSelf ? nullptr : comm_.get(), ctx, *work); });
    });
  };
  g_.block.issueOrDefer(work, [lane = &lane, job = std::move(job)] { lane->submit(job); });
  return work;
}

// ---- collectives ---------------------------------------------------------------

DevicePath::WorkPtr HostPath::broadcast(const OpCall& call, const Tensors& tensors, int root,
                                        const Staged& staged) {
  const at::Tensor& t = tensors[0];
  Contig c(onHost(staged, t));
  return run(
      call, tensors, tensors, signature(call.name, t, root),
      [c, root](HostComm& comm, const OpContext& ctx) {
        comm.broadcast(c.work.data_ptr(), nbytes(c.work), root, ctx);
        c.finish();
      },
      staged);
}

DevicePath::WorkPtr HostPath::allreduce(const OpCall& call, const Tensors& tensors, RedOp op) {
  if (tensors.size() == 1) {
    Contig c(asReal(tensors[0]));
    return run(
        call, tensors, tensors, signature(call.name, c.orig, -1, static_cast<int>(op)),
        [c, op](HostComm& comm, const OpContext& ctx) {
          comm.allreduce(c.work.data_ptr(), c.work.numel(), c.work.scalar_type(), op, ctx);
          c.finish();
        },
        nullptr);
  }
  // One flat buffer: one pipelined all-reduce instead of one per tensor.
  Tensors reals;
  for (const auto& t : tensors) reals.push_back(asReal(t));
  at::Tensor flat = catFlat(reals);
  return run(
      call, tensors, tensors, signature(call.name, flat, -1, static_cast<int>(op)),
      [flat, reals, op](HostComm& comm, const OpContext& ctx) {
        comm.allreduce(flat.data_ptr(), flat.numel(), flat.scalar_type(), op, ctx);
        int64_t off = 0;
        for (const auto& r : reals) {
          r.copy_(flat.narrow(0, off, r.numel()).view(r.sizes()));
          off += r.numel();
        }
      },
      nullptr);
}

DevicePath::WorkPtr HostPath::reduce(const OpCall& call, const Tensors& tensors, RedOp op, int root,
                                     const Staged& staged) {
  const at::Tensor& t = tensors[0];
  Contig c(asReal(onHost(staged, t)));
  return run(
      call, tensors, tensors, signature(call.name, asReal(t), root, static_cast<int>(op)),
      [c, op, root](HostComm& comm, const OpContext& ctx) {
        comm.reduce(c.work.data_ptr(), c.work.numel(), c.work.scalar_type(), op, root, ctx);
        // Only the root's tensor is written back (NCCL leaves the others unchanged).
        if (comm.index() == root) c.finish();
      },
      staged);
}

DevicePath::WorkPtr HostPath::allgather(const OpCall& call, const Tensors& outputs,
                                        const at::Tensor& input, const Staged& staged) {
  at::Tensor src = onHost(staged, input).contiguous();
  if (outputs.size() == 1) {  // one flat output
    Contig c(onHost(staged, outputs[0]));
    return run(
        call, {input}, outputs, signature(call.name, input),
        [src, c](HostComm& comm, const OpContext& ctx) {
          comm.allgather(src.data_ptr(), c.work.data_ptr(), nbytes(src), ctx);
          c.finish();
        },
        staged);
  }
  at::Tensor flat = at::empty({g_.size, input.numel()}, src.options());
  return run(
      call, {input}, outputs, signature(call.name, input),
      [src, flat, outs = onHost(staged, outputs)](HostComm& comm, const OpContext& ctx) {
        comm.allgather(src.data_ptr(), flat.data_ptr(), nbytes(src), ctx);
        for (size_t i = 0; i < outs.size(); ++i)
          outs[i].copy_(flat[static_cast<int64_t>(i)].view(outs[i].sizes()));
      },
      staged);
}

DevicePath::WorkPtr HostPath::allgatherCoalesced(const OpCall& call, const Tensors& outputs,
                                                 const Tensors& inputs, const Staged& staged) {
  Tensors srcs;
  std::vector<Contig> dsts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    srcs.push_back(onHost(staged, inputs[i]).contiguous());
    dsts.emplace_back(onHost(staged, outputs[i]));
  }
  return run(
      call, inputs, outputs,
      signature(call.name, inputs[0], -1, -1, static_cast<int64_t>(inputs.size())),
      [srcs, dsts](HostComm& comm, const OpContext& ctx) {
        for (size_t i = 0; i < srcs.size(); ++i) {
          comm.allgather(srcs[i].data_ptr(), dsts[i].work.data_ptr(), nbytes(srcs[i]), ctx);
          dsts[i].finish();
        }
      },
      staged);
}

DevicePath::WorkPtr HostPath::gather(const OpCall& call, const Tensors& outputs,
                                     const at::Tensor& input, int root, const Staged& staged) {
  at::Tensor src = onHost(staged, input).contiguous();
  at::Tensor flat =
      g_.rank == root ? at::empty({g_.size, input.numel()}, src.options()) : at::Tensor();
  return run(
      call, {input}, outputs, signature(call.name, input, root),
      [src, flat, outs = onHost(staged, outputs), root](HostComm& comm, const OpContext& ctx) {
        comm.gather(src.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, nbytes(src), root,
                    ctx);
        for (size_t i = 0; i < outs.size(); ++i)
          outs[i].copy_(flat[static_cast<int64_t>(i)].view(outs[i].sizes()));
      },
      staged);
}

DevicePath::WorkPtr HostPath::scatter(const OpCall& call, const at::Tensor& output,
                                      const Tensors& inputs, int root, const Staged& staged) {
  at::Tensor flat = g_.rank == root ? catFlat(onHost(staged, inputs)) : at::Tensor();
  Contig c(onHost(staged, output));
  return run(
      call, inputs, {output}, signature(call.name, output, root),
      [flat, c, root](HostComm& comm, const OpContext& ctx) {
        comm.scatter(flat.defined() ? flat.data_ptr() : nullptr, c.work.data_ptr(), nbytes(c.work),
                     root, ctx);
        c.finish();
      },
      staged);
}

DevicePath::WorkPtr HostPath::reduceScatter(const OpCall& call, const at::Tensor& output,
                                            const Tensors& inputs, RedOp op, const Staged& staged) {
  at::Tensor src;
  if (inputs.size() == 1) {  // one flat input
    src = asReal(onHost(staged, inputs[0])).contiguous();
  } else {
    Tensors reals;
    for (const auto& i : inputs) reals.push_back(asReal(onHost(staged, i)));
    src = catFlat(reals);
  }
  Contig c(asReal(onHost(staged, output)));
  return run(
      call, inputs, {output}, signature(call.name, asReal(output), -1, static_cast<int>(op)),
      [src, c, op](HostComm& comm, const OpContext& ctx) {
        comm.reduceScatter(src.data_ptr(), c.work.data_ptr(), c.work.numel(), c.work.scalar_type(),
                           op, ctx);
        c.finish();
      },
      staged);
}

DevicePath::WorkPtr HostPath::reduceScatterCoalesced(const OpCall& call, const Tensors& outputs,
                                                     const Tensors& inputs, RedOp op,
                                                     const Staged& staged) {
  Tensors srcs;
  std::vector<Contig> dsts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    srcs.push_back(asReal(onHost(staged, inputs[i])).contiguous());
    dsts.emplace_back(asReal(onHost(staged, outputs[i])));
  }
  return run(
      call, inputs, outputs,
      signature(call.name, inputs[0], -1, static_cast<int>(op),
                static_cast<int64_t>(inputs.size())),
      [srcs, dsts, op](HostComm& comm, const OpContext& ctx) {
        for (size_t i = 0; i < srcs.size(); ++i) {
          comm.reduceScatter(srcs[i].data_ptr(), dsts[i].work.data_ptr(), dsts[i].work.numel(),
                             dsts[i].work.scalar_type(), op, ctx);
          dsts[i].finish();
        }
      },
      staged);
}

DevicePath::WorkPtr HostPath::alltoall(const OpCall& call, const Tensors& outputs,
                                       const Tensors& inputs,
                                       const std::vector<int64_t>& sendCounts,
                                       const std::vector<int64_t>& recvCounts,
                                       const Staged& staged) {
  const int64_t es = inputs[0].element_size();
  std::vector<int64_t> sendBytes, sendOffs, recvBytes, recvOffs;
  blocks(sendCounts, es, sendBytes, sendOffs);
  blocks(recvCounts, es, recvBytes, recvOffs);
  if (inputs.size() == 1 && outputs.size() == 1) {  // one flat input and output
    at::Tensor src = onHost(staged, inputs[0]).contiguous();
    Contig c(onHost(staged, outputs[0]));
    return run(
        call, inputs, outputs, signature(call.name, inputs[0], -1, -1, outputs[0].numel()),
        [=](HostComm& comm, const OpContext& ctx) {
          comm.alltoall(src.data_ptr(), sendBytes, sendOffs, c.work.data_ptr(), recvBytes, recvOffs,
                        ctx);
          c.finish();
        },
        staged);
  }
  at::Tensor src = catFlat(onHost(staged, inputs));
  const int64_t recvTotal = std::accumulate(recvCounts.begin(), recvCounts.end(), int64_t{0});
  at::Tensor dst = at::empty({recvTotal}, src.options());
  Tensors outs = onHost(staged, outputs);
  return run(
      call, inputs, outputs, signature(call.name, src, -1, -1, recvTotal),
      [=](HostComm& comm, const OpContext& ctx) {
        comm.alltoall(src.data_ptr(), sendBytes, sendOffs, dst.data_ptr(), recvBytes, recvOffs,
                      ctx);
        for (size_t i = 0; i < outs.size(); ++i)
          outs[i].copy_(dst.narrow(0, recvOffs[i] / es, recvCounts[i]).view(outs[i].sizes()));
      },
      staged);
}

void HostPath::postToSelf(int tag, at::Tensor message) {
  {
    std::lock_guard<std::mutex> lock(selfMu_);
    toSelf_.emplace(tag, std::move(message));
  }
  selfPosted_.notify_all();
}

at::Tensor HostPath::takeFromSelf(int tag, const OpContext& ctx) {
  std::unique_lock<std::mutex> lock(selfMu_);
  auto found = [&] { return toSelf_.find(tag) != toSelf_.end(); };
  if (!selfPosted_.wait_until(lock, ctx.deadline, found)) {
    throwCommError("fastcomm: " + ctx.describe() + " failed on group rank " +
                   std::to_string(g_.rank) + ": timeout after " +
                   std::to_string(ctx.timeout.count()) +
                   " ms waiting for this rank's own send with tag " + std::to_string(tag));
  }
  auto it = toSelf_.find(tag);
  at::Tensor message = std::move(it->second);
  toSelf_.erase(it);
  return message;
}

DevicePath::WorkPtr HostPath::send(const OpCall& call, const at::Tensor& tensor, int peer, int tag,
                                   const Staged& staged) {
  at::Tensor src = onHost(staged, tensor).contiguous();
  if (peer == g_.rank) {
    // A copy, taken when the send runs: the caller may reuse its tensor once
    // the send completed, before the receive ran.
    return runP2P(
        call, p2pLane(peer, true), tensor, peer,
        [this, src, tag](HostComm*, const OpContext&, HostWork&) { postToSelf(tag, src.clone()); },
        staged);
  }
  return runP2P(
      call, p2pLane(peer, true), tensor, peer,
      [src, peer, tag](HostComm* comm, const OpContext& ctx, HostWork&) {
        comm->send(src.data_ptr(), nbytes(src), peer, tag, ctx);
      },
      staged);
}

DevicePath::WorkPtr HostPath::recv(const OpCall& call, const at::Tensor& tensor, int peer, int tag,
                                   const Staged& staged) {
  Contig c(onHost(staged, tensor));
  if (peer == g_.rank) {
    return runP2P(
        call, p2pLane(peer, false), tensor, peer,
        [this, c, tag](HostComm*, const OpContext& ctx, HostWork& work) {
          const at::Tensor message = takeFromSelf(tag, ctx);
          if (message.nbytes() != c.work.nbytes()) {
            throwCommError("fastcomm: " + ctx.describe() + ": this rank sent itself " +
                           std::to_string(message.nbytes()) + " bytes, the receive takes " +
                           std::to_string(c.work.nbytes()));
          }
          if (message.nbytes() > 0)
            std::memcpy(c.work.data_ptr(), message.data_ptr(), message.nbytes());
          c.finish();
          work.setSourceRank(g_.rank);
        },
        staged);
  }
  return runP2P(
      call, p2pLane(peer, false), tensor, peer,
      [c, peer, tag](HostComm* comm, const OpContext& ctx, HostWork& work) {
        comm->recv(c.work.data_ptr(), nbytes(c.work), peer, tag, ctx);
        c.finish();
        work.setSourceRank(peer);
      },
      staged);
}

DevicePath::WorkPtr HostPath::recvAny(const OpCall& call, const at::Tensor& tensor, int tag) {
  Contig c(tensor);
  // Own lane: it must not queue behind a blocked recv from one particular peer.
  return runP2P(
      call, p2pLane(-1, false), tensor, -1,
      [c, tag](HostComm* comm, const OpContext& ctx, HostWork& work) {
        const int src = comm->recvAny(c.work.data_ptr(), nbytes(c.work), tag, ctx);
        c.finish();
        work.setSourceRank(src);
      },
      nullptr);
}

DevicePath::WorkPtr HostPath::barrier(const OpCall& call) {
  return run(
      call, {}, {}, signature(call.name, at::Tensor()),
      [](HostComm& comm, const OpContext& ctx) { comm.barrier(ctx); }, nullptr);
}

}  // namespace fastcomm
