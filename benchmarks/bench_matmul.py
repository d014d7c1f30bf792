#!/usr/bin/env python
"""Benchmark of fastcomm's fused matmul ops on one GPU, in one run.

Compares, for square sizes (default 1024..8192) and LLM-like shapes
(M=8192, N=4096/11008/14336, K=4096):

* ``matmul``: ``torch.ops.fastcomm.matmul(a, b)`` vs ``torch.matmul`` (cuBLAS),
  a [M, K] and b [K, N] row-major;
* ``linear+bias+gelu``: ``torch.ops.fastcomm.linear(x, w, b, act)`` vs
  ``F.gelu(F.linear(x, w, b))`` (the unfused pair), ``torch._addmm_activation``
  (cuBLASLt's fused GELU epilogue) and ``torch.compile`` of the unfused code;
  x [M, K], w [N, K].  ``--gelu tanh`` (default) uses the tanh approximation
  everywhere, which is what ``_addmm_activation(use_gelu=True)`` computes on
  CUDA, so that all methods compute the same function; ``--gelu erf`` uses the
  exact GELU (then ``_addmm_activation`` still uses tanh);
* ``train`` (``--ops train``): forward + backward of linear + bias + GELU with x, w
  and b requiring grad, ``torchext.ops.linear`` (which keeps the pre-activation
  for the backward) and ``torch.ops.fastcomm.linear`` called directly (whose
  backward recomputes it) vs ``F.gelu(F.linear(x, w, b))``; checked by dW.

Each fastcomm kernel path listed in ``--variants`` is timed separately,
forced through torchext._testing.set_matmul_config (see ``Variant.SETTINGS``;
needs the testing module, FASTCOMM_BUILD_TESTING=1): ``auto`` (the default
dispatch), ``skinny`` (B K-major, at most 8 rows of A), ``mma`` (mma.sync), ``simt``,
``wgmma`` (the Hopper kernel with its own heuristic), ``split_coop128`` /
``split_pingpong`` / ``split_coop256`` (the Hopper kernel with K split over CTAs where its
model gains), ``coop64`` / ``coop64_s1`` / ``coop64_s2`` (the cooperative 128x64 tile:
with its rule's split count, or the bytes model's where the rule does not take the shape;
unsplit; 2 splits), ``coop64_direct`` (that tile with its epilogue from registers), and the
Hopper variants ``coop`` (cooperative 128x256, epilogue from registers), ``coop_tma`` (same,
epilogue through shared memory + TMA stores), ``coop192`` / ``coop128`` (cooperative 128x192
/ 128x128, TMA stores), ``pingpong`` (two
128x128 tiles in ping-pong) and ``coop_off`` (the offload epilogue: activation
and stores by the producer warpgroup's idle warps, under the next tile's
MMAs). ``--variants hopper`` names every Hopper kernel shape, ``--variants
fused`` the epilogues, ``--variants narrow`` the default beside the 128x64 tile.
The kernel a variant actually ran is recorded (``torch.ops.fastcomm._kernel_name``),
and a summary matrix (ratio to the baseline, per shape and variant) is printed last.

Timing: CUDA events around every call, median of ``--reps`` calls after a
warm-up, with the GPU kept busy ahead of the host (GPU time, not launch time), inputs rotated over enough copies to exceed twice the L2 cache,
random normal data (never zeros). Every method's output is checked against a
float32 reference first (relative Frobenius error, reported in the table).

Also measured on the same GPU: the memory-bandwidth ceiling (a large
device-to-device copy, bytes read + written) and the tensor-core ceiling
(cuBLAS on 8192^3), used for the roofline figure.

float32 (``--dtype fp32``) honours torch's matmul precision in both libraries:
``--tf32 off`` (default; torch's "highest": exact float32, fastcomm's CUDA-core
kernel), ``on`` (TF32 allowed: cuBLAS's TF32 tensor-core kernels, fastcomm's
TF32 Hopper kernel on sm_90) or ``both`` (every shape timed under each setting,
every method under the same setting as its baseline; the TF32 rows are
labelled ``MxNxK tf32``). References are always computed with TF32 off; TF32
results are checked against a relative error of 2e-3.

Outputs: a table on stdout (TFLOP/s and ratio columns), ``--json`` (all
numbers + device, torch version, command line), ``--plot`` (TFLOP/s bars) and
``--roofline`` (each kernel placed under the two ceilings).

Example::

    python benchmarks/bench_matmul.py --dtype bf16 --variants hopper \\
        --json benchmarks/results/matmul_h200.json \\
        --plot benchmarks/results/matmul_h200.png \\
        --roofline benchmarks/results/roofline_h200.png

    # every Hopper kernel shape (about 1-2 minutes on an H200)
    python benchmarks/bench_matmul.py --variants hopper --sizes 2048,4096,8192 \\
        --reps 30 --warmup-ms 50 --no-compile
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
from typing import Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# float32 with TF32 allowed: 10-bit mantissas in the products (~3e-4 measured
# relative error is typical).
TOL_TF32 = 2e-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--sizes", default="1024,2048,4096,8192", help="square sizes M=N=K (comma list)")
    p.add_argument(
        "--llm",
        default="8192x4096x4096,8192x11008x4096,8192x14336x4096",
        help="MxNxK shapes (comma list); empty for none",
    )
    p.add_argument(
        "--variants",
        default="auto",
        help="fastcomm kernel paths to time (comma list): "
        + ", ".join(Variant.SETTINGS)
        + "; or a set: "
        + ", ".join(Variant.SETS),
    )
    p.add_argument(
        "--tf32",
        default="off",
        choices=["off", "on", "both"],
        help="float32 only: torch.backends.cuda.matmul.allow_tf32 for cuBLAS and fastcomm alike "
        "(both: each shape under each setting)",
    )
    p.add_argument(
        "--ops",
        default="matmul,linear",
        help="which comparisons: matmul, linear (+ bias + GELU against _addmm_activation), bias "
        "(linear + bias without activation against cuBLAS's F.linear: the fused GELU's cost is "
        "the difference), train (forward + backward of linear + bias + GELU through "
        "torchext.ops.linear against torch's F.gelu(F.linear) under autograd; fastcomm_op: "
        "torch.ops.fastcomm.linear called directly, whose backward recomputes the "
        "pre-activation)",
    )
    p.add_argument("--gelu", default="tanh", choices=["tanh", "erf"])
    p.add_argument(
        "--reps", type=int, default=50, help="timed calls per measurement (median reported)"
    )
    p.add_argument("--warmup-ms", type=float, default=100.0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every method this many times per shape, in alternating order: the median "
        "of the rounds' medians (p20/p80 in the JSON become the rounds' min/max)",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--quick", action="store_true", help="small sizes, few reps (smoke test)")
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--plot", help="write a TFLOP/s bar chart (PNG)")
    p.add_argument("--roofline", help="write a roofline figure (PNG)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.llm, args.reps, args.warmup_ms = "512,1024", "1024x1536x512", 10, 20.0
    return args


# ----------------------------------------------------------------------------- timing


def _l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))


# About 100 µs of GPU clock per timed call: more than any method's host time to launch one.
_SLEEP_CYCLES_PER_CALL = 200_000


def time_calls(fn: Callable[[int], object], reps: int, warmup_ms: float) -> dict:
    """Median / 20th / 80th percentile of per-call GPU time in ms. fn(i) runs call i."""
    torch.cuda.synchronize()
    # warm-up for at least warmup_ms and 3 calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    i = 0
    while True:
        fn(i)
        i += 1
        if i >= 3:
            end.record()
            end.synchronize()
            if start.elapsed_time(end) >= warmup_ms or i >= 10_000:
                break
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    # Keep the GPU behind the host: without a queue of work in front, a small product's events
    # would time the host's launch of it (tens of µs) instead of the kernel.
    torch.cuda._sleep(int(reps * _SLEEP_CYCLES_PER_CALL))
    for r in range(reps):
        starts[r].record()
        fn(r)
        ends[r].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"ms": statistics.median(times), "p20_ms": q(0.2), "p80_ms": q(0.8)}


def measure_bandwidth(reps: int = 20) -> float:
    """Device-to-device copy of 2 GiB: (bytes read + bytes written) / time, in GB/s."""
    n = (2 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t = time_calls(lambda i: dst.copy_(src), reps, 50.0)["ms"]
    del src, dst
    return 2 * n * 4 / (t * 1e-3) / 1e9


@contextlib.contextmanager
def matmul_tf32(allow: bool):
    """torch.backends.cuda.matmul.allow_tf32 set for the block, restored after it."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def measure_mm_peak(dtype: torch.dtype, reps: int) -> float:
    """cuBLAS on 8192^3 random data, TFLOP/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = time_calls(lambda i: torch.matmul(a, b), reps, 200.0)["ms"]
    return 2 * n**3 / (t * 1e-3) / 1e12


# ----------------------------------------------------------------------------- methods


class Variant:
    """Forces the matmul settings of a kernel path while a fastcomm method runs, through
    torchext._testing.set_matmul_config (settings a variant does not name are auto). A
    variant name may end in ``@g<N>``: the same kernel with group=N (rows or columns of C
    per group of the Hopper tile order), e.g. ``auto@g4096``."""

    _HOPPER: ClassVar[dict[str, str]] = {"impl": "wgmma"}
    SETTINGS: ClassVar[dict[str, dict[str, str]]] = {
        "auto": {},
        "mma": {"impl": "mma"},
        "simt": {"impl": "simt"},
        # The CUDA-core kernel's 128x128 tiling at every size (auto takes it
        # only once its tiles fill the GPU).
        "simt_wide": {"impl": "simt", "tile": "large"},
        # ... without its K split, and the 64x64 tiling.
        "simt_s1": {"impl": "simt", "tile": "large", "splits": 1},
        "simt_small": {"impl": "simt", "tile": "small"},
        "wgmma": _HOPPER,
        "coop": {**_HOPPER, "sched": "coop", "tile": "large", "epi": "direct"},
        # The TMA epilogue (bias prefetched under the last MMAs, one barrier per
        # chunk, lean activations).
        "coop_tma": {**_HOPPER, "sched": "coop", "tile": "large", "epi": "tma"},
        "coop192": {**_HOPPER, "sched": "coop", "tile": "medium", "epi": "tma"},
        "coop128": {**_HOPPER, "sched": "coop", "tile": "small", "epi": "tma"},
        "pingpong": {**_HOPPER, "sched": "pingpong"},
        # The offload epilogue (3 stages + a whole-tile output buffer; the
        # activation and the TMA stores run on warps 1-3 of the producer
        # warpgroup, under the next tile's main loop).
        "coop_off": {**_HOPPER, "sched": "coop", "tile": "large", "epi": "offload"},
        "coop128_off": {**_HOPPER, "sched": "coop", "tile": "small", "epi": "offload"},
        "skinny": {"impl": "skinny"},
        # The Hopper kernel with K split over CTAs (splits from the bytes-per-SM model,
        # 1 where it finds no gain): cooperative 128x128 and 128x256 (the default's two
        # tiles), ping-pong.
        "split_coop128": {**_HOPPER, "sched": "coop", "tile": "small"},
        "split_pingpong": {**_HOPPER, "sched": "pingpong"},
        # The cooperative 128x64 tile (the default's where its rule takes the shape): with
        # the split count the default would give it, unsplit, and with 2 splits.
        "coop64": {**_HOPPER, "sched": "coop", "tile": "narrow"},
        "coop64_s1": {**_HOPPER, "sched": "coop", "tile": "narrow", "splits": 1},
        "coop64_s2": {**_HOPPER, "sched": "coop", "tile": "narrow", "splits": 2},
        # ... with the direct epilogue (stores from registers) instead of the TMA one.
        "coop64_direct": {**_HOPPER, "sched": "coop", "tile": "narrow", "epi": "direct"},
        "split_coop256": {**_HOPPER, "sched": "coop", "tile": "large"},
        # The default's kernel with every tile taken whole by one CTA: no split K and no
        # stream-K (the last round of tiles as it falls).
        "whole_tiles": {"splits": 1},
    }
    SETS: ClassVar[dict[str, list[str]]] = {
        # Every Hopper kernel shape, and the default.
        "hopper": [
            "auto",
            "mma",
            "coop_tma",
            "coop192",
            "coop128",
            "pingpong",
            "coop_off",
            "coop128_off",
        ],
        # The epilogues of the cooperative 128x256 kernel beside ping-pong's.
        "fused": ["auto", "coop", "coop_tma", "coop_off", "pingpong"],
        # Small M: the default beside each split-K kernel, mma.sync and the skinny kernel.
        "splitk": ["auto", "split_coop128", "split_coop256", "split_pingpong", "mma", "skinny"],
        # Small M: the default beside the 128x64 tile.
        "narrow": ["auto", "coop64", "coop64_s1", "coop64_s2", "coop64_direct"],
    }

    def __init__(self, name: str):
        base, _, group = name.partition("@g")
        if base not in self.SETTINGS or ("@g" in name and not group.isdigit()):
            raise ValueError(
                f"unknown variant {name!r}; known: {sorted(self.SETTINGS)} (each may end in "
                f"@g<group>) and sets {sorted(self.SETS)}"
            )
        self.name = f"{base}@g{group}" if group else base
        self.settings = {**self.SETTINGS[base], **({"group": group} if group else {})}

    @classmethod
    def expand(cls, spec: str) -> list[str]:
        out: list[str] = []
        for v in (v.strip() for v in spec.split(",")):
            for name in cls.SETS.get(v, [v] if v else []):
                if name not in out:
                    out.append(name)
        return out

    def __enter__(self) -> "Variant":
        from torchext import _testing

        _testing.set_matmul_config(**self.settings)
        return self

    def __exit__(self, *exc: object) -> None:
        from torchext import _testing

        _testing.reset_matmul_config()


def kernel_name(a: torch.Tensor, b: torch.Tensor, activation: str = "none") -> str:
    """The fastcomm kernel matmul(a, b) with that epilogue activation runs under the current
    settings ("?" if unknown)."""
    try:
        return torch.ops.fastcomm._kernel_name(a, b, activation)
    except (AttributeError, RuntimeError) as e:
        return f"? ({str(e)[:60]})"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, with_b_kn: bool) -> list[dict]:
    """Enough independent input sets that the rotation exceeds twice the L2 cache."""
    elt = torch.finfo(dtype).bits // 8
    set_bytes = (m * k + k * n + n + m * n) * elt
    n_sets = max(1, min(16, math.ceil(2 * _l2_bytes() / set_bytes)))
    sets = []
    for _ in range(n_sets):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / math.sqrt(k)
        s = {"x": x, "w": w, "bias": torch.randn(n, device="cuda", dtype=dtype)}
        if with_b_kn:
            s["b"] = w.t().contiguous()  # [K, N] row-major, as torch.matmul users hold it
        sets.append(s)
    return sets


def run_shape(
    m: int, n: int, k: int, args, dtype, compiled_cache: dict, tf32: bool = False
) -> list[dict]:
    """Every method on one shape, all of them under allow_tf32 = tf32 (float32)."""
    with matmul_tf32(tf32):
        rows = _run_shape(m, n, k, args, dtype, compiled_cache, tf32)
    if tf32:
        for r in rows:
            r["tf32"] = True
    return rows


def _run_shape(m: int, n: int, k: int, args, dtype, compiled_cache: dict, tf32: bool) -> list[dict]:
    ops_wanted = set(args.ops.split(","))
    variants = Variant.expand(args.variants)
    sets = make_inputs(m, n, k, dtype, "matmul" in ops_wanted)
    flops = 2.0 * m * n * k
    elt = torch.finfo(dtype).bits // 8
    rows = []
    approx = "tanh" if args.gelu == "tanh" else "none"
    act = "gelu_tanh" if args.gelu == "tanh" else "gelu"

    # Every method is checked first, then timed in --rounds rounds, the order reversed in every
    # other round, so that slow drifts (clocks under the power limit, temperature) fall on all
    # methods alike; a method's time is the median of its rounds' medians.
    pending = []

    def failed(op, method, e):
        # keep going: one failing method must not lose the run
        rows.append({"M": m, "N": n, "K": k, "op": op, "method": method, "error": repr(e)[:300]})
        print(f"  {op:8s} {method:18s} FAILED: {e!r}"[:200], flush=True)

    def grad_mode(grad: bool):
        return torch.enable_grad() if grad else torch.no_grad()

    def record(op, method, fn, ref, min_bytes, kernel=None, variant=None, grad=False, fl=None):
        try:
            with grad_mode(grad):
                err = rel_err(fn(0), ref)
        except Exception as e:
            failed(op, method, e)
            return
        pending.append(
            {
                "op": op,
                "method": method,
                "fn": fn,
                "err": err,
                "min_bytes": min_bytes,
                "kernel": kernel,
                "variant": variant,
                "grad": grad,
                "flops": fl or flops,
                "times": [],
            }
        )

    def time_all():
        for rnd in range(args.rounds):
            for entry in pending if rnd % 2 == 0 else pending[::-1]:
                if "error" in entry:
                    continue
                # The knobs stay set for the whole series (warm-up, timed calls), so that
                # setting them costs no time inside the measurement.
                variant = (
                    Variant(entry["variant"]) if entry["variant"] else contextlib.nullcontext()
                )
                try:
                    with variant, grad_mode(entry["grad"]):
                        entry["times"].append(time_calls(entry["fn"], args.reps, args.warmup_ms))
                except Exception as e:
                    entry["error"] = e
        for entry in pending:
            if "error" in entry:
                failed(entry["op"], entry["method"], entry["error"])
                continue
            times = entry["times"]
            ms = statistics.median(t["ms"] for t in times)
            if len(times) == 1:
                p20, p80 = times[0]["p20_ms"], times[0]["p80_ms"]
            else:  # the spread between rounds
                p20, p80 = min(t["ms"] for t in times), max(t["ms"] for t in times)
            err = entry["err"]
            rows.append(
                {
                    "M": m,
                    "N": n,
                    "K": k,
                    "op": entry["op"],
                    "method": entry["method"],
                    "ms": ms,
                    "p20_ms": p20,
                    "p80_ms": p80,
                    **({"round_ms": [t["ms"] for t in times]} if len(times) > 1 else {}),
                    "tflops": entry["flops"] / (ms * 1e-3) / 1e12,
                    "rel_err": err,
                    "ok": err < (TOL_TF32 if tf32 else TOL[dtype]),
                    "flops": entry["flops"],
                    "min_bytes": entry["min_bytes"],
                    "intensity": entry["flops"] / entry["min_bytes"],
                    **({"kernel": entry["kernel"]} if entry["kernel"] else {}),
                }
            )

    s0 = sets[0]
    if "matmul" in ops_wanted:
        with matmul_tf32(False):  # exact float32 reference
            ref = s0["x"].float() @ s0["b"].float()
        mb = (m * k + k * n + m * n) * elt
        record(
            "matmul",
            "cublas",
            lambda i: torch.matmul(sets[i % len(sets)]["x"], sets[i % len(sets)]["b"]),
            ref,
            mb,
        )

        def fc(i):
            s = sets[i % len(sets)]
            return torch.ops.fastcomm.matmul(s["x"], s["b"])

        for v in variants:
            with Variant(v):
                record("matmul", f"fastcomm[{v}]", fc, ref, mb, kernel_name(s0["x"], s0["b"]), v)
        del ref
    if "bias" in ops_wanted:
        with matmul_tf32(False):
            ref = F.linear(s0["x"].float(), s0["w"].float(), s0["bias"].float())
        mb = (m * k + k * n + n + m * n) * elt
        record(
            "linear_bias",
            "cublas",
            lambda i: F.linear(
                sets[i % len(sets)]["x"], sets[i % len(sets)]["w"], sets[i % len(sets)]["bias"]
            ),
            ref,
            mb,
        )

        def fb(i):
            s = sets[i % len(sets)]
            return torch.ops.fastcomm.linear(s["x"], s["w"], s["bias"], "none")

        for v in variants:
            with Variant(v):
                record(
                    "linear_bias",
                    f"fastcomm[{v}]",
                    fb,
                    ref,
                    mb,
                    kernel_name(s0["x"], s0["w"].t(), "none"),
                    v,
                )
        del ref
    if "linear" in ops_wanted:
        with matmul_tf32(False):
            ref = F.gelu(
                F.linear(s0["x"].float(), s0["w"].float(), s0["bias"].float()), approximate=approx
            )
        mb = (m * k + k * n + n + m * n) * elt

        def fl(i):
            s = sets[i % len(sets)]
            return torch.ops.fastcomm.linear(s["x"], s["w"], s["bias"], act)

        for v in variants:
            with Variant(v):
                record(
                    "linear_gelu",
                    f"fastcomm[{v}]",
                    fl,
                    ref,
                    mb,
                    kernel_name(s0["x"], s0["w"].t(), act),
                    v,
                )

        def unfused(i):
            s = sets[i % len(sets)]
            return F.gelu(F.linear(s["x"], s["w"], s["bias"]), approximate=approx)

        record("linear_gelu", "unfused", unfused, ref, mb)

        def addmm(i):
            s = sets[i % len(sets)]
            return torch._addmm_activation(s["bias"], s["x"], s["w"].t(), use_gelu=True)

        record("linear_gelu", "addmm_activation", addmm, ref, mb)
        if not args.no_compile:
            if "fn" not in compiled_cache:
                compiled_cache["fn"] = torch.compile(
                    lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approx), dynamic=False
                )
            cfn = compiled_cache["fn"]

            def comp(i):
                s = sets[i % len(sets)]
                return cfn(s["x"], s["w"], s["bias"])

            record("linear_gelu", "torch.compile", comp, ref, mb)
        del ref
    if "train" in ops_wanted:
        # Forward + backward of linear + bias + GELU with x, weight and bias requiring grad
        # (views of the same inputs), checked by dW against float32 autograd.
        tsets = [
            {
                **{key: s[key].detach().requires_grad_() for key in ("x", "w", "bias")},
                "gy": torch.randn(m, n, device="cuda", dtype=dtype),
            }
            for s in sets
        ]
        t0 = tsets[0]
        with matmul_tf32(False):
            xr, wr, br = (t0[key].detach().float().requires_grad_() for key in ("x", "w", "bias"))
            yr = F.gelu(F.linear(xr, wr, br), approximate=approx)
            ref = torch.autograd.grad(yr, wr, t0["gy"].float())[0]
            del xr, wr, br, yr
        mb = 3 * (m * k + k * n + m * n) * elt

        def train(forward):
            def fn(i):
                s = tsets[i % len(tsets)]
                y = forward(s["x"], s["w"], s["bias"])
                return torch.autograd.grad(y, (s["x"], s["w"], s["bias"]), s["gy"])[1]

            return fn

        from torchext import ops as fastcomm_ops

        train_flops = 3 * flops  # forward, dX, dW
        fused = train(lambda x, w, b: fastcomm_ops.linear(x, w, b, act))
        for v in variants:
            with Variant(v):
                name = kernel_name(t0["x"].detach(), t0["w"].detach().t(), "none")
                record("train_gelu", f"fastcomm[{v}]", fused, ref, mb, name, v, True, train_flops)
        record(
            "train_gelu",
            "fastcomm_op",
            train(lambda x, w, b: torch.ops.fastcomm.linear(x, w, b, act)),
            ref,
            mb,
            grad=True,
            fl=train_flops,
        )
        record(
            "train_gelu",
            "unfused",
            train(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate=approx)),
            ref,
            mb,
            grad=True,
            fl=train_flops,
        )
        del ref, t0
    time_all()
    if "train" in ops_wanted:
        tsets.clear()  # the timed closures hold it until here
    del sets
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- reporting


def shape_label(r: dict) -> str:
    """MxNxK, with " tf32" for float32 rows timed with TF32 allowed: each method is compared
    with the baselines of the same shape and setting."""
    return f"{r['M']}x{r['N']}x{r['K']}" + (" tf32" if r.get("tf32") else "")


def best_fastcomm(rows: list[dict], op: str, label: str) -> Optional[dict]:
    cands = [
        r
        for r in rows
        if r["op"] == op
        and shape_label(r) == label
        and r["method"].startswith("fastcomm")
        and "tflops" in r
        and r["ok"]
    ]
    return max(cands, key=lambda r: r["tflops"]) if cands else None


# The baseline of each op: cuBLAS for the bare products, _addmm_activation for linear + GELU.
OP_BASELINE = {
    "matmul": "cublas",
    "linear_bias": "cublas",
    "linear_gelu": "addmm_activation",
    "train_gelu": "unfused",
}


def find(rows, op, label, method):
    for r in rows:
        if r["op"] == op and shape_label(r) == label and r["method"] == method and "tflops" in r:
            return r
    return None


def print_table(rows: list[dict]) -> None:
    labels = list(dict.fromkeys(shape_label(r) for r in rows))
    print()
    print(
        f"{'M x N x K':>20s}  {'op':11s} {'method':18s} {'ms':>8s} {'TFLOP/s':>8s} "
        f"{'vs cuBLAS/addmm':>15s} {'vs unfused':>10s} {'rel err':>8s}"
    )
    for lab in labels:
        for op, baseline in OP_BASELINE.items():
            base = find(rows, op, lab, baseline)
            unf = find(rows, op, lab, "unfused")
            for r in rows:
                if shape_label(r) != lab or r["op"] != op:
                    continue
                if "tflops" not in r:
                    print(
                        f"{lab:>20s}  {op:11s} {r['method']:18s} FAILED {r.get('error', '')[:60]}"
                    )
                    continue
                vb = f"{r['tflops'] / base['tflops']:.2f}x" if base and r is not base else ""
                vu = (
                    f"{r['tflops'] / unf['tflops']:.2f}x"
                    if unf and op != "matmul" and r is not unf
                    else ""
                )
                flag = "" if r["ok"] else " WRONG"
                print(
                    f"{lab:>20s}  {op:11s} {r['method']:18s} {r['ms']:8.3f} {r['tflops']:8.1f} "
                    f"{vb:>15s} {vu:>10s} {r['rel_err']:8.1e}{flag}"
                )


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets: matmul >= 0.9x cuBLAS at 4096, 8192 and the LLM shapes;
    linear+bias+gelu >= 1.0x _addmm_activation and >= 1.1x the unfused pair."""
    out = []
    labels = list(dict.fromkeys(shape_label(r) for r in rows))
    for lab in labels:
        m, n, k = (int(v) for v in lab.split()[0].split("x"))
        if not (
            (m == n == k and m in (4096, 8192))
            or (m == 8192 and k == 4096 and n in (4096, 11008, 14336))
        ):
            continue
        fm = best_fastcomm(rows, "matmul", lab)
        cb = find(rows, "matmul", lab, "cublas")
        if fm and cb:
            ratio = fm["tflops"] / cb["tflops"]
            out.append(
                {
                    "shape": lab,
                    "target": "matmul >= 0.9x cuBLAS",
                    "method": fm["method"],
                    "ratio": ratio,
                    "pass": ratio >= 0.9,
                }
            )
        fl = best_fastcomm(rows, "linear_gelu", lab)
        ad = find(rows, "linear_gelu", lab, "addmm_activation")
        un = find(rows, "linear_gelu", lab, "unfused")
        if fl and ad:
            ratio = fl["tflops"] / ad["tflops"]
            out.append(
                {
                    "shape": lab,
                    "target": "linear+gelu >= 1.0x addmm_activation",
                    "method": fl["method"],
                    "ratio": ratio,
                    "pass": ratio >= 1.0,
                }
            )
        if fl and un:
            ratio = fl["tflops"] / un["tflops"]
            out.append(
                {
                    "shape": lab,
                    "target": "linear+gelu >= 1.1x unfused",
                    "method": fl["method"],
                    "ratio": ratio,
                    "pass": ratio >= 1.1,
                }
            )
    return out


