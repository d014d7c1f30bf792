"""The classic collectives demo, verified: all_reduce, broadcast, all_gather, reduce_scatter.

    torchrun --nproc_per_node=4 examples/allreduce_demo.py                  # fastcomm
    torchrun --nproc_per_node=4 examples/allreduce_demo.py --backend gloo   # the same on Gloo

Uses one GPU per local rank when CUDA is available, else CPU tensors. Every rank checks its own
results against the exact expected values; rank 0 prints them. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the demo."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend",
        default="fastcomm",
        help="torch.distributed backend, e.g. fastcomm, gloo, nccl (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="tensor device; auto = cuda (one GPU per local rank) when available",
    )
    return p.parse_args(argv)


def pick_device(choice: str) -> torch.device:
    """cuda:LOCAL_RANK when asked for or available (auto), else cpu."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def run_demo(device: torch.device) -> int:
    """Run the four collectives; returns how many ranks saw at least one wrong result."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mismatches = 0

    def show(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal mismatches
        ok = torch.equal(got.cpu(), want)
        mismatches += not ok
        if rank == 0 or not ok:
            verdict = "OK" if ok else f"MISMATCH (expected {want.tolist()})"
            print(f"[rank {rank}] {name:<15} {got.cpu().tolist()}  {verdict}", flush=True)

    # all_reduce (sum): rank r contributes r + 1 in every element; asynchronous, then wait().
    x = torch.full((4,), rank + 1.0, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, async_op=True).wait()
    show("all_reduce", x, torch.full((4,), n * (n + 1) / 2))

    # broadcast from rank 0: the other ranks start from zeros.
    y = (torch.arange(4.0) + 100 if rank == 0 else torch.zeros(4)).to(device)
    dist.broadcast(y, src=0)
    show("broadcast", y, torch.arange(4.0) + 100)

    # all_gather_into_tensor: rank r contributes [10r, 10r + 1].
    part = torch.tensor([10.0 * rank, 10.0 * rank + 1], device=device)
    gathered = torch.empty(2 * n, dtype=torch.float32, device=device)
    dist.all_gather_into_tensor(gathered, part)
    want = torch.tensor([float(10 * r + k) for r in range(n) for k in (0, 1)])
    show("all_gather", gathered, want)

    # reduce_scatter_tensor (sum): rank r contributes arange(2n) + r; rank q keeps elements
    # [2q, 2q + 2) of the sum, which is n * index + n(n-1)/2.
    full = torch.arange(2.0 * n, device=device) + rank
    mine = torch.empty(2, dtype=torch.float32, device=device)
    dist.reduce_scatter_tensor(mine, full, op=dist.ReduceOp.SUM)
    show("reduce_scatter", mine, n * torch.arange(2.0 * rank, 2.0 * rank + 2) + n * (n - 1) / 2)

    # How many ranks failed? (a float32 sum, which every backend supports)
    bad = torch.tensor([float(mismatches > 0)], device=device)
    dist.all_reduce(bad)
    return int(bad.item())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (under torchrun); returns the exit status."""
    args = parse_args(argv)
    if args.backend == "fastcomm":
        import torchext  # noqa: F401  registers "fastcomm" (entry points do too, once installed)
    device = pick_device(args.device)
    dist.init_process_group(
        backend=args.backend, device_id=device if device.type == "cuda" else None
    )
    if dist.get_rank() == 0:
        print(f"backend {args.backend}, {dist.get_world_size()} ranks, device {device.type}")
    bad_ranks = run_demo(device)
    if dist.get_rank() == 0:
        print("all results correct" if bad_ranks == 0 else f"{bad_ranks} rank(s) saw wrong results")
    dist.destroy_process_group()
    return 1 if bad_ranks else 0


if __name__ == "__main__":
    sys.exit(main())
