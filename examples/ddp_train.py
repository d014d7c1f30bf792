"""DDP training on a synthetic regression task, deterministic given --seed.

    torchrun --nproc_per_node=4 examples/ddp_train.py                  # fastcomm
    torchrun --nproc_per_node=4 examples/ddp_train.py --backend gloo   # same loss curve on Gloo

Uses one GPU per local rank when CUDA is available, else CPU. The targets come from a fixed
random "teacher" MLP plus noise. Step s draws a global batch of --batch x world samples from
(--seed, s); rank r trains on its own slice, so DDP's averaged gradient is that of the global
batch and the loss curve does not depend on the backend (up to the summation order of its
all-reduce). Rank 0 prints the mean loss over ranks every --log-every steps, then the average
step time, and for fastcomm the backend's per-collective statistics. Exit status 1 when the
loss did not decrease or the parameters differ across ranks at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

IN_FEATURES = 32
OUT_FEATURES = 4
TEACHER_HIDDEN = 64
NOISE = 0.01


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the training script."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend", default="fastcomm", help="torch.distributed backend (default: %(default)s)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto = cuda (one GPU per local rank) when available, else cpu",
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, teacher and data")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.hidden, args.log_every) < 1:
        p.error("--steps, --batch, --hidden and --log-every must be positive")
    return args


def pick_device(choice: str) -> torch.device:
    """cuda:LOCAL_RANK when asked for or available (auto), else cpu."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def mlp(hidden: int, layers: int, seed: int) -> nn.Sequential:
    """An MLP from IN_FEATURES to OUT_FEATURES with `layers` hidden layers, seeded weights."""
    torch.manual_seed(seed)
    dims = [IN_FEATURES] + [hidden] * layers
    mods: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        mods += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(dims[-1], OUT_FEATURES))


def make_batch(
    teacher: nn.Module, seed: int, step: int, batch: int, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of step `step` (generated on the CPU)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch * world, IN_FEATURES, generator=gen)
    with torch.no_grad():
        y = teacher(x) + NOISE * torch.randn(batch * world, OUT_FEATURES, generator=gen)
    mine = slice(rank * batch, (rank + 1) * batch)
    return x[mine], y[mine]


def mean_over_ranks(value: torch.Tensor) -> float:
    """Mean of a scalar over ranks (a float32 sum through the training backend)."""
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def params_in_sync(model: nn.Module) -> bool:
    """True when every rank holds bitwise the same parameters as rank 0."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    differs = torch.tensor([float(not torch.equal(ref, flat))], device=flat.device)
    dist.all_reduce(differs)
    return differs.item() == 0


def format_stats(stats: dict[str, dict[str, float]]) -> str:
    """torchext.stats() as a table: calls, bytes, time and the resulting rate per collective."""
    lines = [
        f"{'collective':<24}{'calls':>8}{'bytes':>14}{'time (ms)':>12}{'avg (us)':>11}{'GB/s':>9}"
    ]
    for name, s in sorted(stats.items()):
        calls, nbytes, t_us = int(s["count"]), s["bytes"], s["time_us"]
        avg = t_us / calls if calls else 0.0
        rate = nbytes / (t_us * 1e3) if t_us else 0.0
        lines.append(
            f"{name:<24}{calls:>8}{int(nbytes):>14}{t_us / 1e3:>12.2f}{avg:>11.1f}{rate:>9.2f}"
        )
    return "\n".join(lines)


def train(args: argparse.Namespace, device: torch.device) -> int:
    """Train, report, verify; returns the exit status."""
    rank, world = dist.get_rank(), dist.get_world_size()
    teacher = mlp(TEACHER_HIDDEN, 1, args.seed + 1)
    model = mlp(args.hidden, 2, args.seed).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()
    if rank == 0:
        print(
            f"backend {args.backend}, {world} ranks, device {device.type}, seed {args.seed}, "
            f"global batch {args.batch * world}, {sum(p.numel() for p in model.parameters())} "
            "parameters"
        )
    warm = min(5, args.steps - 1)  # steps excluded from the step time (DDP builds buckets)
    losses: list[float] = []
    start = 0.0
    for step in range(args.steps):
        if step == warm:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        x, y = make_batch(teacher, args.seed, step, args.batch, rank, world)
        loss = loss_fn(ddp(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            losses.append(mean_over_ranks(loss))
            if rank == 0:
                print(f"step {step:>5}  loss {losses[-1]:.6f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_ms = (time.perf_counter() - start) / (args.steps - warm) * 1e3
    if rank == 0:
        print(f"average step time {step_ms:.3f} ms (rank 0, steps {warm}..{args.steps - 1})")
    if args.backend == "fastcomm":
        import torchext

        stats = torchext.stats()
        if rank == 0:
            print("fastcomm statistics of rank 0 (all collectives since init):")
            print(format_stats(stats), flush=True)
    in_sync = params_in_sync(model)
    learned = all(map(math.isfinite, losses)) and (len(losses) < 2 or losses[-1] < losses[0])
    if rank == 0:
        print(f"parameters identical on all ranks: {'yes' if in_sync else 'NO'}")
        if not learned:
            print(f"loss did not decrease: {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0 if in_sync and learned else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (under torchrun); returns the exit status."""
    args = parse_args(argv)
    if args.backend == "fastcomm":
        import torchext  # noqa: F401  registers "fastcomm" (entry points do too, once installed)
    device = pick_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # same arithmetic whatever the GPU defaults
    dist.init_process_group(
        backend=args.backend, device_id=device if device.type == "cuda" else None
    )
    status = train(args, device)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