def print_variant_summary(rows: list[dict]) -> None:
    """Ratio of each fastcomm variant to the baseline (cuBLAS for matmul,
    _addmm_activation for linear+gelu), one line per shape and op; WRONG /
    FAILED where a variant's result was off or it did not run."""
    variants = list(
        dict.fromkeys(
            r["method"][len("fastcomm[") : -1] for r in rows if r["method"].startswith("fastcomm[")
        )
    )
    if not variants:
        return
    width = max(8, *(len(v) for v in variants))
    print(
        "\nfastcomm variants / baseline (matmul, linear_bias: cuBLAS; linear_gelu: "
        "addmm_activation; train_gelu: unfused):"
    )
    print(f"{'M x N x K':>16s} {'op':11s} " + " ".join(f"{v:>{width}s}" for v in variants))
    for lab in dict.fromkeys(shape_label(r) for r in rows):
        for op, baseline in OP_BASELINE.items():
            base = find(rows, op, lab, baseline)
            cells = []
            for v in variants:
                r = next(
                    (
                        r
                        for r in rows
                        if r["op"] == op
                        and shape_label(r) == lab
                        and r["method"] == f"fastcomm[{v}]"
                    ),
                    None,
                )
                if r is None:
                    cells.append("")
                elif "tflops" not in r:
                    cells.append("FAILED")
                elif not r["ok"]:
                    cells.append("WRONG")
                else:
                    cells.append(
                        f"{r['tflops'] / base['tflops']:.3f}" if base else f"{r['tflops']:.0f}T"
                    )
            if any(cells):
                print(f"{lab:>16s} {op:11s} " + " ".join(f"{c:>{width}s}" for c in cells))
    kernels = {}
    for r in rows:
        if r["method"].startswith("fastcomm[") and r.get("kernel"):
            kernels.setdefault(r["method"], {}).setdefault(r["kernel"], []).append(shape_label(r))
    print("kernels run:")
    for meth, ks in kernels.items():
        for k, labs in ks.items():
            shapes = ", ".join(dict.fromkeys(labs))
            print(f"  {meth:24s} {k}  [{shapes}]")


