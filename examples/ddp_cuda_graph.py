"""A whole DDP training step captured into a CUDA graph over fastcomm, and checked against eager.

    torchrun --nproc_per_node=4 examples/ddp_cuda_graph.py
    torchrun --nproc_per_node=4 examples/ddp_cuda_graph.py --hook bf16 --optimizer sgd

The recipe (torch's "whole-network capture" with DDP, see torch/docs notes/cuda.rst):

1. DDP with ``static_graph=True`` (the same buckets and hooks every step) and
   ``gradient_as_bucket_view=True`` (gradients live in DDP's buckets: fixed addresses, no
   copies), a communication hook from ``torchext.hooks`` that stays on the GPU streams, and a
   capturable optimizer (``Adam(capturable=True)`` keeps its step count on the GPU; SGD is
   capturable as it is).
2. Build DDP and warm up on a side stream, for at least 11 steps: DDP synchronises CUDA events
   for its runtime statistics in its first 10 iterations, which a capture cannot contain.
3. Capture one step (zero_grad in place, forward, backward, optimizer step) with
   ``torch.cuda.graph``; then each training step is: copy the batch into the static input
   tensors, ``graph.replay()``.

The script trains two copies of the same model on the same data: one with eager steps, one
with the warm-up followed by replays, and prints the time per step of both and the largest
difference between their parameters (float32 rounding at most). Without CUDA it trains the
eager copy on CPU with the hook and says that the capture needs GPUs. Exit status 1 when the
captured training does not match the eager one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HOOKS = {"allreduce": "allreduce_hook", "bf16": "bf16_compress_hook", "fp16": "fp16_compress_hook"}
MIN_WARMUP = 11


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the example."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend", default="fastcomm", help="process group backend (default: %(default)s)"
    )
    p.add_argument("--hook", choices=sorted(HOOKS), default="allreduce", help="torchext.hooks hook")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--layers", type=int, default=24, help="Linear layers of the MLP")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument(
        "--warmup",
        type=int,
        default=MIN_WARMUP,
        help=f"eager steps before the capture (>= {MIN_WARMUP})",
    )
    p.add_argument(
        "--steps", type=int, default=100, help="replayed (and eager) steps after the warm-up"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest allowed parameter difference, relative to the parameter's scale")  # fmt: skip
    args = p.parse_args(argv)
    if args.warmup < MIN_WARMUP or args.warmup % 100 == 0:
        # DDP synchronises its timing events at the start of the iteration after one of
        # iterations 1..10 and every 100th: the captured iteration must not be one of those.
        p.error(f"--warmup must be at least {MIN_WARMUP} and not a multiple of 100")
    if min(args.layers, args.width, args.batch, args.steps) < 1:
        p.error("--layers, --width, --batch and --steps must be positive")
    return args


def make_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    """An MLP of --layers Linear(width, width) + Tanh, the same on every rank and call."""
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    return nn.Sequential(*layers).to(device)


def batches(
    args: argparse.Namespace, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Input and target of every step for this rank (from --seed, the step and the rank)."""
    out = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7919 * step + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.tanh(x.flip(1)) + 0.01 * torch.randn(args.batch, args.width, generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def make_ddp(args: argparse.Namespace, device: torch.device) -> tuple[DDP, torch.optim.Optimizer]:
    """DDP over the default group with the hook, and its optimizer."""
    import torchext.hooks

    ddp = DDP(
        make_model(args, device),
        device_ids=[device.index] if device.type == "cuda" else None,
        static_graph=True,
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(None, getattr(torchext.hooks, HOOKS[args.hook]))
    if args.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(
            ddp.parameters(), lr=1e-3, capturable=device.type == "cuda", foreach=True
        )
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, foreach=True)
    return ddp, opt


def step(
    ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """One training step. zero_grad in place: the gradients stay views of DDP's buckets."""
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    return loss


def train_eager(
    args: argparse.Namespace, device: torch.device, data: list[Any]
) -> tuple[DDP, float]:
    """Warm-up and --steps eager steps; returns the model and the seconds per timed step."""
    ddp, opt = make_ddp(args, device)
    for x, y in data[: args.warmup]:
        step(ddp, opt, x, y)
    sync(device)
    t0 = time.perf_counter()
    for x, y in data[args.warmup :]:
        step(ddp, opt, x, y)
    sync(device)
    return ddp, (time.perf_counter() - t0) / args.steps


def train_captured(
    args: argparse.Namespace, device: torch.device, data: list[Any]
) -> tuple[DDP, float]:
    """Warm-up on a side stream, capture one step, replay it --steps times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp, opt = make_ddp(args, device)
        static_x = torch.empty_like(data[0][0])
        static_y = torch.empty_like(data[0][1])
        for x, y in data[: args.warmup]:
            static_x.copy_(x)
            static_y.copy_(y)
            step(ddp, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(ddp, opt, static_x, static_y)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in data[args.warmup :]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    return ddp, (time.perf_counter() - t0) / args.steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(value: float, group: Any) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under torchrun; returns the exit status."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            f"run under torchrun, e.g. torchrun --nproc_per_node=2 {sys.argv[0]}", file=sys.stderr
        )
        return 2
    if args.backend == "fastcomm":
        import torchext  # noqa: F401  (registers the backend where entry points do not)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend=args.backend)
    # timings and the comparison travel over Gloo: the measured group only trains
    cpu_group = dist.new_group(backend="gloo")
    world = dist.get_world_size()
    data = batches(args, rank, device)
    status = 0
    if not cuda:
        if rank == 0:
            print(
                "no CUDA device for this rank: CUDA graphs need GPUs (one per rank), so only the "
                f"eager part runs here: DDP on CPU with torchext.hooks.{HOOKS[args.hook]}."
            )
        _, per_step = train_eager(args, device, data)
        per_step = max_over_ranks(per_step, cpu_group)
        if rank == 0:
            print(f"eager (CPU, {world} ranks): {1e3 * per_step:.3f} ms/step")
    else:
        eager, t_eager = train_eager(args, device, data)
        captured, t_graph = train_captured(args, device, data)
        t_eager = max_over_ranks(t_eager, cpu_group)
        t_graph = max_over_ranks(t_graph, cpu_group)
        worst = 0.0
        for p, q in zip(captured.module.parameters(), eager.module.parameters()):
            scale = max(1.0, float(q.abs().max()))
            worst = max(worst, float((p - q).abs().max()) / scale)
        worst = max_over_ranks(worst, cpu_group)
        if rank == 0:
            print(
                f"{world} ranks, {args.backend}, {HOOKS[args.hook]}, {args.optimizer}, "
                f"{args.layers} x Linear({args.width}), batch {args.batch}/rank"
            )
            print(f"eager:    {1e3 * t_eager:8.3f} ms/step")
            print(f"captured: {1e3 * t_graph:8.3f} ms/step ({t_eager / t_graph:.2f}x)")
            print(
                f"max parameter difference after {args.warmup + args.steps} steps "
                f"(captured vs eager, relative to max(1, |param|)): {worst:.3g}"
            )
        if not worst <= args.tolerance:
            status = 1
            if rank == 0:
                print(f"FAILED: the difference exceeds --tolerance {args.tolerance:g}")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
