"""FASTCOMM_CUDA_INTER=host: CUDA collectives other than all_reduce across nodes staged
through pinned host memory and run by the hierarchical host plan. 4 GPUs as 2 simulated
nodes x 2 (FASTCOMM_HOST_ID). References come from every rank's regenerated input
(tests/_harness.py gen). The path's use is proven by stats()["cuda_via_host"].

Run on the GPU machine:  python -m pytest -q tests/test_cuda_inter_host.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import Checker, gen, is_gloo, run_ranks

pytestmark = [
    pytest.mark.skipif(is_gloo(), reason="fastcomm's multi-node CUDA path"),
    pytest.mark.cuda(world_size=4),
]

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]


def ENV(rank: int) -> dict[str, str]:
    return {"FASTCOMM_HOST_ID": f"simnode{rank // 2}", "FASTCOMM_CUDA_INTER": "host"}


def _device(rank: int) -> torch.device:
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _via_host() -> int:
    import torchext

    return int(torchext.stats().get("cuda_via_host", {}).get("count", 0))


def _ops(dt: torch.dtype) -> list[str]:
    return ["SUM", "AVG", "MIN", "MAX"] if dt.is_floating_point else ["SUM", "MIN", "MAX"]


def matrix_fn(rank: int, ws: int) -> None:
    dev = _device(rank)
    chk = Checker(f"rank {rank}")
    n = 1003  # odd: not divisible by chunks or ranks
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        k = f"inter/{dt_name}"
        ins = [gen(k, r, (n,), dt) for r in range(ws)]
        before = _via_host()

        # broadcast from a rank of the other node
        t = ins[rank].to(dev)
        dist.broadcast(t, src=3)
        chk.equal(t, ins[3], f"{k} broadcast")

        # all_gather / all_gather_into_tensor
        outs = [torch.empty(n, dtype=dt, device=dev) for _ in range(ws)]
        dist.all_gather(outs, ins[rank].to(dev))
        for r in range(ws):
            chk.equal(outs[r], ins[r], f"{k} all_gather[{r}]")
        flat = torch.empty(ws * n, dtype=dt, device=dev)
        dist.all_gather_into_tensor(flat, ins[rank].to(dev))
        chk.equal(flat, torch.cat(ins), f"{k} all_gather_into_tensor")

        # gather / scatter with a root on node 1
        root = 2
        g = [torch.empty(n, dtype=dt, device=dev) for _ in range(ws)] if rank == root else None
        dist.gather(ins[rank].to(dev), g, dst=root)
        if rank == root:
            for r in range(ws):
                chk.equal(g[r], ins[r], f"{k} gather[{r}]")
        s = torch.empty(n, dtype=dt, device=dev)
        dist.scatter(s, [x.to(dev) for x in ins] if rank == 1 else None, src=1)
        chk.equal(s, ins[rank], f"{k} scatter")

        # all_to_all_single with uneven splits: every rank sends i + 1 rows to rank i
        sizes = [i + 1 for i in range(ws)]
        offs = [sum(sizes[:i]) for i in range(ws)]
        urows = [gen(f"{k}/a2av", r, (sum(sizes), 2), dt) for r in range(ws)]
        o = torch.empty((rank + 1) * ws, 2, dtype=dt, device=dev)
        dist.all_to_all_single(o, urows[rank].to(dev), [rank + 1] * ws, sizes)
        want = torch.cat([urows[r][offs[rank] : offs[rank] + rank + 1] for r in range(ws)])
        chk.equal(o, want, f"{k} all_to_all_single")
        # all_to_all of lists, equal chunks
        rows = [gen(f"{k}/a2a", r, (ws * 3, 2), dt) for r in range(ws)]
        chunks = [rows[rank][i * 3 : i * 3 + 3].to(dev) for i in range(ws)]
        outl = [torch.empty(3, 2, dtype=dt, device=dev) for _ in range(ws)]
        dist.all_to_all(outl, chunks)
        for r in range(ws):
            chk.equal(outl[r], rows[r][rank * 3 : rank * 3 + 3], f"{k} all_to_all[{r}]")

        # send/recv across nodes: 0 <-> 2, 1 <-> 3
        peer = (rank + 2) % ws
        recv = torch.empty(n, dtype=dt, device=dev)
        if rank < 2:
            dist.send(ins[rank].to(dev), peer)
            dist.recv(recv, peer)
        else:
            dist.recv(recv, peer)
            dist.send(ins[rank].to(dev), peer)
        chk.equal(recv, ins[peer], f"{k} send/recv")

        for op in _ops(dt):
            kk = f"{k}/{op}"
            rin = [gen(kk, r, (ws * n,), dt, op) for r in range(ws)]
            pieces = [[x[i * n : (i + 1) * n] for i in range(ws)] for x in rin]
            rop = getattr(dist.ReduceOp, op)
            # reduce to a root on node 1; non-roots keep their input (as with NCCL)
            t = rin[rank][:n].to(dev)
            dist.reduce(t, dst=3, op=rop)
            if rank == 3:
                chk.reduced(t, [x[:n] for x in rin], op, f"{kk} reduce")
            else:
                chk.equal(t, rin[rank][:n], f"{kk} reduce non-root unchanged")
            out = torch.empty(n, dtype=dt, device=dev)
            dist.reduce_scatter_tensor(out, rin[rank].to(dev), op=rop)
            chk.reduced(out, [p[rank] for p in pieces], op, f"{kk} reduce_scatter_tensor")
            out2 = torch.empty(n, dtype=dt, device=dev)
            dist.reduce_scatter(out2, [p.to(dev) for p in pieces[rank]], op=rop)
            chk.reduced(out2, [p[rank] for p in pieces], op, f"{kk} reduce_scatter")
        chk.true(_via_host() > before, f"{k}: no collective took the host-staged path")
    chk.raise_if_failed()


def test_every_collective_host_staged() -> None:
    run_ranks(4, matrix_fn, env=ENV, timeout_s=600)


def semantics_fn(rank: int, ws: int) -> None:
    import torchext

    dev = _device(rank)
    chk = Checker(f"rank {rank}")
    n = 1 << 16
    # Input produced by a kernel still queued on the current stream; async work; outputs
    # used right after wait() on another stream; the future's value is the output tensor.
    x = torch.full((n,), float(rank + 1), device=dev)
    torch.cuda._sleep(20_000_000)
    x.mul_(2)
    out = torch.empty(ws * n, device=dev)
    w = dist.all_gather_into_tensor(out, x, async_op=True)
    fut = w.get_future()
    w.wait()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = out.view(ws, n)[:, 0].cpu()
    side.synchronize()
    chk.equal(got, torch.tensor([2.0 * (r + 1) for r in range(ws)]), "all_gather after wait")
    val = fut.wait()
    chk.true(isinstance(val, list) and val[0].data_ptr() == out.data_ptr(), "future value")

    # all_reduce keeps its own path: not counted as staged through host memory.
    before = _via_host()
    t = torch.ones(4 << 20, device=dev)
    dist.all_reduce(t)
    chk.equal(t[:4].cpu(), torch.full((4,), float(ws)), "all_reduce")
    chk.true(_via_host() == before, "all_reduce went through the host-staged path")
    chk.true("all_reduce" in torchext.stats(), "all_reduce not counted")

    # Capture refused with a clear error, before any CUDA call (the capture stays valid).
    y = torch.zeros(n, device=dev)
    ys = torch.empty(ws * n, device=dev)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    msg = ""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            dist.all_gather_into_tensor(ys, y)
        except RuntimeError as e:
            msg = str(e)
        y.add_(1)
        graph.capture_end()
    chk.true("cannot be captured into a CUDA graph with FASTCOMM_CUDA_INTER=host" in msg, msg)
    graph.replay()
    torch.cuda.synchronize()
    chk.equal(y[:2].cpu(), torch.ones(2), "capture still valid")
    dist.barrier()
    chk.raise_if_failed()


def test_semantics_capture_and_all_reduce_path() -> None:
    run_ranks(4, semantics_fn, env=ENV, timeout_s=300)


def coalesced_fn(rank: int, ws: int) -> None:
    dev = _device(rank)
    chk = Checker(f"rank {rank}")
    n = 257
    ins = [gen("coal", r, (n,), torch.float32) for r in range(ws)]
    peer = (rank + 2) % ws
    recv = torch.empty(n, device=dev)
    ops = [dist.P2POp(dist.isend, ins[rank].to(dev), peer), dist.P2POp(dist.irecv, recv, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    chk.equal(recv, ins[peer], "batch_isend_irecv across nodes")
    chk.raise_if_failed()


def test_coalesced_p2p_run_one_by_one() -> None:
    run_ranks(4, coalesced_fn, env=ENV, timeout_s=300)
