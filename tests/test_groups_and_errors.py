"""Subgroups, split_group, destroy/re-init, argument validation and failure handling.

Runs against FASTCOMM_TEST_BACKEND (default "fastcomm"); see tests/README.md.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _harness import BACKEND, Checker, RankFailure, free_port, gen, is_gloo, run_ranks

# ------------------------------------------------------------------------------ helpers


def _new_group(ranks: list[int]) -> tuple[dist.ProcessGroup, list[int]]:
    """new_group in the order given where torch supports it (sort_ranks); older torch
    (2.11) sorts the ranks. Returns the group and its members in group-rank order."""
    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        return dist.new_group(ranks, sort_ranks=False), list(ranks)
    return dist.new_group(ranks), sorted(ranks)


def _group_checks(chk: Checker, grp: Any, members: list[int], key: str, device: str) -> None:
    """Run a set of collectives on ``grp`` (whose group rank i is global rank
    members[i]) and check them against references built from global-rank inputs."""
    rank = dist.get_rank()
    n = len(members)
    gr = members.index(rank)
    dev = torch.device(device)
    chk.true(dist.get_rank(grp) == gr, f"{key}: get_rank(group)={dist.get_rank(grp)} != {gr}")
    chk.true(dist.get_world_size(grp) == n, f"{key}: get_world_size(group) != {n}")
    chk.true(
        dist.get_process_group_ranks(grp) == members,
        f"{key}: get_process_group_ranks {dist.get_process_group_ranks(grp)} != {members}",
    )

    def g(
        r: int, shape: Any, dtype: torch.dtype = torch.float32, salt: str = "", mode: str = "any"
    ):
        return gen(f"{key}/{salt}", r, shape, dtype, mode)

    # all_reduce (float32 SUM, int64 MAX)
    ins = [g(m, (11,), mode="SUM") for m in members]
    t = g(rank, (11,), mode="SUM").to(dev)
    dist.all_reduce(t, group=grp)
    chk.reduced(t, ins, "SUM", f"{key}: all_reduce")
    ins = [g(m, (6,), torch.int64, "max") for m in members]
    t = g(rank, (6,), torch.int64, "max").to(dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=grp)
    chk.reduced(t, ins, "MAX", f"{key}: all_reduce MAX")
    # broadcast with a global src, and with group_src
    src = members[-1]
    t = g(rank, (5,), salt="b").to(dev)
    dist.broadcast(t, src=src, group=grp)
    chk.equal(t, g(src, (5,), salt="b"), f"{key}: broadcast src={src}")
    t = g(rank, (5,), salt="b0").to(dev)
    dist.broadcast(t, group=grp, group_src=0)
    chk.equal(t, g(members[0], (5,), salt="b0"), f"{key}: broadcast group_src=0")
    # all_gather / all_gather_into_tensor: outputs in GROUP rank order
    outs = [torch.zeros(4, device=dev) for _ in range(n)]
    dist.all_gather(outs, g(rank, (4,), salt="ag").to(dev), group=grp)
    for j, m in enumerate(members):
        chk.equal(outs[j], g(m, (4,), salt="ag"), f"{key}: all_gather[{j}] (global {m})")
    out = torch.zeros(4 * n, device=dev)
    dist.all_gather_into_tensor(out, g(rank, (4,), salt="agt").to(dev), group=grp)
    chk.equal(out, torch.cat([g(m, (4,), salt="agt") for m in members]), f"{key}: agt order")
    # reduce_scatter_tensor: group rank gr gets chunk gr
    ins = [g(m, (3 * n,), salt="rs", mode="SUM") for m in members]
    out = torch.zeros(3, device=dev)
    dist.reduce_scatter_tensor(out, g(rank, (3 * n,), salt="rs", mode="SUM").to(dev), group=grp)
    chk.reduced(out, [x.chunk(n)[gr] for x in ins], "SUM", f"{key}: reduce_scatter_tensor")
    # reduce to a global dst
    dst = members[0]
    ins = [g(m, (7,), salt="red", mode="SUM") for m in members]
    t = g(rank, (7,), salt="red", mode="SUM").to(dev)
    dist.reduce(t, dst=dst, group=grp)
    if rank == dst:
        chk.reduced(t, ins, "SUM", f"{key}: reduce dst={dst}")
    # gather / scatter by group rank
    gl = [torch.zeros(2, device=dev) for _ in range(n)] if gr == n - 1 else None
    dist.gather(g(rank, (2,), salt="ga").to(dev), gl, group=grp, group_dst=n - 1)
    if gl is not None:
        for j, m in enumerate(members):
            chk.equal(gl[j], g(m, (2,), salt="ga"), f"{key}: gather[{j}]")
    sl = [g(rank, (2,), salt=f"sc{j}").to(dev) for j in range(n)] if gr == 0 else None
    out = torch.zeros(2, device=dev)
    dist.scatter(out, sl, group=grp, group_src=0)
    chk.equal(out, g(members[0], (2,), salt=f"sc{gr}"), f"{key}: scatter")
    # all_to_all_single
    out = torch.zeros(2 * n, device=dev)
    dist.all_to_all_single(out, g(rank, (2 * n,), salt="a2a").to(dev), group=grp)
    exp = torch.cat([g(m, (2 * n,), salt="a2a").chunk(n)[gr] for m in members])
    chk.equal(out, exp, f"{key}: all_to_all_single")
    # point-to-point inside the group: group ranks and global ranks
    if n > 1:
        nxt, prv = (gr + 1) % n, (gr - 1) % n
        buf = torch.zeros(3, device=dev)
        works = [
            dist.isend(g(rank, (3,), salt="p2p").to(dev), group=grp, group_dst=nxt),
            dist.irecv(buf, group=grp, group_src=prv),
        ]
        for w in works:
            w.wait()
        chk.equal(buf, g(members[prv], (3,), salt="p2p"), f"{key}: irecv group_src={prv}")
        buf2 = torch.zeros(3, device=dev)
        ops = [
            dist.P2POp(dist.irecv, buf2, members[prv], group=grp),
            dist.P2POp(dist.isend, g(rank, (3,), salt="batch").to(dev), members[nxt], group=grp),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        chk.equal(buf2, g(members[prv], (3,), salt="batch"), f"{key}: batch_isend_irecv")
    dist.barrier(group=grp)


def _world_check(chk: Checker, key: str, device: str = "cpu") -> None:
    """A normal collective on the world group with fresh data, checked."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    ins = [gen(key, r, (13,), torch.float32, "SUM") for r in range(ws)]
    t = ins[rank].clone().to(device)
    dist.all_reduce(t)
    chk.reduced(t, ins, "SUM", f"{key}: world all_reduce")
    out = torch.zeros(5 * ws, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, gen(key + "/ag", rank, (5,), torch.int64).to(device))
    chk.equal(out, torch.cat([gen(key + "/ag", r, (5,), torch.int64) for r in range(ws)]), key)


