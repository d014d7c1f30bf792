#!/usr/bin/env python
"""Correctness smoke run of every fastcomm matmul kernel variant on one GPU.

For each variant (the matmul settings of benchmarks/bench_matmul.py's
``Variant``, forced through torchext._testing, plus the other tile order): both ops on odd
and multi-tile shapes, every operand layout, every activation, float16 and
bfloat16 (and float32 on the paths that take it), against a float64
reference on fresh random data, outputs poisoned with NaN first. One line per
variant: the kernel it ran, worst error over tolerance, OK / FAIL. Exit status
1 when any variant fails. Runs in well under a minute on an H200; ``--quick``
(small shapes only) fits under compute-sanitizer.

    python benchmarks/tools/matmul_smoke.py                      # all variants for this GPU
    python benchmarks/tools/matmul_smoke.py --variants coop,pingpong --quick
    python benchmarks/tools/matmul_smoke.py --variants coop,coop_tma,coop_off --stream-k
    python benchmarks/tools/matmul_smoke.py --tf32 --quick        # float32 as TF32 only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_matmul import Variant

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 1e-5}
# float32 with TF32 allowed (--tf32): operands rounded or truncated to 10 mantissa bits, a
# product off by up to 2^-9, and a single-element output (1x1x1) relative to itself, where
# the bias may cancel most of the product.
TOL_TF32 = 1e-2
ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
# The 16-bit epilogues' gelu_tanh through the hardware tanh is off by up to ~5.5e-6 absolute
# where 1 + tanh cancels (the negative tail, docs/matmul.md): a single tail output is off by
# more than the type's relative rounding, as cuBLASLt's fused GELU is.
ACT_ATOL = {"gelu_tanh": 1e-5}
SMALL = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (129, 200, 72), (130, 264, 136)]
# Edges with TMA stores (N % 8 == 0), several tiles per CTA (ping-pong turns,
# stage phases wrapping), long K.
LARGE = [(300, 520, 1000), (1000, 1512, 700), (2304, 2304, 256), (257, 1024, 4096)]
# Stream-K on the cooperative 128 x 128 and 128 x 256 tiles (561 and 289 tiles: at least two
# rounds on 132 SMs, the last part-full); N % 8 == 0 (TMA stores), odd M and K.
STREAM_K = [(2100, 4104, 1000)]
# The skinny kernel's problems: at most 8 rows of A, K a multiple of 8, B K-major; float32
# also with B N-major, there on any K.
SKINNY = [(1, 13, 8), (1, 1000, 4096), (3, 520, 1000), (8, 4104, 264)]
SKINNY_NMAJOR = [(1, 13, 7), (2, 4099, 4101), (8, 33, 3)]
LAYOUTS = (("a", "b"), ("a", "b^T"), ("a^T", "b"), ("a^T", "b^T"))
# Settings beyond the benchmark's variants: the other tile order.
EXTRAS = {
    "coop_tma+raster_n": ("coop_tma", {"raster": "n"}),
    "coop192+raster_n": ("coop192", {"raster": "n"}),
    "pingpong+raster_n": ("pingpong", {"raster": "n"}),
    "coop_off+raster_n": ("coop_off", {"raster": "n"}),
}


def error_ratio(out: torch.Tensor, ref: torch.Tensor, tol: float, atol: float = 0.0) -> float:
    """Relative error over `tol`, with an absolute floor per element added to the allowed
    error: the output type's smallest normal number times `tol` (an output in float16's
    subnormal range, a lone 1x1x1 linear + GELU of a negative input, is rounded by an absolute
    step, not a relative one) and `atol` (an activation whose error is absolute, see ACT_ATOL)."""
    floor = (torch.finfo(out.dtype).tiny * tol + atol) * math.sqrt(max(out.numel(), 1))
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / (tol * ref.norm() + floor)).item()


def poison() -> None:
    """NaN-filled blocks in the caching allocator: an unwritten output shows as NaN."""
    bufs = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 12, 1 << 16, 1 << 22)]
    del bufs


def check(
    dtypes: list[torch.dtype],
    shapes: list[tuple[int, int, int]],
    layouts: tuple[tuple[str, str], ...] = LAYOUTS,
    tol: dict[torch.dtype, float] = TOL,
    linear: bool = True,
) -> tuple[float, list[str]]:
    """Worst error / tolerance of matmul (and, with `linear`, of linear) over shapes, layouts
    and activations, and a line per case over tolerance (dtype, shape, layout or activation,
    the kernel that ran it)."""
    worst = 0.0
    failures: list[str] = []

    def record(ratio: float, what: str, a: torch.Tensor, b: torch.Tensor, act: str) -> None:
        nonlocal worst
        worst = max(worst, ratio)
        if not ratio < 1:
            kernel = torch.ops.fastcomm._kernel_name(a, b, act)
            failures.append(f"{what}: error / tolerance {ratio:.3f} [{kernel}]")

    for dt in dtypes:
        for m, n, k in shapes:
            a = torch.randn(m, k, device="cuda").to(dt)
            at = torch.randn(k, m, device="cuda").to(dt).t()
            b = torch.randn(k, n, device="cuda").to(dt)
            bt = torch.randn(n, k, device="cuda").to(dt).t()
            operands = {"a": a, "a^T": at, "b": b, "b^T": bt}
            for name_a, name_b in layouts:
                aa, bb = operands[name_a], operands[name_b]
                poison()
                out = torch.ops.fastcomm.matmul(aa, bb)
                ratio = error_ratio(out, aa.double() @ bb.double(), tol[dt])
                record(ratio, f"{dt} {m}x{n}x{k} matmul {name_a} @ {name_b}", aa, bb, "none")
            if not linear:
                continue
            w, bias = bt.t(), torch.randn(n, device="cuda").to(dt)
            pre = a.double() @ w.double().t() + bias.double()
            for act in ACTS:
                poison()
                y = torch.ops.fastcomm.linear(a, w, bias, act)
                ref = {
                    "none": pre,
                    "relu": F.relu(pre),
                    "gelu": F.gelu(pre),
                    "silu": F.silu(pre),
                    "gelu_tanh": F.gelu(pre, approximate="tanh"),
                }[act]
                atol = ACT_ATOL.get(act, 0.0) if dt != torch.float32 else 0.0
                ratio = error_ratio(y, ref, tol[dt], atol)
                record(ratio, f"{dt} {m}x{n}x{k} linear {act}", a, w.t(), act)
    torch.cuda.synchronize()
    return worst, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="", help="comma list (default: all that this GPU runs)")
    p.add_argument("--quick", action="store_true", help="small shapes only (for compute-sanitizer)")
    p.add_argument(
        "--stream-k",
        action="store_true",
        help="the stream-K shape only (for compute-sanitizer on the fix-up)",
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="float32 only, with TF32 allowed (the tensor-core kernels' TF32 forms)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul_smoke: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torchext  # noqa: F401  (registers torch.ops.fastcomm)

    cc = torch.cuda.get_device_capability()
    if args.variants:
        names = [v for v in args.variants.split(",") if v]
    else:
        names = ["auto", "simt", "simt_wide"] + (["mma"] if cc[0] >= 8 else [])
        if cc == (9, 0):
            names += [v for v in Variant.SETTINGS if v not in names and v != "wgmma"]
            names += list(EXTRAS)
    shapes = STREAM_K if args.stream_k else SMALL if args.quick else SMALL + LARGE
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    tol = {**TOL, torch.float32: TOL_TF32} if args.tf32 else TOL
    failed = 0
    for name in names:
        base, extra = EXTRAS.get(name, (name, {}))
        variant = Variant(base)
        variant.settings.update(extra)
        with variant:
            dtypes = [torch.float16, torch.bfloat16]
            if base in ("auto", "simt", "simt_wide", "skinny"):
                dtypes.append(torch.float32)
            if args.tf32:
                dtypes = [torch.float32]
            try:
                probe_dtype = torch.float32 if args.tf32 else torch.bfloat16
                probe = torch.empty(4096, 4096, device="cuda", dtype=probe_dtype)
                if base == "skinny":  # one row of A, B K-major
                    kernel = torch.ops.fastcomm._kernel_name(probe[:1], probe.t())
                else:
                    kernel = torch.ops.fastcomm._kernel_name(probe, probe)
                t0 = time.perf_counter()
                if base == "skinny":
                    worst, failures = check(dtypes, SKINNY, (("a", "b^T"),), tol)
                    if torch.float32 in dtypes:
                        w32, f32 = check(
                            [torch.float32], SKINNY_NMAJOR, (("a", "b"),), tol, linear=False
                        )
                        worst, failures = max(worst, w32), failures + f32
                else:
                    worst, failures = check(dtypes, shapes, LAYOUTS, tol)
                status = "OK" if worst < 1 else "FAIL"
                msg = f"worst error / tolerance {worst:.3f}  ({time.perf_counter() - t0:.1f} s)"
            except RuntimeError as e:
                status, kernel, msg, failures = "FAIL", "-", f"raised {str(e)[:200]}", []
        failed += status != "OK"
        print(f"{name:22s} {status:4s} {msg}  [{kernel} at 4096^2]", flush=True)
        for line in failures:
            print(f"    {line}", flush=True)
    print(f"matmul_smoke: {len(names) - failed}/{len(names)} variants OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
