// The ib transport: RDMA over RC queue pairs (InfiniBand or RoCE), after
// NCCL's net_ib. docs/ib.md describes the data path; in short:
// - Setup through the c10d store: per pair and direction one key
//   ib/<rank>/<peer> with the QPNs and PSNs of FASTCOMM_IB_QPS_PER_PEER RC
//   QPs, the port's LID/GID, MTU, and the address and rkey of this rank's
//   control block for that peer; then RTR/RTS and a "ready" key, so no
//   write reaches a QP that is not ready to receive it.
// - Receiver-driven: every irecv is cut into pieces, and for each piece the
//   receiver RDMA-writes a slot {addr, rkey, length, message, offset, size}
//   into the sender's FIFO (a bounded ring of kFifoDepth slots in the
//   sender's control block), with an immediate that wakes the sender. A
//   slot is reused only once the data for its previous piece arrived, so the
//   FIFO is the credit: the sender never writes anything the receiver did
//   not hand out.
// - The sender writes each piece with RDMA_WRITE_WITH_IMM straight into the
//   advertised memory, striped over the QPs; the immediate names the slot
//   and the stripe count, and the receiver's receive completions count the
//   stripes.
// - Memory: buffers registered through registerMemory() (a registration
//   cache with reference counts) move zero-copy; others go through
//   registered staging slots (a bounded pool per connection and direction,
//   copied in and out by the progress thread), since a cache of
//   registrations of arbitrary, unannounced memory could silently target
//   freed and remapped pages.
// - One progress thread polls the completion queue (sleeping on its
//   completion channel); completion errors, async QP events, a peer that no
//   longer acknowledges (keepalive writes while requests wait) become a
//   TransportError naming the peer and fail that connection only.
#pragma once

#include <memory>
#include <string>

#include "common/config.hpp"
#include "inter/transport.hpp"

namespace fastcomm {
namespace transport {
namespace ib {

std::unique_ptr<Transport> createIbTransport(const Config& cfg);

// See transportUsable(): whether an RDMA device (or the emulation) is usable.
bool ibUsable(const Config& cfg, std::string* why);

}  // namespace ib
}  // namespace transport
}  // namespace fastcomm
