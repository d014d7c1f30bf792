"""The inter-node transport (csrc/inter/transport.hpp), driven directly.

Every implementation must pass the same suite: add its name to TRANSPORTS. Ranks talk
through ``torchext._testing._TransportEndpoint`` (a transport connected to every other rank;
test-only bindings in csrc/python/transport_bindings.cpp), with a TCPStore of their own
instead of a process group. Each spawned group runs many checks, since importing torch
costs seconds per process.

Payloads are random bytes seeded from (case, src, dst, index), so a receiver checks
what it got against data it regenerates itself.
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest

from _harness import Checker, gloo_skip, run_ranks, seed_of

TRANSPORTS = ["tcp", "ib"]

# The environment each transport's ranks run with: ib runs on its software RC emulation
# (no RDMA hardware in CI), which exercises the whole protocol of csrc/inter/ib.
TRANSPORT_ENV: dict[str, dict[str, str]] = {"tcp": {}, "ib": {"FASTCOMM_IB_EMULATE": "1"}}
# What the error says when the peer's process is gone: tcp sees the connection closed;
# ib sees its writes unacknowledged past the RC retry budget (IBV_WC_RETRY_EXC_ERR).
PEER_GONE = {"tcp": "closed by the peer", "ib": "the peer closed or is unreachable"}

pytestmark = gloo_skip("drives fastcomm's transport directly, below any process group")

STRIPE = 512 << 10
SIZES = [0, 1, 7, 4096, 4097, 65535, STRIPE - 1, STRIPE + 13, 3 << 20, (64 << 20) + 3]
# Settings per transport, applied while the endpoint is created; None keeps the defaults
# (tcp: 4 sockets, 2 threads; ib: 2 queue pairs per peer).
CONFIGS: dict[str, list[dict[str, str] | None]] = {
    "tcp": [
        None,
        {"FASTCOMM_TCP_SOCKETS": "1", "FASTCOMM_TCP_THREADS": "1"},
        {"FASTCOMM_TCP_SOCKETS": "8", "FASTCOMM_TCP_THREADS": "4"},
        # small kernel buffers: messages up to 64 MiB in many short socket writes and reads
        {"FASTCOMM_TCP_SOCKETS": "2", "FASTCOMM_TCP_SOCKET_BUFFER": "64K"},
    ],
    "ib": [None, {"FASTCOMM_IB_QPS_PER_PEER": "1"}, {"FASTCOMM_IB_QPS_PER_PEER": "4"}],
}


# ------------------------------------------------------------------------------ helpers


def _store(rank: int, world: int, timeout_s: float = 60.0) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        rank == 0,
        timedelta(seconds=timeout_s),
    )


def _barrier(store: Any, world: int, key: str, add: int = 1) -> None:
    store.add(key, add)
    deadline = time.monotonic() + 60
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {key}: {store.add(key, 0)} of {world} ranks")
        time.sleep(0.01)


def _finish(store: Any, rank: int, world: int, key: str = "finished") -> None:
    """A barrier of the `world` ranks still alive, then rank 0 (the store's host, whose fd
    count includes one socket per store client) leaves after everyone else."""
    _barrier(store, world, key)
    store.add(key + "/left", 1)
    if rank == 0:
        _barrier(store, world, key + "/left", add=0)


def _payload(nbytes: int, *key: Any) -> Any:
    """Random bytes for ``key``; int64 generation then a byte view (fast for 64 MiB)."""
    import torch

    g = torch.Generator().manual_seed(seed_of(*key))
    words = torch.randint(-(2**62), 2**62, ((nbytes + 7) // 8,), generator=g, dtype=torch.int64)
    return words.view(torch.uint8)[:nbytes]


def _endpoint(store: Any, rank: int, world: int, name: str, config: Any = None, **kw: Any) -> Any:
    import torchext._testing as C

    with mock.patch.dict(os.environ, config or {}):
        return C._TransportEndpoint(store, rank, world, name=name, **kw)


def _store_server_sockets() -> set[str]:
    """Inodes of the sockets on the store's port: the store's host (rank 0) has one per
    client, and they come and go with the other processes, not with the transport."""
    port = int(os.environ["MASTER_PORT"])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except OSError:
            pass
    return inodes


def _resources() -> tuple[dict[str, str], int]:
    """(open fds -> what they are, thread count) of this process, without the store's
    server-side sockets."""
    gc.collect()
    skip = {f"socket:[{i}]" for i in _store_server_sockets()}
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd
            continue
        if target not in skip:
            fds[fd] = target
    return fds, len(os.listdir("/proc/self/task"))


def _check_leaks(chk: Checker, before: Any, after: Any, what: str) -> None:
    (fa, ta), (fb, tb) = before, after
    if len(fa) != len(fb):
        gone = sorted(set(fa.items()) - set(fb.items()))
        new = sorted(set(fb.items()) - set(fa.items()))
        chk.fail(f"{what}: {len(fa)} fds before, {len(fb)} after (new {new}, gone {gone})")
    chk.true(ta == tb, f"{what}: {ta} threads before, {tb} after")


def _all_pairs(chk: Checker, ep: Any, rank: int, world: int, tag: str, sizes: list[int]) -> None:
    """Every rank sends every size to every other rank, all posted at once."""
    import torch

    peers = [p for p in range(world) if p != rank]
    sends = [(p, _payload(n, tag, rank, p, i)) for p in peers for i, n in enumerate(sizes)]
    recvs = [(p, torch.empty(n, dtype=torch.uint8)) for p in peers for n in sizes]
    ep.exchange(sends, recvs)
    del sends
    for (p, got), (i, n) in zip(recvs, [(i, n) for _ in peers for i, n in enumerate(sizes)]):
        chk.equal(got, _payload(n, tag, p, rank, i), f"{tag}: {n} bytes from rank {p}")


def _many_small(chk: Checker, ep: Any, rank: int, world: int, tag: str, count: int) -> None:
    """`count` small messages per direction and pair, of varying sizes, in order: views
    into one buffer, so a message matched out of order lands in the wrong place."""
    import torch

    sizes = [(i * 7919) % 61 + 1 for i in range(count)]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    peers = [p for p in range(world) if p != rank]
    out = {p: _payload(offsets[-1], tag, rank, p) for p in peers}
    inb = {p: torch.zeros(offsets[-1], dtype=torch.uint8) for p in peers}
    sends = [(p, out[p][offsets[i] : offsets[i + 1]]) for p in peers for i in range(count)]
    recvs = [(p, inb[p][offsets[i] : offsets[i + 1]]) for p in peers for i in range(count)]
    # Whether these posts meet the in-flight limit depends on how fast the peers drain them
    # (progress threads, scheduling); the "retry later" path is checked deterministically in
    # the two-rank suite (a peer that posts nothing until the limit was hit).
    ep.exchange(sends, recvs)
    for p in peers:
        chk.equal(inb[p], _payload(offsets[-1], tag, p, rank), f"{tag}: small messages from {p}")


def _lone_messages(chk: Checker, ep: Any, rank: int, peer: int) -> None:
    """tcp: every socket carries data at first, and a lone message of up to one stripe, sent
    once the one before it completed, goes on socket 0 (the lowest free one), not on whichever
    socket's progress thread wakes first."""
    import torch

    c = ep.counters()
    socks = c["sockets_per_peer"]
    chk.true(c["data_sockets"] == socks, f"lone: {c['data_sockets']} of {socks} carry data")
    before = [c[f"data_frames_socket{k}"] for k in range(socks)]
    count = 40
    for i in range(count):  # ping-pong: the ranks take turns sending
        n = (i * 40961) % STRIPE + 1
        if (rank + i) % 2 == 0:
            ep.send(peer, _payload(n, "lone", i))
        else:
            got = torch.empty(n, dtype=torch.uint8)
            ep.recv(peer, got)
            chk.equal(got, _payload(n, "lone", i), f"lone: message {i}")
    c = ep.counters()
    frames = [c[f"data_frames_socket{k}"] - before[k] for k in range(socks)]
    chk.true(
        frames[0] == count // 2 and sum(frames) == count // 2,
        f"lone: {count // 2} messages sent one at a time went on sockets {frames}",
    )


