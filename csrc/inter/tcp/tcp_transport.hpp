// The tcp transport: plain sockets, always available.
//
// Shape (after NCCL's socket transport and Gloo's transport/tcp):
// - Each rank listens on one address (FASTCOMM_SOCKET_IFNAME or chosen
//   automatically) and publishes "host port nonce sockets" under the store key
//   tcp/<rank>. For each pair the lower rank connects and the higher accepts,
//   FASTCOMM_TCP_SOCKETS sockets per pair; a hello on each socket (rank, socket
//   index, the acceptor's nonce) lets the acceptor sort them and reject strays.
// - Every socket carries both directions as a stream of frames, each a 24-byte
//   header plus, for DATA, a payload:
//     CTS      {seq, size}    "my receive #seq of `size` bytes is posted"
//     DATA     {seq, offset}  `len` bytes of message #seq at `offset`
//     MISMATCH {seq, size}    "your receive #seq did not match my `size` bytes"
//   A sender sends message #seq only after the CTS of receive #seq, so every
//   byte on the wire has a posted buffer to land in (receiver-driven): sockets
//   are always read, and a sender whose receiver has not posted does not
//   progress. The CTS also carries the posted size, so a size mismatch fails
//   both requests (the receiver learns it from MISMATCH) and the connection
//   goes on.
// - Message #seq is cut into 512 KiB stripes, queued per connection; the
//   lowest free sockets are woken for them and every busy socket takes the
//   next when it has written its last, so lone small messages stay on socket
//   0 and large ones use every socket that carries data. Every socket does at
//   first; sockets are shed while the kernel measures their flows delivering
//   slowly, and come back when the rest deliver fast (Peer in tcp_peer.hpp).
//   Control frames go on the lowest socket with no stripe to write. Payloads
//   move straight between the socket and the user buffer (sendmsg of header
//   + buffer, recv into the buffer).
// - FASTCOMM_TCP_THREADS progress threads each own a subset of the sockets in
//   an epoll set; an eventfd wakes one when another thread queues a frame.
// - EOF, reset or any socket error fails every pending and future request of
//   that connection with an error naming the peer; the other connections go
//   on.
#pragma once

#include <memory>

#include "common/config.hpp"
#include "inter/transport.hpp"

namespace fastcomm {
namespace transport {
namespace tcp {

std::unique_ptr<Transport> createTcpTransport(const Config& cfg);

}  // namespace tcp
}  // namespace transport
}  // namespace fastcomm
