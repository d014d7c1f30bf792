"""fastcomm's CUDA all_gather and reduce_scatter over NVLink peer memory inside a node
(csrc/intra/nvlink/, kernels/nvlink_collectives.cu): the flat forms (all_gather_into_tensor,
reduce_scatter_tensor, and the list forms' single flat tensor) up to
torchext._testing.nvlink_part_limits() bytes per rank; NCCL above and for everything else.

Needs 2 GPUs connected by NVLink (one per rank). The path taken by every call is checked through
stats() (nvlink_all_gather / nvlink_reduce_scatter), so a silent fallback to NCCL fails.
all_gather must be exact for every dtype; reduce_scatter is compared with a float64 reference
within the order-independent rounding bound. Replays of a CUDA graph are checked on the GPU
against integer data whose reductions are exact in every dtype.

Run on the GPU machine:  python -m pytest -q tests/test_nvlink_gather_scatter.py
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
    pytest.mark.skipif(is_gloo(), reason="fastcomm's NVLink all_gather / reduce_scatter"),
    pytest.mark.cuda(world_size=2),
]

REDUCE_DTYPES = ["float32", "float16", "bfloat16"]
OPS = ["SUM", "AVG", "MIN", "MAX"]
GATHER_DTYPES = ["float32", "bfloat16", "float64", "int64", "int32", "uint8", "bool"]
KEYS = ("nvlink_all_gather", "nvlink_reduce_scatter")


def _sizes(esize: int, limit: int) -> list[int]:
    """Elements per rank from 1 to past the limit: odd ones, every remainder of a 16-byte unit,
    and the limit -1 / exactly / +1 element."""
    per_unit = max(1, 16 // esize)
    small = [1, 2, 3, 5, 7, per_unit - 1, per_unit, per_unit + 1, 2 * per_unit + 3, 127]
    small += [1000, 4097, 65537 // esize]
    n = limit // esize
    return sorted({k for k in small + [n - 1, n, n + 1] if k >= 1})


def _gather_one(
    chk: Checker, rank: int, ws: int, dev: torch.device, dt_name: str, n: int, offset: int
) -> int:
    """all_gather_into_tensor of n elements at an element offset into a guarded buffer."""
    dt = getattr(torch, dt_name)
    key = f"nvl-ag/{dt_name}/{n}/{offset}"
    parts = [gen(key, r, (n,), dt) for r in range(ws)]
    src = torch.zeros(offset + n, dtype=dt, device=dev)
    src[offset:].copy_(parts[rank].to(dev))
    guard = torch.ones((), dtype=dt) if dt != torch.bool else torch.tensor(True)
    buf = torch.full((offset + ws * n + 3,), guard.item(), dtype=dt, device=dev)
    out = buf[offset : offset + ws * n]
    before = nvlink_calls(KEYS[0])
    dist.all_gather_into_tensor(out, src[offset:])
    took = nvlink_calls(KEYS[0]) - before
    got = buf.cpu()
    chk.equal(got[offset : offset + ws * n], torch.cat(parts), key)
    outside = torch.cat([got[:offset], got[offset + ws * n :]])
    chk.true(bool((outside == guard).all()), f"{key}: wrote outside the output")
    return took


def _scatter_one(
    chk: Checker, rank: int, ws: int, dev: torch.device, dt_name: str, op: str, n: int, offset: int
) -> int:
    """reduce_scatter_tensor of ws x n elements (input at an element offset) into n."""
    dt = getattr(torch, dt_name)
    key = f"nvl-rs/{dt_name}/{op}/{n}/{offset}"
    inputs = [gen(key, r, (ws * n,), dt, op) for r in range(ws)]
    src = torch.zeros(offset + ws * n, dtype=dt, device=dev)
    src[offset:].copy_(inputs[rank].to(dev))
    buf = torch.full((offset + n + 3,), 7.0, dtype=dt, device=dev)
    out = buf[offset : offset + n]
    before = nvlink_calls(KEYS[1])
    dist.reduce_scatter_tensor(out, src[offset:], op=getattr(dist.ReduceOp, op))
    took = nvlink_calls(KEYS[1]) - before
    got = buf.cpu()
    chk.reduced(got[offset : offset + n], [x[rank * n : (rank + 1) * n] for x in inputs], op, key)
    outside = torch.cat([got[:offset], got[offset + n :]])
    chk.true(bool((outside == 7.0).all()), f"{key}: wrote outside the output")
    return took


def matrix_fn(rank: int, ws: int) -> dict[str, Any]:
    """Every dtype (and op) x size at offsets 0 and 1, each on the expected path; then the
    in-place forms FSDP uses, the list forms, async calls and a subgroup."""
    import torchext._testing as testing

    dev = rank_device(rank)
    gather_limit, scatter_limit = testing.nvlink_part_limits(ws)
    chk = Checker(f"rank {rank}")
    calls = 0
    for dt_name in GATHER_DTYPES:
        esize = torch.tensor([], dtype=getattr(torch, dt_name)).element_size()
        for n in _sizes(esize, gather_limit):
            for offset in (0, 1):
                took = _gather_one(chk, rank, ws, dev, dt_name, n, offset)
                want = 1 if n * esize <= gather_limit else 0
                chk.true(took == want, f"all_gather {dt_name} x {n}: {took} NVLink calls")
                calls += 1
    for dt_name in REDUCE_DTYPES:
        esize = torch.tensor([], dtype=getattr(torch, dt_name)).element_size()
        for n in _sizes(esize, scatter_limit):
            for op in OPS:
                for offset in (0, 1):
                    took = _scatter_one(chk, rank, ws, dev, dt_name, op, n, offset)
                    want = 1 if n * esize <= scatter_limit else 0
                    chk.true(took == want, f"reduce_scatter {dt_name} {op} x {n}: {took} calls")
                    calls += 1

    # In place: the input is this rank's part of the all_gather's output (FSDP2), the
    # output this rank's part of the reduce_scatter's input.
    n = 3001
    parts = [gen("nvl-ag/inplace", r, (n,), torch.bfloat16) for r in range(ws)]
    out = torch.empty(ws * n, dtype=torch.bfloat16, device=dev)
    out[rank * n : (rank + 1) * n].copy_(parts[rank].to(dev))
    before = nvlink_calls(KEYS[0])
    dist.all_gather_into_tensor(out, out[rank * n : (rank + 1) * n])
    chk.true(nvlink_calls(KEYS[0]) - before == 1, "in-place all_gather not on NVLink")
    chk.equal(out.cpu(), torch.cat(parts), "in-place all_gather")
    inputs = [gen("nvl-rs/inplace", r, (ws * n,), torch.float32, "SUM") for r in range(ws)]
    src = inputs[rank].to(dev)
    before = nvlink_calls(KEYS[1])
    dist.reduce_scatter_tensor(src[rank * n : (rank + 1) * n], src)
    chk.true(nvlink_calls(KEYS[1]) - before == 1, "in-place reduce_scatter not on NVLink")
    chk.reduced(
        src[rank * n : (rank + 1) * n].cpu(),
        [x[rank * n : (rank + 1) * n] for x in inputs],
        "SUM",
        "in-place reduce_scatter",
    )

    # The list forms with one tensor per rank stay on NCCL and are right.
    t = gen("nvl-ag/list", rank, (513,), torch.float32).to(dev)
    outs = [torch.empty_like(t) for _ in range(ws)]
    before = nvlink_calls(KEYS[0])
    dist.all_gather(outs, t)
    chk.true(nvlink_calls(KEYS[0]) == before, "list all_gather left NCCL")
    for r, o in enumerate(outs):
        chk.equal(o.cpu(), gen("nvl-ag/list", r, (513,), torch.float32), f"list all_gather {r}")
    ins = [gen(f"nvl-rs/list/{q}", rank, (513,), torch.float32, "SUM").to(dev) for q in range(ws)]
    o = torch.empty(513, device=dev)
    dist.reduce_scatter(o, ins)
    chk.reduced(
        o.cpu(),
        [gen(f"nvl-rs/list/{rank}", r, (513,), torch.float32, "SUM") for r in range(ws)],
        "SUM",
        "list reduce_scatter",
    )

    # async_op=True on the group's stream, then synchronous calls on the caller's, back to
    # back: each follows the one before.
    for i in range(20):
        n1, n2 = 700 + i, 5000 + 17 * i
        a_parts = [gen(f"nvl-as/{i}", r, (n1,), torch.float16) for r in range(ws)]
        a_out = torch.empty(ws * n1, dtype=torch.float16, device=dev)
        work = dist.all_gather_into_tensor(a_out, a_parts[rank].to(dev), async_op=True)
        b_in = [gen(f"nvl-bs/{i}", r, (ws * n2,), torch.float32, "SUM") for r in range(ws)]
        b_out = torch.empty(n2, device=dev)
        dist.reduce_scatter_tensor(b_out, b_in[rank].to(dev))
        c = gen(f"nvl-cs/{i}", rank, (n1,), torch.float32, "SUM").to(dev)
        dist.all_reduce(c)
        work.wait()
        chk.equal(a_out.cpu(), torch.cat(a_parts), f"async all_gather {i}")
        chk.reduced(b_out.cpu(), [x[rank * n2 : (rank + 1) * n2] for x in b_in], "SUM", f"rs {i}")
        chk.reduced(
            c.cpu(),
            [gen(f"nvl-cs/{i}", r, (n1,), torch.float32, "SUM") for r in range(ws)],
            "SUM",
            f"all_reduce {i}",
        )

    # A subgroup has buffers of its own; a group with the path off stays on NCCL.
    sub, off = sub_and_off_groups(ws)
    for label, group, want in (("subgroup", sub, 1), ("path off", off, 0)):
        parts = [gen(f"nvl-ag/{label}", r, (999,), torch.float32) for r in range(ws)]
        out = torch.empty(ws * 999, device=dev)
        before = nvlink_calls(KEYS[0], group)
        dist.all_gather_into_tensor(out, parts[rank].to(dev), group=group)
        chk.true(nvlink_calls(KEYS[0], group) - before == want, f"{label}: all_gather path")
        chk.equal(out.cpu(), torch.cat(parts), f"{label}: all_gather")
    dist.destroy_process_group(off)
    dist.destroy_process_group(sub)
    chk.raise_if_failed()
    return {"calls": calls}


@pytest.mark.parametrize("ws", WORLDS)
def test_every_dtype_op_size_and_form(ws: int) -> None:
    """all_gather of seven dtypes and reduce_scatter of float32/float16/bfloat16 x SUM/AVG/
    MIN/MAX, 1 element to past the limit per rank at offsets 0 and 1: right, on the expected
    path, nothing written outside the output. The in-place forms, the list forms (NCCL),
    async and synchronous calls back to back, subgroups and FASTCOMM_NVLINK=0."""
    res = run_ranks(ws, matrix_fn, timeout_s=900)
    assert res[0]["calls"] > 300, res


def graph_fn(rank: int, ws: int, replays: int) -> dict[str, Any]:
    """all_gather, reduce_scatter and all_reduce captured in one graph, replayed with fresh
    data; eager calls of other sizes between replays."""
    import torchext._testing as testing

    dev = rank_device(rank)
    gather_limit, scatter_limit = testing.nvlink_part_limits(ws)
    chk = Checker(f"rank {rank}")
    n_ag, n_rs = 4099, scatter_limit // 2 // 2 - 7  # bf16 all_gather, float16 reduce_scatter
    base_ag = torch.arange(n_ag, device=dev, dtype=torch.int64) * 5
    base_rs = torch.arange(ws * n_rs, device=dev, dtype=torch.int64) * 3
    ag_in = torch.zeros(n_ag, dtype=torch.bfloat16, device=dev)
    ag_out = torch.zeros(ws * n_ag, dtype=torch.bfloat16, device=dev)
    rs_in = torch.zeros(ws * n_rs, dtype=torch.float16, device=dev)
    rs_out = torch.zeros(n_rs, dtype=torch.float16, device=dev)
    ar = torch.zeros(777, device=dev)
    base_ar = torch.arange(777, device=dev, dtype=torch.int64)

    def calls() -> None:
        dist.all_gather_into_tensor(ag_out, ag_in)
        dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.AVG)
        dist.all_reduce(ar, op=dist.ReduceOp.MAX)

    calls()  # eager first
    torch.cuda.synchronize()
    before = [nvlink_calls(k) for k in KEYS]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    chk.true(
        [nvlink_calls(k) - b for k, b in zip(KEYS, before)] == [1, 1], "capture not counted once"
    )

    bad = torch.zeros((), dtype=torch.int64, device=dev)
    for i in range(replays):
        ag_in.copy_(replay_pattern(base_ag, rank, i, torch.bfloat16))
        rs_in.copy_(replay_pattern(base_rs, rank, i, torch.float16))
        ar.copy_(replay_pattern(base_ar, rank, i, torch.float32))
        g.replay()
        want_ag = torch.cat([replay_pattern(base_ag, r, i, torch.float64) for r in range(ws)])
        bad += (ag_out.double() != want_ag).sum()
        rows = torch.stack([replay_pattern(base_rs, r, i, torch.float64) for r in range(ws)])
        want_rs = (rows.sum(0) / ws).to(torch.float16)[rank * n_rs : (rank + 1) * n_rs]
        bad += (rs_out != want_rs).sum()
        want_ar = torch.stack(
            [replay_pattern(base_ar, r, i, torch.float64) for r in range(ws)]
        ).amax(0)
        bad += (ar.double() != want_ar).sum()
        if i % 50 == 0:
            m = [9, 1001, gather_limit // 8 + 3][(i // 50) % 3]
            parts = [
                replay_pattern(torch.arange(m, device=dev) * 7, r, i, torch.float32)
                for r in range(ws)
            ]
            out = torch.empty(ws * m, device=dev)
            dist.all_gather_into_tensor(out, parts[rank])
            bad += (out != torch.cat(parts)).sum()
        if i % 1000 == 999 and int(bad):
            break
    torch.cuda.synchronize()
    chk.true(int(bad) == 0, f"{int(bad)} wrong element(s) over {replays} replays")
    del g
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("ws", WORLDS)
def test_graph_replays_between_eager_calls(ws: int) -> None:
    """A CUDA graph of an all_gather (bf16), a reduce_scatter (float16 AVG) and an all_reduce
    (MAX), captured once and replayed 5,000 times with fresh data, an eager all_gather of
    another size every 50 replays: every element exact."""
    run_ranks(ws, graph_fn, 5_000, timeout_s=900)


PG_TIMEOUT_S = 8.0
GRACE_S = 10.0


def killed_fn(rank: int, ws: int, op: str) -> dict[str, Any]:
    dev = rank_device(rank)
    dist.init_process_group(backend=BACKEND, timeout=timedelta(seconds=PG_TIMEOUT_S))
    chk = Checker(f"rank {rank}")
    n = 4099
    key = KEYS[0] if op == "all_gather" else KEYS[1]

    def call(async_op: bool) -> Any:
        if op == "all_gather":
            out = torch.empty(ws * n, device=dev)
            return dist.all_gather_into_tensor(out, torch.ones(n, device=dev), async_op=async_op)
        out = torch.empty(n, device=dev)
        return dist.reduce_scatter_tensor(out, torch.ones(ws * n, device=dev), async_op=async_op)

    before = nvlink_calls(key)
    call(False)
    torch.cuda.synchronize()
    chk.true(nvlink_calls(key) - before == 1, f"warm-up {op} not on NVLink")
    victim = 1
    dist.barrier()
    torch.cuda.synchronize()
    if rank == victim:
        os._exit(17)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        call(True).wait()
        torch.cuda.synchronize()
    except RuntimeError as e:
        out.update(chk.peer_failure(e, t0, PG_TIMEOUT_S + GRACE_S, op, victim))
    else:
        chk.fail(f"{op} returned normally without rank {victim}")
    out["destroy_s"] = chk.destroy_within(PG_TIMEOUT_S + GRACE_S)
    chk.raise_if_failed()
    return out


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_killed_peer_fails_the_survivor_clearly(op: str) -> None:
    """Rank 1 dies after the path was set up: rank 0's call raises within the group timeout +
    10 s naming the collective, rank [1] and the timeout; destroy_process_group() returns."""
    res = run_ranks(
        2,
        killed_fn,
        op,
        init=False,
        expect_fail={1: 17},
        timeout_s=180,
        env={"FASTCOMM_BLOCKING_WAIT": "1"},
    )
    assert isinstance(res[1], RankFailure)
    assert "message" in res[0], res[0]