def _expect_error(chk: Checker, fn: Any, what: str, *needles: str) -> str:
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        for n in needles:
            chk.true(n in msg, f"{what}: error does not mention {n!r}: {msg}")
        return msg
    chk.fail(f"{what}: no error")
    return ""


# ------------------------------------------------------------------------------ rank bodies


def _two_rank_suite(rank: int, world: int, name: str) -> None:
    import torch
    import torchext._testing as C

    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    peer = 1 - rank
    _payload(1 << 20, "warm-up").sum()  # thread pools etc. exist before the baseline
    _barrier(store, world, "baseline")  # every store client is connected
    before = _resources()

    for config in CONFIGS[name]:
        tag = f"cfg{config}"
        ep = _endpoint(store, rank, world, name, config)
        _all_pairs(chk, ep, rank, world, f"{tag}/pairs", SIZES)
        _many_small(chk, ep, rank, world, f"{tag}/small", 300)
        ep.close()
        ep.close()  # idempotent
        del ep

    ep = _endpoint(store, rank, world, name)
    max_in_flight = C._TRANSPORT_MAX_IN_FLIGHT
    if name == "tcp":
        _lone_messages(chk, ep, rank, peer)

    # Blocking send/recv in both orders.
    for n in (0, 5, 3 << 20):
        a, b = _payload(n, "blk", 0, 1), _payload(n, "blk", 1, 0)
        got = torch.empty(n, dtype=torch.uint8)
        if rank == 0:
            ep.send(1, a)
            ep.recv(1, got)
            chk.equal(got, b, f"blocking {n} bytes 1->0")
        else:
            ep.recv(0, got)
            ep.send(0, b)
            chk.equal(got, a, f"blocking {n} bytes 0->1")

    # "Retry later": rank 0 fills both directions to rank 1 before rank 1 posts anything,
    # so nothing can complete and the next post must be refused.
    count = max_in_flight + 9
    sizes = [(i * 37) % 5000 for i in range(count)]
    sends = [_payload(n, "retry", rank, peer, i) for i, n in enumerate(sizes)]
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    if rank == 0:
        hr = [ep.irecv(1, bufs[i]) for i in range(max_in_flight)]
        chk.true(all(h is not None for h in hr), "irecv refused below the limit")
        chk.true(ep.irecv(1, bufs[max_in_flight]) is None, "irecv above the limit not refused")
        hs = [ep.isend(1, sends[i]) for i in range(max_in_flight)]
        chk.true(all(h is not None for h in hs), "isend refused below the limit")
        chk.true(ep.isend(1, sends[max_in_flight]) is None, "isend above the limit not refused")
        chk.true(not any(h.test() for h in hr + hs), "a request completed with no peer posts")
        store.set("retry/full", "1")
        ep.exchange([(1, t) for t in sends[max_in_flight:]], [(1, b) for b in bufs[max_in_flight:]])
        for h in hr + hs:
            h.wait()
            chk.true(h.test(), "a waited request does not test complete")
    else:
        store.wait(["retry/full"])
        ep.exchange([(0, t) for t in sends], [(0, b) for b in bufs])
    for i, n in enumerate(sizes):
        chk.equal(bufs[i], _payload(n, "retry", peer, rank, i), f"retry: message {i}")

    # A receiver that posts late: the 64 MiB send must not complete before it posts.
    big = 64 << 20
    if rank == 0:
        src = _payload(big, "late", 0, 1)
        h = ep.isend(1, src)
        time.sleep(0.3)
        chk.true(not h.test(), "64 MiB send completed before the receiver posted")
        store.set("late/go", "1")
        h.wait()
        del src
    else:
        store.wait(["late/go"])
        got = torch.empty(big, dtype=torch.uint8)
        ep.irecv(0, got).wait()
        chk.equal(got, _payload(big, "late", 0, 1), "late receiver: data")
        del got

    # Size mismatch: both requests fail naming the peer and both sizes, and the
    # connection goes on.
    if rank == 0:
        h = ep.isend(1, _payload(100, "mm"))
    else:
        h = ep.irecv(0, torch.empty(200, dtype=torch.uint8))
    _expect_error(chk, h.wait, "size mismatch (wait)", f"rank {peer}", "100", "200")
    try:
        h.test()
        chk.fail("size mismatch: test() did not raise")
    except C._TransportError as e:
        chk.true(f"rank {peer}" in str(e), f"size mismatch: test() error: {e}")
    _all_pairs(chk, ep, rank, world, "after-mismatch", [0, 3, 5000])

    # Bad arguments.
    _expect_error(chk, lambda: ep.isend(rank, torch.zeros(1)), "send to self", "not a peer")
    _expect_error(chk, lambda: ep.isend(peer, torch.zeros(4, 4).t()), "strided", "contiguous")

    ep.close()
    h_after = ep  # requests after close fail cleanly, naming the peer
    _expect_error(chk, lambda: h_after.send(peer, torch.zeros(3)), "send after close", "closed")
    del ep, h_after, h
    _check_leaks(chk, before, _resources(), "after close()")
    _finish(store, rank, world)
    chk.raise_if_failed()


