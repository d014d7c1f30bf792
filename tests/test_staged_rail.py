"""The rail phase of the CUDA multi-node all_reduce (csrc/plans/staged_rail.*) on the CPU.

The same proxy, schedule, flag protocol, staging layout and transports the GPU path runs, with
an emulated device (torchext._testing._StagedRailEndpoint: one thread runs the device operations in
issue order, its waits polling host flags as cuStreamWaitValue32 does). Every rank is one node,
so the rail is the whole group. Checks results against float64/int64 references on random
data, many chunks with short and empty pieces, several ops in flight reusing the staging
slots, the wire dtypes, and that a dead or absent peer makes the others fail with a
clear error instead of hanging.

Eager ops run their steps (packToStaging, reduceFromStaging, gatherFromStaging) on three lanes,
as on a GPU: a worker thread per kind of step, each in chunk order, ordered against each other
only by the flags.

Captured mode (what a CUDA graph does on the GPU): the endpoint records the device operations
of its ops once (capture_begin / issue / capture_end) and replays them; each replay hands the
op to the proxy from a host call in stream order. Checked: results on fresh data every replay,
eager ops interleaved with replays (also in flight together with them), two replays in flight,
every flag back at its initial value after each op, and a peer lost during a replay.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _harness import Checker, RankFailure, gen, is_gloo, run_ranks

pytestmark = pytest.mark.skipif(is_gloo(), reason="fastcomm's own pipeline code")

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def _store(rank: int, ws: int) -> Any:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ws, rank == 0,
        timeout=timedelta(seconds=60),
    )  # fmt: skip


def _endpoint(store: Any, prefix: str, rank: int, ws: int, **kw: Any) -> Any:
    from torchext import _testing as _C

    return _C._StagedRailEndpoint(store, prefix, rank, ws, **kw)


def _done(store: Any, key: str, rank: int, ws: int) -> None:
    """A barrier at the end. Rank 0 hosts the store, so it leaves only after everyone else
    stopped using it."""
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(ws)], timedelta(seconds=60))
    store.set(f"{key}/left/{rank}", "1")
    if rank == 0:
        store.wait([f"{key}/left/{r}" for r in range(ws)], timedelta(seconds=60))


def correctness_fn(rank: int, ws: int) -> dict[str, Any]:
    store = _store(rank, ws)
    chk = Checker(f"rank {rank}")
    ep = _endpoint(store, "plain", rank, ws, chunk_bytes=4096, timeout_s=30.0)
    # one at a time: every dtype x op, sizes with 1 element, fewer elements than ranks, and
    # many chunks whose last one is short
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        for op in OPS:
            for n in (1, 2, 1031, 9001):
                key = f"staged/{dt_name}/{op}/{n}"
                inputs = [gen(key, r, (n,), dt, op) for r in range(ws)]
                t = inputs[rank].clone()
                ep.wait(ep.issue(t, op))
                chk.reduced(t, inputs, op, key)
    # several in flight (staging slots reused across ops), waited out of order
    tickets, cases = [], []
    for i in range(8):
        dt = [torch.float32, torch.int64, torch.bfloat16, torch.uint8][i % 4]
        op = ["SUM", "MAX", "AVG", "MIN"][i % 4]
        n = 3000 + 1777 * i
        inputs = [gen(f"inflight/{i}", r, (n,), dt, op) for r in range(ws)]
        t = inputs[rank].clone()
        tickets.append(ep.issue(t, op))
        cases.append((t, inputs, op))
    for i in reversed(range(len(tickets))):
        ep.wait(tickets[i])
    for i, (t, inputs, op) in enumerate(cases):
        chk.reduced(t, inputs, op, f"in flight {i} ({op})")
    ep.close()
    _done(store, "correctness", rank, ws)
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("ws", [2, 3])
def test_staged_rail_correctness(ws: int) -> None:
    """Every dtype x op, odd sizes down to 1 element, 4 KiB chunks (many, with short and empty
    pieces), 8 ops in flight: equal to the references."""
    run_ranks(ws, correctness_fn, init=False, timeout_s=400)


# Per wire dtype: the largest error of one coding of a value, relative to the value (bf16) or
# to the largest magnitude of the block of 256 it is coded in (fp16, int8: block-scaled).
WIRE_STEP = {"bf16": 2.0**-8, "fp16": 2.0**-11, "int8": 1 / 127}


def _check_wire_rounding(
    chk: Checker, t: torch.Tensor, inputs: list[torch.Tensor], op: str, wire: str, what: str
) -> torch.Tensor:
    """A float32 SUM/AVG over a wire dtype is within a few codings of the float64 reference:
    relative to the sum of magnitudes (bf16), or to its largest within any block of 256
    holding the element (block-scaled: a block lies within i-255 .. i+255). Returns the
    error."""
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
    if op == "AVG":
        exact, magnitude = exact / len(inputs), magnitude / len(inputs)
    err = (t.double() - exact).abs()
    if wire == "bf16":
        bound = 4 * WIRE_STEP[wire] * magnitude
    else:
        local = torch.nn.functional.max_pool1d(magnitude[None, None], 511, 1, 255)[0, 0]
        bound = 3 * WIRE_STEP[wire] * local
    chk.true(bool(torch.isfinite(t).all()), f"{what}: non-finite values")
    chk.true(bool((err <= bound + 1e-30).all()), f"{what}: error {err.max():.3g}")
    return err


def wire_fn(rank: int, ws: int, wire: str) -> dict[str, Any]:
    store = _store(rank, ws)
    chk = Checker(f"rank {rank}")
    ep = _endpoint(store, f"wire-{wire}", rank, ws, chunk_bytes=8192, wire=wire)
    results = {}
    n = 20_011
    # Gaussian values, and values of about 1e3 with outliers of 5e4 at the same places on
    # every rank, whose sums pass fp16's largest value (65504)
    for case in ("SUM", "AVG", "outliers"):
        op = "SUM" if case == "outliers" else case
        inputs = [gen(f"wire/{case}", r, (n,), torch.float32, "SUM") for r in range(ws)]
        if case == "outliers":
            for x in inputs:
                x.mul_(1e3)[torch.arange(7, n, 997)] = 5e4
        t = inputs[rank].clone()
        ep.wait(ep.issue(t, op))
        err = _check_wire_rounding(chk, t, inputs, op, wire, case)
        chk.true(bool((err > 0).any()), f"{case}: no rounding: the wire dtype is not in use")
        results[case] = t
    ints = [gen("wire/int", r, (5000,), torch.int32, "SUM") for r in range(ws)]
    ti = ints[rank].clone()
    ep.wait(ep.issue(ti, "SUM"))
    chk.reduced(ti, ints, "SUM", "int32 sum (never compressed)")
    ep.close()
    # every rank ends with bit-identical values: compare through the store
    for case, t in results.items():
        store.set(f"wire/{wire}/{case}/{rank}", t.view(torch.int32).numpy().tobytes())
    for case, t in results.items():
        for r in range(ws):
            other = store.get(f"wire/{wire}/{case}/{r}")
            chk.true(other == t.view(torch.int32).numpy().tobytes(), f"{case}: rank {r} differs")
    _done(store, f"wire-{wire}", rank, ws)
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("wire", list(WIRE_STEP))
def test_staged_rail_wire_dtype(wire: str, ws: int) -> None:
    """float32 SUM/AVG over each wire dtype (fp16 and int8 block-scaled, as the kernels code
    them), two members exchanging whole chunks and three reducing pieces: within its coding
    bound of the float64 reference, finite past fp16's range, and bit-identical on every rank;
    integers exact."""
    run_ranks(ws, wire_fn, wire, init=False, timeout_s=300)


def window_fn(rank: int, ws: int, window: int, lag: int) -> dict[str, Any]:
    store = _store(rank, ws)
    chk = Checker(f"rank {rank}")
    endpoints = {
        wire: _endpoint(store, f"window-{window}-{lag}-{wire}", rank, ws, chunk_bytes=4096,
                        window=window, lag=lag, wire=wire)
        for wire in ("none", "bf16")
    }  # fmt: skip
    cases = [
        ("none", torch.float32, "SUM", 40_009),
        ("none", torch.int64, "MAX", 20_011),
        ("none", torch.bfloat16, "AVG", 70_001),
        ("bf16", torch.float32, "SUM", 60_013),
        ("none", torch.uint8, "MIN", 5),
        ("none", torch.float64, "PRODUCT", 9_001),
    ]
    # all in flight at once: more chunks than slots, slots reused across ops
    issued = []
    for i, (wire, dt, op, n) in enumerate(cases):
        inputs = [gen(f"window/{i}", r, (n,), dt, op) for r in range(ws)]
        t = inputs[rank].clone()
        issued.append((endpoints[wire].issue(t, op), t, inputs))
    for (wire, dt, op, n), (ticket, t, inputs) in zip(cases, issued):
        endpoints[wire].wait(ticket)
        what = f"window {window}, lag {lag}: {wire} wire, {dt} {op} of {n}"
        if wire == "none":
            chk.reduced(t, inputs, op, what)
        else:
            _check_wire_rounding(chk, t, inputs, op, wire, what)
    for wire, ep in endpoints.items():
        chk.true(ep.flags_at_rest() == "", f"window {window} ({wire}): flags at rest")
        ep.close()
    _done(store, f"window-{window}", rank, ws)
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("window,lag", [(3, 1), (3, 2), (16, 2), (16, 15)])
def test_staged_rail_window(window: int, lag: int) -> None:
    """The fewest chunk slots the schedule allows (3) and many (16, FASTCOMM_CUDA_WINDOW), with
    the all-gather steps right behind the reductions (lag 1) or as late as the window allows
    (FASTCOMM_CUDA_LAG): ops of many chunks, all in flight, equal to the references; every flag
    at rest after."""
    run_ranks(2, window_fn, window, lag, init=False, timeout_s=240)


def test_staged_rail_window_out_of_range() -> None:
    from torchext import _testing as _C

    for window in (2, 33):
        with pytest.raises(RuntimeError, match="window must be from 3 to 32"):
            _C._StagedRailEndpoint(dist.HashStore(), "x", 0, 2, chunk_bytes=4096, window=window)


def small_op_chunks_fn(rank: int, ws: int) -> dict[str, Any]:
    import torchext

    store = _store(rank, ws)
    chk = Checker(f"rank {rank}")
    ep = _endpoint(store, "small", rank, ws, chunk_bytes=4 << 20)
    # (elements, dtype, chunks): an op of up to 4 chunks' worth is cut into 4 chunks of at
    # least 256 KiB; larger ones keep the 4 MiB chunks
    cases = [
        ((1 << 19) + 3, torch.float32, 4),  # 2 MiB + 12 B: 4 chunks of about 512 KiB
        (1 << 16, torch.float32, 1),  # 256 KiB: one chunk of the least size
        ((1 << 20) + 1, torch.float64, 4),  # 8 MiB + 8 B: 4 of about 2 MiB
        (3 << 20, torch.int8, 4),  # 3 MiB of bytes: 4 of 768 KiB
        ((1 << 22) + 5, torch.float32, 5),  # 16 MiB + 20 B: 4 MiB chunks and a short one
    ]
    torchext.timeline()
    for i, (n, dt, chunks) in enumerate(cases):
        inputs = [gen(f"small/{i}", r, (n,), dt, "SUM") for r in range(ws)]
        t = inputs[rank].clone()
        ep.wait(ep.issue(t, "SUM"))
        chk.reduced(t, inputs, "SUM", f"{n} x {dt}")
        # every chunk's "d2h" event is in: the proxy recorded it before sending the chunk,
        # which the peers' pieces this rank's device waited for needed
        events = [e for e in torchext.timeline() if e["thread"] == "fc-cuda-proxy"]
        seen = {e["chunk"] for e in events}
        chk.true(seen == set(range(chunks)), f"{n} x {dt}: chunks {sorted(seen)}, not {chunks}")
        # two members exchange whole chunks: one network hop per chunk, no all-gather
        hops = sorted({e["name"] for e in events if e["name"].startswith("net")})
        chk.true(hops == ["net"], f"{n} x {dt}: network steps {hops}")
    ep.close()
    _done(store, "small", rank, ws)
    chk.raise_if_failed()
    return {}


def test_staged_rail_small_op_chunks() -> None:
    """Small ops are cut into 4 chunks of at least 256 KiB (so their steps overlap), larger
    ones keep the configured chunk: the proxy's timeline shows the chunks, each with one
    network hop (two members exchange whole chunks); results exact."""
    run_ranks(2, small_op_chunks_fn, init=False, env={"FASTCOMM_TIMELINE": "1"}, timeout_s=240)


TIMEOUT_S = 4.0


def _lose_peer(
    store: Any,
    ep: Any,
    tag: str,
    rank: int,
    ws: int,
    mode: str,
    ops: Callable[[], None],
    after: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Rank 1 exits (mode "dies") or stays alive without issuing ("sleeps") while the
    others run `ops`: their error and how long it took, then `after(out)`, then how long
    closing took. Rank 0 (the store's host) leaves last. Every rank first waits until all
    have finished the collectives before this call: a rank that exits right after its own
    part of one could reset a connection whose last bytes a peer has yet to read."""
    victim = 1
    out: dict[str, Any] = {}
    store.set(f"{tag}/ready/{rank}", "1")
    store.wait([f"{tag}/ready/{r}" for r in range(ws)], timedelta(seconds=60))
    if rank == victim:
        if mode == "dies":
            os._exit(17)
        store.wait([f"{tag}/done/{r}" for r in range(ws) if r != victim], timedelta(seconds=60))
        ep.close()
        return out
    t0 = time.monotonic()
    try:
        ops()
    except RuntimeError as e:
        out["elapsed"] = time.monotonic() - t0
        out["message"] = str(e)
    if after is not None:
        after(out)
    t1 = time.monotonic()
    ep.close()
    out["close_s"] = time.monotonic() - t1
    store.set(f"{tag}/done/{rank}", "1")
    if rank == 0:
        store.wait([f"{tag}/done/{r}" for r in range(ws) if r != victim], timedelta(seconds=60))
        if mode == "sleeps":
            time.sleep(1.0)
    return out


