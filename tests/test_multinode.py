"""Groups spanning several (simulated) nodes: FASTCOMM_HOST_ID gives each rank a node.

The collective x dtype x op matrix over 2x2, 2x2 interleaved, 4x1 and 3+1 layouts lives in
test_collectives.py (LAYOUTS); here: DDP parity, a killed rank, wire compression, choices
agreed through the store, a real two-torchrun launch, and no leaks after destroy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import (
    BACKEND,
    Checker,
    RankFailure,
    capture_stderr,
    dtype_of,
    gen,
    is_gloo,
    reduce_op,
    run_ranks,
    valid_ops,
)
from test_ddp import ddp_parity_fn
from test_groups_and_errors import peer_failure_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(is_gloo(), reason="fastcomm's multi-node plans")


def nodes_env(nodes: list[int], **extra: str) -> Any:
    return lambda rank: {"FASTCOMM_HOST_ID": f"simnode{nodes[rank]}", **extra}


def test_ddp_parity_two_nodes() -> None:
    """DDP over 2 nodes x 2 ranks gives gloo's per-step losses and parameters."""
    res = run_ranks(4, ddp_parity_fn, "cpu", "gloo", env=nodes_env([0, 0, 1, 1]), timeout_s=240)
    assert res[0]["losses"][-1] < res[0]["losses"][0]


IB_ENV = {"FASTCOMM_TRANSPORT": "ib", "FASTCOMM_IB_EMULATE": "1"}


def test_ddp_parity_two_nodes_ib() -> None:
    """The same over the ib transport (its software RC emulation: no RDMA hardware here)."""
    res = run_ranks(
        4, ddp_parity_fn, "cpu", "gloo", env=nodes_env([0, 0, 1, 1], **IB_ENV), timeout_s=240
    )
    assert res[0]["losses"][-1] < res[0]["losses"][0]


QP_FAULT_TIMEOUT_S = 8.0


def qp_fault_fn(rank: int, ws: int) -> dict[str, Any]:
    if rank == 2:
        import torchext._testing as T

        T.ib_emu_fail("qp_error:after=30")  # before the group opens its transport
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=QP_FAULT_TIMEOUT_S))
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    t = torch.ones(1 << 20)
    dist.all_reduce(t)  # the connections work before the fault
    t0 = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(t)
        out["message"] = None
    except RuntimeError as e:
        out["message"] = str(e)
    out["elapsed"] = time.monotonic() - t0
    store.set(f"qp_fault/done/{rank}", "1")
    if rank == 0:  # hosts the store
        store.wait([f"qp_fault/done/{r}" for r in range(ws)], timedelta(seconds=60))
    dist.destroy_process_group()
    return out


def test_injected_qp_error_fails_every_rank() -> None:
    """ib over 2x2 nodes; rank 2's queue pair to its rail peer (rank 0) enters the error
    state in the middle of the all_reduces (torchext._testing.ib_emu_fail). Ranks 2 and 0
    raise at once, naming all_reduce, each other and what the device reported; ranks 1 and
    3, whose own rail is intact, raise by the group timeout naming the ranks they wait for.
    Nobody hangs, and destroy_process_group() returns."""

    def env(rank: int) -> dict[str, str]:
        return {"FASTCOMM_HOST_ID": f"simnode{rank // 2}", **IB_ENV}

    res = run_ranks(4, qp_fault_fn, init=False, timeout_s=120, env=env)
    for rank, r in enumerate(res):
        msg = r["message"]
        assert msg is not None, f"rank {rank}: 50 all_reduces succeeded despite the fault"
        assert "all_reduce" in msg, (rank, msg)
        assert r["elapsed"] < QP_FAULT_TIMEOUT_S + 10, (rank, r)
    assert "IBV_EVENT_QP_FATAL" in res[2]["message"], res[2]
    assert "group rank [0]" in res[2]["message"], res[2]
    assert "group rank [2]" in res[0]["message"], res[0]
    assert res[0]["elapsed"] < 8 and res[2]["elapsed"] < 8, res


def test_killed_rank_on_other_node_fails_everyone() -> None:
    """Rank 1 (node 0) dies before an all_reduce over 2x2 nodes: ranks 0, 2 and 3 (two of
    them on the other node) raise within timeout + 10 s naming all_reduce, rank [1] and the
    timeout, and destroy_process_group() still returns."""
    res = run_ranks(
        4,
        peer_failure_fn,
        "dies",
        True,
        init=False,
        expect_fail={1: 17},
        timeout_s=120,
        env=nodes_env([0, 0, 1, 1]),
    )
    assert isinstance(res[1], RankFailure)
    for r in (0, 2, 3):
        assert "message" in res[r], res[r]


