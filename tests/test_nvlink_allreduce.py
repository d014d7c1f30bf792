"""fastcomm's own CUDA all_reduce over NVLink peer memory inside a node (csrc/intra/nvlink/,
kernels/nvlink_collectives.cu): one-shot and two-shot kernels for float32, float16 and bfloat16
SUM / AVG / MIN / MAX up to the limits torchext._testing.nvlink_limits() reports, NCCL above
them and for everything else.

Every test needs 2 GPUs connected by NVLink (one per rank): where the path cannot be set up
(PCIe only, no peer access) the tests fail, and FASTCOMM_LOG=INFO shows the set-up's reason.
The path taken by every call is checked through stats() (nvlink_one_shot / nvlink_two_shot),
so a silent fallback to NCCL fails. References come from fresh random data every rank
regenerates (tests/_harness.py gen), reduced in float64; results must be bit-identical on all
ranks. Replays of a CUDA graph are checked on the GPU against integer data whose reductions are
exact in every dtype, so thousands of replays cost no host round trips.

Run on the GPU machine:  python -m pytest -q tests/test_nvlink_allreduce.py
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import BACKEND, Checker, RankFailure, gen, is_gloo, run_ranks
from _nvlink import WORLDS, nvlink_calls, rank_device, replay_pattern, sub_and_off_groups

pytestmark = [
    pytest.mark.skipif(is_gloo(), reason="fastcomm's NVLink all_reduce"),
    pytest.mark.cuda(world_size=2),
]

DTYPES = ["float32", "float16", "bfloat16"]
OPS = ["SUM", "AVG", "MIN", "MAX"]
ONE, TWO, NCCL = "one", "two", "nccl"


def _counts(group: Any = None) -> tuple[int, int]:
    return nvlink_calls("nvlink_one_shot", group), nvlink_calls("nvlink_two_shot", group)


def _path(before: tuple[int, int], after: tuple[int, int]) -> str:
    d1, d2 = after[0] - before[0], after[1] - before[1]
    if (d1, d2) == (1, 0):
        return ONE
    if (d1, d2) == (0, 1):
        return TWO
    if (d1, d2) == (0, 0):
        return NCCL
    return f"?{d1},{d2}"


def _expected_path(nbytes: int, limits: tuple[int, int]) -> str:
    return ONE if nbytes <= limits[0] else TWO if nbytes <= limits[1] else NCCL


def _same_everywhere(chk: Checker, t: torch.Tensor, what: str, group: Any = None) -> None:
    """Every rank holds bit-identical values (compared as raw bytes, so NaN-safe)."""
    raw = t.contiguous().view(-1).view(torch.uint8)
    everyone = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, raw, group=group)
    for r, other in enumerate(everyone):
        chk.true(torch.equal(other, raw), f"{what}: rank {r} holds different values")


def _sizes(esize: int, limits: tuple[int, int], low_latency: int) -> list[int]:
    """Element counts from 1 to past the two-shot limit: odd ones, every remainder of a
    16-byte unit, and each limit (the low-latency one-shot's too) -1 / exactly / +1 element."""
    per_unit = 16 // esize
    small = [1, 2, 3, 5, 7, per_unit - 1, per_unit, per_unit + 1, 2 * per_unit + 3, 127]
    small += [1000, 4097, 65537 // esize]
    edges = []
    for limit in (low_latency, *limits):
        n = limit // esize
        edges += [n - 1, n, n + 1]
    return sorted({n for n in small + edges if n >= 1})


def _check_one(
    chk: Checker,
    rank: int,
    ws: int,
    dev: torch.device,
    dt_name: str,
    op: str,
    n: int,
    offset: int,
    limits: tuple[int, int],
    async_op: bool,
) -> None:
    dt = getattr(torch, dt_name)
    key = f"nvl/{dt_name}/{op}/{n}/{offset}"
    inputs = [gen(key, r, (n,), dt, op) for r in range(ws)]
    guard = 7.0
    buf = torch.full((offset + n + 5,), guard, dtype=dt, device=dev)
    view = buf[offset : offset + n]
    view.copy_(inputs[rank].to(dev))
    before = _counts()
    work = dist.all_reduce(view, op=getattr(dist.ReduceOp, op), async_op=async_op)
    if async_op:
        work.wait()
    got = buf.cpu()
    path = _path(before, _counts())
    want = _expected_path(n * buf.element_size(), limits)
    chk.true(path == want, f"{key}: took {path}, expected {want}")
    chk.reduced(got[offset : offset + n], inputs, op, key)
    outside = torch.cat([got[:offset], got[offset + n :]])
    chk.true(bool((outside == guard).all()), f"{key}: wrote outside the tensor")
    _same_everywhere(chk, view, key)


# ----------------------------------------------------------------------------- correctness


def matrix_fn(rank: int, ws: int) -> dict[str, Any]:
    """Every dtype x op x size (1 element to past the two-shot limit) at offsets 0, 1 and 3
    elements, synchronous and async; then the cases that stay on NCCL, a strided tensor,
    async/sync calls on different streams, a subgroup and a group with the path off."""
    import torchext._testing as testing

    dev = rank_device(rank)
    limits = tuple(testing.nvlink_limits(ws))
    chk = Checker(f"rank {rank}")
    calls = 0
    for dt_name in DTYPES:
        esize = torch.tensor([], dtype=getattr(torch, dt_name)).element_size()
        for n in _sizes(esize, limits, testing.nvlink_low_latency_bytes(ws)):
            offsets = (0, 1, 3) if n * esize <= limits[0] else (0, 1)
            for op in OPS:
                for offset in offsets:
                    _check_one(chk, rank, ws, dev, dt_name, op, n, offset, limits, calls % 3 == 0)
                    calls += 1

    # Not for these kernels: other dtypes and ops, several tensors at once.
    for dt_name, op in (("float64", "SUM"), ("int32", "SUM"), ("float32", "PRODUCT")):
        dt = getattr(torch, dt_name)
        key = f"nccl/{dt_name}/{op}"
        inputs = [gen(key, r, (1001,), dt, op) for r in range(ws)]
        t = inputs[rank].to(dev)
        before = _counts()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        chk.true(_path(before, _counts()) == NCCL, f"{key}: did not stay on NCCL")
        chk.reduced(t.cpu(), inputs, op, key)
    with dist._coalescing_manager(async_ops=False):
        pair = [torch.full((257,), float(rank + 1), device=dev) for _ in range(2)]
        before = _counts()
        for t in pair:
            dist.all_reduce(t)
    chk.true(_counts() == before, "a coalesced block left NCCL")
    for t in pair:
        chk.true(bool((t == ws * (ws + 1) / 2).all()), "coalesced all_reduce")

    # A strided tensor takes the kernels through a contiguous copy.
    key = "nvl/strided"
    inputs = [gen(key, r, (2 * 3001,), torch.float32, "SUM") for r in range(ws)]
    base = inputs[rank].to(dev)
    view = base[::2]
    before = _counts()
    dist.all_reduce(view)
    chk.true(_path(before, _counts()) == ONE, f"{key}: not one-shot")
    chk.reduced(view.cpu(), [x[::2].contiguous() for x in inputs], "SUM", key)
    chk.true(torch.equal(base[1::2].cpu(), inputs[rank][1::2]), f"{key}: touched the gaps")

    # async_op=True runs on the group's stream, a synchronous call on the caller's: issued
    # back to back without a wait, the second must still follow the first.
    for i in range(20):
        n1, n2 = 513 + i, limits[0] // 4 + 1 + 17 * i  # one-shot, then two-shot (float32)
        k1, k2 = f"nvl/streams/{i}/a", f"nvl/streams/{i}/b"
        a_in = [gen(k1, r, (n1,), torch.float32, "SUM") for r in range(ws)]
        b_in = [gen(k2, r, (n2,), torch.float32, "SUM") for r in range(ws)]
        a, b = a_in[rank].to(dev), b_in[rank].to(dev)
        work = dist.all_reduce(a, async_op=True)
        dist.all_reduce(b)
        work.wait()
        chk.reduced(a.cpu(), a_in, "SUM", k1)
        chk.reduced(b.cpu(), b_in, "SUM", k2)

    # A subgroup has buffers of its own; a group created with the path off stays on NCCL.
    sub, off = sub_and_off_groups(ws)
    for label, group, want in (("subgroup", sub, ONE), ("path off", off, NCCL)):
        key = f"nvl/{label}"
        inputs = [gen(key, r, (4099,), torch.bfloat16, "SUM") for r in range(ws)]
        t = inputs[rank].to(dev)
        before = _counts(group)
        dist.all_reduce(t, group=group)
        chk.true(_path(before, _counts(group)) == want, f"{key}: expected {want}")
        chk.reduced(t.cpu(), inputs, "SUM", key)
        _same_everywhere(chk, t, key, group)
    dist.destroy_process_group(off)
    dist.destroy_process_group(sub)
    chk.raise_if_failed()
    return {"calls": calls}


@pytest.mark.parametrize("ws", WORLDS)
def test_every_dtype_op_size_and_offset(ws: int) -> None:
    """float32/float16/bfloat16 x SUM/AVG/MIN/MAX x sizes from 1 element to past the two-shot
    limit (odd, every tail of a 16-byte unit, each limit +-1) at element offsets 0, 1, 3,
    synchronous and async: each on the expected kernel (or NCCL past the limit), within the
    order-independent rounding bound of the float64 reference, bit-identical on all ranks, and
    nothing written outside the tensor. Other dtypes, PRODUCT and coalesced blocks stay on
    NCCL; strided tensors, async/sync calls back to back, subgroups and
    FASTCOMM_NVLINK=0 are right."""
    res = run_ranks(ws, matrix_fn, timeout_s=900)
    assert res[0]["calls"] > 500, res


def _expected(base: torch.Tensor, ws: int, i: int, op: str, dt: torch.dtype) -> torch.Tensor:
    x = torch.stack([replay_pattern(base, r, i, torch.float64) for r in range(ws)])
    if op == "SUM":
        r = x.sum(0)
    elif op == "AVG":
        r = x.sum(0) / ws
    elif op == "MIN":
        r = x.amin(0)
    else:
        r = x.amax(0)
    return r.to(dt)


def graph_fn(rank: int, ws: int, replays: int) -> dict[str, Any]:
    """One graph of all_reduces on both kernels and on NCCL, captured once and replayed
    `replays` times with fresh data each time, eager calls of other sizes between them."""
    import torchext._testing as testing

    dev = rank_device(rank)
    one, two = testing.nvlink_limits(ws)
    chk = Checker(f"rank {rank}")
    # A second group on the same GPUs, with buffers and counters of its own, in the same graph.
    sub = dist.new_group(list(range(ws)), backend=BACKEND)
    specs = [  # dtype, op, elements, group
        ("bfloat16", "SUM", 3001, None),
        ("float32", "AVG", 1, None),
        ("float16", "MAX", one // 2 - 5, None),  # one-shot
        ("float32", "SUM", two // 4 - 3, None),  # two-shot
        ("bfloat16", "MIN", one // 2 + 11, None),  # two-shot
        ("float32", "SUM", two // 4 + 1001, None),  # NCCL
        ("float32", "SUM", 5003, sub),  # one-shot
        ("bfloat16", "MAX", one // 2 + 11, sub),  # two-shot
    ]
    bases = [torch.arange(n, device=dev, dtype=torch.int64) * 7 for _, _, n, _ in specs]
    static = [torch.zeros(n, dtype=getattr(torch, d), device=dev) for d, _, n, _ in specs]

    def reduce_all() -> None:
        for t, (_, op, _, group) in zip(static, specs):
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)

    reduce_all()  # eager first: the path's buffers exist
    torch.cuda.synchronize()
    before, before_sub = _counts(), _counts(sub)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        reduce_all()
    captured = [b - a for a, b in zip(before, _counts())]
    chk.true(captured == [3, 2], f"captured {captured} one-/two-shot all_reduces, expected [3, 2]")
    captured = [b - a for a, b in zip(before_sub, _counts(sub))]
    chk.true(captured == [1, 1], f"subgroup: captured {captured}, expected [1, 1]")

    bad = torch.zeros((), dtype=torch.int64, device=dev)
    eager_calls = 0
    before = _counts()
    for i in range(replays):
        for t, base, (d, _, _, _) in zip(static, bases, specs):
            t.copy_(replay_pattern(base, rank, i, getattr(torch, d)))
        g.replay()
        for t, base, (d, op, _, _) in zip(static, bases, specs):
            bad += (t != _expected(base, ws, i, op, getattr(torch, d))).sum()
        if i % 50 == 0:
            # An eager call of another size and dtype between replays.
            d, op = DTYPES[(i // 50) % 3], OPS[(i // 50) % 4]
            n = [17, 1023, one // 4 + 5, two // 8 + 3][(i // 50) % 4]
            base = torch.arange(n, device=dev, dtype=torch.int64) * 3
            t = replay_pattern(base, rank, i, getattr(torch, d))
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            bad += (t != _expected(base, ws, i, op, getattr(torch, d))).sum()
            eager_calls += 1
        if i % 1000 == 999:
            chk.true(int(bad) == 0, f"{int(bad)} wrong element(s) by replay {i}")
            if int(bad):
                break
    torch.cuda.synchronize()
    chk.true(int(bad) == 0, f"{int(bad)} wrong element(s) over {replays} replays")
    eager = sum(_counts()) - sum(before)
    chk.true(eager == eager_calls, f"{eager} eager NVLink calls counted, {eager_calls} issued")
    del g
    dist.destroy_process_group(sub)
    # Random data on both kernels after the graph is gone.
    for n in (777, two // 4 - 1):
        key = f"nvl/after-graph/{n}"
        inputs = [gen(key, r, (n,), torch.float32, "SUM") for r in range(ws)]
        t = inputs[rank].to(dev)
        dist.all_reduce(t)
        chk.reduced(t.cpu(), inputs, "SUM", key)
        _same_everywhere(chk, t, key)
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("ws", WORLDS)
def test_graph_replays_between_eager_calls(ws: int) -> None:
    """A CUDA graph of eight all_reduces (one-shot, two-shot and NCCL sizes; SUM, AVG, MIN,
    MAX; three dtypes; two of them on a second group of the same GPUs) captured once and
    replayed 10,000 times with fresh data, an eager all_reduce of another size every 50
    replays: every replay and eager call exact, the capture counted once, the eager calls on
    the NVLink kernels."""
    run_ranks(ws, graph_fn, 10_000, timeout_s=900)


# ----------------------------------------------------------------------------- failures

PG_TIMEOUT_S = 8.0
GRACE_S = 10.0


def killed_fn(rank: int, ws: int, mode: str, kernel: str) -> dict[str, Any]:
    import torchext._testing as testing

    dev = rank_device(rank)
    dist.init_process_group(backend=BACKEND, timeout=timedelta(seconds=PG_TIMEOUT_S))
    chk = Checker(f"rank {rank}")
    # float32 elements: a quarter of the low-latency kernel's limit, or just past it (still
    # one-shot, on the kernel with a barrier).
    low_latency = testing.nvlink_low_latency_bytes(ws) // 4
    n = low_latency // 4 + 3 if kernel == "low-latency" else low_latency + 1001
    warm = torch.ones(n, device=dev)
    before = _counts()
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    chk.true(bool((warm == ws).all()), "warm-up")
    chk.true(_path(before, _counts()) == ONE, "warm-up not on the one-shot kernel")
    static = torch.ones(n, device=dev)
    g = None
    if mode == "graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(static)
        static.fill_(1.0)
        g.replay()
        torch.cuda.synchronize()
        chk.true(bool((static == ws).all()), "replay with every rank")
    victim = 1
    dist.barrier()
    torch.cuda.synchronize()
    if rank == victim:
        os._exit(17)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        if mode == "eager":
            dist.all_reduce(torch.ones(n, device=dev), async_op=True).wait()
            torch.cuda.synchronize()
        else:
            assert g is not None
            g.replay()  # its kernel gives up after the timeout and reports
            torch.cuda.synchronize()
            out["replay_s"] = time.monotonic() - t0
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline:  # the report fails the group
                dist.all_reduce(torch.ones(n, device=dev), async_op=True).wait()
                torch.cuda.synchronize()
    except RuntimeError as e:
        out.update(chk.peer_failure(e, t0, PG_TIMEOUT_S + GRACE_S, "all_reduce", victim))
    else:
        chk.fail(f"{mode}: all_reduce returned normally without rank {victim}")
    del g
    out["destroy_s"] = chk.destroy_within(PG_TIMEOUT_S + GRACE_S)
    chk.raise_if_failed()
    return out


@pytest.mark.parametrize("kernel", ["low-latency", "barrier"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_killed_peer_fails_the_survivor_clearly(mode: str, kernel: str) -> None:
    """Rank 1 dies after the path was set up, on each one-shot kernel (the low-latency one and
    the one with a barrier). Eager: rank 0's all_reduce raises within the group timeout + 10 s
    naming all_reduce, rank [1] and the timeout (the watchdog, or the kernel's own bounded
    wait). Graph: the replay's kernel gives up after the timeout and reports; the group fails
    with that error at the next call. destroy_process_group() returns either way."""
    res = run_ranks(
        2,
        killed_fn,
        mode,
        kernel,
        init=False,
        expect_fail={1: 17},
        timeout_s=180,
        env={"FASTCOMM_BLOCKING_WAIT": "1"},
    )
    assert isinstance(res[1], RankFailure)
    assert "message" in res[0], res[0]
