// Index arithmetic of the pipelined rail exchange of the CUDA multi-node
// all-reduce (plans/cuda/cuda_hier.*), kept apart so that it compiles on the
// host and in kernels alike and can be unit-tested without a GPU
// (torchext._C._hier_layout, tests/test_hier_layout.py).
//
// After the intra-node reduce-scatter each rank owns a shard of `shard`
// elements (the same count on every rank). The shard is cut into chunks of
// `chunkElems`; chunk k is cut into `rails` pieces of q(k) elements (the last
// ones shorter or empty), and piece p of every chunk belongs to the rail
// member on node p. So every rail member owns a piece of every chunk and all
// of them reduce at once while the next chunk is on the wire.
//
// Pieces start on multiples of `align` elements (64 bytes) of the shard, and
// a full chunk's pieces all have qMax elements; staging slots hold qMax
// elements per peer (on a block-scaled wire: their codes and scales).
#pragma once

#include <algorithm>
#include <cstdint>

#include "wire_format.hpp"

namespace fastcomm {

struct HierLayout {
  int64_t shard = 0;       // elements of this rank's shard
  int rails = 1;           // R: rail members (nodes)
  int64_t align = 1;       // piece alignment in elements
  int64_t qMax = 1;        // piece elements of a full chunk
  int64_t chunkElems = 1;  // rails * qMax
  int64_t chunks = 0;

  static FASTCOMM_HD int64_t roundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

  // `chunkBytes` is the target size of one chunk of the shard; `esize` the
  // element size in bytes.
  static HierLayout make(int64_t shardElems, int rails, int64_t chunkBytes, int64_t esize) {
    HierLayout l;
    l.shard = shardElems;
    l.rails = rails;
    l.align = std::max<int64_t>(1, 64 / esize);
    const int64_t target = std::max<int64_t>(1, chunkBytes / esize);
    l.qMax = roundUp((target + rails - 1) / rails, l.align);
    l.chunkElems = l.qMax * rails;
    l.chunks = (shardElems + l.chunkElems - 1) / l.chunkElems;
    return l;
  }

  // Bytes one piece slot needs for elements of `esize` bytes: the most over
  // every element size, so one staging allocation serves every dtype. 1- and
  // 2-byte elements may be a block-scaled wire's codes, whose scales come too.
  static int64_t pieceSlotBytes(int rails, int64_t chunkBytes) {
    int64_t most = 0;
    for (int64_t esize : {1, 2, 4, 8}) {
      const int64_t q = make(0, rails, chunkBytes, esize).qMax;
      most = std::max(most, esize <= 2 ? scaledWireBytes(q, esize) : q * esize);
    }
    return most;
  }

  // n contiguous elements as piece 0 of chunk 0, for the steps' kernels with
  // me = 1 (they move the pieces of the nodes other than `me`): how the
  // two-member exchange stages and decodes a whole chunk.
  static HierLayout wholeRange(int64_t n) {
    HierLayout l;
    l.shard = 2 * n;
    l.rails = 2;
    l.align = 1;
    l.qMax = n;
    l.chunkElems = 2 * n;
    l.chunks = 1;
    return l;
  }

  FASTCOMM_HD int64_t chunkOff(int64_t k) const { return k * chunkElems; }
  FASTCOMM_HD int64_t chunkLen(int64_t k) const {
    const int64_t left = shard - k * chunkElems;
    return left < chunkElems ? left : chunkElems;
  }
  // Piece length unit of chunk k (qMax for every full chunk).
  FASTCOMM_HD int64_t q(int64_t k) const {
    const int64_t len = chunkLen(k);
    return len == chunkElems ? qMax : roundUp((len + rails - 1) / rails, align);
  }
  // Offset of piece p within chunk k, and its length (0: empty).
  FASTCOMM_HD int64_t pieceOff(int64_t k, int p) const { return p * q(k); }
  FASTCOMM_HD int64_t pieceLen(int64_t k, int p) const {
    const int64_t v = chunkLen(k) - p * q(k);
    const int64_t qk = q(k);
    return v <= 0 ? 0 : (v < qk ? v : qk);
  }
};

// Staging slots hold the pieces exchanged with the R-1 peers back to back,
// qMax elements apart, in node order without this rank's own node `me`:
// slot index j holds node peerNode(j, me).
FASTCOMM_HD inline int peerNode(int j, int me) { return j < me ? j : j + 1; }
FASTCOMM_HD inline int peerSlot(int node, int me) { return node < me ? node : node - 1; }

}  // namespace fastcomm
