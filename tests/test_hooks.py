"""torchext.hooks: DDP communication hooks, eagerly on CPU and captured into CUDA graphs.

CPU (CI), 2 and 4 ranks, over the backend under test and over Gloo:
- a hook applied to a bucket directly: the result lands in ``bucket.buffer()`` (the future's
  value is that tensor) and equals the average of every rank's buffer, regenerated locally,
  within the rounding bound of float32 (allreduce) or of the 16-bit type (compressed);
- DDP with each hook: the averaged gradient of the first step against a local reference, and
  the parameters after STEPS steps against DDP's default reduction on the same backend.

GPU (marked cuda): DDP with ``static_graph=True``, ``gradient_as_bucket_view=True`` and a
capturable optimizer, a whole training step captured with ``torch.cuda.graph`` and replayed on
static inputs: the parameters after N replays equal those of N eager steps (same seed and
data) for each hook, also on 4 GPUs simulated as 2 nodes x 2, where the largest bucket takes
fastcomm's staged multi-node path (captured with the host node that feeds its proxy) and the
others the flat NCCL communicator. Also: a hook's future is complete during the capture, eager
works still watched when a capture begins, FASTCOMM_BLOCKING_WAIT under capture, and the clear
error when the staged path's first use is under capture.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import BACKEND, Checker, gen, run_ranks

HOOKS = ("allreduce_hook", "bf16_compress_hook", "fp16_compress_hook")
WIRE = {
    "allreduce_hook": None,
    "bf16_compress_hook": torch.bfloat16,
    "fp16_compress_hook": torch.float16,
}
STEPS = 5
LR = 0.05


def _hook(name: str) -> Callable[..., Any]:
    import torchext.hooks

    return getattr(torchext.hooks, name)


class _Bucket:
    """What a hook uses of dist.GradBucket (which Python cannot construct)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class _State:
    """A hook state object carrying its group, as PowerSGDState does."""

    def __init__(self, group: Any) -> None:
        self.process_group = group