# ---------------------------------------------------------------------------- subgroups


def subgroups_fn(rank: int, ws: int, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    chk = Checker(f"rank {rank}")
    assert ws == 4
    layouts = {
        "subset[1,2]": [1, 2],
        "gap[0,3]": [0, 3],
        "reversed[3,2,1,0]": [3, 2, 1, 0],
        "single[2]": [2],
    }
    groups = {}
    for name, members in layouts.items():  # every rank creates every group, in order
        groups[name], layouts[name] = _new_group(members)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for name, members in layouts.items():
        grp = groups[name]
        if rank in members:
            _group_checks(chk, grp, members, name, device)
        else:
            chk.true(grp == dist.GroupMember.NON_GROUP_MEMBER, f"{name}: non-member got a group")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ret = dist.all_reduce(torch.ones(1, device=device), group=grp)
            chk.true(ret is None, f"{name}: collective on a non-member group returned {ret}")
        _world_check(chk, f"world after {name}", device)
    # two disjoint groups running at the same time
    mine = pairs[0] if rank < 2 else pairs[1]
    _group_checks(chk, mine, [0, 1] if rank < 2 else [2, 3], "concurrent pair", device)
    _world_check(chk, "world after pairs", device)
    # destroying a subgroup leaves the others working
    dist.destroy_process_group(pairs[0] if rank < 2 else pairs[1])
    dist.destroy_process_group(pairs[1] if rank < 2 else pairs[0])  # NON_GROUP_MEMBER: no-op
    if rank in layouts["reversed[3,2,1,0]"]:
        rev = layouts["reversed[3,2,1,0]"]  # the group-rank order this torch gave it
        _group_checks(chk, groups["reversed[3,2,1,0]"], rev, "reversed again", device)
    _world_check(chk, "world after destroying pairs", device)
    chk.raise_if_failed()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda(world_size=4))]
)
def test_subgroups(device: str) -> None:
    run_ranks(4, subgroups_fn, device, timeout_s=180)


def split_group_fn(rank: int, ws: int, device: str) -> None:
    # torch (2.11 at least) splits CUDA groups only when the default group is bound to a
    # device, so this test initialises the group itself, with device_id on CUDA.
    dev = torch.device("cuda", rank) if device == "cuda" else None
    if dev is not None:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend=BACKEND, device_id=dev, timeout=timedelta(seconds=60))
    chk = Checker(f"rank {rank}")
    layout = [[0, 2], [3, 1]]
    sub = dist.split_group(split_ranks=layout)
    # group-rank order as torch assigned it (torch 2.11 sorts each split, 2.15 keeps it)
    members = dist.get_process_group_ranks(sub)
    chk.true(sorted(members) == sorted(next(m for m in layout if rank in m)), "split members")
    chk.true(sub is not None and sub != dist.GroupMember.NON_GROUP_MEMBER, "no split group")
    chk.true(dist.get_backend(sub) == BACKEND, f"split group backend {dist.get_backend(sub)}")
    _group_checks(chk, sub, members, f"split{members}", device)
    _world_check(chk, "world after split", device)
    # a split in which rank 1 is in no group
    sub2 = dist.split_group(split_ranks=[[0, 3, 2]])
    if rank == 1:
        # torch 2.11 returns None to a non-member of a split, newer torch NON_GROUP_MEMBER
        chk.true(
            sub2 is None or sub2 == dist.GroupMember.NON_GROUP_MEMBER,
            f"rank 1 got a group from split: {sub2!r}",
        )
    else:
        _group_checks(chk, sub2, dist.get_process_group_ranks(sub2), "split[0,3,2]", device)
    # split of a split: split_ranks are ranks of the parent group (e.g. [0, 3, 2] on
    # torch 2.15, where group ranks [0, 2] are global [0, 2] and group rank [1] is global 3)
    if rank != 1:
        parent = dist.get_process_group_ranks(sub2)
        sub3 = dist.split_group(parent_pg=sub2, split_ranks=[[0, 2], [1]])
        want = {parent[0], parent[2]} if rank in (parent[0], parent[2]) else {parent[1]}
        mem3 = dist.get_process_group_ranks(sub3)
        chk.true(set(mem3) == want, f"split-of-split members {mem3}, expected {sorted(want)}")
        _group_checks(chk, sub3, mem3, f"split-of-split{mem3}", device)
    _world_check(chk, "world after nested split", device)
    dist.destroy_process_group()  # tear down every group here, not at interpreter exit
    chk.raise_if_failed()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda(world_size=4))]
)
def test_split_group(device: str) -> None:
    if not hasattr(dist, "split_group"):
        pytest.skip("this torch has no dist.split_group")
    run_ranks(4, split_group_fn, device, init=False, timeout_s=180)


