"""The staging kernels of the CUDA multi-node all_reduce alone
(kernels/staged_kernels.cu: packToStaging, reduceFromStaging, gatherFromStaging,
reached through the torchext._testing._staged_pack / _staged_reduce / _staged_gather).

Staging in pinned host memory and in device memory; every dtype and op, the wire dtypes,
AVG divisors; shards that start on a 16-byte boundary (vector path) and one element off it
(scalar path); sizes from 1 element to several chunks with short and empty pieces. Expected
values are computed independently on the CPU in the kernels' arithmetic (float32
accumulation for 16-bit types and the wires, 64-bit integers; the block-scaled fp16 and int8
wires coded by the host's codec, plans/wire_codec.*, through _wire_encode / _wire_decode), so
results must match bit for bit, and bytes outside the pieces must stay untouched.

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
WIRE = {"none": None, "bf16": torch.bfloat16}
SCALED = ["fp16", "int8"]  # block-scaled: a piece is its blocks' float32 scales, then its codes
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
    cases = [(d, "none") for d in DTYPES] + [("float32", "bf16")]
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
    and op, AVG, the bf16 wire, host and device staging, aligned and misaligned shards, 1
    element to many chunks; nothing written outside the pieces."""
    run_ranks(1, kernels_fn, init=False, timeout_s=600)


# ----------------------------------------------------------------------------- block-scaled wires


