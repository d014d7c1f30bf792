#!/usr/bin/env python
"""Forced kernel settings on small-M products beside cuBLAS and the default dispatch.

For each shape and op (``matmul`` with ``b`` [K, N] as torch users hold it, ``linear`` +
GELU with the weight [N, K]): cuBLAS (``torch.matmul`` / ``torch._addmm_activation``), the
default dispatch, and each setting of ``--settings`` forced through
``torchext._testing.set_matmul_config``: the mma.sync kernel's row tiles (16 / 32 / 64 x 128)
at each split count (``rows_s<N>``, ``rows`` for the kernel's own count), its 64 x 64 tile
(``small``), and the Hopper kernel's cooperative 128 x 64 / 128 x 128 / 128 x 256 tiles
(``coop64``, ``coop128``, ``coop256``; ``coop256tma``, ``coop128direct``: that epilogue) and
ping-pong (``pingpong``); ``_s<N>`` forces N K splits. Times
are bench_matmul.py's: GPU time per call with the GPU kept ahead of the host and the operands
rotated over twice the L2, alternating rounds, median of the rounds' medians. Each forced
setting is checked against float64 first. Prints one line per shape and op (baseline time /
setting time) and writes the JSON.

    python benchmarks/tools/matmul_split_sweep.py --dtype bf16 --json out.json
    python benchmarks/tools/matmul_split_sweep.py --dtype fp32 --ops matmul --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

import torchext  # noqa: F401  (registers torch.ops.fastcomm)
from torchext import _testing, ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_matmul import DTYPES, make_inputs, matmul_tf32, time_calls  # noqa: E402

DEFAULT_SHAPES = ",".join(
    f"{m}x{n}x{k}"
    for m in (1, 8, 16, 32, 64, 128)
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
)
DEFAULT_SETTINGS = "auto,rows,rows_s1,rows_s2,rows_s4,rows_s6,rows_s8,rows_s12,coop64,small"


def parse_setting(name: str) -> dict[str, str]:
    """The forced configuration a setting name stands for ({} for the default)."""
    base, _, splits = name.partition("_s")
    table = {
        "auto": {},
        "rows": {"impl": "mma", "tile": "narrow"},
        "small": {"impl": "mma", "tile": "small"},
        "coop64": {"impl": "wgmma", "sched": "coop", "tile": "narrow"},
        "coop128": {"impl": "wgmma", "sched": "coop", "tile": "small"},
        "coop256": {"impl": "wgmma", "sched": "coop", "tile": "large"},
        "coop256tma": {"impl": "wgmma", "sched": "coop", "tile": "large", "epi": "tma"},
        "coop128direct": {"impl": "wgmma", "sched": "coop", "tile": "small", "epi": "direct"},
        "pingpong": {"impl": "wgmma", "sched": "pingpong"},
    }
    if base not in table or (splits and not splits.isdigit()) or (base == "auto" and splits):
        raise ValueError(f"unknown setting {name!r}: one of {sorted(table)}, + _s<splits>")
    return {**table[base], **({"splits": splits} if splits else {})}


def op_calls(op: str, sets: list[dict]) -> tuple[Callable[[int], object], Callable[[int], object]]:
    """(fastcomm, baseline) call i of op on the rotating input sets."""
    if op == "matmul":

        def ours(i: int) -> object:
            s = sets[i % len(sets)]
            return ops.matmul(s["x"], s["b"])

        def base(i: int) -> object:
            s = sets[i % len(sets)]
            return torch.matmul(s["x"], s["b"])

    elif op == "linear":

        def ours(i: int) -> object:
            s = sets[i % len(sets)]
            return ops.linear(s["x"], s["w"], s["bias"], "gelu_tanh")

        def base(i: int) -> object:
            s = sets[i % len(sets)]
            return torch._addmm_activation(s["bias"], s["x"], s["w"].t(), use_gelu=True)

    else:
        raise ValueError(f"unknown op {op!r}: matmul, linear")
    return ours, base


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="fp32 runs as TF32")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxNxK list")
    p.add_argument("--ops", default="matmul,linear")
    p.add_argument("--settings", default=DEFAULT_SETTINGS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup-ms", type=float, default=15.0)
    p.add_argument("--json", required=True, help="write the results here")
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    tf32 = dtype == torch.float32
    settings = {name: parse_setting(name) for name in args.settings.split(",")}
    tol = 2e-3 if tf32 else 2e-2
    out = []
    with matmul_tf32(tf32):
        for shape in args.shapes.split(","):
            m, n, k = (int(v) for v in shape.split("x"))
            sets = make_inputs(m, n, k, dtype, with_b_kn=True)
            for op in args.ops.split(","):
                ours, base = op_calls(op, sets)
                ref = base(0).double()
                row: dict[str, object] = {"shape": shape, "op": op}
                good = {}
                for name, cfg in settings.items():
                    _testing.set_matmul_config(**cfg)
                    try:
                        y = ours(0).double()
                    except RuntimeError as e:  # a forced path that cannot take the shape
                        row[name] = f"error: {str(e).splitlines()[0][:80]}"
                        continue
                    err = ((y - ref).norm() / ref.norm()).item()
                    row[name + "_kernel"] = torch.ops.fastcomm._kernel_name(
                        sets[0]["x"],
                        sets[0]["b"] if op == "matmul" else sets[0]["w"].t(),
                        activation="none" if op == "matmul" else "gelu_tanh",
                    )
                    if err > tol:
                        row[name] = f"wrong: {err:.1e}"
                        continue
                    good[name] = cfg
                _testing.reset_matmul_config()
                times: dict[str, list[float]] = {"cublas": []}
                for r in range(args.rounds):
                    order = ["cublas", *good]
                    for name in order if r % 2 == 0 else reversed(order):
                        if name == "cublas":
                            _testing.reset_matmul_config()
                            fn = base
                        else:
                            _testing.set_matmul_config(**good[name])
                            fn = ours
                        t = time_calls(fn, args.reps, args.warmup_ms)["ms"] * 1e3
                        times.setdefault(name, []).append(t)
                _testing.reset_matmul_config()
                t_base = statistics.median(times["cublas"])
                row["cublas_us"] = round(t_base, 2)
                for name in good:
                    row[name] = round(t_base / statistics.median(times[name]), 3)
                out.append(row)
                ratios = " ".join(f"{name}={row.get(name)}" for name in settings)
                print(f"{shape} {op} cublas {t_base:.1f} us {ratios}", flush=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "dtype": args.dtype,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rounds": args.rounds,
                "results": out,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