def _four_rank_suite(rank: int, world: int, name: str) -> None:
    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    _payload(1 << 20, "warm-up").sum()
    _barrier(store, world, "baseline")
    before = _resources()
    for config in (CONFIGS[name][0], CONFIGS[name][-1]):
        tag = f"cfg{config}"
        ep = _endpoint(store, rank, world, name, config)
        _all_pairs(chk, ep, rank, world, f"{tag}/pairs", SIZES)
        _many_small(chk, ep, rank, world, f"{tag}/small", 100)
        ep.close()
        del ep
    _check_leaks(chk, before, _resources(), "after close()")
    _finish(store, rank, world)
    chk.raise_if_failed()


VICTIM = 1


def _peer_killed(rank: int, world: int, name: str) -> float:
    import torch

    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    ep = _endpoint(store, rank, world, name, timeout=timedelta(seconds=60))
    _all_pairs(chk, ep, rank, world, "warm", [1, 4096])
    big = 64 << 20
    if rank == VICTIM:
        # Take part in big transfers, then die in the middle of them (the handles keep
        # the buffers alive until then, as the transport requires).
        handles = []
        for p in (0, 2):
            handles.append(ep.irecv(p, torch.empty(big, dtype=torch.uint8)))
            handles.append(ep.isend(p, torch.zeros(big, dtype=torch.uint8)))
        time.sleep(0.02)
        os._exit(3)
    survivor = 2 if rank == 0 else 0
    t0 = time.monotonic()
    msg = _expect_error(
        chk,
        # The second receive is never sent: the exchange cannot finish before the victim
        # dies, however fast the transport moves the 64 MiB.
        lambda: ep.exchange(
            [(VICTIM, torch.zeros(big, dtype=torch.uint8))],
            [(VICTIM, torch.empty(big, dtype=torch.uint8)), (VICTIM, torch.empty(1))],
        ),
        "peer killed",
        f"rank {VICTIM}",
        PEER_GONE[name],
    )
    elapsed = time.monotonic() - t0
    chk.true(elapsed < 10, f"the failure took {elapsed:.1f} s to show: {msg}")
    # Later requests to the dead rank fail at once; the survivors still talk.
    _expect_error(
        chk, lambda: ep.send(VICTIM, torch.zeros(1)), "send to the dead", f"rank {VICTIM}"
    )
    a = _payload(5 << 20, "surv", rank, survivor)
    got = torch.empty_like(a)
    ep.exchange([(survivor, a)], [(survivor, got)])
    chk.equal(got, _payload(5 << 20, "surv", survivor, rank), "survivors still exchange")
    ep.close()
    _finish(store, rank, world - 1)
    chk.raise_if_failed()
    return elapsed


