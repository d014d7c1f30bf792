#!/usr/bin/env python
"""K-split sweep of the mma.sync kernel's TF32 form on small-M ``matmul`` (b N-major, the
layout it takes by default), beside cuBLAS TF32 and the default dispatch.

For each shape: cuBLAS (``torch.matmul`` with TF32 allowed), fastcomm's default, and the
mma.sync kernel forced (``torchext._testing.set_matmul_config``) with its row tiles at each
split count and with its 64 x 64 tile at a few. Time per call: CUDA events over 20 back-to-back
calls on two copies of b (over the L2), median of 3; each forced variant is checked against
float64 first. Prints one line per shape (cuBLAS time / variant time) and writes the JSON.

    python benchmarks/tools/matmul_split_sweep.py out.json
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

import torchext  # noqa: F401  (registers torch.ops.fastcomm)
from torchext import _testing, ops

SHAPES = [(m, n, k) for m in (32, 64, 128, 256)
          for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))]  # fmt: skip
SETTINGS: list[tuple[str, dict[str, str]]] = (
    [("auto", {})]
    + [
        (f"rows_s{s}", {"impl": "mma", "tile": "narrow", "splits": str(s)})
        for s in (1, 2, 3, 4, 6, 8, 12)
    ]
    + [(f"small_s{s}", {"impl": "mma", "tile": "small", "splits": str(s)}) for s in (1, 2, 3)]
)


def time_us(
    fn: Callable[[torch.Tensor], torch.Tensor], bs: list[torch.Tensor], reps: int = 20
) -> float:
    for i in range(3):
        fn(bs[i % len(bs)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for i in range(reps):
            fn(bs[i % len(bs)])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e3)
    return sorted(times)[1]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("json", help="write the results here")
    args = p.parse_args()
    torch.set_float32_matmul_precision("high")
    out = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda")
        bs = [torch.randn(k, n, device="cuda") for _ in range(2)]
        ref = a.double() @ bs[0].double()
        t_cublas = time_us(lambda b: torch.matmul(a, b), bs)
        row: dict[str, object] = {"shape": f"{m}x{n}x{k}", "cublas_us": t_cublas}
        for name, settings in SETTINGS:
            _testing.set_matmul_config(**settings)
            y = ops.matmul(a, bs[0])
            err = ((y.double() - ref).norm() / ref.norm()).item()
            t = time_us(lambda b: ops.matmul(a, b), bs)
            row[name] = round(t_cublas / t, 3) if err < 2e-3 else f"wrong: {err:.1e}"
            row[name + "_kernel"] = torch.ops.fastcomm._kernel_name(a, bs[0])
        _testing.reset_matmul_config()
        out.append(row)
        ratios = " ".join(f"{name}={row[name]}" for name, _ in SETTINGS)
        print(f"{row['shape']} cublas {t_cublas:.1f} us {ratios}", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
