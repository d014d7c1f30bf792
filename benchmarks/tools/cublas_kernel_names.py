#!/usr/bin/env python3
"""Which kernels cuBLAS / cuBLASLt run for the matmul benchmark's baselines.

For each shape (M x N x K) it profiles one call each of torch.matmul (b as
[K, N] row-major, as bench_matmul.py holds it), F.linear with bias and
torch._addmm_activation(use_gelu=True), and prints every CUDA kernel's name
with its grid, block and shared memory from the profiler's trace. cuBLAS's
Hopper kernel names carry the tile shape, cluster shape, stage count and
schedule (cooperative / ping-pong), so this says what our own kernels are
compared against. Usage on a GPU machine:

    python3 benchmarks/tools/cublas_kernel_names.py --shapes 4096x4096x4096,8192x4096x4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
import torch.nn.functional as F


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) == 1:
        parts = parts * 3
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want M, MxNxK")
    return parts[0], parts[1], parts[2]


def kernels_of(fn, warmup: int = 3) -> list[dict]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        out.append(
            {
                "name": e.get("name", ""),
                "us": round(float(e.get("dur", 0.0)), 1),
                "grid": args.get("grid"),
                "block": args.get("block"),
                "shared_memory": args.get("shared memory"),
                "registers_per_thread": args.get("registers per thread"),
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096x4096,8192x4096x4096")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", help="write the kernels per shape and op here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "shapes": {},
    }
    for text in args.shapes.split(","):
        m, n, k = parse_shape(text)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        b_kn = w.t().contiguous()
        bias = torch.randn(n, device="cuda", dtype=dtype)
        ops = {
            "torch.matmul": lambda x=x, b=b_kn: torch.matmul(x, b),
            "F.linear(bias)": lambda x=x, w=w, bias=bias: F.linear(x, w, bias),
            "_addmm_activation(gelu)": lambda x=x, w=w, bias=bias: torch._addmm_activation(
                bias, x, w.t(), use_gelu=True
            ),
        }
        label = f"{m}x{n}x{k}"
        report["shapes"][label] = {}
        for op, fn in ops.items():
            ks = kernels_of(fn)
            report["shapes"][label][op] = ks
            for kern in ks:
                print(
                    f"{label:>16s} {op:24s} {kern['us']:8.1f} us grid={kern['grid']} "
                    f"block={kern['block']} smem={kern['shared_memory']} "
                    f"regs={kern['registers_per_thread']}  {kern['name']}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