def split_fn(rank: int, ws: int) -> None:
    chk = Checker(f"rank {rank}")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    store = dist.distributed_c10d._get_default_store()

    def split(name: str, ranks: list[int]) -> Any:
        opts = backend._copy_options()
        opts.group_name = name
        opts._timeout = timedelta(seconds=20)
        return backend.split(dist.PrefixStore(f"{name}/", store), ranks, opts)

    def check_all_reduce(child: Any, key: str) -> None:
        t = gen(key, rank, (7,), torch.float32, "SUM")
        child.allreduce([t]).wait()
        ins = [gen(key, r, (7,), torch.float32, "SUM") for r in range(ws)]
        chk.reduced(t, ins, "SUM", f"all_reduce on the split: {key}")

    # as torch 2.11's ProcessGroup::splitGroup asks: once per device type, same store and name
    opts = backend._copy_options()
    opts.group_name = "split-twice"
    twice = dist.PrefixStore("split-twice/", store)
    first = backend.split(twice, [1, 0], opts)
    chk.true(backend.split(twice, [1, 0], opts) is first, "a second ask made another backend")
    check_all_reduce(first, "asked twice")
    # a split rank 1 is no member of, then one that torch 2.11 names differently on each rank
    # after such a group (it salts the name with the number of groups the rank is in)
    chk.true((split("only-0", [0]) is None) == (rank == 1), "membership of split [0]")
    check_all_reduce(split(f"named-on-rank-{rank}", [0, 1]), "names differ between the ranks")
    dist.destroy_process_group()
    chk.raise_if_failed()


@pytest.mark.skipif(is_gloo(), reason="gloo: tests fastcomm's split")
def test_split_asked_twice_or_named_differently_per_rank() -> None:
    """torch 2.11 asks a backend to split once per device type, and names a split differently
    on each rank after a new_group not every rank joined: one child per split, and its ranks
    meet whatever the name."""
    run_ranks(2, split_fn, timeout_s=120)


def _split_with_late_peer(rank: int, name: str) -> tuple[Any, torch.Tensor]:
    """A split of both ranks named `name`, and this rank's all_reduce input; rank 1 returns a
    second late, so rank 0's all_reduce on the split waits for it."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    opts = backend._copy_options()
    opts.group_name = name
    store = dist.PrefixStore(f"{name}/", dist.distributed_c10d._get_default_store())
    child = backend.split(store, [0, 1], opts)
    if rank == 1:
        time.sleep(1.0)
    return child, gen(name, rank, (7,), torch.float32, "SUM")


def drop_with_callback_pending_fn(rank: int, ws: int) -> None:
    chk = Checker(f"rank {rank}")
    # rank 0's all_reduce is still waiting when it drops its group
    child, t = _split_with_late_peer(rank, "dropped")
    callback_threads: list[int] = []
    fut = child.allreduce([t]).get_future()
    # The callback runs where the all_reduce completes, a thread of the group, and takes
    # the GIL there: the group's destruction below must not hold the GIL while it waits.
    done = fut.then(lambda f: callback_threads.append(threading.get_ident()))
    del child  # returns once the group's work is done
    chk.true(len(callback_threads) == 1, "the callback had run when the group was gone")
    done.wait()
    ins = [gen("dropped", r, (7,), torch.float32, "SUM") for r in range(ws)]
    chk.reduced(t, ins, "SUM", "all_reduce completed by the group's destruction")
    dist.destroy_process_group()
    chk.raise_if_failed()


@pytest.mark.skipif(is_gloo(), reason="gloo: tests fastcomm's destruction")
def test_group_dropped_with_a_python_callback_pending() -> None:
    """The last reference to a split group dropped in Python while its all_reduce is in
    flight with a Python callback on its future: the group's work drains as the reference
    goes (not later, with its parent), and the callback, which needs the GIL on the
    group's thread, runs meanwhile; nothing deadlocks."""
    run_ranks(2, drop_with_callback_pending_fn, timeout_s=60)


