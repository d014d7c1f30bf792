#!/usr/bin/env python
"""Speed ratios of a bench_matmul.py grid run, as one figure.

For every shape of the JSON files given (``bench_matmul.py --json``; several files of one dtype,
e.g. the two halves of ``scripts/gpu_check.sh matmulgrid``, are merged), one point per op:
``fastcomm[auto]`` against the op's baseline (cuBLAS for ``matmul``, ``_addmm_activation`` for
``linear`` + GELU, torch's unfused pair for ``train``), shapes ordered by M and grouped by
(N, K), with the targets drawn as lines. One panel per dtype.

    python benchmarks/tools/matmul_grid_plot.py --out grid.png \
        --dtype bf16 bf16_small.json bf16_mid.json --dtype fp16 fp16_small.json fp16_mid.json

Needs only matplotlib (no torch).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

BASELINE = {"matmul": "cublas", "linear_gelu": "addmm_activation", "train_gelu": "unfused"}
TARGET = {"matmul": 0.95, "linear_gelu": 1.0, "train_gelu": 1.0}
LABEL = {
    "matmul": "matmul / cuBLAS",
    "linear_gelu": "linear + GELU / _addmm_activation",
    "train_gelu": "linear + GELU fwd + bwd / unfused",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument(
        "--dtype",
        nargs="+",
        action="append",
        required=True,
        metavar=("NAME", "JSON"),
        help="a panel: its title, then the JSON files of that dtype",
    )
    p.add_argument("--method", default="fastcomm[auto]", help="the fastcomm method to plot")
    args = p.parse_args(argv)
    for panel in args.dtype:
        if len(panel) < 2:
            p.error("--dtype needs a name and at least one JSON file")
    return args


def ratios(paths: list[str], method: str) -> tuple[dict[str, dict[tuple, float]], str]:
    """op -> {(M, N, K): baseline time / method time}, and the device named in the files."""
    times: dict[tuple, float] = {}
    device = ""
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        device = data.get("meta", {}).get("device", device)
        for r in data["results"]:
            if "ms" in r and r.get("ok", True):
                times[(r["M"], r["N"], r["K"], r["op"], r["method"])] = r["ms"]
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    for (m, n, k, op, meth), ms in times.items():
        base = times.get((m, n, k, op, BASELINE.get(op, "")))
        if meth == method and base:
            out[op][(m, n, k)] = base / ms
    return out, device


def shape_order(shapes: set[tuple]) -> list[tuple]:
    """The (N, K) groups of the grid (squares last), M ascending within each."""
    squares = sorted(s for s in shapes if s[0] == s[1] == s[2] and s[0] >= 1024)
    rest = [s for s in shapes if s not in squares]
    groups = sorted({(n, k) for _, n, k in rest})
    return [s for g in groups for s in sorted(x for x in rest if (x[1], x[2]) == g)] + squares


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(panel[0], *ratios(panel[1:], args.method)) for panel in args.dtype]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.2 * len(panels)), squeeze=False)
    for ax, (name, by_op, device) in zip(axes[:, 0], panels):
        shapes = shape_order({s for per in by_op.values() for s in per})
        xs = {s: i for i, s in enumerate(shapes)}
        for op, per in by_op.items():
            pts = sorted(per.items(), key=lambda kv: xs[kv[0]])
            met = sum(v >= TARGET[op] - 1e-9 for _, v in pts)
            ax.plot(
                [xs[s] for s, _ in pts],
                [v for _, v in pts],
                "o",
                ms=4,
                label=f"{LABEL.get(op, op)} ({met} of {len(pts)} at >= {TARGET[op]:.2f})",
            )
        for t in sorted({TARGET[op] for op in by_op}):
            ax.axhline(t, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(["x".join(map(str, s)) for s in shapes], rotation=90, fontsize=6)
        ax.set_ylabel("speed ratio")
        ax.set_title(f"{name}, {args.method}, {device}")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(axis="y", lw=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