ABSENT = 2


def _never_connects(rank: int, world: int, name: str, timeout_s: float) -> float:
    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    _barrier(store, world, "baseline")  # every store client is connected
    if rank == ABSENT:
        store.wait(["nc/done"], timedelta(seconds=60))
        return 0.0
    before = _resources()
    t0 = time.monotonic()
    _expect_error(
        chk,
        lambda: _endpoint(store, rank, world, name, timeout=timedelta(seconds=timeout_s)),
        "absent peer",
        f"[{ABSENT}]",
        f"{int(timeout_s * 1000)} ms",
        "transport connect",
    )
    elapsed = time.monotonic() - t0
    _check_leaks(chk, before, _resources(), "after a failed connect")
    store.add("nc/count", 1)
    if rank == 0:
        while store.add("nc/count", 0) < world - 1:
            time.sleep(0.02)
        store.set("nc/done", "1")
        time.sleep(0.2)  # the absent rank reads the key before the server goes
    chk.raise_if_failed()
    return elapsed


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", TRANSPORTS)
def test_two_ranks(name: str) -> None:
    """All sizes both ways in several configurations (tcp: the defaults, 1 socket and thread,
    8 sockets on 4 threads, 2 sockets with 64 KiB kernel buffers; ib: 1/2/4 queue pairs),
    many small messages in order, tcp's choice of socket for lone messages, the in-flight
    limit, a late receiver, a size mismatch, close() and leaks."""
    run_ranks(2, _two_rank_suite, name, init=False, timeout_s=120, env=TRANSPORT_ENV[name])