def last_reference_in_callback_fn(rank: int, ws: int) -> None:
    chk = Checker(f"rank {rank}")
    # rank 0's all_reduce completes on the group's own thread
    child, t = _split_with_late_peer(rank, "released")
    holder = [child]
    fut = child.allreduce([t]).get_future()
    # The callback drops the group's last reference: on rank 0 on the thread that completed
    # the all_reduce, which the group's destruction then cannot join.
    done = fut.then(lambda f: holder.clear())
    del child
    done.wait()
    ins = [gen("released", r, (7,), torch.float32, "SUM") for r in range(ws)]
    chk.reduced(t, ins, "SUM", "all_reduce of a group released by its callback")
    chk.true(not holder, "the callback ran")
    t2 = gen("after", rank, (5,), torch.float32, "SUM")
    dist.all_reduce(t2)
    ins2 = [gen("after", r, (5,), torch.float32, "SUM") for r in range(ws)]
    chk.reduced(t2, ins2, "SUM", "all_reduce on the parent afterwards")
    dist.destroy_process_group()
    chk.raise_if_failed()


@pytest.mark.skipif(is_gloo(), reason="gloo: tests fastcomm's destruction")
def test_group_released_by_its_own_callback() -> None:
    """A Python callback on a split group's work holds the group's last reference and drops it
    on the thread that completed the work, one of the group's own: the group is destroyed
    there without joining that thread from itself, and the process goes on."""
    run_ranks(2, last_reference_in_callback_fn, timeout_s=60)


