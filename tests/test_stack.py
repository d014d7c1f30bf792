"""The PyTorch distributed stack on the backend under test, compared with a stock backend.

FSDP2 (``fully_shard``, resharding both ways, bf16 mixed precision), HSDP on a 2-D
DeviceMesh, DTensor redistributions, tensor and sequence parallelism, functional
collectives eager and under ``torch.compile(fullgraph=True)``, DDP of a compiled module,
distributed checkpointing, pipelining (GPipe, 1F1B) and the object collectives.

Every group runs each case twice, in two spawns: with the backend under test as the
default process group (as users run it), and with the stock backend of the device (gloo for
CPU tensors, NCCL for CUDA ones). Each run checks itself against a communication-free local
reference (the single-device module, the full tensor, the known objects); the parent then
compares the two runs' results: exactly where the math is the same (data movement; sums of
two ranks, which are commutative), otherwise within a few float32 ulps (sums of four ranks
in another order; a compiled module against the eager one of the reference run).

Simulated nodes (``FASTCOMM_HOST_ID`` per rank) put the HSDP replicate dimension, the
pipeline stages and half of every other group across nodes.
"""

from __future__ import annotations

import copy
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _harness import BACKEND, Checker, RanksFailed, gen, run_ranks, seed_of

PG_TIMEOUT_S = 90.0
LOCAL_TOL = 1e-5  # against the communication-free local reference
# Sums over four ranks, in another order than the reference backend's (float32, O(1) data).
PARITY_RTOL = 1e-5
PARITY_ATOL = 1e-6


class Ctx:
    """What a case sees: its rank, device, checker, and the results it hands back for the
    comparison with the other backend's run."""

    def __init__(self, rank: int, ws: int, device: torch.device, name: str, reference: bool):
        self.rank = rank
        self.ws = ws
        self.device = device
        self.name = name
        self.reference = reference  # the stock backend's run
        self.chk = Checker(f"rank {rank}")
        # key -> (value, mode): "exact" (data movement), "reduced" (float sums: exact over two
        # ranks) or "approx" (other rounding)
        self.results: dict[str, tuple[Any, str]] = {}

    def keep(self, key: str, value: Any, mode: str = "reduced") -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().clone()
        self.results[key] = (value, mode)

    def close(self, actual: Any, expected: Any, what: str) -> None:
        """Within LOCAL_TOL of the local reference."""
        self.chk.close(actual, expected, what, rtol=LOCAL_TOL, atol=LOCAL_TOL)

    def data(self, key: str, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Fresh float32 data of ``rank`` for ``key`` (any rank can compute it), on the device."""
        return gen(f"{self.name}/{key}", rank, shape, torch.float32).to(self.device)

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, shape, mesh_dim_names=names)


# ----------------------------------------------------------------------------- models


def _mlp(seed: int) -> nn.Sequential:
    """The last layer has 5 outputs: its weight and bias shard unevenly over 2 and 4 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)
    )


_TEACHER = 0.25 * torch.randn(16, 5, generator=torch.Generator().manual_seed(7))


