"""The staging kernels of the CUDA multi-node all_reduce alone
(kernels/staged_kernels.cu: packToStaging, reduceFromStaging, gatherFromStaging,
reached through the torchext._testing._staged_pack / _staged_reduce / _staged_gather).

Staging in pinned host memory and in device memory; every dtype and op, the 16-bit wire dtypes,
AVG divisors; shards that start on a 16-byte boundary (vector path) and one element off it
(scalar path); sizes from 1 element to several chunks with short and empty pieces. Expected
values are computed independently with torch on the CPU in the kernels' arithmetic (float32
accumulation for 16-bit types and the wire, 64-bit integers), so results must match bit for
bit, and bytes outside the pieces must stay untouched.

Needs one GPU:  python -m pytest -q tests/test_staged_kernels.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _harness import Checker, gen, is_gloo, run_ranks

pytestmark = [
    pytest.mark.skipif(is_gloo(), reason="fastcomm's own kernels"),
    pytest.mark.cuda(world_size=1),
]

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
WIRE = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
RAILS = 3
CHUNK = 4096
SENTINEL = 0xAB


def _pitch(rails: int, chunk: int) -> int:
    from torchext import _testing as _C

    raw = _C._hier_layout(1, rails, chunk, 4)["piece_slot_bytes"]
    return (raw + 255) // 256 * 256


def _staging(nbytes: int, where: str) -> torch.Tensor:
    if where == "host":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t.fill_(SENTINEL)
    return t


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """`x` on the GPU, starting `shift` elements after a 256-byte boundary."""
    buf = torch.empty(x.numel() + shift, dtype=x.dtype, device="cuda")
    out = buf[shift:]
    out.copy_(x)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).cpu()


def _peer_node(j: int, me: int) -> int:
    return j if j < me else j + 1


def _combine(acc: torch.Tensor, peers: list[torch.Tensor], op: str) -> torch.Tensor:
    """acc op peer, for every peer, in acc's dtype."""
    for p in peers:
        v = p.to(acc.dtype)
        if op in ("SUM", "AVG"):
            acc = acc + v
        elif op == "PRODUCT":
            acc = acc * v
        elif op == "MIN":
            acc = torch.minimum(acc, v)
        else:
            acc = torch.maximum(acc, v)
    return acc


def _reference(own: torch.Tensor, peers: list[torch.Tensor], op: str, wire: str, divisor: int):
    """(own after the reduction, what the kernel stores in the staging) on the CPU."""
    dt = own.dtype
    if dt.is_floating_point:
        acc = _combine(own.to(torch.float64 if dt == torch.float64 else torch.float32), peers, op)
        if divisor > 0:
            acc = acc / divisor
        if wire != "none":
            out = acc.to(WIRE[wire])
            return out.to(torch.float32), out
        res = acc.to(dt)
        return res, res
    acc = _combine(own.to(torch.int64), peers, op)
    if divisor > 0:
        acc = torch.div(acc, divisor, rounding_mode="trunc")
    res = acc.to(dt)
    return res, res


def kernels_fn(rank: int, ws: int) -> dict[str, Any]:
    from torchext import _testing as _C

    torch.cuda.set_device(0)
    chk = Checker("staged kernels")
    pitch = _pitch(RAILS, CHUNK)
    cases = [(d, "none") for d in DTYPES] + [("float32", "bf16"), ("float32", "fp16")]
    for where in ("host", "device"):
        for dt_name, wire in cases:
            dt = getattr(torch, dt_name)
            esize = torch.empty(0, dtype=dt).element_size()
            sdt = WIRE[wire] or dt  # what the staging holds
            ssize = torch.empty(0, dtype=sdt).element_size()
            for shift in (0, 1):
                for n in (1, 777, 5003):
                    me = n % RAILS
                    what = f"{where} staging, {dt_name}, wire {wire}, shift {shift}, n={n}"
                    layout = _C._hier_layout(n, RAILS, CHUNK, esize)
                    x = gen(f"k/{what}", 0, (n,), dt, "SUM")
                    shard = _shifted(x, shift)
                    for k, c in enumerate(layout["chunks"]):
                        # P: the peers' pieces into their slots, cast to the wire
                        slots = _staging((RAILS - 1) * pitch, where)
                        _C._staged_pack(shard, k, RAILS, me, CHUNK, wire, slots, pitch)
                        torch.cuda.synchronize()
                        got = slots.cpu()
                        expect = torch.full_like(got, SENTINEL)
                        for j in range(RAILS - 1):
                            off, ln = c["pieces"][_peer_node(j, me)]
                            piece = x[c["off"] + off : c["off"] + off + ln].to(sdt)
                            expect[j * pitch : j * pitch + ln * ssize] = _bytes(piece)
                        chk.true(torch.equal(got, expect), f"pack chunk {k}: {what}")
                        # B: slots of fresh values into place, the own piece untouched
                        src = gen(f"kb/{what}/{k}", 0, ((RAILS - 1) * pitch // ssize,), sdt, "SUM")
                        slots = _staging((RAILS - 1) * pitch, where)
                        slots.copy_(_bytes(src))
                        before = shard.cpu()
                        _C._staged_gather(slots, pitch, shard, k, RAILS, me, CHUNK, wire)
                        torch.cuda.synchronize()
                        want = before.clone()
                        for j in range(RAILS - 1):
                            off, ln = c["pieces"][_peer_node(j, me)]
                            vals = src[j * pitch // ssize : j * pitch // ssize + ln]
                            want[c["off"] + off : c["off"] + off + ln] = vals.to(dt)
                        chk.true(
                            torch.equal(_bytes(shard), _bytes(want)), f"gather chunk {k}: {what}"
                        )
                    # A: the own piece reduced with the peers' from the staging
                    for op in ("SUM", "AVG") if wire != "none" else OPS:
                        divisor = 3 if op == "AVG" else 0
                        own_x = gen(f"ka/{what}/{op}", 0, (n,), dt, op)
                        peers = [
                            gen(f"ka/{what}/{op}", 1 + j, (n,), sdt if wire != "none" else dt, op)
                            for j in range(RAILS - 1)
                        ]
                        rpitch = (n * ssize + 255) // 256 * 256 + 256
                        recv = _staging((RAILS - 1) * rpitch, where)
                        for j, p in enumerate(peers):
                            recv[j * rpitch : j * rpitch + n * ssize] = _bytes(p)
                        out = _staging(rpitch, where)
                        own = _shifted(own_x, shift)
                        _C._staged_reduce(own, recv, rpitch, RAILS - 1, op, wire, divisor, out)
                        torch.cuda.synchronize()
                        want_own, want_out = _reference(own_x, peers, op, wire, divisor)
                        chk.true(torch.equal(_bytes(own), _bytes(want_own)), f"reduce {op}: {what}")
                        got_out = out.cpu()
                        chk.true(
                            torch.equal(got_out[: n * ssize], _bytes(want_out)),
                            f"reduce {op}: staged result: {what}",
                        )
                        chk.true(
                            bool((got_out[n * ssize :] == SENTINEL).all()),
                            f"reduce {op}: wrote past the piece: {what}",
                        )
    chk.raise_if_failed()
    return {}


def test_fused_staging_kernels_bit_exact() -> None:
    """pack / reduce / gather against CPU references in the kernels' arithmetic: every dtype
    and op, AVG, both wire dtypes, host and device staging, aligned and misaligned shards, 1
    element to many chunks; nothing written outside the pieces."""
    run_ranks(1, kernels_fn, init=False, timeout_s=600)