def send_to_self_alone_fn(rank: int, ws: int, device: str) -> None:
    """Rank 0 alone exchanges messages with itself as the first ops of a fresh group (as
    PyTorch's test_batch_isend_irecv_self_nccl does): nothing may wait for the other ranks,
    which meanwhile wait in a barrier of the world group."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    chk = Checker(f"rank {rank}")
    grp = dist.new_group(list(range(ws)))
    if rank == 0:  # torch allows sends to the rank itself only in batches
        for n in (1, 2):  # receives listed before their sends; two keep their order
            sent = [gen(f"self{n}", k, (7, 3), torch.float32).to(device) for k in range(n)]
            got = [torch.full((7, 3), -1.0, device=device) for _ in range(n)]
            ops = [dist.P2POp(dist.irecv, g, 0, group=grp) for g in got]
            ops += [dist.P2POp(dist.isend, t, 0, group=grp) for t in sent]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            for k in range(n):
                chk.equal(got[k], sent[k], f"batch of {n} with itself alone: message {k}")
    dist.barrier()
    _group_checks(chk, grp, list(range(ws)), "group after the self exchange", device)
    dist.destroy_process_group(grp)
    chk.raise_if_failed()


@pytest.mark.skipif(is_gloo(), reason="gloo cannot send to the rank itself")
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda(world_size=2))]
)
def test_send_to_self_alone_first(device: str) -> None:
    run_ranks(2, send_to_self_alone_fn, device, pg_timeout_s=30, timeout_s=120)


def reinit_fn(rank: int, ws: int, ports: list[int]) -> int:
    chk = Checker(f"rank {rank}")
    rounds = len(ports)
    for i in range(rounds):
        # A fresh rendezvous per round (env:// keeps one multi-tenant TCPStore per port
        # alive in the process, and the group names repeat after a destroy, so reusing the
        # port would hand every backend the previous round's stale keys).
        os.environ["MASTER_PORT"] = str(ports[i])
        dist.init_process_group(backend=BACKEND, timeout=timedelta(seconds=60))
        chk.true(dist.is_initialized() and dist.get_backend() == BACKEND, f"round {i}: backend")
        _world_check(chk, f"round {i}")
        sub, order = _new_group([1, 0])  # same group name every round
        _group_checks(chk, sub, order, f"round {i} subgroup", "cpu")
        dist.destroy_process_group()
        chk.true(not dist.is_initialized(), f"round {i}: still initialised after destroy")
    chk.raise_if_failed()
    return rounds


def test_destroy_and_reinit() -> None:
    """destroy_process_group() then init_process_group() again in the same processes
    (three rounds, each with a subgroup that gets the same name every round)."""
    ports = [free_port() for _ in range(3)]
    assert run_ranks(2, reinit_fn, ports, init=False, timeout_s=120) == [3, 3]


# ------------------------------------------------------------------- invalid arguments


def _invalid_calls(rank: int, ws: int) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) pairs; each call is made by ONE rank only and must raise."""
    f32 = lambda *s: torch.ones(*s)  # noqa: E731
    R = dist.ReduceOp

    def wait_(w: Any) -> None:
        if w is not None:
            w.wait()

    def a2a_bad_sum() -> None:
        dist.all_to_all_single(torch.zeros(2 * ws), f32(2 * ws), [2] * ws, [2] * (ws - 1) + [3])

    def a2a_bad_len() -> None:
        dist.all_to_all_single(torch.zeros(2 * ws), f32(2 * ws), [2] * ws, [1] * (2 * ws))

    def coalesced(ts: list[torch.Tensor], op: Any = R.SUM) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_reduce_coalesced(ts, op=op)

    return [
        ("broadcast src=world_size", lambda: dist.broadcast(f32(4), src=ws)),
        ("broadcast src=-1", lambda: dist.broadcast(f32(4), src=-1)),
        ("reduce dst=world_size", lambda: dist.reduce(f32(4), dst=ws)),
        ("gather dst=world_size", lambda: dist.gather(f32(4), None, dst=ws)),
        ("scatter src=world_size", lambda: dist.scatter(f32(4), None, src=ws)),
        ("send dst=world_size", lambda: dist.send(f32(4), dst=ws)),
        ("isend dst=world_size", lambda: wait_(dist.isend(f32(4), dst=ws))),
        ("recv src=world_size", lambda: dist.recv(f32(4), src=ws)),
        ("irecv src=world_size", lambda: wait_(dist.irecv(f32(4), src=ws))),
        ("send to self", lambda: dist.send(f32(4), dst=rank)),
        (
            "batch_isend_irecv peer=world_size",
            lambda: [
                wait_(w) for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, f32(4), ws)])
            ],
        ),
        (
            "all_gather list too long",
            lambda: dist.all_gather([f32(4) for _ in range(ws + 1)], f32(4)),
        ),
        (
            "all_gather list too short",
            lambda: dist.all_gather([f32(4) for _ in range(ws - 1)], f32(4)),
        ),
        (
            "gather list wrong length",
            lambda: dist.gather(f32(4), [f32(4) for _ in range(ws + 1)], dst=rank),
        ),
        (
            "scatter list wrong length",
            lambda: dist.scatter(f32(4), [f32(4) for _ in range(ws + 1)], src=rank),
        ),
        (
            "reduce_scatter input list wrong length",
            lambda: dist.reduce_scatter(f32(4), [f32(4) for _ in range(ws + 1)]),
        ),
        (
            "all_to_all list wrong length",
            lambda: dist.all_to_all([f32(2)] * (ws + 1), [f32(2)] * (ws + 1)),
        ),
        (
            "all_gather_into_tensor output too big",
            lambda: dist.all_gather_into_tensor(torch.zeros(4 * (ws + 1)), f32(4)),
        ),
        (
            "all_gather_into_tensor output too small",
            lambda: dist.all_gather_into_tensor(torch.zeros(4 * ws - 1), f32(4)),
        ),
        (
            "reduce_scatter_tensor input not world_size x output",
            lambda: dist.reduce_scatter_tensor(torch.zeros(4), f32(4 * ws + 1)),
        ),
        ("all_to_all_single splits do not sum to the input", a2a_bad_sum),
        ("all_to_all_single wrong number of splits", a2a_bad_len),
        (
            "all_to_all_single output size mismatch",
            lambda: dist.all_to_all_single(torch.zeros(2 * ws + 1), f32(2 * ws)),
        ),
        (
            "all_gather mixed dtypes",
            lambda: dist.all_gather([torch.zeros(4, dtype=torch.float64)] * ws, f32(4)),
        ),
        (
            "all_gather_into_tensor mixed dtypes",
            lambda: dist.all_gather_into_tensor(torch.zeros(4 * ws, dtype=torch.float64), f32(4)),
        ),
        (
            "reduce_scatter_tensor mixed dtypes",
            lambda: dist.reduce_scatter_tensor(torch.zeros(4, dtype=torch.int32), f32(4 * ws)),
        ),
        (
            "all_to_all_single mixed dtypes",
            lambda: dist.all_to_all_single(torch.zeros(2 * ws, dtype=torch.int64), f32(2 * ws)),
        ),
        (
            "all_reduce_coalesced mixed dtypes",
            lambda: coalesced([f32(3), torch.ones(3, dtype=torch.float64)]),
        ),
        (
            "scatter mixed dtypes",
            lambda: dist.scatter(f32(2), [torch.ones(2, dtype=torch.int32)] * ws, src=rank),
        ),
        ("all_reduce BAND on float32", lambda: dist.all_reduce(f32(4), op=R.BAND)),
        ("all_reduce BXOR on float16", lambda: dist.all_reduce(f32(4).half(), op=R.BXOR)),
        ("reduce BOR on float64", lambda: dist.reduce(f32(4).double(), dst=0, op=R.BOR)),
        (
            "reduce_scatter_tensor BXOR on bfloat16",
            lambda: dist.reduce_scatter_tensor(
                torch.zeros(2, dtype=torch.bfloat16), f32(2 * ws).bfloat16(), op=R.BXOR
            ),
        ),
        ("all_reduce_coalesced BAND on float32", lambda: coalesced([f32(3), f32(2)], R.BAND)),
        (
            "all_reduce AVG on bool",
            lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=R.AVG),
        ),
        ("reduce AVG on bool", lambda: dist.reduce(torch.ones(4, dtype=torch.bool), 0, op=R.AVG)),
    ]


