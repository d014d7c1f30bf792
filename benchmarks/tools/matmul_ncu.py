#!/usr/bin/env python
"""One call of each matmul method inside a CUDA profiler range, for Nsight Compute.

Run under ``ncu --profile-from-start off`` (benchmarks/tools/matmul_ncu.sh does): every
method is warmed up outside the range, then called once inside it, so ncu
profiles exactly one kernel per method, in the order printed on stdout
(``# kernel <i>: <shape> <method>``). The counters (instructions per pipe,
shared-memory wavefronts, L2 / DRAM bytes) say where one kernel spends more
work than another for the same product, which timings at the power limit cannot
separate.

Methods: ``cublas`` (torch.matmul), ``cublas_linear`` (F.linear with bias),
``addmm_act`` (torch._addmm_activation, gelu tanh), ``unfused_gelu`` (the
elementwise F.gelu of the unfused pair), ``fc[<variant>]`` / ``fcl[<variant>]`` /
``fcb[<variant>]`` (fastcomm matmul / linear + bias + gelu_tanh / linear + bias
without activation, under bench_matmul's variant knobs): ``fcb`` beside ``fcl``
isolates the activation's cost.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_matmul import Variant, kernel_name

import torchext  # noqa: F401  (registers torch.ops.fastcomm)


def method_call(
    method: str,
    x: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    pre: torch.Tensor,
) -> tuple[Callable[[], torch.Tensor], str | None, Callable[[], str]]:
    """The call that runs `method` on these inputs, the bench_matmul variant it needs, and its
    label (for fastcomm's ops with the kernel they run, read under that variant's knobs)."""
    if method == "cublas":
        return (lambda: torch.matmul(x, b)), None, lambda: method
    if method == "cublas_linear":
        return (lambda: F.linear(x, w, bias)), None, lambda: method
    if method == "addmm_act":
        return (
            (lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)),
            None,
            lambda: method,
        )
    if method == "unfused_gelu":
        return (lambda: F.gelu(pre, approximate="tanh")), None, lambda: method
    if method.startswith("fc[") and method.endswith("]"):
        return (
            (lambda: torch.ops.fastcomm.matmul(x, b)),
            method[3:-1],
            lambda: f"{method} = {kernel_name(x, b)}",
        )
    linear_act = {"fcl[": "gelu_tanh", "fcb[": "none"}.get(method[:4])
    if linear_act is not None and method.endswith("]"):
        return (
            (lambda: torch.ops.fastcomm.linear(x, w, bias, linear_act)),
            method[4:-1],
            lambda: f"{method} = {kernel_name(x, w.t(), linear_act)}",
        )
    raise SystemExit(f"unknown method {method!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="4096x4096x4096", help="MxNxK, comma list")
    p.add_argument(
        "--methods",
        default="cublas,fc[auto],addmm_act,fcl[auto],unfused_gelu",
        help="comma list (see the module doc)",
    )
    args = p.parse_args(argv)
    torch.manual_seed(0)
    i = 0
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        pre = F.linear(x, w, bias)
        for method in args.methods.split(","):
            fn, variant, describe = method_call(method, x, b, w, bias, pre)
            with Variant(variant) if variant else contextlib.nullcontext():
                label = describe()
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            print(f"# kernel {i}: {shape} {label}", flush=True)
            i += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
