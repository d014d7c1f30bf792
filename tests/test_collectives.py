"""Correctness of every collective x dtype x reduce op, on 2 and 4 ranks.

Written purely against the public torch.distributed API, so it runs against any backend
(FASTCOMM_TEST_BACKEND, default "fastcomm").

Design: each (device, world size) group is spawned ONCE; the spawned ranks run every
selected case back to back (after each case the ranks exchange a status through the c10d
store, so an exception on one rank cannot desynchronise the rest of the run), and each
case is then reported as its own pytest test. Every case compares against a reference
the rank computes itself from fresh random data seeded by (case, rank).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _harness import (
    BACKEND,
    DTYPE_NAMES,
    Checker,
    RanksFailed,
    dtype_of,
    gen,
    is_gloo,
    reduce_op,
    run_ranks,
    seed_of,
    valid_ops,
)

INT_DTYPES = ("int8", "uint8", "int32", "int64")

# Shapes used by the per-dtype cases (chosen per case from its name): a 0-dim scalar,
# one element, odd sizes and multi-dimensional tensors.
SHAPES: list[tuple[int, ...]] = [(), (1,), (7,), (3, 5), (2, 3, 4), (129,), (1, 1000), (33,)]
# Shapes with a leading dimension (for ops that split or stack along dim 0).
ROW_SHAPES: list[tuple[int, ...]] = [(1,), (7,), (3, 5), (2, 3, 4), (129,), (1, 1000), (33,)]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str
    dtype: str | None = None
    op: str | None = None


@dataclasses.dataclass
class Ctx:
    rank: int
    ws: int
    device: torch.device
    case: Case
    chk: Checker

    @property
    def dt(self) -> torch.dtype:
        assert self.case.dtype is not None
        return dtype_of(self.case.dtype)

    def shape(self, rows: bool = False) -> tuple[int, ...]:
        pool = ROW_SHAPES if rows else SHAPES
        return pool[seed_of(self.case.name, "shape") % len(pool)]

    def root(self, salt: str = "root") -> int:
        return seed_of(self.case.name, salt) % self.ws

    def gen(self, rank: int, shape: Any, salt: str = "", mode: str = "any") -> torch.Tensor:
        """CPU input of ``rank`` (every rank can compute every other rank's input)."""
        return gen(f"{self.case.name}/{salt}", rank, shape, self.dt, mode)

    def dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def garbage(self, shape: Any, salt: str = "out") -> torch.Tensor:
        """An output buffer pre-filled with random data (so a no-op cannot pass)."""
        return self.dev(gen(f"{self.case.name}/garbage/{salt}", self.rank, shape, self.dt))


# ------------------------------------------------------------------------ reduction cases


def case_all_reduce(c: Ctx) -> None:
    op = c.case.op
    shape = c.shape()
    inputs = [c.gen(r, shape, mode=op) for r in range(c.ws)]
    t = c.dev(inputs[c.rank].clone())
    ret = dist.all_reduce(t, op=reduce_op(op))
    c.chk.true(ret is None, f"all_reduce(async_op=False) returned {ret!r}")
    c.chk.reduced(t, inputs, op, f"all_reduce {shape}")


def case_reduce(c: Ctx) -> None:
    op = c.case.op
    shape = c.shape()
    dst = c.root()
    inputs = [c.gen(r, shape, mode=op) for r in range(c.ws)]
    t = c.dev(inputs[c.rank].clone())
    dist.reduce(t, dst=dst, op=reduce_op(op))
    if c.rank == dst:  # non-root buffers are unspecified after reduce
        c.chk.reduced(t, inputs, op, f"reduce dst={dst} {shape}")


def case_reduce_scatter(c: Ctx) -> None:
    op = c.case.op
    shape = c.shape()
    inputs_of = [[c.gen(r, shape, salt=str(j), mode=op) for j in range(c.ws)] for r in range(c.ws)]
    out = c.garbage(shape)
    dist.reduce_scatter(out, [c.dev(x.clone()) for x in inputs_of[c.rank]], op=reduce_op(op))
    c.chk.reduced(out, [inputs_of[r][c.rank] for r in range(c.ws)], op, f"reduce_scatter {shape}")


def case_reduce_scatter_tensor(c: Ctx) -> None:
    op = c.case.op
    shape = c.shape(rows=True)
    big = (shape[0] * c.ws, *shape[1:])
    inputs = [c.gen(r, big, mode=op) for r in range(c.ws)]
    out = c.garbage(shape)
    dist.reduce_scatter_tensor(out, c.dev(inputs[c.rank].clone()), op=reduce_op(op))
    mine = [x.chunk(c.ws, dim=0)[c.rank] for x in inputs]
    c.chk.reduced(out, mine, op, f"reduce_scatter_tensor {big}->{shape}")


def case_reduce_scatter_tensor_stack(c: Ctx) -> None:
    """Input as a stack of the per-rank blocks (documented form (ii))."""
    op = c.case.op
    shape = c.shape(rows=True)
    inputs = [c.gen(r, (c.ws, *shape), mode=op) for r in range(c.ws)]
    out = c.garbage(shape)
    dist.reduce_scatter_tensor(out, c.dev(inputs[c.rank].clone()), op=reduce_op(op))
    c.chk.reduced(out, [x[c.rank] for x in inputs], op, f"reduce_scatter_tensor stack {shape}")


def case_all_reduce_coalesced(c: Ctx) -> None:
    op = c.case.op
    shapes = [(5,), (3, 4), (1,), c.shape()]
    inputs = [
        [c.gen(r, s, salt=str(i), mode=op) for r in range(c.ws)] for i, s in enumerate(shapes)
    ]
    ts = [c.dev(inp[c.rank].clone()) for inp in inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated but public
        dist.all_reduce_coalesced(ts, op=reduce_op(op))
    for i, (t, inp) in enumerate(zip(ts, inputs)):
        c.chk.reduced(t, inp, op, f"all_reduce_coalesced tensor {i} {shapes[i]}")


# -------------------------------------------------------------------- data movement cases


def case_broadcast(c: Ctx) -> None:
    shape = c.shape()
    src = c.root()
    t = c.dev(c.gen(c.rank, shape))  # receivers start with their own (different) data
    dist.broadcast(t, src=src)
    c.chk.equal(t, c.gen(src, shape), f"broadcast src={src} {shape}")
    # and with group_src (same thing on the world group)
    src2 = (src + 1) % c.ws
    t2 = c.dev(c.gen(c.rank, shape, salt="2"))
    dist.broadcast(t2, group_src=src2)
    c.chk.equal(t2, c.gen(src2, shape, salt="2"), f"broadcast group_src={src2} {shape}")


def case_all_gather(c: Ctx) -> None:
    shape = c.shape()
    outs = [c.garbage(shape, salt=str(j)) for j in range(c.ws)]
    dist.all_gather(outs, c.dev(c.gen(c.rank, shape)))
    for j in range(c.ws):
        c.chk.equal(outs[j], c.gen(j, shape), f"all_gather output[{j}] {shape}")


def case_all_gather_into_tensor(c: Ctx) -> None:
    """Output as a concatenation of the inputs along dim 0."""
    shape = c.shape(rows=True)
    inp = c.dev(c.gen(c.rank, shape))
    cat = c.garbage((shape[0] * c.ws, *shape[1:]), salt="cat")
    dist.all_gather_into_tensor(cat, inp)
    c.chk.equal(cat, torch.cat([c.gen(j, shape) for j in range(c.ws)]), f"cat form {shape}")


def case_all_gather_into_tensor_stack(c: Ctx) -> None:
    """Output as a stack of the inputs along a new leading dim (documented form (ii))."""
    shape = c.shape(rows=True)
    inp = c.dev(c.gen(c.rank, shape))
    stk = c.garbage((c.ws, *shape), salt="stack")
    dist.all_gather_into_tensor(stk, inp)
    c.chk.equal(stk, torch.stack([c.gen(j, shape) for j in range(c.ws)]), f"stack form {shape}")


def case_gather(c: Ctx) -> None:
    shape = c.shape()
    dst = c.root()
    outs = [c.garbage(shape, salt=str(j)) for j in range(c.ws)] if c.rank == dst else None
    dist.gather(c.dev(c.gen(c.rank, shape)), outs, dst=dst)
    if outs is not None:
        for j in range(c.ws):
            c.chk.equal(outs[j], c.gen(j, shape), f"gather dst={dst} output[{j}] {shape}")


def case_scatter(c: Ctx) -> None:
    shape = c.shape()
    src = c.root()
    ins = [c.dev(c.gen(src, shape, salt=str(j))) for j in range(c.ws)] if c.rank == src else None
    out = c.garbage(shape)
    dist.scatter(out, ins, src=src)
    c.chk.equal(out, c.gen(src, shape, salt=str(c.rank)), f"scatter src={src} {shape}")


def case_all_to_all_single(c: Ctx) -> None:
    shape = c.shape(rows=True)
    big = (shape[0] * c.ws, *shape[1:])
    out = c.garbage(big)
    dist.all_to_all_single(out, c.dev(c.gen(c.rank, big)))
    expected = torch.cat([c.gen(j, big).chunk(c.ws)[c.rank] for j in range(c.ws)])
    c.chk.equal(out, expected, f"all_to_all_single equal splits {big}")


def _split(src: int, dst: int) -> int:
    return (src * 3 + dst * 5 + 1) % 4  # 0..3 rows, zeros included


def case_all_to_all_single_uneven(c: Ctx) -> None:
    cols = 3
    in_splits = [_split(c.rank, j) for j in range(c.ws)]
    out_splits = [_split(j, c.rank) for j in range(c.ws)]
    inputs = [c.gen(r, (sum(_split(r, j) for j in range(c.ws)), cols)) for r in range(c.ws)]
    out = c.garbage((sum(out_splits), cols))
    dist.all_to_all_single(out, c.dev(inputs[c.rank]), out_splits, in_splits)
    pieces = []
    for j in range(c.ws):
        off = sum(_split(j, k) for k in range(c.rank))
        pieces.append(inputs[j][off : off + _split(j, c.rank)])
    c.chk.equal(out, torch.cat(pieces), f"all_to_all_single in={in_splits} out={out_splits}")


def _pair_shape(src: int, dst: int) -> tuple[int, int]:
    return (1 + (src + 2 * dst) % 3, 2)


def case_all_to_all(c: Ctx) -> None:
    shape = c.shape()
    ins = [c.dev(c.gen(c.rank, shape, salt=str(j))) for j in range(c.ws)]
    outs = [c.garbage(shape, salt=str(j)) for j in range(c.ws)]
    dist.all_to_all(outs, ins)
    for j in range(c.ws):
        c.chk.equal(outs[j], c.gen(j, shape, salt=str(c.rank)), f"all_to_all output[{j}] {shape}")


def case_all_to_all_uneven(c: Ctx) -> None:
    """List all_to_all where every (src, dst) pair has its own size."""
    ins = [c.dev(c.gen(c.rank, _pair_shape(c.rank, j), salt=str(j))) for j in range(c.ws)]
    outs = [c.garbage(_pair_shape(j, c.rank), salt=str(j)) for j in range(c.ws)]
    dist.all_to_all(outs, ins)
    for j in range(c.ws):
        exp = c.gen(j, _pair_shape(j, c.rank), salt=str(c.rank))
        c.chk.equal(outs[j], exp, f"all_to_all output[{j}] (uneven sizes)")


def case_send_recv(c: Ctx) -> None:
    """Blocking send/recv around a ring (even ranks send first: deadlock-free)."""
    shape = c.shape()
    nxt, prv = (c.rank + 1) % c.ws, (c.rank - 1) % c.ws
    out = c.garbage(shape)
    payload = c.dev(c.gen(c.rank, shape, salt=f"to{nxt}"))
    if c.rank % 2 == 0:
        dist.send(payload, dst=nxt)
        got = dist.recv(out, src=prv)
    else:
        got = dist.recv(out, src=prv)
        dist.send(payload, dst=nxt)
    c.chk.true(got == prv, f"recv returned {got}, expected {prv}")
    c.chk.equal(out, c.gen(prv, shape, salt=f"to{c.rank}"), f"recv from {prv} {shape}")


def case_isend_irecv(c: Ctx) -> None:
    """isend/irecv pairs in both ring directions, waited in reverse order."""
    shape = c.shape()
    nxt, prv = (c.rank + 1) % c.ws, (c.rank - 1) % c.ws
    a = c.dev(c.gen(c.rank, shape, salt="A"))  # goes to next
    b = c.dev(c.gen(c.rank, shape, salt="B"))  # goes to prev
    from_prv = c.garbage(shape, salt="p")
    from_nxt = c.garbage(shape, salt="n")
    works = [
        dist.isend(a, dst=nxt),
        dist.isend(b, dst=prv),
        dist.irecv(from_prv, src=prv),
        dist.irecv(from_nxt, src=nxt),
    ]
    for w in reversed(works):
        w.wait()
    c.chk.equal(from_prv, c.gen(prv, shape, salt="A"), f"irecv from prev {prv}")
    c.chk.equal(from_nxt, c.gen(nxt, shape, salt="B"), f"irecv from next {nxt}")


def case_recv_anysource(c: Ctx) -> None:
    """Rank 0 receives one message from every other rank with src=None.

    CUDA: NCCL has no wildcard receive (ProcessGroupNCCL rejects it too), so fastcomm
    must refuse it with a clear error before communicating; nobody sends."""
    shape = c.shape()
    if c.device.type == "cuda":
        if c.rank == 0:
            try:
                dist.recv(c.garbage(shape), src=None)
            except RuntimeError as e:
                c.chk.true("any source" in str(e), f"unclear error for CUDA recv(src=None): {e}")
            else:
                c.chk.fail("recv(src=None) on a CUDA tensor did not raise")
        return
    if c.rank == 0:
        seen = []
        for _ in range(c.ws - 1):
            buf = c.garbage(shape, salt=str(len(seen)))
            sender = dist.recv(buf, src=None)
            seen.append(sender)
            if 0 < sender < c.ws:
                c.chk.equal(buf, c.gen(sender, shape), f"recv(src=None) data from {sender}")
            else:
                c.chk.fail(f"recv(src=None) returned sender {sender}")
        c.chk.true(sorted(seen) == list(range(1, c.ws)), f"any-source senders {seen}")
    else:
        dist.send(c.dev(c.gen(c.rank, shape)), dst=0)


def case_batch_isend_irecv(c: Ctx) -> None:
    """Full exchange with every peer, the rank itself included (receives listed before
    sends), plus two ordered messages to the same peer."""
    shape = c.shape()
    peers = [p for p in range(c.ws) if p != c.rank or not is_gloo()]
    recv_bufs = {p: [c.garbage(shape, salt=f"{p}/{k}") for k in range(2)] for p in peers}
    ops = []
    for p in peers:
        for k in range(2):
            ops.append(dist.P2POp(dist.irecv, recv_bufs[p][k], p))
    for p in reversed(peers):
        for k in range(2):
            ops.append(dist.P2POp(dist.isend, c.dev(c.gen(c.rank, shape, salt=f"{p}/{k}")), p))
    reqs = dist.batch_isend_irecv(ops)
    for r in reqs:
        r.wait()
    for p in peers:
        for k in range(2):
            c.chk.equal(recv_bufs[p][k], c.gen(p, shape, salt=f"{c.rank}/{k}"), f"from {p} msg {k}")


def case_all_gather_coalesced(c: Ctx) -> None:
    """The legacy list form: outputs[r][i] receives rank r's inputs[i] (an empty one too)."""
    shapes = [(3,), (2, 5), (0,), c.shape()]
    ins = [c.dev(c.gen(c.rank, s, salt=f"agc{i}")) for i, s in enumerate(shapes)]
    outs = [[c.garbage(s, salt=f"agc{r}/{i}") for i, s in enumerate(shapes)] for r in range(c.ws)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated but public
        work = dist.all_gather_coalesced(outs, ins, async_op=True)
    work.wait()
    for r in range(c.ws):
        for i, s in enumerate(shapes):
            exp = c.gen(r, s, salt=f"agc{i}")
            c.chk.equal(outs[r][i], exp, f"all_gather_coalesced rank {r} tensor {i} {s}")


def case_coalesced_all_gather(c: Ctx) -> None:
    """all_gather_into_tensor on lists under dist._coalescing_manager (async and sync)."""
    shapes = [(3,), (2, 5), c.shape(rows=True)]
    for mode in ("async", "sync"):
        ins = [c.dev(c.gen(c.rank, s, salt=f"{mode}{i}")) for i, s in enumerate(shapes)]
        outs = [c.garbage((s[0] * c.ws, *s[1:]), salt=f"{mode}{i}") for i, s in enumerate(shapes)]
        if mode == "async":
            with dist._coalescing_manager(async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            cm.wait()
        else:
            with dist._coalescing_manager():
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
        for i, s in enumerate(shapes):
            exp = torch.cat([c.gen(j, s, salt=f"{mode}{i}") for j in range(c.ws)])
            c.chk.equal(outs[i], exp, f"coalesced ({mode}) all_gather_into_tensor {i} {s}")


def case_coalesced_all_reduce(c: Ctx) -> None:
    shapes = [(4,), (3, 3), c.shape()]
    for mode, op in (("sync", "SUM"), ("async", "MAX")):
        inputs = [
            [c.gen(r, s, salt=f"{mode}{i}", mode=op) for r in range(c.ws)]
            for i, s in enumerate(shapes)
        ]
        ts = [c.dev(inp[c.rank].clone()) for inp in inputs]
        with dist._coalescing_manager(async_ops=(mode == "async")) as cm:
            for t in ts:
                dist.all_reduce(t, op=reduce_op(op))
        if mode == "async":
            cm.wait()
        for i, (t, inp) in enumerate(zip(ts, inputs)):
            c.chk.reduced(t, inp, op, f"coalesced ({mode}) all_reduce {op} {i}")


def case_coalesced_reduce_scatter(c: Ctx) -> None:
    shapes = [(2,), (3, 2), c.shape(rows=True)]
    op = "SUM"
    inputs = [
        [c.gen(r, (s[0] * c.ws, *s[1:]), salt=str(i), mode=op) for r in range(c.ws)]
        for i, s in enumerate(shapes)
    ]
    outs = [c.garbage(s, salt=str(i)) for i, s in enumerate(shapes)]
    with dist._coalescing_manager():
        for o, inp in zip(outs, inputs):
            dist.reduce_scatter_tensor(o, c.dev(inp[c.rank].clone()), op=reduce_op(op))
    for i, o in enumerate(outs):
        mine = [x.chunk(c.ws)[c.rank] for x in inputs[i]]
        c.chk.reduced(o, mine, op, f"coalesced reduce_scatter_tensor {i} {shapes[i]}")


# ------------------------------------------------------------------------- special cases


def case_barrier(c: Ctx) -> None:
    """Nobody leaves a barrier before the last rank entered it."""
    times = []
    last = c.ws - 1
    for i in range(3):
        if c.rank == (last - i) % c.ws:
            time.sleep(0.3)
        t_in = time.time()
        if i == 1:
            w = dist.barrier(async_op=True)
            w.wait()
        else:
            dist.barrier()
        times.append((t_in, time.time()))
    mine = torch.tensor(times, dtype=torch.float64).flatten()
    everyone = [torch.zeros_like(mine) for _ in range(c.ws)]
    dist.all_gather_object(everyone, mine)  # via the backend too, but independent of barrier
    allt = torch.stack(everyone).view(c.ws, -1, 2)
    for i in range(allt.shape[1]):
        last_in = allt[:, i, 0].max().item()
        first_out = allt[:, i, 1].min().item()
        c.chk.true(
            first_out >= last_in - 0.005,
            f"barrier {i}: a rank left at {first_out:.4f} before the last rank entered at "
            f"{last_in:.4f}",
        )
    for _ in range(5):  # back-to-back barriers
        dist.barrier()


def case_zero_element(c: Ctx) -> None:
    ws = c.ws
    e = c.dev(torch.empty(0, dtype=c.dt))
    e2 = c.dev(torch.empty(0, 3, dtype=c.dt))
    dist.all_reduce(e)
    dist.all_reduce(e2, op=dist.ReduceOp.MAX)
    dist.broadcast(e2, src=ws - 1)
    dist.reduce(e, dst=0)
    outs = [c.dev(torch.empty(0, dtype=c.dt)) for _ in range(ws)]
    dist.all_gather(outs, e)
    dist.all_gather_into_tensor(c.dev(torch.empty(0, dtype=c.dt)), e)
    dist.reduce_scatter_tensor(e, c.dev(torch.empty(0, dtype=c.dt)))
    dist.all_to_all_single(c.dev(torch.empty(0, dtype=c.dt)), e)
    dist.all_to_all_single(c.dev(torch.empty(0, dtype=c.dt)), e, [0] * ws, [0] * ws)
    dist.gather(e, outs if c.rank == 0 else None, dst=0)
    dist.scatter(e, outs if c.rank == ws - 1 else None, src=ws - 1)
    nxt, prv = (c.rank + 1) % ws, (c.rank - 1) % ws
    w = [dist.isend(e, dst=nxt), dist.irecv(c.dev(torch.empty(0, dtype=c.dt)), src=prv)]
    for x in w:
        x.wait()
    # an empty tensor next to a non-empty one in one coalesced call
    inputs = [c.gen(r, (5,), mode="SUM") for r in range(ws)]
    t = c.dev(inputs[c.rank].clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced([c.dev(torch.empty(0, dtype=c.dt)), t])
    c.chk.reduced(t, inputs, "SUM", "all_reduce_coalesced([empty, t])")
    c.chk.true(e.numel() == 0 and e2.shape == (0, 3), "empty tensors changed shape")
    # the group still works with real data right after all the empty calls
    t2 = c.dev(inputs[c.rank].clone())
    dist.all_reduce(t2)
    c.chk.reduced(t2, inputs, "SUM", "all_reduce after zero-element calls")


def _region_mask(base_shape: tuple[int, ...], index: Any) -> torch.Tensor:
    m = torch.zeros(base_shape, dtype=torch.bool)
    m[index] = True
    return m


def _noncontig_op(c: Ctx) -> str:
    return "SUM" if c.case.dtype != "bool" else "BOR"


def case_noncontig_all_reduce_transposed(c: Ctx) -> None:
    """all_reduce into a transposed (non-contiguous) view of the whole storage."""
    op = _noncontig_op(c)
    base_in = [c.gen(r, (6, 10), mode=op) for r in range(c.ws)]
    base = c.dev(base_in[c.rank].clone())
    view = base.t()
    assert not view.is_contiguous()
    dist.all_reduce(view, op=reduce_op(op))
    c.chk.reduced(view, [x.t() for x in base_in], op, "all_reduce into transposed view")
    c.chk.reduced(base, base_in, op, "storage under the transposed view")


def case_noncontig_all_reduce_slice(c: Ctx) -> None:
    """all_reduce into a strided slice: elements outside it must be untouched."""
    op = _noncontig_op(c)
    idx = (slice(1, 5), slice(None, None, 2))
    base_in = [c.gen(r, (6, 10), mode=op) for r in range(c.ws)]
    base = c.dev(base_in[c.rank].clone())
    view = base[idx]
    assert not view.is_contiguous()
    dist.all_reduce(view, op=reduce_op(op))
    c.chk.reduced(view, [x[idx] for x in base_in], op, "all_reduce into strided slice")
    outside = ~_region_mask((6, 10), idx)
    c.chk.equal(base.cpu()[outside], base_in[c.rank][outside], "elements outside the slice")


def case_noncontig_broadcast_transposed(c: Ctx) -> None:
    src = c.root()
    base = c.dev(c.gen(c.rank, (8, 6)))
    dist.broadcast(base.t(), src=src)
    c.chk.equal(base, c.gen(src, (8, 6)), f"broadcast into transposed view src={src}")


def case_noncontig_broadcast_slice(c: Ctx) -> None:
    src = c.root()
    idx = (slice(None, None, 3), slice(2, 5))
    mine = c.gen(c.rank, (8, 6))
    base = c.dev(mine.clone())
    view = base[idx]
    assert not view.is_contiguous()
    dist.broadcast(view, src=src)
    c.chk.equal(view, c.gen(src, (8, 6))[idx], f"broadcast into strided slice src={src}")
    outside = ~_region_mask((8, 6), idx)
    c.chk.equal(base.cpu()[outside], mine[outside], "elements outside the slice")


def case_large_all_reduce(c: Ctx) -> None:
    n = 1_000_003  # odd, ~4 MB of float32
    inputs = [c.gen(r, (n,), mode="SUM") for r in range(c.ws)]
    t = c.dev(inputs[c.rank].clone())
    dist.all_reduce(t)
    c.chk.reduced(t, inputs, "SUM", f"all_reduce of {n} elements")
    t = c.dev(inputs[c.rank].clone())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c.chk.reduced(t, inputs, "MAX", f"all_reduce MAX of {n} elements")


def case_large_reduce(c: Ctx) -> None:
    # Above the all-reduce shortcut: across nodes, the reduce-scatter phases
    # then a gather on the root's node (HierComm::reduce), every root.
    n = 1_000_003  # odd, ~4 MB of float32
    for op in ("SUM", "MAX"):
        inputs = [c.gen(r, (n,), salt=op, mode=op) for r in range(c.ws)]
        for dst in range(c.ws):
            t = c.dev(inputs[c.rank].clone())
            dist.reduce(t, dst=dst, op=reduce_op(op))
            if c.rank == dst:
                c.chk.reduced(t, inputs, op, f"reduce {op} dst={dst} of {n} elements")


def case_large_broadcast(c: Ctx) -> None:
    n = 3 * 2**20 // 2 + 1  # 3 MiB of bfloat16, odd
    src = c.root()
    t = c.dev(c.gen(c.rank, (n,)))
    dist.broadcast(t, src=src)
    c.chk.equal(t, c.gen(src, (n,)), f"broadcast of {n} elements")


def case_large_all_gather_into_tensor(c: Ctx) -> None:
    n = 2**18 + 7  # ~1 MiB of int32 per rank
    out = c.dev(torch.empty(n * c.ws, dtype=c.dt))
    dist.all_gather_into_tensor(out, c.dev(c.gen(c.rank, (n,))))
    c.chk.equal(out, torch.cat([c.gen(j, (n,)) for j in range(c.ws)]), f"{n} per rank")


def case_large_reduce_scatter_tensor(c: Ctx) -> None:
    n = 2**18 + 3  # output per rank, float32
    inputs = [c.gen(r, (n * c.ws,), mode="SUM") for r in range(c.ws)]
    out = c.garbage((n,))
    dist.reduce_scatter_tensor(out, c.dev(inputs[c.rank].clone()))
    c.chk.reduced(out, [x.chunk(c.ws)[c.rank] for x in inputs], "SUM", f"{n} per rank")


def case_large_all_to_all_single(c: Ctx) -> None:
    n = 2**20 + 1  # bytes per peer, uint8
    out = c.dev(torch.empty(n * c.ws, dtype=c.dt))
    dist.all_to_all_single(out, c.dev(c.gen(c.rank, (n * c.ws,))))
    exp = torch.cat([c.gen(j, (n * c.ws,)).chunk(c.ws)[c.rank] for j in range(c.ws)])
    c.chk.equal(out, exp, f"all_to_all_single {n} bytes per peer")


def case_async_all_reduce(c: Ctx) -> None:
    for how in ("wait", "future"):
        shape = (17, 3)
        inputs = [c.gen(r, shape, salt=how, mode="SUM") for r in range(c.ws)]
        t = c.dev(inputs[c.rank].clone())
        work = dist.all_reduce(t, async_op=True)
        c.chk.true(work is not None, "all_reduce(async_op=True) returned None")
        if how == "wait":
            work.wait()
        else:
            value = work.get_future().wait()
            # DDP comm hooks rely on this: the future's value is the list of outputs.
            ok = isinstance(value, list) and len(value) >= 1
            c.chk.true(ok, f"all_reduce future value is {type(value)}, expected list")
            if ok:
                c.chk.reduced(value[0], inputs, "SUM", "all_reduce future value[0]")
        c.chk.reduced(t, inputs, "SUM", f"async all_reduce ({how})")
    # chained future, as a DDP comm hook does it
    inputs = [c.gen(r, (9,), salt="then", mode="SUM") for r in range(c.ws)]
    t = c.dev(inputs[c.rank].clone())
    fut = dist.all_reduce(t, async_op=True).get_future()
    res = fut.then(lambda f: f.value()[0].div(c.ws)).wait()
    expected = sum(x.to(torch.float64) for x in inputs) / c.ws
    c.chk.close(res.double(), expected, "future.then(...) result", rtol=1e-5, atol=1e-5)


def case_async_many(c: Ctx) -> None:
    """Many different async collectives in flight at once, waited in reverse order."""
    ws = c.ws
    pending: list[tuple[Any, Callable[[], None]]] = []
    for i, (dtname, n) in enumerate(
        [("float32", 1), ("int64", 100), ("float16", 33), ("float32", 4097)]
    ):
        dt = dtype_of(dtname)
        inputs = [gen(f"{c.case.name}/ar{i}", r, (n,), dt, "SUM") for r in range(ws)]
        t = c.dev(inputs[c.rank].clone())
        w = dist.all_reduce(t, async_op=True)
        pending.append(
            (w, lambda t=t, inputs=inputs, i=i: c.chk.reduced(t, inputs, "SUM", f"ar{i}"))
        )
    dt = torch.float32
    src = ws - 1
    b = c.dev(gen(f"{c.case.name}/bc", c.rank, (50,), dt))
    w = dist.broadcast(b, src=src, async_op=True)
    pending.append((w, lambda: c.chk.equal(b, gen(f"{c.case.name}/bc", src, (50,), dt), "bcast")))
    ag = c.dev(torch.empty(ws * 10, dtype=dt))
    w = dist.all_gather_into_tensor(
        ag, c.dev(gen(f"{c.case.name}/ag", c.rank, (10,), dt)), async_op=True
    )
    exp_ag = torch.cat([gen(f"{c.case.name}/ag", j, (10,), dt) for j in range(ws)])
    pending.append((w, lambda: c.chk.equal(ag, exp_ag, "all_gather_into_tensor")))
    rs_in = [gen(f"{c.case.name}/rs", r, (ws * 6,), dt, "SUM") for r in range(ws)]
    rs = c.dev(torch.empty(6, dtype=dt))
    w = dist.reduce_scatter_tensor(rs, c.dev(rs_in[c.rank].clone()), async_op=True)
    mine = [x.chunk(ws)[c.rank] for x in rs_in]
    pending.append((w, lambda: c.chk.reduced(rs, mine, "SUM", "reduce_scatter_tensor")))
    a2a = c.dev(torch.empty(ws * 4, dtype=dt))
    w = dist.all_to_all_single(
        a2a, c.dev(gen(f"{c.case.name}/a2a", c.rank, (ws * 4,), dt)), async_op=True
    )
    exp_a2a = torch.cat(
        [gen(f"{c.case.name}/a2a", j, (ws * 4,), dt).chunk(ws)[c.rank] for j in range(ws)]
    )
    pending.append((w, lambda: c.chk.equal(a2a, exp_a2a, "all_to_all_single")))
    for w, check in reversed(pending):
        w.wait()
        check()


def case_back_to_back(c: Ctx) -> None:
    """Many small collectives with no synchronisation in between (buffer reuse races)."""
    ws = c.ws
    results = []
    for i in range(40):
        n = [1, 7, 1000, 33, 4096][i % 5]
        key = f"{c.case.name}/{i}"
        kind = i % 4
        if kind == 0:
            inputs = [gen(key, r, (n,), torch.float32, "SUM") for r in range(ws)]
            t = c.dev(inputs[c.rank].clone())
            dist.all_reduce(t)
            results.append(
                lambda t=t, inputs=inputs, i=i: c.chk.reduced(t, inputs, "SUM", f"#{i} ar")
            )
        elif kind == 1:
            src = i % ws
            t = c.dev(gen(key, c.rank, (n,), torch.int32))
            dist.broadcast(t, src=src)
            exp = gen(key, src, (n,), torch.int32)
            results.append(lambda t=t, exp=exp, i=i: c.chk.equal(t, exp, f"#{i} bcast"))
        elif kind == 2:
            out = c.dev(torch.empty(n * ws, dtype=torch.float16))
            dist.all_gather_into_tensor(out, c.dev(gen(key, c.rank, (n,), torch.float16)))
            exp = torch.cat([gen(key, j, (n,), torch.float16) for j in range(ws)])
            results.append(lambda out=out, exp=exp, i=i: c.chk.equal(out, exp, f"#{i} ag"))
        else:
            inputs = [gen(key, r, (n * ws,), torch.int64, "SUM") for r in range(ws)]
            out = c.dev(torch.empty(n, dtype=torch.int64))
            dist.reduce_scatter_tensor(out, c.dev(inputs[c.rank].clone()))
            mine = [x.chunk(ws)[c.rank] for x in inputs]
            results.append(
                lambda out=out, mine=mine, i=i: c.chk.reduced(out, mine, "SUM", f"#{i} rs")
            )
    for check in results:
        check()


# --------------------------------------------------------------------------- case table

CASE_FUNCS: dict[str, Callable[[Ctx], None]] = {
    name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")
}

REDUCTION_KINDS = [
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce_coalesced",
]
PER_DTYPE_KINDS = [
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_into_tensor_stack",
    "gather",
    "scatter",
    "all_to_all_single",
    "all_to_all_single_uneven",
    "all_to_all",
    "all_to_all_uneven",
    "send_recv",
    "isend_irecv",
    "recv_anysource",
    "batch_isend_irecv",
    "all_gather_coalesced",
    "coalesced_all_gather",
    "coalesced_all_reduce",
    "coalesced_reduce_scatter",
]


def _build_cases() -> list[Case]:
    cases = []
    for kind in REDUCTION_KINDS:
        for dt in DTYPE_NAMES:
            for op in valid_ops(dt):
                cases.append(Case(f"{kind}-{dt}-{op}", kind, dt, op))
    for kind in PER_DTYPE_KINDS:
        for dt in DTYPE_NAMES:
            cases.append(Case(f"{kind}-{dt}", kind, dt))
    for dt in DTYPE_NAMES:  # stack form: one op per dtype is enough
        op = "MAX" if dt == "bool" else "SUM"
        cases.append(
            Case(f"reduce_scatter_tensor_stack-{dt}-{op}", "reduce_scatter_tensor_stack", dt, op)
        )
    cases += [
        Case("barrier", "barrier"),
        Case("zero_element-float32", "zero_element", "float32"),
        Case("zero_element-int64", "zero_element", "int64"),
        Case("zero_element-bool", "zero_element", "bool"),
        Case("async_all_reduce-float32", "async_all_reduce", "float32"),
        Case("async_many", "async_many"),
        Case("back_to_back", "back_to_back"),
        Case("large_all_reduce-float32", "large_all_reduce", "float32"),
        Case("large_reduce-float32", "large_reduce", "float32"),
        Case("large_broadcast-bfloat16", "large_broadcast", "bfloat16"),
        Case("large_all_gather_into_tensor-int32", "large_all_gather_into_tensor", "int32"),
        Case("large_reduce_scatter_tensor-float32", "large_reduce_scatter_tensor", "float32"),
        Case("large_all_to_all_single-uint8", "large_all_to_all_single", "uint8"),
    ]
    for dt in ("float32", "float16", "int32", "uint8", "bool"):
        for kind in (
            "noncontig_all_reduce_transposed",
            "noncontig_all_reduce_slice",
            "noncontig_broadcast_transposed",
            "noncontig_broadcast_slice",
        ):
            cases.append(Case(f"{kind}-{dt}", kind, dt))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    missing = {c.kind for c in cases} - set(CASE_FUNCS)
    assert not missing, missing
    return cases


CASES = _build_cases()
CASES_BY_NAME = {c.name: c for c in CASES}


def gloo_skip_reason(case: Case) -> str | None:
    """Why a case is skipped when the backend under test is gloo (never for fastcomm)."""
    if BACKEND != "gloo":
        return None
    if case.kind in ("all_gather_into_tensor_stack", "reduce_scatter_tensor_stack"):
        # ProcessGroupGloo splits the big tensor along dim 0 and requires each piece to
        # have the exact shape of the small one, i.e. only the concatenation form.
        return "gloo supports only the concatenation form of the big tensor"
    if case.kind in ("noncontig_all_reduce_slice", "noncontig_broadcast_slice"):
        # ProcessGroupGloo treats a strided slice as numel() contiguous elements from
        # its data pointer: wrong values inside the slice, clobbered values outside it.
        return "gloo mishandles strided (non-dense) slices (silently wrong results)"
    if case.kind == "all_to_all_uneven":
        # ProcessGroupGloo::alltoall requires every tensor of both lists to have one size.
        return "gloo's list all_to_all needs equal tensor sizes"
    if case.op == "AVG" and case.dtype in INT_DTYPES:
        # ProcessGroupGloo implements AVG as SUM followed by an in-place true division,
        # which fails for integer tensors ("result type Float can't be cast ...").
        return "gloo has no integer AVG (SUM then true division fails for integer dtypes)"
    return None


# ------------------------------------------------------------------------ spawned side


def run_cases(
    rank: int, ws: int, device_type: str, names: list[str], sync_timeout_s: float
) -> dict[str, str | None]:
    """Runs on every rank: all cases in order; returns case name -> None (passed) or the
    failure text. After each case the ranks exchange their status through the store, so
    an exception that hit only some ranks does not desynchronise the following cases."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    results: dict[str, str | None] = {}
    stopped: str | None = None
    for i, name in enumerate(names):
        if stopped is not None:
            results[name] = f"not run: {stopped}"
            continue
        case = CASES_BY_NAME[name]
        # progress goes to the rank's log: on a hang, the failure report's output tail and
        # stack dump show the case it is stuck in
        print(f"[rank {rank}] case {i + 1}/{len(names)}: {name}", flush=True)
        chk = Checker(f"rank {rank}")
        status = "ok"
        try:
            CASE_FUNCS[case.kind](Ctx(rank, ws, device, case, chk))
            if device.type == "cuda":
                torch.cuda.synchronize()
            chk.raise_if_failed()
            results[name] = None
        except AssertionError as e:
            results[name] = str(e)
            status = "mismatch"
        except Exception:
            results[name] = f"rank {rank} raised:\n{traceback.format_exc()}"
            status = "exception"
        try:
            store.set(f"fastcomm_test/{i}/{rank}", status)
            store.wait(
                [f"fastcomm_test/{i}/{r}" for r in range(ws)], timedelta(seconds=sync_timeout_s)
            )
        except Exception as e:  # some rank is stuck inside a collective
            stopped = f"ranks did not all finish case {name!r} ({type(e).__name__}: {e})"
    return results


# --------------------------------------------------------------------------- pytest side

# Node layouts simulated with FASTCOMM_HOST_ID: the simulated node of each rank.
# "" is one real node. "2x2i" interleaves the nodes, so group ranks are not
# node-contiguous; "3+1" has uneven nodes (the flat plan). A "-ib" layout runs the
# inter-node transport over ib on its software RC emulation, for IB_DTYPES (every
# collective and op of those dtypes, and the large cases): tcp covers the whole matrix.
LAYOUTS: dict[str, list[int]] = {
    "": [],
    "2x2": [0, 0, 1, 1],
    "2x2i": [0, 1, 0, 1],
    "4x1": [0, 1, 2, 3],
    "3+1": [0, 0, 0, 1],
    "2x2-ib": [0, 0, 1, 1],
    "3+1-ib": [0, 0, 0, 1],
    "2x2-staged": [0, 0, 1, 1],
}
# Extra environment of a layout. "2x2-staged": every CUDA all_reduce across nodes, however
# small, takes the staged pipeline (csrc/plans/cuda/), in chunks of 4 KiB, so the matrix's odd
# small shapes hit its short and empty pieces.
LAYOUT_ENV: dict[str, dict[str, str]] = {
    "2x2-staged": {"FASTCOMM_CUDA_HIER_MIN_BYTES": "0", "FASTCOMM_CUDA_CHUNK_BYTES": "4K"},
    "2x2-ib": {"FASTCOMM_TRANSPORT": "ib", "FASTCOMM_IB_EMULATE": "1"},
    "3+1-ib": {"FASTCOMM_TRANSPORT": "ib", "FASTCOMM_IB_EMULATE": "1"},
}
IB_DTYPES = ("float32", "bfloat16", "int64")

GROUPS = [
    pytest.param("cpu", 2, "", id="cpu-2ranks"),
    pytest.param("cpu", 4, "", id="cpu-4ranks"),
    pytest.param("cpu", 4, "2x2", id="cpu-4ranks-2x2nodes"),
    pytest.param("cpu", 4, "2x2i", id="cpu-4ranks-2x2nodes-interleaved"),
    pytest.param("cpu", 4, "4x1", id="cpu-4ranks-4x1nodes"),
    pytest.param("cpu", 4, "3+1", id="cpu-4ranks-3+1nodes"),
    pytest.param("cpu", 4, "2x2-ib", id="cpu-4ranks-2x2nodes-ib"),
    pytest.param("cpu", 4, "3+1-ib", id="cpu-4ranks-3+1nodes-ib"),
    pytest.param("cuda", 2, "", id="cuda-2ranks", marks=pytest.mark.cuda(world_size=2)),
    pytest.param("cuda", 4, "", id="cuda-4ranks", marks=pytest.mark.cuda(world_size=4)),
    pytest.param("cuda", 4, "2x2", id="cuda-4ranks-2x2nodes", marks=pytest.mark.cuda(world_size=4)),
    pytest.param(
        "cuda",
        4,
        "2x2-staged",
        id="cuda-4ranks-2x2nodes-staged",
        marks=pytest.mark.cuda(world_size=4),
    ),
]


def layout_env(layout: str) -> Any:
    nodes = LAYOUTS[layout]
    if not nodes:
        return None
    extra = LAYOUT_ENV.get(layout, {})
    return lambda rank: {"FASTCOMM_HOST_ID": f"simnode{nodes[rank]}", **extra}


def layout_skip_reason(layout: str, case: Case) -> str | None:
    if (
        layout.endswith("-ib")
        and case.dtype not in (None, *IB_DTYPES)
        and not case.kind.startswith("large_")
    ):
        return f"the ib layouts run {', '.join(IB_DTYPES)} (tcp layouts run every dtype)"
    return None


def _case_param(case: Case) -> Any:
    reason = gloo_skip_reason(case)
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return pytest.param(case, id=case.name, marks=marks)


_GROUP_RESULTS: dict[tuple[str, int, str], Any] = {}
_GROUP_REPORTED: set[tuple[str, int, str]] = set()
PG_TIMEOUT_S = 60.0


def _selected_cases(session: pytest.Session, device: str, ws: int, layout: str) -> list[str]:
    names = []
    for item in session.items:
        cs = getattr(item, "callspec", None)
        if cs is None or item.originalname != "test_collective":
            continue
        if (cs.params.get("device"), cs.params.get("ws"), cs.params.get("layout")) != (
            device,
            ws,
            layout,
        ):
            continue
        case = cs.params["case"]
        if gloo_skip_reason(case) is None and layout_skip_reason(layout, case) is None:
            names.append(case.name)
    return names


@pytest.fixture
def group_results(
    request: pytest.FixtureRequest, device: str, ws: int, layout: str
) -> list[dict[str, Any]]:
    key = (device, ws, layout)
    if key not in _GROUP_RESULTS:
        names = _selected_cases(request.session, device, ws, layout)
        t0 = time.monotonic()
        try:
            _GROUP_RESULTS[key] = run_ranks(
                ws,
                run_cases,
                device,
                names,
                PG_TIMEOUT_S + 20.0,
                pg_timeout_s=PG_TIMEOUT_S,
                timeout_s=150.0 + 0.3 * len(names),
                env=layout_env(layout),
            )
        except RanksFailed as e:
            _GROUP_RESULTS[key] = e
        print(f"\n[{device} x{ws} {layout}: {len(names)} cases in {time.monotonic() - t0:.1f}s]")
    res = _GROUP_RESULTS[key]
    if isinstance(res, RanksFailed):
        if key in _GROUP_REPORTED:
            pytest.fail(f"the {device} x{ws} group failed as a whole (see the first failure)")
        _GROUP_REPORTED.add(key)
        raise res
    return res


@pytest.mark.parametrize("case", [_case_param(c) for c in CASES])
@pytest.mark.parametrize("device,ws,layout", GROUPS)
def test_collective(
    device: str, ws: int, layout: str, case: Case, group_results: list[dict[str, Any]]
) -> None:
    reason = layout_skip_reason(layout, case)
    if reason:
        pytest.skip(reason)
    errors = []
    for rank, per_rank in enumerate(group_results):
        if case.name not in per_rank:
            errors.append(f"rank {rank}: case was not run")
        elif per_rank[case.name] is not None:
            errors.append(per_rank[case.name])
    if errors:
        pytest.fail(
            f"{case.name} on {ws} {device} ranks {layout} ({BACKEND}):\n" + "\n".join(errors),
            pytrace=False,
        )