def _average_bound(
    inputs: list[torch.Tensor], wire: torch.dtype | None, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact average (float64) of the ranks' ``inputs`` and an error bound valid for any
    summation order: every input rounded once to the wire type, divided by n (one more
    rounding) and summed in the wire type (at most n - 1 roundings of partial sums whose
    magnitudes are at most the sum of magnitudes); plus one unit of the smallest spacing
    per rounding for values that fall into the subnormal range."""
    n = len(inputs)
    x = torch.stack([t.to(torch.float64) for t in inputs]) / n
    exact = x.sum(0)
    magnitude = x.abs().sum(0)
    if wire is None:
        eps = torch.finfo(compute).eps
        return exact, (n + 1) * eps * magnitude + torch.finfo(compute).tiny
    fi = torch.finfo(wire)
    spacing = fi.tiny * fi.eps  # the subnormal step
    return exact, (n + 2) * fi.eps * magnitude + (n + 2) * spacing


def _check_direct(
    chk: Checker, rank: int, ws: int, group: Any, label: str, device: str = "cpu"
) -> None:
    """Each hook on a hand-made bucket, for several sizes and each form of state."""
    states = {"None": None, "group": group, "state object": _State(group)}
    if group is not None and group is not dist.group.WORLD:
        del states["None"]  # None means the default group
    for name in HOOKS:
        for state_name, state in states.items():
            for numel in (1, 1000, 65539):
                key = f"direct|{label}|{name}|{state_name}|{numel}"
                buf = gen(key, rank, (numel,), torch.float32).to(device)
                original = buf.clone().cpu()  # .cpu() alone aliases a CPU buffer
                fut = _hook(name)(state, _Bucket(buf))
                value = fut.wait()
                what = f"{label} {name}(state={state_name}) on {numel} elements"
                chk.true(
                    isinstance(value, torch.Tensor)
                    and value.data_ptr() == buf.data_ptr()
                    and value.shape == buf.shape,
                    f"{what}: the future's value is not the bucket's buffer",
                )
                inputs = [gen(key, r, (numel,), torch.float32) for r in range(ws)]
                chk.true(torch.equal(inputs[rank], original), f"{what}: inputs not reproducible")
                exact, bound = _average_bound(inputs, WIRE[name], torch.float32)
                got = buf.cpu()
                err = (got.to(torch.float64) - exact).abs()
                bad = ~(err <= bound)
                if bool(bad.any()):
                    i = int(torch.nonzero(bad)[0])
                    chk.fail(
                        f"{what}: {int(bad.sum())} element(s) off, first at {i}: got "
                        f"{got[i].item()!r}, expected {exact[i].item()!r} +- {bound[i].item():.3g}"
                    )
                if WIRE[name] is not None:
                    # the sum really travelled in 16 bits: every result is a 16-bit number
                    chk.true(
                        torch.equal(got, got.to(WIRE[name]).to(torch.float32)),
                        f"{what}: results are not {WIRE[name]} values (no compression?)",
                    )


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


_TEACHER = 0.25 * torch.randn(16, 4, generator=torch.Generator().manual_seed(99))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x @ _TEACHER + 0.01 * torch.randn(8, 4, generator=g)


def _train(
    start: nn.Module, group: Any, hook: str | None, rank: int, device: str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """STEPS steps of plain SGD under DDP; returns the first step's (averaged) gradients
    and the final parameters (on the CPU)."""
    dev = torch.device(device)
    ddp = DDP(copy.deepcopy(start).to(dev), process_group=group, bucket_cap_mb=0.002,
              gradient_as_bucket_view=True,
              device_ids=[dev.index] if dev.type == "cuda" else None)  # fmt: skip
    if hook is not None:
        ddp.register_comm_hook(group, _hook(hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    first: list[torch.Tensor] = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(ddp(x.to(dev)), y.to(dev)).backward()
        if step == 0:
            first = [p.grad.detach().clone().cpu() for p in ddp.parameters()]
        opt.step()
    return first, [p.detach().clone().cpu() for p in ddp.module.parameters()]


def _local_grads(start: nn.Module, rank: int, device: str = "cpu") -> list[torch.Tensor]:
    model = copy.deepcopy(start).to(device)
    x, y = _batch(0, rank)
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    return [p.grad.detach().clone().cpu() for p in model.parameters()]


def _check_ddp(
    chk: Checker, rank: int, ws: int, group: Any, label: str, device: str = "cpu"
) -> None:
    start = _model(1234)
    local = [_local_grads(start, r, device) for r in range(ws)]  # every rank's step-0 grads
    _, default_params = _train(start, group, None, rank, device)
    for name in HOOKS:
        first, params = _train(start, group, name, rank, device)
        what = f"{label} DDP + {name}"
        for i, g in enumerate(first):
            exact, bound = _average_bound([lg[i] for lg in local], WIRE[name], torch.float32)
            err = (g.to(torch.float64) - exact).abs()
            if not bool((err <= bound).all()):
                chk.fail(f"{what}: step-0 gradient {i} off by {err.max().item():.3g}")
        # Parameters after STEPS steps against DDP's own reduction: float32 rounding for
        # allreduce; for the compressed hooks each step's gradient may differ by its bound
        # (at most (n+2)·eps·max|g| per element), which SGD adds up lr times per step.
        if WIRE[name] is None:
            tol = 1e-6
        else:
            gmax = max(float(g.abs().max()) for lg in local for g in lg)
            tol = 2 * STEPS * LR * (ws + 2) * torch.finfo(WIRE[name]).eps * gmax + 1e-6
        for j, (p, q) in enumerate(zip(params, default_params)):
            d = float((p - q).abs().max())
            if not d <= tol:
                chk.fail(f"{what}: parameter {j} differs from DDP's default by {d:.3g} > {tol:.3g}")
        # parameters identical on every rank
        flat = torch.cat([p.reshape(-1) for p in params]).to(device)
        gathered = [torch.empty_like(flat) for _ in range(ws)]
        dist.all_gather(gathered, flat, group=group)
        chk.true(all(torch.equal(t, flat) for t in gathered), f"{what}: ranks disagree")


def _check_coalesced_future(chk: Checker, rank: int, ws: int) -> None:
    """The future of a coalesced block's work: complete with every output, after them."""
    ins = [
        [gen(f"coalesced|{i}", r, (5 + 7 * i,), torch.float32) for r in range(ws)] for i in range(3)
    ]
    ts = [x[rank].clone() for x in ins]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    values = [v for w in cm.works for v in w.get_future().wait()]
    chk.true(
        sorted(v.data_ptr() for v in values) == sorted(t.data_ptr() for t in ts),
        "coalesced future: its value is not the block's outputs",
    )
    for i, t in enumerate(ts):
        chk.reduced(t, ins[i], "SUM", f"coalesced all_reduce {i} via the future")


def hooks_cpu_fn(rank: int, ws: int) -> dict[str, Any]:
    chk = Checker(f"rank {rank}")
    gloo = dist.new_group(backend="gloo")
    for label, group in ((BACKEND, dist.group.WORLD), ("gloo", gloo)):
        _check_direct(chk, rank, ws, group, label)
        _check_ddp(chk, rank, ws, group, label)
    _check_coalesced_future(chk, rank, ws)
    chk.raise_if_failed()
    return {"ok": True}


@pytest.mark.parametrize("ws", [2, 4])
def test_hooks_cpu(ws: int) -> None:
    run_ranks(ws, hooks_cpu_fn, timeout_s=300)


def test_hook_signatures_accepted_by_ddp() -> None:
    """DDP's register_comm_hook compares the annotations with the real types."""
    import inspect

    import torchext.hooks

    for name in HOOKS:
        sig = inspect.signature(getattr(torchext.hooks, name))
        assert list(sig.parameters) == ["state", "bucket"]
        assert sig.parameters["bucket"].annotation is dist.GradBucket
        assert sig.return_annotation == torch.futures.Future[torch.Tensor]


# ------------------------------------------------------------------------------------- GPU


def hooks_cuda_eager_fn(rank: int, ws: int) -> dict[str, Any]:
    """The CPU checks with CUDA tensors, over the backend under test and over NCCL."""
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    chk = Checker(f"rank {rank}")
    nccl = dist.new_group(backend="nccl")
    for label, group in ((BACKEND, dist.group.WORLD), ("nccl", nccl)):
        _check_direct(chk, rank, ws, group, label, device)
        _check_ddp(chk, rank, ws, group, label, device)
    chk.raise_if_failed()
    return {}


@pytest.mark.cuda(2)
def test_hooks_cuda_eager() -> None:
    run_ranks(2, hooks_cuda_eager_fn, timeout_s=300)


WARMUP = 11  # DDP samples runtime stats (event syncs) in its first 10 iterations
REPLAYS = 6
G_IN, G_HIDDEN, G_LAYERS, G_BATCH = 64, 128, 6, 16


G_WIDE = 1024  # wide model: a 1024 x 1024 weight, 4 MiB of float32 gradients in one bucket
# The staged path's threshold in the wide model's tests: the wide bucket at 16 bits is above it,
# the small buckets below.
WIDE_BUCKET_THRESHOLD = "2M"


def _gpu_model(seed: int, device: torch.device, wide: bool = False) -> nn.Module:
    """Small layers; ``wide`` adds a G_WIDE x G_WIDE layer, whose bucket (4 MiB, or 2 MiB
    compressed to 16 bits) is at or above WIDE_BUCKET_THRESHOLD while the others' stay below
    it."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(G_IN, G_HIDDEN), nn.Tanh()]
    for _ in range(G_LAYERS - 2):
        layers += [nn.Linear(G_HIDDEN, G_HIDDEN), nn.Tanh()]
    if wide:
        layers += [nn.Linear(G_HIDDEN, G_WIDE), nn.Tanh(), nn.Linear(G_WIDE, G_WIDE), nn.Tanh()]
        layers.append(nn.Linear(G_WIDE, 8))
    else:
        layers.append(nn.Linear(G_HIDDEN, 8))
    return nn.Sequential(*layers).to(device)


def _gpu_batches(n: int, rank: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(G_BATCH, G_IN, generator=g)
        out.append((x.to(device), torch.randn(G_BATCH, 8, generator=g).to(device)))
    return out


def _make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, capturable=True, foreach=True)
    return torch.optim.SGD(params, lr=0.02, momentum=0.9, foreach=True)


def _gpu_step(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    # Zero in place: the gradients stay views of DDP's buckets (gradient_as_bucket_view)
    # and keep their addresses, as the graph requires.
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return loss


def _ddp(model: nn.Module, device: torch.device, hook: str) -> DDP:
    ddp = DDP(
        model,
        device_ids=[device.index],
        static_graph=True,
        gradient_as_bucket_view=True,
        bucket_cap_mb=0.1,  # several buckets: hooks overlap backward in the graph too
    )
    ddp.register_comm_hook(None, _hook(hook))
    return ddp


def capture_parity_fn(
    rank: int, ws: int, cases: list[tuple[str, str]], wide: bool = False
) -> dict[str, Any]:
    """``wide``: the wide model, and the staged multi-node path must run in the replays
    (its proxy's timeline events, FASTCOMM_TIMELINE=1)."""
    if wide:
        import torchext
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    chk = Checker(f"rank {rank}")
    data = _gpu_batches(WARMUP + REPLAYS, rank, device)
    diffs = {}
    for hook, optim in cases:
        what = f"{hook} + {optim}"
        # Eager reference: WARMUP + REPLAYS ordinary steps.
        ref = _ddp(_gpu_model(42, device, wide), device, hook)
        ref_opt = _make_opt(optim, ref.parameters())
        for x, y in data:
            _gpu_step(ref, ref_opt, x, y)

        # Captured: DDP built and warmed up on a side stream (torch's recipe for
        # whole-network capture with DDP), then one step captured and replayed.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ddp = _ddp(_gpu_model(42, device, wide), device, hook)
            opt = _make_opt(optim, ddp.parameters())
            static_x = torch.empty_like(data[0][0])
            static_y = torch.empty_like(data[0][1])
            for x, y in data[:WARMUP]:
                static_x.copy_(x)
                static_y.copy_(y)
                _gpu_step(ddp, opt, static_x, static_y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _gpu_step(ddp, opt, static_x, static_y)
        if wide:
            torchext.timeline()  # from here on: the replays' events only
        for x, y in data[WARMUP:]:
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
        torch.cuda.synchronize()
        if wide:
            chunks = {e["chunk"] for e in torchext.timeline() if e["thread"] == "fc-cuda-proxy"}
            chk.true(len(chunks) > 0, f"{what}: the staged multi-node path did not run in replays")
        worst = 0.0
        for j, (p, q) in enumerate(zip(ddp.module.parameters(), ref.module.parameters())):
            d = float((p - q).abs().max())
            worst = max(worst, d)
            scale = float(q.abs().max())
            if not d <= 1e-6 * max(1.0, scale):
                chk.fail(f"{what}: parameter {j} after {REPLAYS} replays differs by {d:.3g}")
        moved = max(
            float((p - q).abs().max())
            for p, q in zip(ddp.module.parameters(), _gpu_model(42, device, wide).parameters())
        )
        chk.true(moved > 1e-4, f"{what}: the replays did not train (max change {moved:.3g})")
        diffs[what] = worst
        del graph
    chk.raise_if_failed()
    return {"max_abs_diff": diffs}


GPU_CASES = [
    ("allreduce_hook", "adam"),
    ("allreduce_hook", "sgd"),
    ("bf16_compress_hook", "adam"),
    ("fp16_compress_hook", "sgd"),
]


@pytest.mark.parametrize(
    "ws", [pytest.param(2, marks=pytest.mark.cuda(2)), pytest.param(4, marks=pytest.mark.cuda(4))]
)
def test_ddp_step_captured_equals_eager(ws: int) -> None:
    res = run_ranks(ws, capture_parity_fn, GPU_CASES, timeout_s=400)
    print(res[0])


def hook_future_in_capture_fn(rank: int, ws: int) -> dict[str, Any]:
    """Each hook on a bucket while capturing: the future is complete when the hook returns,
    its value is the bucket's buffer, and each replay recomputes the average."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    chk = Checker(f"rank {rank}")
    dist.all_reduce(torch.ones(1, device=device))  # communicator set up eagerly
    torch.cuda.synchronize()
    for name in HOOKS:
        n = 4099
        buf = torch.empty(n, device=device)
        side = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            fut = _hook(name)(None, _Bucket(buf))
            done = fut.done()
            value = fut.wait()  # only orders streams
        chk.true(done, f"{name}: the future was not complete during the capture")
        chk.true(value.data_ptr() == buf.data_ptr(), f"{name}: value is not the buffer")
        for replay in range(3):
            key = f"capture|{name}|{replay}"
            buf.copy_(gen(key, rank, (n,), torch.float32).to(device))
            graph.replay()
            torch.cuda.synchronize()
            exact, bound = _average_bound(
                [gen(key, r, (n,), torch.float32) for r in range(ws)], WIRE[name], torch.float32
            )
            err = (buf.cpu().to(torch.float64) - exact).abs()
            chk.true(bool((err <= bound).all()), f"{name} replay {replay}: off by {err.max():.3g}")
        del graph
    chk.raise_if_failed()
    return {}


@pytest.mark.cuda(2)
def test_hook_future_complete_during_capture() -> None:
    run_ranks(2, hook_future_in_capture_fn, timeout_s=240)


def watched_then_capture_fn(rank: int, ws: int) -> dict[str, Any]:
    """A capture that begins while eager collectives are still queued for the watchdog (no
    synchronize in between, unlike torch.cuda.graph) and lasts several watchdog periods:
    the watchdog's event queries from its own thread must not break the capture."""
    import time

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    x = torch.ones(1 << 22, device=device)
    y = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    works = [dist.all_reduce(x, async_op=True) for _ in range(20)]  # in flight, watched
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            for _ in range(3):
                dist.all_reduce(y)
                time.sleep(0.15)  # the watchdog polls every 100 ms
                y.div_(ws)
        finally:
            graph.capture_end()
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    torch.testing.assert_close(x, torch.full_like(x, float(ws**21)))
    y.fill_(float(rank + 1))
    graph.replay()
    torch.cuda.synchronize()
    # the first round averages rank + 1 over the ranks; the next two keep that mean
    torch.testing.assert_close(y, torch.full_like(y, (ws + 1) / 2))
    # eager work after the capture still works
    z = torch.ones(8, device=device)
    dist.all_reduce(z)
    torch.testing.assert_close(z, torch.full_like(z, float(ws)))
    return {}


@pytest.mark.cuda(2)
def test_capture_while_eager_works_are_watched() -> None:
    run_ranks(2, watched_then_capture_fn, timeout_s=240)


def coalesced_capture_fn(rank: int, ws: int) -> dict[str, Any]:
    """A coalesced block of all_reduces captured, waited through the group work's future:
    that future must be CUDA-aware (else the capture ends with the communication stream
    not joined), complete during the capture, and each replay must recompute the sums."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    a = torch.empty(1000, device=device)
    b = torch.empty(3, 7, device=device)
    dist.all_reduce(a)  # communicator set up eagerly
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b)
        futs = [w.get_future() for w in cm.works]
        done = all(f.done() for f in futs)
        for f in futs:
            f.wait()
        a.mul_(2)
    assert done, "the coalesced work's future was not complete during the capture"
    for replay in range(2):
        ins = [
            gen(f"coalesced|{replay}|{i}", rank, t.shape, torch.float32)
            for i, t in enumerate((a, b))
        ]
        a.copy_(ins[0].to(device))
        b.copy_(ins[1].to(device))
        graph.replay()
        torch.cuda.synchronize()
        for i, (t, scale) in enumerate(((a, 2.0), (b, 1.0))):
            exact, bound = _average_bound(
                [gen(f"coalesced|{replay}|{i}", r, t.shape, torch.float32) for r in range(ws)],
                None,
                torch.float32,
            )
            torch.testing.assert_close(
                t.cpu().double(), scale * ws * exact, rtol=0, atol=float(scale * ws * bound.max())
            )
    # eagerly too: the future orders the current stream after the block
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a.fill_(1.0))
    cm.works[0].get_future().wait()
    torch.testing.assert_close(a, torch.full_like(a, float(ws)))
    return {}


@pytest.mark.cuda(2)
def test_coalesced_future_in_capture() -> None:
    run_ranks(2, coalesced_capture_fn, timeout_s=240)


def blocking_wait_capture_fn(rank: int, ws: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    y = torch.ones(256, device=device)
    dist.all_reduce(y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(y)  # synchronous: work.wait() under FASTCOMM_BLOCKING_WAIT=1
        work = dist.all_reduce(y, async_op=True)
        work.wait()
    y.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.full_like(y, float(ws * ws)))
    # a captured work cannot be waited on outside its capture: a clear error
    try:
        work.wait()
    except RuntimeError as e:
        assert "CUDA graph" in str(e), e
    else:
        raise AssertionError("waiting on a captured work outside the capture did not raise")
    return {}


@pytest.mark.skipif(BACKEND != "fastcomm", reason="fastcomm's FASTCOMM_BLOCKING_WAIT")
@pytest.mark.cuda(2)
def test_capture_with_blocking_wait() -> None:
    run_ranks(2, blocking_wait_capture_fn, env={"FASTCOMM_BLOCKING_WAIT": "1"}, timeout_s=240)


def _messages(e: BaseException) -> list[str]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return out


def multinode_capture_fn(rank: int, ws: int, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """First the non-capturable case: the staged path's first use under capture (its set-up
    cannot be captured) raises a clear error naming CUDA graphs and the eager warm-up it
    needs. Then the parity of captured and eager DDP steps with the wide model."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    x = torch.ones(1 << 20, device=device)  # 4 MiB: the staged path across nodes
    # The group's CUDA set-up first (test_cuda_hier covers its own refusal).
    dist.all_reduce(torch.ones(8, device=device))
    graph = torch.cuda.CUDAGraph()
    first_use: dict[str, Any] = {"raised": False, "messages": []}
    try:
        with torch.cuda.graph(graph):
            _hook("allreduce_hook")(None, _Bucket(x)).wait()
    except RuntimeError as e:
        first_use = {"raised": True, "messages": _messages(e)}
    del graph
    torch.cuda.synchronize()
    out = capture_parity_fn(rank, ws, cases, wide=True)
    out["first_use"] = first_use
    return out


MULTINODE_CASES = [
    ("allreduce_hook", "adam"),
    ("bf16_compress_hook", "sgd"),
    ("fp16_compress_hook", "sgd"),
]


@pytest.mark.skipif(BACKEND != "fastcomm", reason="fastcomm's multi-node CUDA path")
@pytest.mark.cuda(4)
def test_multinode_ddp_step_captured_equals_eager() -> None:
    """4 GPUs as 2 nodes x 2: a whole DDP step captured with each hook, its 4 MiB bucket on
    the staged multi-node path and the small ones on the flat NCCL communicator; after
    REPLAYS replays the parameters equal those of the eager steps. Before that, the staged
    path's first use under capture raises a RuntimeError naming CUDA graphs and the eager
    warm-up instead of hanging or recording a wrong graph."""
    res = run_ranks(
        4,
        multinode_capture_fn,
        MULTINODE_CASES,
        env=lambda r: {
            "FASTCOMM_HOST_ID": f"simnode{r // 2}",
            "FASTCOMM_TIMELINE": "1",
            "FASTCOMM_CUDA_HIER_MIN_BYTES": WIDE_BUCKET_THRESHOLD,
        },
        timeout_s=400,
    )
    print(res[0])
    for rank, out in enumerate(res):
        o = out["first_use"]
        assert o["raised"], f"rank {rank}: the staged path's first use under capture did not raise"
        text = " ".join(o["messages"]).lower()
        assert "cuda graph" in text and "eager" in text, (
            f"rank {rank}: the error does not name CUDA graphs and the eager warm-up: "
            f"{o['messages']}"
        )
