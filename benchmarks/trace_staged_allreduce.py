"""Where the time of the staged CUDA all_reduce across nodes goes.

Run with torchrun on one machine; ranks are split into ``--sim-nodes`` simulated
nodes (FASTCOMM_HOST_ID), so the all_reduce takes the staged path (NCCL in the
node, fastcomm's transport between nodes). For each size it prints the host
wall time per call (issue to stream synchronised) and, for the last size, the
proxy's per-chunk phases (FASTCOMM_TIMELINE) summarised: how long each phase
kind was busy, how long the op took, and how much of it had two or more phases
in flight at once (the overlap the pipeline is built for). With ``--trace`` the
phases are written as a Chrome trace per rank.

    FASTCOMM_LOG=INFO torchrun --nproc_per_node=4 benchmarks/trace_staged_allreduce.py \\
        --sim-nodes 2 --sizes 1M,16M,256M --trace /tmp/staged

``--staging auto,host`` compares the staging memory (FASTCOMM_STAGED_MEMORY) in one run: each
setting gets a process group of its own, created with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def busy_union(spans: list[tuple[float, float]]) -> float:
    """Total time covered by the union of `spans`."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def overlapped(spans: list[tuple[float, float]]) -> float:
    """Time during which two or more of `spans` are in flight."""
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    depth, last, total = 0, 0.0, 0.0
    for t, d in points:
        if depth >= 2:
            total += t - last
        depth += d
        last = t
    return total


def summarise(events: list[dict[str, Any]]) -> dict[str, Any]:
    if not events:
        return {}
    t0 = min(e["start_us"] for e in events)
    t1 = max(e["end_us"] for e in events)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        kinds.setdefault(e["name"], []).append((e["start_us"], e["end_us"]))
    spans = [(e["start_us"], e["end_us"]) for e in events]
    per_kind = {
        k: {
            "count": len(v),
            "busy_us": busy_union(v),
            "median_us": statistics.median(e - s for s, e in v),
            "max_us": max(e - s for s, e in v),
        }
        for k, v in kinds.items()
    }
    return {
        "span_us": t1 - t0,
        "overlap_us": overlapped(spans),
        "phases": per_kind,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim-nodes", type=int, default=2)
    p.add_argument("--sizes", default="1M,16M,256M", help="float32 bytes per rank")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--wire", default="", help="FASTCOMM_WIRE_DTYPE for this run")
    p.add_argument("--trace", default="", help="prefix of per-rank Chrome traces")
    p.add_argument("--json", default="", help="summary JSON (rank 0)")
    p.add_argument(
        "--staging", default="", help="FASTCOMM_STAGED_MEMORY values to compare, e.g. auto,host"
    )
    args = p.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    per_node = world // args.sim_nodes
    os.environ.setdefault("FASTCOMM_HOST_ID", f"simnode{rank // per_node}")
    os.environ["FASTCOMM_TIMELINE"] = "1"
    if args.wire:
        os.environ["FASTCOMM_WIRE_DTYPE"] = args.wire

    import torch
    import torch.distributed as dist

    import torchext

    torch.cuda.set_device(local)
    dist.init_process_group("fastcomm", device_id=torch.device("cuda", local))
    results: dict[str, Any] = {"world": world, "sim_nodes": args.sim_nodes, "sizes": []}
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    events: list[dict[str, Any]] = []
    for staging in args.staging.split(",") if args.staging else [None]:
        group = None
        mode = {}
        if staging:
            # the setting is read when a group is created: one group per value
            os.environ["FASTCOMM_STAGED_MEMORY"] = mode["staging"] = staging
            group = dist.new_group(backend="fastcomm")
            if rank == 0:
                print(f"-- FASTCOMM_STAGED_MEMORY={staging}", flush=True)
        for size in sizes:
            n = size // 4
            x = torch.randn(n, device="cuda")
            for _ in range(2):  # warm-up: set-up, staging, connections
                dist.all_reduce(x, group=group)
            torch.cuda.synchronize()
            dist.barrier(group=group)
            times, issue = [], []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                dist.barrier(group=group, device_ids=[local])
                torch.cuda.synchronize()
                torchext.timeline()  # keep only the phases of the last call
                t = time.perf_counter()
                dist.all_reduce(x, group=group)
                issue.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.01)  # the proxy records its last phase after the stream passed it
            events = torchext.timeline()
            med = statistics.median(times)
            busbw = size * 2 * (world - 1) / world / (med * 1e-3) / 1e9
            row = {
                **mode,
                "bytes": size,
                "ms": times,
                "issue_ms": issue,
                "median_ms": med,
                "busbw_GBps": busbw,
            }
            if events:
                row["timeline_last_call"] = summarise(events)
            results["sizes"].append(row)
            if rank == 0:
                print(
                    f"{size:>12} B  median {med:8.3f} ms  busbw {busbw:6.2f} GB/s  "
                    f"(min {min(times):.3f}, max {max(times):.3f}; host issue {statistics.median(issue):.3f} ms)",
                    flush=True,
                )
                if "timeline_last_call" in row:
                    print(json.dumps(row["timeline_last_call"], indent=1), flush=True)
        if args.trace and events:
            tag = "".join(f".{v}" for v in mode.values())
            torchext.save_timeline(f"{args.trace}{tag}.rank{rank}.json", events)
        if group is not None:
            dist.destroy_process_group(group)
    if rank == 0 and args.json:
        results["torch"] = torch.__version__
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