def failure_fn(rank: int, ws: int, mode: str) -> dict[str, Any]:
    store = _store(rank, ws)
    ep = _endpoint(store, f"fail-{mode}", rank, ws, chunk_bytes=4096, timeout_s=TIMEOUT_S)
    n = 50_001
    t = torch.ones(n)
    ep.wait(ep.issue(t, "SUM"))  # all connected and working
    assert bool((t == ws).all())

    def ops() -> None:
        for _ in range(3):
            ep.wait(ep.issue(torch.ones(n), "SUM"))

    return _lose_peer(store, ep, "failure", rank, ws, mode, ops)


@pytest.mark.parametrize("mode", ["dies", "sleeps"])
def test_staged_rail_dead_or_absent_peer(mode: str) -> None:
    """Rank 1 of 3 exits, or stays alive without issuing: the others raise within the timeout
    (+ grace) naming all_reduce, rank [1] and the timeout, and closing returns promptly (every
    lane released)."""
    res = run_ranks(
        3, failure_fn, mode, init=False,
        expect_fail={1: 17} if mode == "dies" else None, timeout_s=120,
    )  # fmt: skip
    if mode == "dies":
        assert isinstance(res[1], RankFailure)
    for r in (0, 2):
        out = res[r]
        assert "message" in out, f"rank {r}: no error without rank 1: {out}"
        msg = out["message"]
        assert "all_reduce" in msg and "[1]" in msg and "timeout" in msg.lower(), msg
        assert out["elapsed"] <= TIMEOUT_S + 10, out
        assert out["close_s"] <= 15, out