# Per wire dtype: the largest error of one coding of a value, relative to the largest
# magnitude of the block of 256 it is coded in (bf16: to the value itself), and a bound on
# the relative L2 error of a whole all_reduce of Gaussian data (up to four codings of a value:
# a ring codes a partial sum, then its owner the finished block; recursive doubling with a
# folded node codes both operands of two exchanges).
WIRE_STEP = {"bf16": 2.0**-8, "fp16": 2.0**-11, "int8": 1 / 127}
WIRE_L2 = {"bf16": 2.0**-7, "fp16": 2.0**-10, "int8": 2.0**-5}


def wire_fn(rank: int, ws: int, wire: str) -> dict[str, Any]:
    chk = Checker(f"rank {rank}")
    # the small path, the pipelined one, and sums past fp16's largest value (65504): values
    # of about 1e3 with outliers of 3e4 at the same places on every rank
    for kind, n in (("small", 1000), ("pipelined", 3 << 20), ("outliers", 70001)):
        inputs = [gen(f"wire/{n}", r, (n,), torch.float32, "SUM") for r in range(ws)]
        if kind == "outliers":
            spots = torch.arange(7, n, 997)
            for x in inputs:
                x.mul_(1e3)[spots] = 3e4
        t = inputs[rank].clone()
        dist.all_reduce(t)
        exact = sum(x.double() for x in inputs)
        magnitude = sum(x.double().abs() for x in inputs)  # bounds every partial sum
        err = (t.double() - exact).abs()
        if wire == "bf16":
            bound = magnitude * WIRE_STEP[wire] * 4
        else:
            # any block of 256 holding element i lies within i-255 .. i+255
            local = torch.nn.functional.max_pool1d(magnitude[None, None], 511, 1, 255)[0, 0]
            bound = local * WIRE_STEP[wire] * 3
        chk.true(bool(torch.isfinite(t).all()), f"{kind}: non-finite values")
        chk.true(bool((err <= bound).all()), f"{kind}: max err {err.max():.3g} over the bound")
        if kind != "outliers":  # there, values far below their block's largest lose more
            rel = (err.norm() / exact.norm()).item()
            chk.true(rel <= WIRE_L2[wire], f"{kind}: relative L2 error {rel:.3g}")
        chk.true(bool((err > 0).any()), f"{kind}: no rounding at all: {wire} wire not in use?")
        everyone = [torch.empty_like(t) for _ in range(ws)]
        dist.all_gather(everyone, t)
        for r in range(ws):
            chk.true(torch.equal(everyone[r], t), f"{kind}: rank {r} holds different values")
    # integer sums never go through the wire
    ints = [gen("wire/ints", r, (4099,), torch.int64, "SUM") for r in range(ws)]
    ti = ints[rank].clone()
    dist.all_reduce(ti)
    chk.equal(ti, sum(ints), "int64 sum")
    chk.raise_if_failed()
    return {}


@pytest.mark.parametrize("wire", list(WIRE_STEP))
@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 1, 2]], ids=["2x2", "3x1"])
def test_wire_dtype(layout: list[int], wire: str) -> None:
    """FASTCOMM_WIRE_DTYPE: float32 sums within the wire's coding bound, no overflow of
    fp16 past 65504 (block scales), bit-identical on all ranks; integer sums exact. 3x1
    folds the third node into recursive doubling."""
    run_ranks(len(layout), wire_fn, wire, env=nodes_env(layout, FASTCOMM_WIRE_DTYPE=wire))


def odd_rail_fn(rank: int, ws: int) -> None:
    """All-reduce on a rail of 3 nodes: recursive doubling with a folded member for
    small messages, the ring above 64 KiB; every dtype and op against the reference,
    and the same values on every rank."""
    chk = Checker(f"rank {rank}")
    for dtype_name in ("float32", "float64", "bfloat16", "int32", "uint8", "bool"):
        dtype = dtype_of(dtype_name)
        for op in valid_ops(dtype_name):
            for n in (1, 37, 4099, 40000):
                key = f"rail3/{dtype_name}/{op}/{n}"
                inputs = [gen(key, r, (n,), dtype, op) for r in range(ws)]
                t = inputs[rank].clone()
                dist.all_reduce(t, op=reduce_op(op))
                chk.reduced(t, inputs, op, f"{dtype_name} {op} n={n}")
                everyone = [torch.empty_like(t) for _ in range(ws)]
                dist.all_gather(everyone, t)
                for r in range(ws):
                    chk.equal(everyone[r], t, f"{dtype_name} {op} n={n}: rank {r} vs mine")
    chk.raise_if_failed()