# Invalid calls that gloo does not reject before communicating (calling them on one rank
# desynchronises or breaks the group); skipped for gloo only, never for other backends.
GLOO_LATE_CHECKS = {
    # ProcessGroupGloo implements AVG as SUM then true division: the SUM has already run.
    "all_reduce AVG on bool": "gloo runs the SUM before it fails on AVG of bool",
    "reduce AVG on bool": "gloo runs the SUM before it fails on AVG of bool",
    # ProcessGroupGloo does not range-check p2p peers: it tries to connect to the
    # missing rank through the store, times out and leaves the group broken.
    "send dst=world_size": "gloo does not range-check the peer of send",
    "isend dst=world_size": "gloo does not range-check the peer of isend",
    "recv src=world_size": "gloo does not range-check the peer of recv",
    "irecv src=world_size": "gloo does not range-check the peer of irecv",
    "batch_isend_irecv peer=world_size": "gloo does not range-check the peer of isend",
    # ProcessGroupGloo rejects bitwise ops on floating types only when the queued work
    # runs, after the call consumed a collective sequence number (tag) on this rank.
    "all_reduce BAND on float32": "gloo rejects bitwise ops on floats only after enqueueing",
    "all_reduce BXOR on float16": "gloo rejects bitwise ops on floats only after enqueueing",
    "reduce BOR on float64": "gloo rejects bitwise ops on floats only after enqueueing",
    "reduce_scatter_tensor BXOR on bfloat16": "gloo rejects bitwise ops on floats late",
    "all_reduce_coalesced BAND on float32": "gloo rejects bitwise ops on floats late",
}


def _run_invalid_sequence(
    rank: int,
    ws: int,
    calls: list[tuple[str, Callable[[], Any]]],
    check_devices: list[str],
    skip: dict[str, str],
) -> dict[str, str]:
    """Make each call on ONE rank (i % ws) and then check that the whole group still
    works. After every step the ranks compare notes through the store and all stop at the
    first step that broke the group (everything after it would fail for the same reason)."""
    chk = Checker(f"rank {rank}")
    seen: dict[str, str] = {}
    store = dist.distributed_c10d._get_default_store()
    for dev in check_devices:
        _world_check(chk, f"before ({dev})", dev)
    for i, (name, call) in enumerate(calls):
        if name in skip:
            continue
        bad = i % ws
        print(f"[rank {rank}] invalid call #{i} on rank {bad}: {name}", flush=True)
        n_before = len(chk.errors)
        if rank == bad:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    call()
            except (ValueError, RuntimeError) as e:
                seen[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            except Exception as e:  # noqa: BLE001
                chk.fail(f"{name!r} raised {type(e).__name__} (want ValueError/RuntimeError): {e}")
            else:
                chk.fail(f"{name!r} did not raise on rank {rank}")
        # every rank: the group must be intact (the invalid call sent, consumed or
        # advanced nothing)
        broken = False
        for dev in check_devices:
            n_check = len(chk.errors)
            try:
                _world_check(chk, f"collectives after {name!r} on rank {bad} ({dev})", dev)
            except Exception as e:  # noqa: BLE001
                chk.fail(f"collectives after {name!r} on rank {bad} ({dev}) raised: {e}")
            broken = broken or len(chk.errors) > n_check
        status = "broken" if broken else ("bad" if len(chk.errors) > n_before else "ok")
        store.set(f"invalid/{i}/{rank}", status)
        keys = [f"invalid/{i}/{r}" for r in range(ws)]
        store.wait(keys, timedelta(seconds=120))
        if any(store.get(k) == b"broken" for k in keys):
            chk.fail(f"stopped: the group was broken by {name!r} on rank {bad}")
            break
    # Rank 0 hosts the store: it stays until every rank has read its last keys.
    store.set(f"invalid/done/{rank}", "1")
    if rank == 0:
        store.wait([f"invalid/done/{r}" for r in range(ws)], timedelta(seconds=120))
    chk.raise_if_failed()
    return seen


def invalid_args_fn(rank: int, ws: int) -> dict[str, str]:
    skip = GLOO_LATE_CHECKS if is_gloo() else {}
    return _run_invalid_sequence(rank, ws, _invalid_calls(rank, ws), ["cpu"], skip)


def test_invalid_arguments_raise_before_communicating() -> None:
    """Each invalid call is made on ONE rank only and must raise ValueError/RuntimeError
    without communicating: right after it, all ranks run normal collectives and get correct
    results (a call that sent or consumed anything would corrupt or hang them)."""
    results = run_ranks(2, invalid_args_fn, pg_timeout_s=10, timeout_s=240)
    n_calls = len(_invalid_calls(0, 2)) - (len(GLOO_LATE_CHECKS) if is_gloo() else 0)
    assert sum(len(r) for r in results) == n_calls, results


def mixed_devices_fn(rank: int, ws: int) -> dict[str, str]:
    torch.cuda.set_device(rank)
    cuda = torch.device("cuda", rank)

    def coalesced(ts: list[torch.Tensor]) -> None:
        dist.all_reduce_coalesced(ts)

    calls: list[tuple[str, Callable[[], Any]]] = [
        (
            "all_gather cpu input, cuda outputs",
            lambda: dist.all_gather([torch.zeros(4, device=cuda)] * ws, torch.ones(4)),
        ),
        (
            "all_gather_into_tensor cuda out, cpu in",
            lambda: dist.all_gather_into_tensor(torch.zeros(4 * ws, device=cuda), torch.ones(4)),
        ),
        (
            "reduce_scatter_tensor cpu out, cuda in",
            lambda: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * ws, device=cuda)),
        ),
        (
            "all_to_all_single cuda out, cpu in",
            lambda: dist.all_to_all_single(torch.zeros(2 * ws, device=cuda), torch.ones(2 * ws)),
        ),
        (
            "all_reduce_coalesced cpu + cuda",
            lambda: coalesced([torch.ones(3), torch.ones(3, device=cuda)]),
        ),
        (
            "scatter cuda out, cpu list",
            lambda: dist.scatter(torch.zeros(2, device=cuda), [torch.ones(2)] * ws, src=rank),
        ),
        (
            "all_to_all mixed list",
            lambda: dist.all_to_all([torch.zeros(2, device=cuda)] * ws, [torch.ones(2)] * ws),
        ),
    ]
    return _run_invalid_sequence(rank, ws, calls, ["cuda", "cpu"], {})