@pytest.mark.parametrize("name", TRANSPORTS)
def test_four_ranks(name: str) -> None:
    run_ranks(4, _four_rank_suite, name, init=False, timeout_s=120, env=TRANSPORT_ENV[name])


@pytest.mark.parametrize("name", TRANSPORTS)
def test_peer_killed_mid_transfer(name: str) -> None:
    res = run_ranks(
        3,
        _peer_killed,
        name,
        init=False,
        timeout_s=90,
        expect_fail={VICTIM: 3},
        env=TRANSPORT_ENV[name],
    )
    assert all(t < 10 for t in (res[0], res[2])), res


@pytest.mark.parametrize("name", TRANSPORTS)
def test_peer_never_connects(name: str) -> None:
    timeout_s = 3.0
    res = run_ranks(
        3, _never_connects, name, timeout_s, init=False, timeout_s=90, env=TRANSPORT_ENV[name]
    )
    for r in (0, 1):
        assert timeout_s * 0.9 < res[r] < timeout_s + 10, res


def test_unknown_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    import torchext._testing as C

    store = dist.HashStore()
    with pytest.raises(ValueError, match="unknown transport 'nope'"):
        C._TransportEndpoint(store, 0, 1, name="nope")
    # ib without a usable device (no emulation here, and no RDMA hardware or no rdma-core
    # where tests run) is a clear error saying how to get one.
    monkeypatch.delenv("FASTCOMM_IB_EMULATE", raising=False)
    usable, why = C._transport_usable("ib")
    if not usable:
        with pytest.raises(RuntimeError, match="no usable RDMA device.*FASTCOMM_IB_EMULATE=1"):
            C._TransportEndpoint(store, 0, 1, name="ib", prefix="nodev")
    # One rank alone: nothing to connect, close() twice is fine.
    ep = C._TransportEndpoint(store, 0, 1, name="tcp", prefix="alone")
    ep.close()
    ep.close()
    # FASTCOMM_SOCKET_IFNAME: an exact name or a prefix; no match is a clear error.
    monkeypatch.setenv("FASTCOMM_SOCKET_IFNAME", "no-such-if")
    with pytest.raises(ValueError, match="FASTCOMM_SOCKET_IFNAME=no-such-if matches no"):
        C._TransportEndpoint(store, 0, 1, name="tcp", prefix="noif")
    monkeypatch.setenv("FASTCOMM_SOCKET_IFNAME", "l")  # prefix of lo
    C._TransportEndpoint(store, 0, 1, name="tcp", prefix="lo").close()