def test_allreduce_on_a_rail_of_three_nodes() -> None:
    run_ranks(3, odd_rail_fn, env=nodes_env([0, 1, 2]), timeout_s=180)


def agree_fn(rank: int, ws: int) -> dict[str, Any]:
    chk = Checker(f"rank {rank}")
    n = 1 << 20
    inputs = [gen("agree", r, (n,), torch.float32, "SUM") for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    everyone = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(everyone, t)
    for r in range(ws):
        chk.true(torch.equal(everyone[r], t), f"rank {r} holds different values")
    chk.raise_if_failed()
    return {}


def test_choices_follow_rank_zero() -> None:
    """Ranks configured differently (wire dtype, chunk size) still agree: rank 0 decides
    through the store, so nothing hangs or diverges."""

    def env(rank: int) -> dict[str, str]:
        e = {"FASTCOMM_HOST_ID": f"simnode{rank // 2}"}
        if rank % 2:
            e.update(FASTCOMM_WIRE_DTYPE="bf16", FASTCOMM_CHUNK_BYTES="64K")
            e.update(
                FASTCOMM_CUDA_WINDOW="16", FASTCOMM_CUDA_LAG="9", FASTCOMM_CUDA_CHUNK_BYTES="1M"
            )
        return e

    run_ranks(4, agree_fn, env=env)


def sockets_fn(rank: int, ws: int, log_dir: str) -> dict[str, Any]:
    capture_stderr(os.path.join(log_dir, f"rank{rank}.log"))
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    chk = Checker(f"rank {rank}")
    n = 300_000  # the pipelined path: every socket of a peer carries stripes
    inputs = [gen("sockets", r, (n,), torch.float32, "SUM") for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    chk.reduced(t, inputs, "SUM", "all_reduce")
    dist.destroy_process_group()
    chk.raise_if_failed()
    with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
        return {"log": f.read()}


@pytest.mark.parametrize(
    "nodes,env,sockets",
    [
        pytest.param([0, 1], {}, 8, id="2x1-auto"),
        pytest.param([0, 0, 1, 1], {}, 4, id="2x2-auto"),
        pytest.param([0, 0, 0, 1, 1, 1], {}, 2, id="2x3-auto"),
        pytest.param([0, 0, 1, 1], {"FASTCOMM_TCP_SOCKETS": "3"}, 3, id="2x2-set"),
        # Rank 0's setting is the group's: the others' differing ones are replaced.
        pytest.param([0, 0, 1, 1], {1: {"FASTCOMM_TCP_SOCKETS": "6"}}, 4, id="2x2-rank0-auto"),
    ],
)
def test_tcp_sockets_per_peer_follow_the_ranks_per_host(
    tmp_path: Any, nodes: list[int], env: dict[Any, Any], sockets: int
) -> None:
    """FASTCOMM_TCP_SOCKETS=auto (the default) splits 8 sockets per peer among a host's ranks,
    which share its link; a set value is taken as it is. The plan and every rank's transport
    say how many they use, and the all_reduce is right."""

    def rank_env(rank: int) -> dict[str, str]:
        e = {"FASTCOMM_HOST_ID": f"simnode{nodes[rank]}", "FASTCOMM_LOG": "INFO"}
        e.update({k: v for k, v in env.items() if isinstance(k, str)})
        e.update(env.get(rank, {}))
        return e

    res = run_ranks(len(nodes), sockets_fn, str(tmp_path), init=False, timeout_s=180, env=rank_env)
    assert f"; transport tcp ({sockets} sockets per peer);" in res[0]["log"], res[0]["log"][-3000:]
    for rank, r in enumerate(res):
        lines = [ln for ln in r["log"].splitlines() if "tcp transport listening on" in ln]
        assert lines and all(f", {sockets} socket(s) per peer," in ln for ln in lines), (
            rank,
            lines,
        )


def bad_setting_fn(rank: int, ws: int, name: str, value: str) -> dict[str, Any]:
    os.environ[name] = value
    with pytest.raises(Exception) as info:
        dist.init_process_group(BACKEND, rank=rank, world_size=ws)
    text = str(info.value)
    assert f"{name}={value}" in text, text
    return {"error": text}


@pytest.mark.parametrize(
    "name,value",
    [
        ("FASTCOMM_CUDA_WINDOW", "2"),
        ("FASTCOMM_CUDA_WINDOW", "33"),
        ("FASTCOMM_CUDA_LAG", "0"),
        ("FASTCOMM_CUDA_LAG", "6"),  # not below the default window
        ("FASTCOMM_TCP_SOCKET_BUFFER", "2G"),
        ("FASTCOMM_WIRE_DTYPE", "fp8"),
    ],
)
def test_bad_setting_is_refused_at_init(name: str, value: str) -> None:
    """A setting out of its range fails init_process_group with an error naming it, before
    any communication."""
    out = run_ranks(1, bad_setting_fn, name, value, init=False)
    assert name in out[0]["error"]


def _task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def leak_fn(rank: int, ws: int) -> dict[str, Any]:
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ws, rank == 0,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    # Warm torch's own lazily started threads before the baseline.
    torch.ones(4).sum()
    before = (_task_count(), _fd_count())
    for round_ in range(2):
        dist.init_process_group(
            BACKEND, store=dist.PrefixStore(f"round{round_}", store), rank=rank, world_size=ws
        )
        t = torch.ones(1 << 18)
        dist.all_reduce(t)
        dist.send(t, (rank + 2) % ws) if rank < 2 else dist.recv(t, (rank + 2) % ws)
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(0.5)
    after = (_task_count(), _fd_count())
    return {"before": before, "after": after}


def recv_any_fn(rank: int, ws: int) -> None:
    """Rank 0 receives with src=None from ranks on its own node (shared memory) and on
    the other (transport), and tags filter. Headers that a recv from any source read
    ahead (tag 3 while it looked for tag 7) go to the later recv(src=peer) they belong
    to. With no sender, the error comes within the group's timeout."""
    chk = Checker(f"rank {rank}")
    shape = (257,)

    def expect(tag: int, src: int) -> torch.Tensor:
        return gen(f"any/{tag}", src, shape, torch.float32)

    if rank == 0:
        for tag, explicit in ((7, False), (3, True), (5, False)):
            seen = []
            for peer in range(1, ws):
                buf = torch.full(shape, float("nan"))
                src = dist.recv(buf, src=peer if explicit else None, tag=tag)
                seen.append(src)
                chk.equal(buf, expect(tag, src), f"tag-{tag} data from {src}")
            chk.true(sorted(seen) == list(range(1, ws)), f"tag-{tag} senders {seen}")
    else:
        dist.send(expect(7, rank), dst=0, tag=7)
        works = [dist.isend(expect(tag, rank), dst=0, tag=tag) for tag in (3, 5)]
        for w in works:
            w.wait()
    dist.barrier()
    pg = dist.new_group(backend="fastcomm", timeout=timedelta(seconds=3))
    dist.barrier(group=pg)  # everyone has set the group up; nobody sends
    if rank == 0:
        start = time.monotonic()
        try:
            dist.recv(torch.empty(shape), src=None, tag=11, group=pg)
        except RuntimeError as e:
            took = time.monotonic() - start
            chk.true("any source" in str(e) and "3000 ms" in str(e), f"unclear error: {e}")
            chk.true(took < 3 + 5, f"the error took {took:.1f} s")
        else:
            chk.fail("recv(src=None) with no sender returned")
    dist.barrier()
    chk.raise_if_failed()


@pytest.mark.parametrize(
    "layout", [[0, 0, 1, 1], [0, 1, 0, 1], [0, 1, 2, 3]], ids=["2x2", "2x2i", "4x1"]
)
def test_recv_from_any_source_across_nodes(layout: list[int]) -> None:
    run_ranks(4, recv_any_fn, env=nodes_env(layout), timeout_s=120)


def test_no_thread_or_fd_leaks_after_destroy() -> None:
    """Two init/use/destroy rounds over 2x2 nodes leave no threads or sockets behind
    (the shared-memory check runs for every test in conftest)."""
    res = run_ranks(4, leak_fn, init=False, env=nodes_env([0, 0, 1, 1]))
    for rank, r in enumerate(res):
        assert r["after"][0] <= r["before"][0], f"rank {rank}: threads {r}"
        assert r["after"][1] <= r["before"][1], f"rank {rank}: fds {r}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_invocations() -> None:
    """The recipe for real clusters: one torchrun per node (--nnodes=2 --node_rank=0/1,
    rendezvous on loopback), told apart by FASTCOMM_HOST_ID; runs the verified demo."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        env = dict(os.environ, FASTCOMM_HOST_ID=f"node{node}", OMP_NUM_THREADS="1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
            "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
            os.path.join(ROOT, "examples", "allreduce_demo.py"), "--device", "cpu",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out.decode(errors="replace"))
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} torchrun exited {p.returncode}:\n{out[-4000:]}"
    assert "all results correct" in outs[0], outs[0][-2000:]


def timeline_fn(rank: int, ws: int, path: str) -> dict[str, Any]:
    import torchext

    t = gen("timeline", rank, (4 << 20,), torch.float32, "SUM")  # 16 MiB: 32 chunks of 512K
    torchext.timeline()  # drop anything earlier
    dist.all_reduce(t)
    events = torchext.timeline()
    if rank == 0:
        torchext.save_timeline(path, events)
    return {"events": events}


def test_timeline_shows_intra_and_inter_phases_overlapping(tmp_path: Any) -> None:
    """FASTCOMM_TIMELINE=1: the pipelined all_reduce over 2x2 nodes records every chunk's
    three phases, and some network phase runs while a shared-memory phase of another
    chunk does (the pipeline overlaps); rank 0 writes a Chrome trace."""
    path = str(tmp_path / "timeline.json")
    env = nodes_env([0, 0, 1, 1], FASTCOMM_TIMELINE="1", FASTCOMM_CHUNK_BYTES="256K")
    res = run_ranks(4, timeline_fn, path, env=env)
    for rank, r in enumerate(res):
        ev = r["events"]
        names = {e["name"] for e in ev}
        assert {
            "intra reduce-scatter (shm)",
            "inter all-reduce (rail ring)",
            "intra all-gather (shm)",
        } <= names, (rank, names)
        chunks = {e["chunk"] for e in ev if e["name"].startswith("inter")}
        assert chunks == set(range(len(chunks))) and len(chunks) == 32, (rank, sorted(chunks))
        inter = [e for e in ev if e["thread"] == "fc-inter"]
        intra = [e for e in ev if e["thread"] == "fc-host"]
        overlaps = sum(
            1
            for a in inter
            for b in intra
            if a["chunk"] != b["chunk"]
            and a["start_us"] < b["end_us"]
            and b["start_us"] < a["end_us"]
        )
        assert overlaps > 0, f"rank {rank}: no inter phase overlapped an intra phase"
    import json

    with open(path) as f:
        trace = json.load(f)
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def pipeline_chunks_fn(rank: int, ws: int, sizes: list[int]) -> dict[int, int]:
    import torchext

    chunks = {}
    for numel in sizes:
        t = gen(f"pipeline{numel}", rank, (numel,), torch.float32, "SUM")
        want = sum(gen(f"pipeline{numel}", r, (numel,), torch.float64, "SUM") for r in range(ws))
        torchext.timeline()  # drop anything earlier
        dist.all_reduce(t)
        events = torchext.timeline()
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-5)
        chunks[numel] = len({e["chunk"] for e in events if e["name"].startswith("inter all")})
    return chunks


def test_medium_all_reduce_is_pipelined() -> None:
    """The hierarchical all_reduce cuts medium sizes into at least 4 chunks but keeps each
    rank's shard of a chunk at 256 KiB or more, and large ones in shards of
    FASTCOMM_CHUNK_BYTES (1 MiB): 2 x 2 nodes, float32, correct sums."""
    kib = 256  # float32 elements per KiB
    sizes = [256 * kib, 1024 * kib, 2048 * kib, 4096 * kib, 16384 * kib + 3]
    env = nodes_env([0, 0, 1, 1], FASTCOMM_TIMELINE="1")
    res = run_ranks(4, pipeline_chunks_fn, sizes, env=env)
    # per size: shard = clamp(bytes / 2 ranks / 4, 256 KiB, 1 MiB), chunks = bytes / (2 shards)
    want = {sizes[0]: 1, sizes[1]: 2, sizes[2]: 4, sizes[3]: 4, sizes[4]: 9}
    for rank, chunks in enumerate(res):
        assert chunks == want, (rank, chunks)


# ----------------------------------------------------------------------------- FASTCOMM_CUDA_INTER


def cuda_inter_fn(rank: int, ws: int) -> str:
    import torchext

    dist.barrier()  # every rank has its group before rank 0 (the store's server) may leave
    return dict(kv.split("=", 1) for kv in torchext._backend(None).config().split())["cuda_inter"]


def test_cuda_inter_follows_group_rank_zero() -> None:
    """FASTCOMM_CUDA_INTER set differently across ranks: every rank takes group rank 0's
    (a mixed setting would hang the first CUDA collective)."""

    def env(r: int) -> dict[str, str]:
        return {
            "FASTCOMM_HOST_ID": f"simnode{r // 2}",
            "FASTCOMM_CUDA_INTER": "host" if r == 0 else "nccl",
        }

    assert run_ranks(4, cuda_inter_fn, env=env, timeout_s=120) == ["host"] * 4
