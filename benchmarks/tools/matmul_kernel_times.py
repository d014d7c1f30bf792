#!/usr/bin/env python
"""GPU kernels per call of fastcomm's matmul / linear + GELU beside cuBLAS's, by shape.

For each shape (bf16): fastcomm.matmul vs torch.matmul and fastcomm.linear(..., "gelu_tanh")
vs torch._addmm_activation, 20 calls each under torch.profiler with the GPU kept busy ahead of
the host; one line per method: every kernel it launched with its mean time, the per-call span
from the first kernel's start to the last one's end, and fastcomm's kernel name.

The calls rotate over bench_matmul.py's input sets (enough to exceed twice the L2 cache), so
that the operands come from HBM as in the benchmark; ``--warm`` uses one set, whose operands
then stay in L2 between calls (a 4096 x 4096 bf16 weight is 32 MiB of the H100's 50 MiB).

    python benchmarks/tools/matmul_kernel_times.py [--warm] [MxNxK ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_matmul import make_inputs  # noqa: E402

SHAPES = ["1x4096x4096", "8x4096x4096", "64x4096x4096", "128x4096x4096", "256x4096x4096"]
CALLS = 20


def kernel_times(fn: Callable[[int], object]) -> tuple[float, str]:
    """(span per call in µs, 'kernel xN mean-µs; ...') of CALLS calls fn(0), fn(1), ..."""
    for i in range(5):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(2_000_000)  # the launches queue up behind this
        for i in range(CALLS):
            fn(i)
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "sleep" not in e.name
        and "spin_kernel" not in e.name
    ]
    events.sort(key=lambda e: e.time_range.start)
    by_name: dict[str, list[float]] = collections.OrderedDict()
    for e in events:
        by_name.setdefault(e.name[:70], []).append(e.time_range.elapsed_us())
    span = (events[-1].time_range.end - events[0].time_range.start) / CALLS if events else 0.0
    parts = "; ".join(f"{k} x{len(v) // CALLS} {sum(v) / len(v):.1f}us" for k, v in by_name.items())
    return span, parts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=SHAPES, help="MxNxK (bf16)")
    parser.add_argument("--warm", action="store_true", help="one input set (operands in L2)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul_kernel_times: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torchext  # noqa: F401  (registers torch.ops.fastcomm)

    dt = torch.bfloat16
    ops = torch.ops.fastcomm
    for shape in args.shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        # The benchmark's input sets (x [M, K], w [N, K], b = w^T [K, N], bias); one with --warm.
        sets = make_inputs(m, n, k, dt, with_b_kn=True)[: 1 if args.warm else None]

        def pick(i: int) -> dict:
            return sets[i % len(sets)]

        s0 = sets[0]
        methods = {
            "fc_matmul": (
                lambda i: ops.matmul(pick(i)["x"], pick(i)["b"]),
                (s0["x"], s0["b"], "none"),
            ),
            "cublas": (lambda i: torch.matmul(pick(i)["x"], pick(i)["b"]), None),
            "fc_linear": (
                lambda i: ops.linear(pick(i)["x"], pick(i)["w"], pick(i)["bias"], "gelu_tanh"),
                (s0["x"], s0["w"].t(), "gelu_tanh"),
            ),
            "addmm_act": (
                lambda i: torch._addmm_activation(
                    pick(i)["bias"], pick(i)["x"], pick(i)["w"].t(), use_gelu=True
                ),
                None,
            ),
        }
        print(f"{shape}: {len(sets)} input set(s)", flush=True)
        for name, (fn, probe) in methods.items():
            span, parts = kernel_times(fn)
            kernel = f" [{ops._kernel_name(*probe)}]" if probe else ""
            print(f"{shape} {name:10s} per-call span {span:.1f}us :: {parts}{kernel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
