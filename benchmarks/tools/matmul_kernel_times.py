#!/usr/bin/env python
"""GPU kernels per call of fastcomm's matmul / linear + GELU beside cuBLAS's, by shape.

For each shape (bf16): fastcomm.matmul vs torch.matmul and fastcomm.linear(..., "gelu_tanh")
vs torch._addmm_activation, 20 calls each under torch.profiler with the GPU kept busy ahead of
the host; one line per method: every kernel it launched with its mean time, the per-call span
from the first kernel's start to the last one's end, and fastcomm's kernel name.

    python benchmarks/tools/matmul_kernel_times.py [MxNxK ...]
"""

from __future__ import annotations

import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = ["1x4096x4096", "8x4096x4096", "64x4096x4096", "128x4096x4096", "256x4096x4096"]
CALLS = 20


def kernel_times(fn) -> tuple[float, str]:
    """(span per call in µs, 'kernel xN mean-µs; ...') of CALLS calls of fn."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(2_000_000)  # the launches queue up behind this
        for _ in range(CALLS):
            fn()
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
    if not torch.cuda.is_available():
        print("matmul_kernel_times: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torchext  # noqa: F401  (registers torch.ops.fastcomm)

    dt = torch.bfloat16
    for shape in argv or SHAPES:
        m, n, k = (int(v) for v in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt)
        bias = torch.randn(n, device="cuda", dtype=dt)
        methods = {
            "fc_matmul": (lambda: torch.ops.fastcomm.matmul(a, b), (a, b, "none")),
            "cublas": (lambda: torch.matmul(a, b), None),
            "fc_linear": (
                lambda: torch.ops.fastcomm.linear(a, w, bias, "gelu_tanh"),
                (a, w.t(), "gelu_tanh"),
            ),
            "addmm_act": (lambda: torch._addmm_activation(bias, a, w.t(), use_gelu=True), None),
        }
        for name, (fn, probe) in methods.items():
            span, parts = kernel_times(fn)
            kernel = f" [{torch.ops.fastcomm._kernel_name(*probe)}]" if probe else ""
            print(f"{shape} {name:10s} per-call span {span:.1f}us :: {parts}{kernel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
