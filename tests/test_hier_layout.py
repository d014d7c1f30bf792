"""Index arithmetic of the CUDA multi-node all_reduce (kernels/staged_layout.hpp), checked on
the CPU: chunks tile the shard, pieces tile each chunk, every rail member owns one piece per
chunk, and pieces are aligned and fit the staging slots (block-scaled wire codes with their
scales too). The kernels and the proxy use these functions as they are, so a mistake here
would corrupt or hang the GPU path."""

from __future__ import annotations

import random

import pytest

from _harness import is_gloo

pytestmark = pytest.mark.skipif(is_gloo(), reason="fastcomm's own layout code")


def _layout(shard: int, rails: int, chunk_bytes: int, esize: int) -> dict:
    from torchext import _testing as _C

    return _C._hier_layout(shard, rails, chunk_bytes, esize)


def _check(shard: int, rails: int, chunk_bytes: int, esize: int) -> None:
    d = _layout(shard, rails, chunk_bytes, esize)
    where = f"shard={shard} rails={rails} chunk_bytes={chunk_bytes} esize={esize}"
    align = max(1, 64 // esize)
    assert d["align"] == align, where
    q_max = d["q_max"]
    assert q_max % align == 0 and q_max >= 1, where
    assert d["chunk_elems"] == rails * q_max, where
    # a chunk is about the asked size: never more than one alignment unit per piece above it
    assert d["chunk_elems"] * esize <= max(chunk_bytes, esize) + rails * align * esize, where
    # the staging slot of a piece holds a full piece of any element size, and of 1- or 2-byte
    # codes of a block-scaled wire their float32 scales too (one per 256 values)
    assert q_max * esize <= d["piece_slot_bytes"], where
    if esize <= 2:
        assert -(-q_max // 256) * 4 + q_max * esize <= d["piece_slot_bytes"], where

    covered = 0
    for k, c in enumerate(d["chunks"]):
        assert c["off"] == k * d["chunk_elems"] == covered, (where, k)
        assert 0 < c["len"] <= d["chunk_elems"], (where, k)
        q = c["q"]
        assert q % align == 0 and q <= q_max, (where, k)
        assert q * rails >= c["len"], (where, k)
        if c["len"] == d["chunk_elems"]:
            assert q == q_max, (where, k)
        pos = 0
        for p, (off, length) in enumerate(c["pieces"]):
            assert off == p * q, (where, k, p)
            assert 0 <= length <= q, (where, k, p)
            if length:
                assert off == pos, (where, k, p)  # contiguous tiling in node order
                # aligned within the shard (the shard itself is 64-byte aligned or not: the
                # kernels do not rely on it; the piece offsets are)
                assert (c["off"] + off) % align == 0, (where, k, p)
                pos = off + length
        assert pos == c["len"], (where, k)
        covered += c["len"]
    assert covered == shard, where


@pytest.mark.parametrize("esize", [1, 2, 4, 8])
def test_layout_edge_cases(esize: int) -> None:
    for rails in (2, 3, 4):
        for shard in (1, 2, rails - 1, rails, 63, 64, 65, 4095, 4097):
            _check(shard, rails, 4096, esize)


def test_layout_random() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        esize = rng.choice([1, 2, 4, 8])
        rails = rng.randint(2, 6)
        chunk_bytes = rng.choice([4096, 8192, 12288, 65536])
        shard = rng.randint(1, 40 * chunk_bytes // esize)
        _check(shard, rails, chunk_bytes, esize)


def test_layout_full_chunks_have_equal_pieces() -> None:
    """A shard of whole chunks: every piece of every chunk has exactly q_max elements."""
    d = _layout(3 * 2 * 2048, 2, 8192, 4)
    assert d["q_max"] == 1024 and len(d["chunks"]) == 6
    for c in d["chunks"]:
        assert [length for _, length in c["pieces"]] == [1024, 1024]