def plot_bars(rows: list[dict], path: str, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OP_BASELINE if any(r["op"] == op for r in rows)]
    titles = {
        "matmul": "matmul",
        "linear_bias": "linear + bias",
        "linear_gelu": "linear + bias + gelu",
        "train_gelu": "linear + bias + gelu, forward + backward",
    }
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 4.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        sub = [r for r in rows if r["op"] == op and "tflops" in r]
        labels = list(dict.fromkeys(shape_label(r) for r in sub))
        methods = list(dict.fromkeys(r["method"] for r in sub))
        width = 0.8 / max(1, len(methods))
        for j, meth in enumerate(methods):
            ys = [
                next(
                    (r["tflops"] for r in sub if shape_label(r) == lab and r["method"] == meth), 0.0
                )
                for lab in labels
            ]
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, ys, width, label=meth)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{titles[op]} ({meta['dtype']}, {meta['device']})")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_roofline(rows: list[dict], path: str, meta: dict, ceilings: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = ceilings["bandwidth_GBps"] * 1e9  # bytes/s
    peak = ceilings["matmul_peak_tflops"] * 1e12
    sub = [r for r in rows if "tflops" in r]
    if not sub:
        return
    ai = [r["intensity"] for r in sub]
    lo, hi = min(ai + [peak / bw]) / 4, max(ai) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(12, 6))
    ax.loglog(
        xs,
        [min(peak, bw * x) / 1e12 for x in xs],
        "k-",
        lw=2,
        label=f"ceilings: {ceilings['bandwidth_GBps']:.0f} GB/s copy, "
        f"{ceilings['matmul_peak_tflops']:.0f} TFLOP/s cuBLAS 8192^3",
    )
    ax.axvline(peak / bw, color="gray", ls=":", lw=1)
    methods = list(dict.fromkeys(r["method"] for r in sub))
    markers = {"matmul": "o", "linear_gelu": "s"}
    cmap = plt.get_cmap("tab10")
    for j, meth in enumerate(methods):
        for op, mk in markers.items():
            pts = [r for r in sub if r["method"] == meth and r["op"] == op]
            if pts:
                ax.scatter(
                    [r["intensity"] for r in pts],
                    [r["tflops"] for r in pts],
                    marker=mk,
                    color=cmap(j % 10),
                    label=f"{meth} ({'matmul' if op == 'matmul' else 'linear+gelu'})",
                    s=36,
                    alpha=0.85,
                )
    for lab in dict.fromkeys(shape_label(r) for r in sub):
        r = next(r for r in sub if shape_label(r) == lab)
        ax.annotate(
            lab,
            xy=(r["intensity"], 0.01),
            xycoords=("data", "axes fraction"),
            fontsize=6,
            rotation=90,
            ha="center",
            va="bottom",
            alpha=0.7,
        )
    ax.set_xlabel("arithmetic intensity (FLOP / byte, each operand moved once)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline, {meta['dtype']}, {meta['device']}")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_matmul: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torchext  # noqa: F401  (registers torch.ops.fastcomm)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "l2_bytes": _l2_bytes(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join([sys.executable] + sys.argv),
        "env": {k: v for k, v in os.environ.items() if k.startswith("FASTCOMM_")},
        "dtype": args.dtype,
        "tf32": args.tf32 if args.dtype == "fp32" else "n/a",
        "gelu": args.gelu,
        "reps": args.reps,
        "rounds": args.rounds,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(
        f"# {meta['device']} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), "
        f"torch {meta['torch']}, CUDA {meta['cuda']}, {args.dtype}",
        flush=True,
    )
    # float32: the modes timed (TF32 off / on); other types ignore the setting.
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tf32]
    if dtype != torch.float32:
        modes = [False]
    with matmul_tf32(modes[-1]):  # the tensor-core ceiling where TF32 is timed
        ceilings = {
            "bandwidth_GBps": measure_bandwidth(),
            "matmul_peak_tflops": measure_mm_peak(dtype, args.reps),
            "matmul_peak_tf32": modes[-1],
        }
    print(
        f"# ceilings: copy {ceilings['bandwidth_GBps']:.0f} GB/s (read + write), "
        f"cuBLAS 8192^3 {ceilings['matmul_peak_tflops']:.0f} TFLOP/s"
        + (" (TF32)" if ceilings["matmul_peak_tf32"] else ""),
        flush=True,
    )

    shapes = [(s, s, s) for s in (int(v) for v in args.sizes.split(",") if v)]
    for spec in (v for v in args.llm.split(",") if v):
        m, n, k = (int(t) for t in spec.lower().split("x"))
        shapes.append((m, n, k))
    rows: list[dict] = []
    compiled_cache: dict = {}
    for m, n, k in shapes:
        for tf32 in modes:
            print(f"# {m}x{n}x{k}" + (" tf32" if tf32 else ""), flush=True)
            rows += run_shape(m, n, k, args, dtype, compiled_cache, tf32)

    print_table(rows)
    targets = evaluate_targets(rows)
    if targets:
        print("\ntargets (best correct fastcomm variant):")
        for t in targets:
            print(
                f"  {t['shape']:>16s}  {t['target']:38s} {t['ratio']:.2f}x  {'PASS' if t['pass'] else 'MISS'}"
                f"  ({t['method']})"
            )
    print_variant_summary(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"meta": meta, "ceilings": ceilings, "results": rows, "targets": targets},
                f,
                indent=1,
            )
    for path, fn in (
        (args.plot, lambda p: plot_bars(rows, p, meta)),
        (args.roofline, lambda p: plot_roofline(rows, p, meta, ceilings)),
    ):
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                fn(path)
            except ImportError as e:
                print(f"# cannot plot {path}: {e}", file=sys.stderr)
    bad = [r for r in rows if r.get("ok") is False or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