@pytest.mark.cuda(world_size=2)
def test_mixed_devices_raise_before_communicating() -> None:
    run_ranks(2, mixed_devices_fn, pg_timeout_s=20, timeout_s=180)


# ------------------------------------------------------------------------------ failures

PG_TIMEOUT_S = 5.0
GRACE_S = 10.0


def _check_failure_message(chk: Checker, msg: str, missing: int) -> None:
    low = msg.lower()
    if is_gloo():  # gloo's messages name neither the collective nor the missing rank
        return
    chk.true("all_reduce" in msg, f"error does not name the collective 'all_reduce': {msg!r}")
    chk.true(f"[{missing}]" in msg, f"error does not name the missing rank as [{missing}]: {msg!r}")
    chk.true("timeout" in low, f"error does not contain 'timeout': {msg!r}")


def peer_failure_fn(
    rank: int, ws: int, mode: str, warm_up: bool, device: str = "cpu"
) -> dict[str, Any]:
    """mode "dies": rank 1 exits (os._exit) instead of calling all_reduce;
    mode "sleeps": rank 1 stays alive but never calls it.

    On CUDA the collective is asynchronous for the host (as with NCCL), so the
    survivors wait on the work with FASTCOMM_BLOCKING_WAIT=1 (set by the test)."""
    from datetime import timedelta as td

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend=BACKEND, timeout=td(seconds=PG_TIMEOUT_S))
    store = dist.distributed_c10d._get_default_store()
    chk = Checker(f"rank {rank}")
    if warm_up:
        _world_check(chk, "warm-up", device)
    victim = 1
    out: dict[str, Any] = {}
    if rank == victim:
        if mode == "dies":
            os._exit(17)
        # alive, but never joins: wait until the others are done with their checks
        store.wait([f"failure_test/done/{r}" for r in range(ws) if r != victim], td(seconds=120))
        store.set(f"failure_test/done/{victim}", "1")
        dist.destroy_process_group()
        return out
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8, device=device), async_op=True).wait()
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as e:
        out["elapsed"] = time.monotonic() - t0
        out["message"] = str(e)
        out["type"] = type(e).__name__
        chk.true(
            out["elapsed"] <= PG_TIMEOUT_S + GRACE_S,
            f"all_reduce raised only after {out['elapsed']:.1f}s (timeout {PG_TIMEOUT_S}s)",
        )
        _check_failure_message(chk, str(e), victim)
    except Exception as e:
        chk.fail(f"all_reduce raised {type(e).__name__}, not RuntimeError: {e}")
    else:
        chk.fail(f"all_reduce returned normally without rank {victim}")
    store.set(f"failure_test/done/{rank}", "1")
    if rank == 0:  # rank 0 hosts the store: the other survivors still use it
        store.wait([f"failure_test/done/{r}" for r in range(ws) if r != victim], td(seconds=60))
    out["destroy_s"] = chk.destroy_within(PG_TIMEOUT_S + GRACE_S)  # returns after the error
    if mode == "sleeps" and rank == 0:  # rank 0 hosts the store: outlive the victim's use
        try:
            store.wait([f"failure_test/done/{victim}"], td(seconds=60))
        except Exception:
            pass
    chk.raise_if_failed()
    return out


@pytest.mark.parametrize("warm_up", [True, False], ids=["after-warm-up", "first-collective"])
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda(world_size=3))]
)
def test_dead_rank_fails_collective_with_timeout(warm_up: bool, device: str) -> None:
    """Rank 1 of 3 dies before an all_reduce: ranks 0 and 2 raise RuntimeError within
    timeout + 10 s naming the collective, the missing rank "[1]" and "timeout"; then
    destroy_process_group() returns normally."""
    env = {"FASTCOMM_BLOCKING_WAIT": "1"} if device == "cuda" else None
    res = run_ranks(
        3,
        peer_failure_fn,
        "dies",
        warm_up,
        device,
        init=False,
        expect_fail={1: 17},
        timeout_s=120,
        env=env,
    )
    assert isinstance(res[1], RankFailure)
    for r in (0, 2):
        assert "message" in res[r], res[r]


