#!/usr/bin/env python
"""Where does a CUDA collective's extra time go: host or GPU?

Run with torchrun on one node. For each op and size, and for fastcomm and
nccl, a loop of synchronous calls (``async_op=False``, so both backends issue
on the current stream) is timed three ways:

* ``gpu_us``: CUDA events on the current stream around the loop, divided by
  the number of calls: what the GPU spends per call, launch gaps included;
* ``issue_us``: host time to *issue* the loop (no synchronisation inside):
  what the backend costs the calling thread per call;
* ``wall_us``: host time of the loop including the final synchronisation
  (what bench_collectives.py reports).

If fastcomm's ``gpu_us`` exceeds NCCL's while ``issue_us`` stays well under
``gpu_us``, the difference is on the GPU (extra work or a different NCCL
algorithm), not on the launch path. Prints one table (rank 0) and writes
``--json``.

    torchrun --standalone --nproc_per_node=4 benchmarks/probe_cuda_overhead.py --json probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def run_op(op: str, group: dist.ProcessGroup, buf: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif op == "broadcast":
        dist.broadcast(buf, src=0, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, buf, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(buf, out, group=group)
    else:
        raise ValueError(op)


def measure(op: str, group: dist.ProcessGroup, nbytes: int, iters: int, repeats: int) -> dict:
    world = dist.get_world_size()
    count = nbytes // 4
    if op == "reduce_scatter":
        buf = torch.randn(count // world, device="cuda")
        out = torch.randn(count - count % world, device="cuda")
    else:
        buf = torch.randn(count, device="cuda")
        out = torch.randn(count * world, device="cuda") if op == "all_gather" else buf
    for _ in range(5):
        run_op(op, group, buf, out)
    torch.cuda.synchronize()
    gpu, issue, wall = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(iters):
            run_op(op, group, buf, out)
        end.record()
        t1 = time.perf_counter()
        end.synchronize()
        t2 = time.perf_counter()
        gpu.append(start.elapsed_time(end) * 1000.0 / iters)
        issue.append((t1 - t0) * 1e6 / iters)
        wall.append((t2 - t0) * 1e6 / iters)
    row = torch.tensor(
        [statistics.median(gpu), statistics.median(issue), statistics.median(wall)],
        dtype=torch.float64,
        device="cuda",
    )
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    g, i, w = row.tolist()
    return {"gpu_us": g, "issue_us": i, "wall_us": w}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter")
    p.add_argument("--sizes", default="1M,4M,16M,32M,64M")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args()

    import torchext  # noqa: F401  (registers fastcomm)

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    groups = {"nccl": dist.group.WORLD, "fastcomm": dist.new_group(backend="fastcomm")}
    rows = []
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            nbytes = parse_size(size)
            for name, group in groups.items():
                r = measure(op, group, nbytes, args.iters, args.repeats)
                rows.append({"op": op, "bytes": nbytes, "backend": name, **r})
    if dist.get_rank() == 0:
        print(f"# env FASTCOMM_CUDA_TIMING={os.environ.get('FASTCOMM_CUDA_TIMING', '(default)')}")
        print(
            f"{'op':>15} {'bytes':>9} {'backend':>9} {'gpu_us':>9} {'issue_us':>9} {'wall_us':>9}"
        )
        for r in rows:
            print(
                f"{r['op']:>15} {r['bytes']:>9} {r['backend']:>9} "
                f"{r['gpu_us']:9.2f} {r['issue_us']:9.2f} {r['wall_us']:9.2f}"
            )
        if args.json:
            meta = {
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "device": torch.cuda.get_device_name(0),
                "world": dist.get_world_size(),
                "env": {
                    k: v for k, v in os.environ.items() if k.startswith(("FASTCOMM_", "NCCL_"))
                },
            }
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