def _batch(c: Ctx, rank: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` (the same at every step, so that the loss goes down)."""
    g = torch.Generator().manual_seed(seed_of(c.name, rank))
    x = torch.randn(rows, 16, generator=g)
    y = x @ _TEACHER + 0.01 * torch.randn(rows, 5, generator=g)
    return x.to(c.device), y.to(c.device)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_data_parallel(
    c: Ctx, steps: int, lr: float, param_dtype: torch.dtype | None = None
) -> tuple[list[float], nn.Module]:
    """Data parallelism without communication: the gradient is the mean over ranks of the
    per-rank gradients, each computed (in ``param_dtype`` if given, as FSDP's mixed precision
    does) on that rank's batch. Returns this rank's per-step losses and the model."""
    model = _mlp(1234).to(c.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(c.ws):
            work = copy.deepcopy(model)
            if param_dtype is not None:
                work.to(param_dtype)
            x, y = _batch(c, r)
            if param_dtype is not None:
                x = x.to(param_dtype)
            loss = F.mse_loss(work(x).float(), y)
            loss.backward()
            for g, p in zip(grads, work.parameters()):
                g += p.grad.float()
            if r == c.rank:
                losses.append(loss.item())
        for g, p in zip(grads, model.parameters()):
            p.grad = g / c.ws
        opt.step()
    return losses, model


def _train_and_compare(
    c: Ctx, model: nn.Module, steps: int, param_dtype: Any = None, mode: str = "reduced"
) -> None:
    """Trains ``model`` (data parallel over all ranks) and checks it against the local
    reference; keeps the losses and the final parameters for the parity check."""
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        x, y = _batch(c, c.rank)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ref_losses, ref = _local_data_parallel(c, steps, lr, param_dtype)
    c.close(torch.tensor(losses), torch.tensor(ref_losses), "per-step losses vs local")
    c.chk.true(losses[-1] < losses[0], f"loss did not go down: {losses}")
    c.keep("losses", torch.tensor(losses), mode)
    for p, (n, q) in zip(model.parameters(), ref.named_parameters()):
        full = _full(p.detach())
        c.close(full, q.detach(), f"param {n} vs local")
        c.keep(f"param {n}", full, mode)


# ----------------------------------------------------------------------------- cases


def _fsdp(c: Ctx, mesh: Any, reshard: bool, mixed: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model = _mlp(1234).to(c.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    # each rank holds only its shard of a parameter (uneven for the last layer)
    w = model[0].weight
    c.chk.true(
        tuple(w.to_local().shape) == (32 // mesh.size(-1), 16),
        f"local shard of a (32, 16) weight: {tuple(w.to_local().shape)}",
    )
    _train_and_compare(c, model, steps=3, param_dtype=torch.bfloat16 if mixed else None)


def case_fsdp_reshard(c: Ctx) -> None:
    _fsdp(c, c.mesh((c.ws,)), reshard=True, mixed=False)


def case_fsdp_no_reshard(c: Ctx) -> None:
    _fsdp(c, c.mesh((c.ws,)), reshard=False, mixed=False)


def case_fsdp_bf16(c: Ctx) -> None:
    _fsdp(c, c.mesh((c.ws,)), reshard=True, mixed=True)


def case_hsdp(c: Ctx) -> None:
    """Replicate across the (simulated) nodes, shard within: ranks r and r + ws/2 hold the
    same shard."""
    mesh = c.mesh((2, c.ws // 2), ("replicate", "shard"))
    _fsdp(c, mesh, reshard=True, mixed=False)


def _shard(t: torch.Tensor, n: int, dim: int, i: int) -> torch.Tensor:
    """Piece ``i`` of ``n`` of ``t`` along ``dim`` as Shard(dim) places it (torch.chunk's
    sizes, empty pieces at the end)."""
    pieces = list(t.chunk(n, dim))
    return pieces[i] if i < len(pieces) else t.narrow(dim, 0, 0)


def case_dtensor(c: Ctx) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    ws = c.ws
    mesh = c.mesh((ws,))
    full = c.data("full", 0, (4 * ws, 6))  # the same on every rank

    def local_is(d: Any, expected: torch.Tensor, what: str) -> None:
        c.chk.equal(d.to_local(), expected, f"{what}: local part")
        c.keep(what, d.to_local(), "exact")

    s0 = distribute_tensor(full, mesh, [Shard(0)])
    local_is(s0, _shard(full, ws, 0, c.rank), "distribute Shard(0)")
    local_is(s0.redistribute(mesh, [Replicate()]), full, "Shard(0)->Replicate (all_gather)")
    s1 = s0.redistribute(mesh, [Shard(1)])  # all_to_all
    local_is(s1, _shard(full, ws, 1, c.rank), "Shard(0)->Shard(1) (all_to_all)")
    local_is(s1.redistribute(mesh, [Shard(0)]), _shard(full, ws, 0, c.rank), "Shard(1)->Shard(0)")
    r = distribute_tensor(full, mesh, [Replicate()])
    local_is(r.redistribute(mesh, [Shard(1)]), _shard(full, ws, 1, c.rank), "R->Shard(1)")
    # uneven: 4*ws+1 rows (the last shard is short, all_gather pads)
    odd = c.data("odd", 0, (4 * ws + 1, 3))
    u = distribute_tensor(odd, mesh, [Shard(0)])
    c.chk.equal(u.to_local(), _shard(odd, ws, 0, c.rank), "uneven Shard(0) local")
    c.chk.equal(u.full_tensor(), odd, "uneven Shard(0) full_tensor")
    c.keep("uneven full_tensor", u.full_tensor(), "exact")

    # Partial: every rank holds a different addend
    parts = [c.data("part", q, (2 * ws, 5)) for q in range(ws)]
    p = DTensor.from_local(parts[c.rank], mesh, [Partial()])
    rep = p.redistribute(mesh, [Replicate()])  # all_reduce
    c.chk.reduced(rep.to_local().cpu(), [t.cpu() for t in parts], "SUM", "Partial->Replicate")
    c.keep("Partial->Replicate", rep.to_local())
    sh = p.redistribute(mesh, [Shard(0)])  # reduce_scatter
    mine = [t.chunk(ws, 0)[c.rank].cpu() for t in parts]
    c.chk.reduced(sh.to_local().cpu(), mine, "SUM", "Partial->Shard(0)")
    c.keep("Partial->Shard(0)", sh.to_local())
    pa = DTensor.from_local(parts[c.rank], mesh, [Partial("avg")])
    c.chk.reduced(pa.full_tensor().cpu(), [t.cpu() for t in parts], "AVG", "Partial(avg)")
    c.keep("Partial(avg) full_tensor", pa.full_tensor())
    # other dtypes: bf16 moved, int64 summed (exact in any order)
    half = gen(f"{c.name}/bf16", 0, (2 * ws, 3), torch.bfloat16).to(c.device)
    hs = distribute_tensor(half, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    local_is(hs, _shard(half, ws, 1, c.rank), "bf16 Shard(0)->Shard(1)")
    ints = [gen(f"{c.name}/i64", q, (ws, 2), torch.int64, "SUM") for q in range(ws)]
    pi = DTensor.from_local(ints[c.rank].to(c.device), mesh, [Partial()])
    local_is(pi.redistribute(mesh, [Shard(0)]), sum(ints).chunk(ws)[c.rank], "int64 P->Shard(0)")

    # a 2-D mesh: replicate across nodes x shard within
    mesh2 = c.mesh((2, ws // 2), ("dp", "tp"))
    d2 = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
    r2, t2 = divmod(c.rank, ws // 2)
    exp = _shard(_shard(full, 2, 0, r2), ws // 2, 1, t2)
    local_is(d2, exp, "2-D [Shard(0), Shard(1)]")
    local_is(
        d2.redistribute(mesh2, [Replicate(), Shard(1)]),
        _shard(full, ws // 2, 1, t2),
        "2-D -> [Replicate, Shard(1)]",
    )
    c.chk.equal(d2.full_tensor(), full, "2-D full_tensor")
    # elementwise math on sharded DTensors, reduced to a replicated scalar
    total = (s0 * 2 + 1).sum().full_tensor()
    c.chk.close(total, (full * 2 + 1).sum(), "sum of a sharded DTensor", rtol=1e-5, atol=1e-4)
    c.keep("sum of a sharded DTensor", total)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


def case_tensor_parallel(c: Ctx) -> None:
    """Colwise + Rowwise MLP (replicated input and output), and the same block with sequence
    parallelism (LayerNorm on sequence shards, all_gather in, reduce_scatter out); forward and
    backward against the single-device block."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    ws = c.ws
    mesh = c.mesh((ws,))
    seq = 3 * ws
    x = c.data("x", 0, (2, seq, 16))
    w = c.data("w", 0, (2, seq, 16))  # loss weights: sum(w * out)
    torch.manual_seed(99)
    ref = _Block().to(c.device)
    xr = x.clone().requires_grad_(True)
    out_ref = ref(xr)
    (out_ref * w).sum().backward()

    for sp in (False, True):
        tag = "sp" if sp else "tp"
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        if sp:
            plan = {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1)),
            }
            rows = slice(c.rank * 3, c.rank * 3 + 3)
        else:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            rows = slice(None)
        parallelize_module(model, mesh, plan)
        xin = x[:, rows].clone().requires_grad_(True)
        out = model(xin)
        (out * w[:, rows]).sum().backward()
        c.close(out, out_ref[:, rows], f"{tag}: output vs single device")
        c.keep(f"{tag}: output", out)
        grad_in = xin.grad
        if not sp:  # every rank's replicated input received the full gradient
            c.close(grad_in, xr.grad, f"{tag}: input grad vs single device")
        else:
            c.close(grad_in, xr.grad[:, rows], f"{tag}: input grad vs single device")
        c.keep(f"{tag}: input grad", grad_in)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = _full(p.grad)
            c.close(g, q.grad, f"{tag}: grad {n} vs single device")
            c.keep(f"{tag}: grad {n}", g)


def _functional_inputs(c: Ctx, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    return c.data("x", r, (2 * c.ws, 3)), c.data("y", r, (2, 2 * c.ws))


def _functional(
    x: torch.Tensor,
    y: torch.Tensor,
    group: Any,
    src: int,
    in_splits: list[int],
    out_splits: list[int],
    compiled: bool = False,
) -> list[Any]:
    import torch.distributed._functional_collectives as fcol

    if compiled:
        # dynamo (torch 2.11) does not trace all_gather_tensor's regrouping for a gather
        # along dim 1 (torch._utils._maybe_view_chunk_cat is marked skipped): gather along
        # dim 0 and regroup here
        n = len(in_splits)
        gathered_y = torch.cat(fcol.wait_tensor(fcol.all_gather_tensor(y, 0, group)).chunk(n), 1)
    else:
        gathered_y = fcol.all_gather_tensor(y, 1, group)
    out = [
        fcol.all_reduce(x, "sum", group),
        fcol.all_reduce(y, "max", group),
        fcol.all_gather_tensor(x * 2, 0, group),
        gathered_y,
        fcol.reduce_scatter_tensor(x + 1, "sum", 0, group),
        fcol.reduce_scatter_tensor(y, "avg", 1, group),
        fcol.all_to_all_single(x, None, None, group),
        fcol.all_to_all_single(x[: sum(in_splits)], out_splits, in_splits, group),
        fcol.broadcast(x - 1, src, group),
        *fcol.all_reduce_coalesced([x, y], "sum", group),
        *fcol.all_gather_into_tensor_coalesced([y, x], group),
        *fcol.reduce_scatter_tensor_coalesced([x, y], "sum", [0, 1], group),
    ]
    return [fcol.wait_tensor(t) for t in out]


def _functional_expected(c: Ctx, group_ranks: list[int], splits: list[list[int]]) -> list[Any]:
    """(mode, expected output or the inputs it reduces) per output of :func:`_functional`."""
    ins = {r: _functional_inputs(c, r) for r in group_ranks}
    me = group_ranks.index(c.rank)
    n = len(group_ranks)
    xs = [ins[r][0].cpu() for r in group_ranks]
    ys = [ins[r][1].cpu() for r in group_ranks]
    a2a_uneven = []
    for j in range(n):
        offs = [0, *torch.tensor(splits[j]).cumsum(0).tolist()]
        a2a_uneven.append(xs[j][offs[me] : offs[me + 1]])
    return [
        ("sum", xs),
        ("max", ys),
        ("exact", torch.cat([x * 2 for x in xs], 0)),
        ("exact", torch.cat(ys, 1)),
        ("sum", [(x + 1).chunk(n, 0)[me] for x in xs]),
        ("avg", [y.chunk(n, 1)[me] for y in ys]),
        ("exact", torch.cat([x.chunk(n, 0)[me] for x in xs], 0)),
        ("exact", torch.cat(a2a_uneven, 0)),
        ("exact", xs[-1] - 1),  # broadcast from the group's last rank
        ("sum", xs),
        ("sum", ys),
        ("exact", torch.cat(ys, 0)),
        ("exact", torch.cat(xs, 0)),
        ("sum", [x.chunk(n, 0)[me] for x in xs]),
        ("sum", [y.chunk(n, 1)[me] for y in ys]),
    ]


def _functional_groups(c: Ctx) -> list[tuple[str, Any, list[int]]]:
    """The world group, and the cross-node dimension of a 2-D mesh (ranks r, r + ws/2)."""
    mesh2 = c.mesh((2, c.ws // 2), ("dp", "tp"))
    pair = [c.rank % (c.ws // 2), c.rank % (c.ws // 2) + c.ws // 2]
    return [("world", dist.group.WORLD, list(range(c.ws))), ("mesh dim 0", (mesh2, 0), pair)]


def _check_functional(
    c: Ctx, outs: list[Any], ranks: list[int], splits: list[list[int]], tag: str
) -> None:
    for i, (out, (mode, exp)) in enumerate(zip(outs, _functional_expected(c, ranks, splits))):
        what = f"{tag} output {i}"
        if mode == "exact":
            c.chk.equal(out, exp, what)
            c.keep(what, out, "exact")
        else:
            c.chk.reduced(out.cpu(), exp, mode.upper(), what)
            c.keep(what, out, "exact" if mode == "max" else "reduced")


def _splits_of(r: int, n: int) -> list[int]:
    """Uneven all_to_all split sizes of rank ``r`` (0 for some peers)."""
    return [(r + j) % 3 for j in range(n)]


def _run_functional(c: Ctx, compiled: bool) -> None:
    for tag, group, ranks in _functional_groups(c):
        x, y = _functional_inputs(c, c.rank)
        n = len(ranks)
        me = ranks.index(c.rank)
        splits = [_splits_of(j, n) for j in range(n)]  # of every member of the group
        in_splits = splits[me]
        out_splits = [splits[j][me] for j in range(n)]
        fn = _functional
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(_functional, fullgraph=True)
        # src: a rank of the group
        outs = fn(x, y, group, n - 1, in_splits, out_splits, compiled)
        _check_functional(c, outs, ranks, splits, tag)


def case_functional(c: Ctx) -> None:
    _run_functional(c, compiled=False)


def case_functional_compiled(c: Ctx) -> None:
    """The same functional collectives under torch.compile(fullgraph=True); the reference
    backend's run executes them eagerly."""
    _run_functional(c, compiled=not c.reference)


def case_ddp_compiled(c: Ctx) -> None:
    """DDP over a torch.compile'd module (dynamo's DDPOptimizer compiles it per DDP bucket);
    the reference backend's run trains the eager module. (torch.compile(DDP(model)) captures
    no graph on recent torch: dynamo skips DDP.forward, pytorch/pytorch#140416.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # every rank starts from other weights: DDP broadcasts rank 0's (the local reference's)
    model = _mlp(1234 if c.rank == 0 else 1000 + c.rank).to(c.device)
    graphs = []
    inner: nn.Module = model
    if not c.reference:

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            from torch._inductor.compile_fx import compile_fx

            graphs.append(len(gm.graph.nodes))
            return compile_fx(gm, example_inputs)

        torch._dynamo.reset()
        inner = torch.compile(model, backend=backend)
    kw: dict[str, Any] = {"device_ids": [c.device.index]} if c.device.type == "cuda" else {}
    ddp = DDP(inner, **kw)
    # the compiled module rounds differently from the reference run's eager one
    _train_and_compare(c, ddp, steps=4, mode="approx")
    if not c.reference:
        c.chk.true(len(graphs) > 0, "torch.compile compiled no graph")
    # every rank holds the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = flat.clone()
    dist.broadcast(rank0, src=0)
    c.chk.equal(flat, rank0, "parameters equal to rank 0's")


def case_checkpoint(c: Ctx) -> None:
    """Save an FSDP2-sharded state dict with torch.distributed.checkpoint, load it into a
    fresh sharded model and into a plain (unsharded) one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh = c.mesh((c.ws,))

    def sharded(seed: int) -> nn.Module:
        m = _mlp(seed).to(c.device)
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    path = os.path.join(os.getcwd(), "checkpoint")  # the group's shared working directory
    src = sharded(1234)
    x, y = _batch(c, c.rank)
    F.mse_loss(src(x), y).backward()  # one step, so the weights differ from any init
    torch.optim.SGD(src.parameters(), lr=0.1).step()
    dcp.save({"model": get_model_state_dict(src)}, checkpoint_id=path)
    want = {n: _full(p.detach()) for n, p in src.named_parameters()}

    dst = sharded(4321)
    sd = {"model": get_model_state_dict(dst)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(dst, sd["model"])
    for n, p in dst.named_parameters():
        c.chk.equal(_full(p.detach()), want[n], f"sharded reload: {n}")
        c.keep(f"sharded reload {n}", _full(p.detach()))  # trained: a sum of gradients
    x2 = c.data("x2", c.rank, (4, 16))
    with torch.no_grad():
        c.chk.equal(dst(x2), src(x2), "output of the reloaded model")

    plain = _mlp(999).to(c.device)  # every rank loads every tensor whole
    psd = {"model": plain.state_dict()}
    dcp.load(psd, checkpoint_id=path)
    plain.load_state_dict(psd["model"])
    for n, p in plain.named_parameters():
        c.chk.equal(p.detach(), want[n], f"unsharded reload: {n}")


def _pipeline(c: Ctx, schedule_name: str) -> None:
    """Two stages on ranks r and r + ws/2 (across the simulated nodes), 4 microbatches;
    with 4 ranks, two pipelines run side by side on different data."""
    from torch.distributed import pipelining

    mesh = c.mesh((2, c.ws // 2), ("pp", "dp"))
    stage_idx, dp = divmod(c.rank, c.ws // 2)
    torch.manual_seed(5)
    full = nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32)),
        nn.Sequential(nn.ReLU(), nn.Linear(32, 5)),
    ).to(c.device)
    x, y = _batch(c, dp)
    n_mb = 4

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    ref = copy.deepcopy(full)
    ref_losses = []
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        loss = loss_fn(ref(xm), ym)
        (loss / n_mb).backward()
        ref_losses.append(loss.detach())

    module = copy.deepcopy(full[stage_idx])
    stage = pipelining.PipelineStage(module, stage_idx, 2, c.device, group=mesh.get_group("pp"))
    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=n_mb, loss_fn=loss_fn)
    if stage_idx == 0:
        schedule.step(x)
    else:
        losses: list[torch.Tensor] = []
        out = schedule.step(target=y, losses=losses)
        got = torch.stack([t.detach() for t in losses])
        c.close(got, torch.stack(ref_losses), "microbatch losses vs unpipelined")
        c.keep("microbatch losses", got)
        with torch.no_grad():
            c.close(out, ref(x), "pipeline output vs unpipelined")
    for (n, p), (_, q) in zip(module.named_parameters(), ref[stage_idx].named_parameters()):
        c.close(p.grad, q.grad, f"stage {stage_idx} grad {n} vs unpipelined")
        c.keep(f"grad {n}", p.grad)


def case_pipeline_gpipe(c: Ctx) -> None:
    _pipeline(c, "ScheduleGPipe")


def case_pipeline_1f1b(c: Ctx) -> None:
    _pipeline(c, "Schedule1F1B")


def _obj(r: int, what: str) -> dict[str, Any]:
    """A picklable object whose size differs by rank."""
    return {"rank": r, "what": what, "blob": "x" * (100 * r + 7), "t": torch.arange(r + 2)}


def _obj_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_obj_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_obj_equal, a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.device == b.device and torch.equal(a, b)
    return type(a) is type(b) and a == b


def case_objects(c: Ctx) -> None:
    ws, rank = c.ws, c.rank

    def check(got: Any, exp: Any, what: str) -> None:
        c.chk.true(_obj_equal(got, exp), f"{what}: got {got!r:.200}, expected {exp!r:.200}")
        c.keep(what, got, "exact")

    out: list[Any] = [None] * ws
    dist.all_gather_object(out, _obj(rank, "ag"))
    check(out, [_obj(r, "ag") for r in range(ws)], "all_gather_object")
    src = ws - 1
    lst = [_obj(rank, "b0"), rank, f"r{rank}"]
    dist.broadcast_object_list(lst, src=src)
    check(lst, [_obj(src, "b0"), src, f"r{src}"], "broadcast_object_list")
    dst = 1 % ws
    gathered = [None] * ws if rank == dst else None
    dist.gather_object(_obj(rank, "g"), gathered, dst=dst)
    if rank == dst:
        check(gathered, [_obj(r, "g") for r in range(ws)], "gather_object")
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, [_obj(r, "s") for r in range(ws)] if rank == 0 else None, 0)
    check(mine, [_obj(rank, "s")], "scatter_object_list")
    peer = rank ^ 1  # pairs (0, 1), (2, 3): both directions, the lower rank sends first
    for sender in sorted((rank, peer)):
        if sender == rank:
            dist.send_object_list([_obj(rank, "p2p"), "tail"], dst=peer)
        else:
            got: list[Any] = [None, None]
            dist.recv_object_list(got, src=peer)
            check(got, [_obj(peer, "p2p"), "tail"], "recv_object_list")
    dist.barrier()


CASES: dict[str, Callable[[Ctx], None]] = {
    name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")
}


# ------------------------------------------------------------------------ spawned side


def run_stack(
    rank: int,
    ws: int,
    device_type: str,
    backend: str,
    bind_device: bool,
    names: list[str],
    reference: bool,
) -> dict[str, dict[str, Any]]:
    """Runs on every rank: initialises the default group with ``backend`` (binding the rank's
    GPU with ``device_id`` if asked), runs the cases in order and returns case -> {"error",
    "results"}. After each case the ranks exchange their status through the store, so an
    exception on one rank cannot desynchronise the cases after it."""
    kw: dict[str, Any] = {}
    if device_type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        if bind_device:
            kw["device_id"] = device
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=PG_TIMEOUT_S), **kw)
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, dict[str, Any]] = {}
    stopped: str | None = None
    for i, name in enumerate(names):
        if stopped is not None:
            out[name] = {"error": f"not run: {stopped}", "results": {}}
            continue
        print(f"[rank {rank}] case {i + 1}/{len(names)}: {name}", flush=True)
        t0 = time.monotonic()
        c = Ctx(rank, ws, device, name, reference)
        status = "ok"
        try:
            CASES[name](c)
            if device.type == "cuda":
                torch.cuda.synchronize()
            c.chk.raise_if_failed()
            error = None
        except AssertionError as e:
            error, status = str(e), "mismatch"
        except Exception:
            error, status = f"rank {rank} raised:\n{traceback.format_exc()}", "exception"
        out[name] = {"error": error, "results": c.results, "s": time.monotonic() - t0}
        try:
            store.set(f"stack/{i}/{rank}", status)
            store.wait([f"stack/{i}/{r}" for r in range(ws)], timedelta(seconds=PG_TIMEOUT_S))
        except Exception as e:
            stopped = f"ranks did not all finish case {name!r} ({type(e).__name__}: {e})"
    dist.destroy_process_group()
    return out


# --------------------------------------------------------------------------- pytest side

# Simulated node of each rank ("": one node).
LAYOUTS: dict[str, list[int]] = {
    "": [],
    "2x2": [0, 0, 1, 1],
    "2x2-staged": [0, 0, 1, 1],
    "2x1": [0, 1],
    "2x1-host": [0, 1],
}
# Across the simulated nodes every CUDA all_reduce takes the staged pipeline (csrc/plans/cuda/),
# in 4 KiB chunks, and with "2x1-host" the other CUDA collectives are staged through host
# memory into the host plan: the small tensors of these cases would otherwise all stay on the
# flat NCCL communicator.
LAYOUT_ENV: dict[str, dict[str, str]] = {
    "2x1": {"FASTCOMM_CUDA_HIER_MIN_BYTES": "0", "FASTCOMM_CUDA_CHUNK_BYTES": "4K"},
    "2x2-staged": {"FASTCOMM_CUDA_HIER_MIN_BYTES": "0", "FASTCOMM_CUDA_CHUNK_BYTES": "4K"},
    "2x1-host": {
        "FASTCOMM_CUDA_HIER_MIN_BYTES": "0",
        "FASTCOMM_CUDA_CHUNK_BYTES": "4K",
        "FASTCOMM_CUDA_INTER": "host",
    },
}
_cuda2 = pytest.mark.cuda(2)
# (device, world size, layout, bind the GPU with device_id at init)
GROUPS = [
    pytest.param("cpu", 2, "", False, id="cpu-2ranks"),
    pytest.param("cpu", 4, "2x2", False, id="cpu-4ranks-2x2nodes"),
    pytest.param("cuda", 2, "", False, id="cuda-2ranks", marks=_cuda2),
    pytest.param("cuda", 2, "", True, id="cuda-2ranks-device_id", marks=_cuda2),
    pytest.param("cuda", 2, "2x1-host", False, id="cuda-2x1nodes-host", marks=_cuda2),
    pytest.param("cuda", 2, "2x1", True, id="cuda-2x1nodes-device_id", marks=_cuda2),
    pytest.param(
        "cuda",
        4,
        "2x2-staged",
        True,
        id="cuda-4ranks-2x2nodes-device_id",
        marks=pytest.mark.cuda(4),
    ),
]
REFERENCE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
# generous: the compiled cases compile with inductor on a loaded 2-core machine
GROUP_TIMEOUT_S = {"cpu": 300.0, "cuda": 420.0}

_RUNS: dict[Any, Any] = {}


def _run(device: str, ws: int, layout: str, bind: bool, reference: bool) -> Any:
    """One spawn of every case (cached): the backend under test, or the reference backend
    (one reference run serves every layout of a device and world size)."""
    key = (device, ws, "", False, True) if reference else (device, ws, layout, bind, False)
    if key not in _RUNS:
        backend = REFERENCE_BACKEND[device] if reference else BACKEND
        env = None
        nodes = LAYOUTS[layout]
        if nodes and not reference:
            extra = LAYOUT_ENV.get(layout, {})
            env = lambda r: {"FASTCOMM_HOST_ID": f"simnode{nodes[r]}", **extra}
        t0 = time.monotonic()
        try:
            _RUNS[key] = run_ranks(
                ws,
                run_stack,
                device,
                backend,
                bind,
                list(CASES),
                reference,
                backend=backend,
                init=False,
                env=env,
                timeout_s=GROUP_TIMEOUT_S[device],
            )
        except RanksFailed as e:
            _RUNS[key] = e
        where = f" as {layout} nodes" if layout and not reference else ""
        print(f"\n[{backend} {device} x{ws}{where}: {time.monotonic() - t0:.1f}s]")
    return _RUNS[key]


def _compare(a: Any, b: Any, mode: str, ws: int, what: str) -> str | None:
    """None if ``a`` (backend under test) and ``b`` (reference) agree, else why not."""
    if not isinstance(a, torch.Tensor):
        return None if _obj_equal(a, b) else f"{what}: {a!r:.200} != {b!r:.200}"
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return f"{what}: {a.dtype}{tuple(a.shape)} vs {b!r:.100}"
    if mode == "exact" or (mode == "reduced" and ws == 2):  # a + b == b + a
        if torch.equal(a, b):
            return None
        diff = (a.double() - b.double()).abs().max().item()
        return f"{what}: not bitwise equal (max difference {diff:.3g})"
    try:
        torch.testing.assert_close(a, b, rtol=PARITY_RTOL, atol=PARITY_ATOL)
    except AssertionError as e:
        return f"{what}: {e}"
    return None


def _case_param(name: str) -> Any:
    return pytest.param(name, id=name)


def _failed(run: Any, label: str) -> None:
    if isinstance(run, RanksFailed):
        pytest.fail(f"the {label} run failed as a whole:\n{str(run)[:6000]}", pytrace=False)


@pytest.mark.parametrize("case", [_case_param(n) for n in CASES])
@pytest.mark.parametrize("device,ws,layout,bind", GROUPS)
def test_stack(device: str, ws: int, layout: str, bind: bool, case: str) -> None:
    if device == "cuda" and BACKEND == "gloo":
        pytest.skip("gloo: the CUDA groups compare with NCCL")
    run = _run(device, ws, layout, bind, reference=False)
    _failed(run, BACKEND)
    ref = _run(device, ws, "", False, reference=True)
    _failed(ref, REFERENCE_BACKEND[device])
    errors = []
    for rank, (mine, theirs) in enumerate(zip(run, ref)):
        m, t = mine[case], theirs[case]
        if m["error"]:
            errors.append(f"{BACKEND}: {m['error']}")
        if t["error"]:
            errors.append(f"reference {REFERENCE_BACKEND[device]}: {t['error']}")
        if m["error"] or t["error"]:
            continue
        if m["results"].keys() != t["results"].keys():
            errors.append(f"rank {rank}: results {sorted(m['results'])} vs {sorted(t['results'])}")
            continue
        if not m["results"]:
            errors.append(f"rank {rank}: the case kept no result to compare")
        for key, (value, mode) in m["results"].items():
            why = _compare(value, t["results"][key][0], mode, ws, f"rank {rank}: {key}")
            if why:
                errors.append(f"{BACKEND} vs {REFERENCE_BACKEND[device]}: {why}")
    if errors:
        pytest.fail(f"{case} on {ws} {device} ranks:\n" + "\n".join(errors), pytrace=False)