def test_sleeping_rank_fails_collective_with_timeout() -> None:
    """Rank 1 of 3 is alive but never calls the all_reduce: same error on ranks 0 and 2."""
    res = run_ranks(3, peer_failure_fn, "sleeps", True, init=False, timeout_s=120)
    for r in (0, 2):
        assert "message" in res[r], res[r]


# -------------------------------------------------------------- bound device + new_group


def _split_check(chk: Checker, device: str) -> None:
    if hasattr(dist, "split_group"):
        split = dist.split_group(split_ranks=[[0, 1]])
        _group_checks(chk, split, dist.get_process_group_ranks(split), "split_group", device)


def bound_device_new_group_fn(rank: int, ws: int, device: str, split_first: bool) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu", 0)
    dist.init_process_group(backend=BACKEND, device_id=dev, timeout=timedelta(seconds=60))
    chk = Checker(f"rank {rank}")
    if split_first:
        _split_check(chk, device)
    # with a bound device, torch tries to split the parent's communicator; ranks outside the
    # new group take a different code path there than members
    sub = dist.new_group([0])
    if rank == 0:
        _group_checks(chk, sub, [0], "new_group([0])", device)
    else:
        chk.true(sub == dist.GroupMember.NON_GROUP_MEMBER, "rank 1 got a group")
    both, order = _new_group([1, 0])
    _group_checks(chk, both, order, "new_group([1, 0])", device)
    # groups of stock backends beside the bound default group, as libraries make them
    others = [("gloo", "cpu")] + ([("nccl", "cuda")] if device == "cuda" else [])
    for other, other_device in others:
        grp = dist.new_group(backend=other)
        chk.true(dist.get_backend(grp) == other, f"{other} group has {dist.get_backend(grp)}")
        _group_checks(chk, grp, [0, 1], f"new_group(backend={other!r})", other_device)
        sub = dist.new_group([1], backend=other)
        if rank == 1:
            _group_checks(chk, sub, [1], f"new_group([1], backend={other!r})", other_device)
    if not split_first:
        _split_check(chk, device)
    _world_check(chk, "world", device)
    dist.destroy_process_group()
    chk.raise_if_failed()


def _split_source_ignoring_backend(pg: Any, *args: Any) -> Any:
    """What torch 2.11's ``_get_split_source`` answers: the bound device's backend, whatever
    backend the new group asks for."""
    backend = pg._get_backend(pg.bound_device_id) if pg.bound_device_id else None
    return backend if backend is not None and backend.supports_splitting else None


def split_source_fn(rank: int, ws: int) -> None:
    import torch.distributed.distributed_c10d as c10d

    c10d._get_split_source = _split_source_ignoring_backend  # before fastcomm registers
    import torchext
    from torch._C._distributed_c10d import ProcessGroupNCCL

    dist.init_process_group(backend="fastcomm", device_id=torch.device("cpu", 0))
    chk = Checker(f"rank {rank}")
    pg = dist.group.WORLD
    # unfiltered, the source is our backend, and handing it to NCCL's options is the line
    # that raised in new_group(backend="nccl")
    raw = _split_source_ignoring_backend(pg)
    chk.true(isinstance(raw, torchext._C.ProcessGroupFastComm), f"raw split source {raw!r}")
    try:
        ProcessGroupNCCL.Options().split_from = raw
        chk.true(False, "NCCL's options took a fastcomm group to split from")
    except TypeError:
        pass
    chk.true(c10d._get_split_source(pg) is None, "fastcomm offered as a split source")
    grp = dist.new_group(backend="gloo")
    _group_checks(chk, grp, [0, 1], "gloo beside bound fastcomm", "cpu")
    dist.destroy_process_group()
    chk.raise_if_failed()


@pytest.mark.skipif(is_gloo(), reason="gloo: tests fastcomm's registration")
def test_other_backends_never_split_from_fastcomm() -> None:
    """torch 2.11 hands new_group(backend="nccl") the bound default group's backend to split
    from; a fastcomm default group must not be offered (NCCL's options reject it)."""
    try:
        from torch._C._distributed_c10d import ProcessGroupNCCL  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no NCCL")
    run_ranks(2, split_source_fn, init=False, import_torchext=False, timeout_s=120)


_GLOO_NOCOLOR = pytest.mark.skipif(
    is_gloo(),
    reason="gloo: with device_id bound, torch 2.15 calls split_from.perform_nocolor_split() "
    "on non-members of a new group, a method only ProcessGroupNCCL has (AttributeError)",
)


@pytest.mark.parametrize(
    "device,split_first",
    [
        pytest.param("cpu", True, marks=_GLOO_NOCOLOR),
        pytest.param("cpu", False, marks=_GLOO_NOCOLOR),
        pytest.param("cuda", True, marks=[_GLOO_NOCOLOR, pytest.mark.cuda(world_size=2)]),
        pytest.param("cuda", False, marks=[_GLOO_NOCOLOR, pytest.mark.cuda(world_size=2)]),
    ],
)
def test_new_group_with_bound_device(device: str, split_first: bool) -> None:
    """init_process_group(device_id=...), then split_group, new_group() of fastcomm with a
    subset and with all ranks, and groups of gloo and NCCL beside it."""
    run_ranks(2, bound_device_new_group_fn, device, split_first, init=False, timeout_s=120)