# ----------------------------------------------------------------------------- captured


REPLAYS = 4


def capture_fn(rank: int, ws: int) -> dict[str, Any]:
    store = _store(rank, ws)
    chk = Checker(f"rank {rank}")
    ep = _endpoint(store, "capture", rank, ws, chunk_bytes=4096, timeout_s=30.0)

    def eager(key: str, n: int, dt: torch.dtype, op: str) -> tuple[Any, torch.Tensor, list[Any]]:
        inputs = [gen(key, r, (n,), dt, op) for r in range(ws)]
        t = inputs[rank].clone()
        return t, inputs, ep.issue(t, op)

    # An eager op first, as a warm-up would be: the captured ops then do not start at slot 0.
    t, inputs, tk = eager("cap/warm", 2500, torch.float32, "SUM")
    ep.wait(tk)
    chk.reduced(t, inputs, "SUM", "warm-up")
    chk.true(ep.flags_at_rest() == "", "flags after the warm-up")

    # Graph 1: two all_reduces of static buffers, many chunks each (4 KiB chunks).
    a = torch.zeros(9001, dtype=torch.float32)
    b = torch.zeros(3001, dtype=torch.int64)
    ep.capture_begin()
    tickets = [ep.issue(a, "SUM"), ep.issue(b, "MAX")]
    g1 = ep.capture_end()
    chk.true(tickets == [-1, -1], f"captured issues gave tickets {tickets}")
    chk.true(bool((a == 0).all()) and bool((b == 0).all()), "the capture ran the ops")
    # Graph 2: one integer SUM, replayed twice in flight (exact: ws * ws * sum).
    c = torch.zeros(1777, dtype=torch.int64)
    ep.capture_begin()
    ep.issue(c, "SUM")
    g2 = ep.capture_end()

    for i in range(REPLAYS):
        ins_a = [gen(f"cap/a/{i}", r, a.shape, a.dtype, "SUM") for r in range(ws)]
        ins_b = [gen(f"cap/b/{i}", r, b.shape, b.dtype, "MAX") for r in range(ws)]
        a.copy_(ins_a[rank])
        b.copy_(ins_b[rank])
        # Eager ops before and after the replay, all in flight together; their sizes move the
        # chunk counter by amounts that are no multiple of the slot window, so the replay's
        # fixed slots land on different slots of the eager ops' every time.
        pending = []
        if i % 2:
            pending.append(eager(f"cap/e0/{i}", 1000 * i + 7, torch.float32, "AVG") + ("AVG",))
        rt = ep.replay(g1)
        pending.append(eager(f"cap/e1/{i}", 777 * (i + 1) + 3, torch.int32, "SUM") + ("SUM",))
        pending.append(eager(f"cap/e2/{i}", 5, torch.bfloat16, "MIN") + ("MIN",))
        for t, inputs, tk, op in reversed(pending):
            ep.wait(tk)
            chk.reduced(t, inputs, op, f"replay {i}: eager {op} of {t.numel()} in flight with it")
        ep.wait(rt)
        chk.reduced(a, ins_a, "SUM", f"replay {i}: float32 SUM")
        chk.reduced(b, ins_b, "MAX", f"replay {i}: int64 MAX")
        rest = ep.flags_at_rest()
        chk.true(rest == "", f"replay {i}: flags not back at their initial values:{rest}")

    ins_c = [gen("cap/c", r, c.shape, c.dtype, "SUM") for r in range(ws)]
    c.copy_(ins_c[rank])
    t1, t2 = ep.replay(g2), ep.replay(g2)
    ep.wait(t2)
    ep.wait(t1)
    chk.equal(c, ws * sum(ins_c), "two replays in flight: the second reduces the first's result")
    # Graph 1 still replays correctly after the other graph and all the eager ops.
    ins_a = [gen("cap/a/last", r, a.shape, a.dtype, "SUM") for r in range(ws)]
    a.copy_(ins_a[rank])
    ep.wait(ep.replay(g1))
    chk.reduced(a, ins_a, "SUM", "last replay")
    chk.true(ep.flags_at_rest() == "", "flags after the last replay")
    ep.close()
    _done(store, "capture", rank, ws)
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("ws", [2, 3])
def test_staged_rail_captured_replays(ws: int) -> None:
    """Ops recorded once (on one stream) and replayed with fresh data, eager ops (on three
    lanes) of other sizes interleaved and in flight with the replays, two replays in flight:
    every result equals its reference and every flag is back at its initial value after each
    round."""
    run_ranks(ws, capture_fn, init=False, timeout_s=300)