def _outliers(n: int, seed: int) -> torch.Tensor:
    """float32 values whose blocks of 256 are of every kind a block-scaled wire must code: zeros,
    subnormals, values near float32's largest, a largest magnitude exactly a code's largest
    value times a power of two (fp16 65504, int8 127: the scale's boundary), one inf, one NaN,
    and Gaussian values of 1e-20 to 1e20 with outliers 1e3 times larger. Block b is of kind
    (b + seed) % 8 (the code's largest value by (b + seed) % 16), so short inputs take every
    kind over sixteen seeds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    for b in range(-(-n // 256)):
        blk = x[b * 256 : (b + 1) * 256]
        kind = (b + seed) % 8
        if kind == 0:
            blk.zero_()
        elif kind == 1:
            blk.mul_(1e-41)
        elif kind == 2:
            blk.mul_(1e37)[0] = 3.4e38
        elif kind == 3:
            e = int(torch.randint(-140, 100, (1,), generator=g))
            blk.mul_(2.0**e)[len(blk) // 2] = (65504.0 if (b + seed) % 16 < 8 else 127.0) * 2.0**e
        elif kind == 4:
            blk[len(blk) // 3] = float("inf")
        elif kind == 5:
            blk[-1] = float("nan")
        else:
            blk.mul_(10.0 ** int(torch.randint(-20, 21, (1,), generator=g)))
            blk[::97] *= 1e3
    return x.float()


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal float32, but any NaN equals any NaN (the GPU's arithmetic NaN is 0x7fffffff,
    the CPU's 0x7fc00000)."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | nan).all())


def codec_fn(rank: int, ws: int) -> dict[str, Any]:
    from torchext import _testing as _C

    torch.cuda.set_device(0)
    chk = Checker("wire codec")
    cases = [(n, seed) for n in (1, 255, 256, 257) for seed in range(16)] + [(1000003, 0)]
    for wire in SCALED:
        for n, seed in cases:
            x = _outliers(n, seed)
            want = _C._wire_encode(x, wire)
            want_x = _C._wire_decode(want, n, wire)
            nb = want.numel()
            # the data 0, 1 or 2 elements after a 256-byte boundary (16-, 4-, 8-byte aligned);
            # the staging 0 or 4 bytes after one
            for shift in (0, 1, 2):
                for off in (0, 4):
                    what = f"{wire}, n={n}, seed {seed}, data shift {shift}, staging offset {off}"
                    # P's kernel: the codec's bytes, not one byte more
                    out = _staging(off + nb + 64, "device")
                    _C._staged_encode(_shifted(x, shift), wire, out[off:])
                    torch.cuda.synchronize()
                    got = out.cpu()
                    chk.true(torch.equal(got[off : off + nb], want), f"encode: {what}")
                    chk.true(
                        bool((got[:off] == SENTINEL).all() and (got[off + nb :] == SENTINEL).all()),
                        f"encode wrote outside the piece: {what}",
                    )
                    # B's kernel: the codec's values
                    out[off : off + nb] = want.cuda()
                    y = _shifted(torch.full((n,), 7.0), shift)
                    _C._staged_decode(out[off:], wire, y)
                    chk.true(_same_values(y, want_x), f"decode: {what}")
                    # A's kernel with no peers: coded into the staging, decoded into place
                    res = _staging(off + nb + 64, "device")
                    own = _shifted(x, shift)
                    _C._staged_reduce(own, res[off:], 0, 0, "SUM", wire, 0, res[off:])
                    torch.cuda.synchronize()
                    chk.true(torch.equal(res.cpu()[off : off + nb], want), f"round: {what}")
                    chk.true(_same_values(own, want_x), f"round, own values: {what}")
        try:
            _C._staged_encode(_shifted(torch.ones(300), 0), wire, _staging(1024, "device")[2:])
            chk.true(False, f"{wire}: staging 2 bytes off a word boundary was taken")
        except ValueError as e:
            chk.true("4-byte aligned" in str(e), f"{wire}: refusal names the alignment: {e}")
    chk.raise_if_failed()
    return {}


def test_scaled_wire_kernels_code_as_the_host_codec() -> None:
    """The fp16 and int8 kernels of P, A and B code and decode bit for bit as the host's
    WireCodec (the same scale rule, round to nearest even, NaN scale for inf/NaN blocks) on
    blocks of every kind (zeros, subnormals, near float32's largest, scale boundaries, inf,
    NaN, outliers), lengths 1, 255, 256, 257 and 1000003, data and staging off alignment."""
    run_ranks(1, codec_fn, init=False, timeout_s=600)


def scaled_rail_fn(rank: int, ws: int) -> dict[str, Any]:
    from torchext import _testing as _C

    torch.cuda.set_device(0)
    chk = Checker("block-scaled staging kernels")
    pitch = _pitch(RAILS, CHUNK)
    for where in ("host", "device"):
        for wire in SCALED:
            for shift in (0, 1):
                for n in (1, 777, 5003):
                    me = n % RAILS
                    what = f"{where} staging, {wire}, shift {shift}, n={n}"
                    layout = _C._hier_layout(n, RAILS, CHUNK, 4)
                    x = _outliers(n, n)
                    shard = _shifted(x, shift)
                    for k, c in enumerate(layout["chunks"]):
                        # P: each peer's piece coded into its slot
                        slots = _staging((RAILS - 1) * pitch, where)
                        _C._staged_pack(shard, k, RAILS, me, CHUNK, wire, slots, pitch)
                        torch.cuda.synchronize()
                        expect = torch.full(((RAILS - 1) * pitch,), SENTINEL, dtype=torch.uint8)
                        for j in range(RAILS - 1):
                            off, ln = c["pieces"][_peer_node(j, me)]
                            if ln:
                                coded = _C._wire_encode(x[c["off"] + off :][:ln].clone(), wire)
                                expect[j * pitch : j * pitch + coded.numel()] = coded
                        chk.true(torch.equal(slots.cpu(), expect), f"pack chunk {k}: {what}")
                        # B: coded pieces decoded into place, the own piece untouched
                        slots = _staging((RAILS - 1) * pitch, where)
                        want = shard.cpu()
                        for j in range(RAILS - 1):
                            off, ln = c["pieces"][_peer_node(j, me)]
                            if ln:
                                coded = _C._wire_encode(_outliers(ln, 100 + k * RAILS + j), wire)
                                slots[j * pitch : j * pitch + coded.numel()] = coded.to(slots)
                                lo = c["off"] + off
                                want[lo : lo + ln] = _C._wire_decode(coded, ln, wire)
                        _C._staged_gather(slots, pitch, shard, k, RAILS, me, CHUNK, wire)
                        chk.true(_same_values(shard, want), f"gather chunk {k}: {what}")
                    # A: own + the peers' decoded pieces, coded into `out` and decoded into own
                    for op in ("SUM", "AVG"):
                        divisor = 3 if op == "AVG" else 0
                        own_x = _outliers(n, 7 * n + 1)
                        coded = [
                            _C._wire_encode(_outliers(n, 7 * n + 2 + j), wire)
                            for j in range(RAILS - 1)
                        ]
                        nb = coded[0].numel()
                        rpitch = (nb + 255) // 256 * 256 + 256
                        recv = _staging((RAILS - 1) * rpitch, where)
                        for j, cj in enumerate(coded):
                            recv[j * rpitch : j * rpitch + nb] = cj.to(recv)
                        out = _staging(rpitch, where)
                        own = _shifted(own_x, shift)
                        _C._staged_reduce(own, recv, rpitch, RAILS - 1, op, wire, divisor, out)
                        torch.cuda.synchronize()
                        acc = own_x.clone()
                        for cj in coded:
                            acc = acc + _C._wire_decode(cj, n, wire)
                        if divisor:  # elementwise, as the kernel divides (no reciprocal)
                            acc = acc / torch.full_like(acc, divisor)
                        want_out = _C._wire_encode(acc, wire)
                        got_out = out.cpu()
                        chk.true(torch.equal(got_out[:nb], want_out), f"reduce {op}: {what}")
                        chk.true(
                            bool((got_out[nb:] == SENTINEL).all()),
                            f"reduce {op}: wrote past the piece: {what}",
                        )
                        chk.true(
                            _same_values(own, _C._wire_decode(want_out, n, wire)),
                            f"reduce {op}: own values: {what}",
                        )
    chk.raise_if_failed()
    return {}


def test_scaled_wire_staging_kernels_bit_exact() -> None:
    """pack / reduce (SUM, AVG) / gather on the fp16 and int8 wires with the rail's layout (3
    rails, short and empty pieces), host and device staging, aligned and misaligned shards:
    equal to the host codec's bytes and values; nothing written outside the pieces."""
    run_ranks(1, scaled_rail_fn, init=False, timeout_s=600)
