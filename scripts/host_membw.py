#!/usr/bin/env python3
"""Host memory bandwidth available right now: a probe beside the multi-node benchmarks.

Every byte of the multi-node all_reduce over TCP loopback crosses host memory several times
(staging DMA, the kernel's socket copies), so a launch may be slow because the (shared) host's
memory is busy. scripts/device_check.sh `spread` runs this between benchmark launches: if its
number moves with theirs, host memory is what varies.

Measures copies of one large float32 buffer into another with torch's CPU kernels on
--threads threads, median over --iters copies, counting read + write bytes, and writes JSON in
the benchmarks' shape (``{"results": [{"backend": "host-copy", "busbw_gbps": ...}]}``).

    python3 scripts/host_membw.py --mib 1024 --threads 16 --json /tmp/membw.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def copy_bandwidth_gbps(mib: int, threads: int, iters: int) -> list[float]:
    """GB/s (1e9 bytes, read + write) of each of `iters` copies of a `mib` MiB float32 buffer."""
    torch.set_num_threads(threads)
    n = mib * (1 << 20) // 4
    src = torch.rand(n)  # touched: every page is resident before timing
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up, faults in dst's pages
    rates = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        rates.append(2 * n * 4 / dt / 1e9)
    if not torch.equal(dst, src):  # a copy that did not happen must not read as fast
        raise RuntimeError("host_membw: the copy is wrong")
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=int, default=1024, help="buffer size in MiB (default 1024)")
    p.add_argument("--threads", type=int, default=16, help="CPU threads (default 16)")
    p.add_argument("--iters", type=int, default=10, help="timed copies (default 10)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.mib < 1 or args.threads < 1 or args.iters < 1:
        p.error("--mib, --threads and --iters must be positive")
    rates = copy_bandwidth_gbps(args.mib, args.threads, args.iters)
    median = statistics.median(rates)
    print(f"host copy, {args.mib} MiB on {args.threads} threads: median {median:.1f} GB/s "
          f"(min {min(rates):.1f}, max {max(rates):.1f})")  # fmt: skip
    if args.json:
        row = {
            "backend": "host-copy",
            "bytes": args.mib << 20,
            "threads": args.threads,
            "busbw_gbps": median,
            "samples_gbps": rates,
        }
        args.json.write_text(json.dumps({"results": [row]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