def capture_failure_fn(rank: int, ws: int, mode: str) -> dict[str, Any]:
    store = _store(rank, ws)
    ep = _endpoint(store, f"capfail-{mode}", rank, ws, chunk_bytes=4096, timeout_s=TIMEOUT_S)
    a = torch.zeros(50_001)
    ep.capture_begin()
    ep.issue(a, "SUM")
    g = ep.capture_end()
    a.fill_(1.0)
    ep.wait(ep.replay(g))  # every rank replays once
    assert bool((a == ws).all())

    def ops() -> None:
        for _ in range(3):
            a.fill_(1.0)
            ep.wait(ep.replay(g))

    def next_op(out: dict[str, Any]) -> None:
        try:
            ep.issue(torch.ones(10), "SUM")
            out["next"] = None
        except RuntimeError as e:
            out["next"] = str(e)

    return _lose_peer(store, ep, "capfail", rank, ws, mode, ops, next_op)


@pytest.mark.parametrize("mode", ["dies", "sleeps"])
def test_staged_rail_peer_lost_during_replay(mode: str) -> None:
    """Rank 1 of 3 exits, or stops replaying, after one replay: the others' next replay
    raises within the timeout (+ grace) naming all_reduce in a graph replay, rank [1] and the
    timeout; the next op raises at once naming that failure; closing returns promptly."""
    res = run_ranks(
        3, capture_failure_fn, mode, init=False,
        expect_fail={1: 17} if mode == "dies" else None, timeout_s=120,
    )  # fmt: skip
    for r in (0, 2):
        out = res[r]
        assert "message" in out, f"rank {r}: no error without rank 1: {out}"
        msg = out["message"]
        assert "all_reduce" in msg and "graph replay" in msg, msg
        assert "[1]" in msg and "timeout" in msg.lower(), msg
        assert out["elapsed"] <= TIMEOUT_S + 10, out
        nxt = out["next"]
        assert nxt is not None and "failed earlier" in nxt and "[1]" in nxt, nxt
        assert out["close_s"] <= 15, out
