#!/usr/bin/env python
r"""Collectives inside one node: fastcomm's NVLink kernels beside ProcessGroupNCCL (and, for
all_reduce, torch's symmetric-memory one-shot and two-shot kernels), in CUDA graphs and
eagerly, in one run.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_nvlink.py \
        --json nvlink-ar.json --md nvlink-ar.md --plot nvlink-ar.png
    # all_gather_into_tensor / reduce_scatter_tensor; sizes are bytes per rank:
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_nvlink.py --op all_gather

Backends, one process group each:
- ``nccl``: the default group (ProcessGroupNCCL);
- ``fastcomm``: a fastcomm group (its NVLink kernels up to their limits, NCCL above);
- ``fastcomm-nccl``: a fastcomm group created with FASTCOMM_NVLINK=0;
- ``symm-one-shot`` / ``symm-two-shot``: ``torch.ops.symm_mem.one_shot_all_reduce`` /
  ``two_shot_all_reduce_`` on a symmetric-memory tensor of the NCCL group (all_reduce only).

Modes:
- ``graph``: --iters all_reduces of one tensor captured into a CUDA graph; each replay is timed
  with CUDA events, the GPU time per all_reduce is the replay's time / iters; the median over
  --repeats replays, the maximum over ranks;
- ``eager``: --iters synchronous calls in a loop: ``gpu_us`` from events around the loop,
  ``issue_us`` the host time to issue one call; medians over repeats, maxima over ranks.

Every (backend, size) is checked once for the right sum before it is timed; fastcomm's rows
record which path each size took (``one``, ``two``, ``nvlink`` or ``nccl``, from its stats()).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "fastcomm", "fastcomm-nccl", "symm-one-shot", "symm-two-shot")
MODES = ("graph", "eager")
OPS = ("all_reduce", "all_gather", "reduce_scatter")
# fastcomm's stats() keys of its NVLink kernels, by op, and the path each names.
NVLINK_KEYS = {
    "all_reduce": (("nvlink_one_shot", "one"), ("nvlink_two_shot", "two")),
    "all_gather": (("nvlink_all_gather", "nvlink"),),
    "reduce_scatter": (("nvlink_reduce_scatter", "nvlink"),),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def size_text(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}iB"
    return f"{n} B"


def sizes_between(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torchext

        self.torchext = torchext
        self.args = args
        self.local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local)
        self.dev = torch.device("cuda", self.local)
        dist.init_process_group("nccl", device_id=self.dev)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.nccl = dist.group.WORLD
        self.fastcomm = dist.new_group(backend="fastcomm")
        os.environ["FASTCOMM_NVLINK"] = "0"
        try:
            self.fastcomm_nccl = dist.new_group(backend="fastcomm")
        finally:
            del os.environ["FASTCOMM_NVLINK"]
        self.dtype = DTYPES[args.dtype]
        self.symm: dict[int, torch.Tensor] = {}
        self.path: dict[int, str] = {}  # fastcomm's path by element count
        self.inputs: dict[str, torch.Tensor] = {}  # each backend's input of the last op_for
        self.symm_mem: Any = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if hasattr(symm_mem, "enable_symm_mem_for_group"):
                    symm_mem.enable_symm_mem_for_group(self.nccl.group_name)
            self.symm_mem = symm_mem
        except ImportError as e:
            if self.rank == 0:
                print(f"# torch symmetric memory unavailable: {e}")

    # ------------------------------------------------------------------ the calls

    def symm_tensor(self, numel: int) -> torch.Tensor:
        if numel not in self.symm:
            t = self.symm_mem.empty(numel, dtype=self.dtype, device=self.dev)
            self.symm_mem.rendezvous(t, self.nccl.group_name)
            self.symm[numel] = t
        return self.symm[numel]

    def op_for(self, backend: str, numel: int) -> tuple[Callable[[], Any], torch.Tensor]:
        """The call to time and the tensor that holds this rank's result (the all_gather's
        output, the reduce_scatter's output, the all_reduce's tensor or symm_mem's result
        source); `numel` is the elements per rank."""
        if backend.startswith("symm"):
            t = self.symm_tensor(numel)
            name = self.nccl.group_name
            if backend == "symm-one-shot":
                return (lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", name)), t
            return (lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", name)), t
        group = {"nccl": self.nccl, "fastcomm": self.fastcomm, "fastcomm-nccl": self.fastcomm_nccl}
        g = group[backend]
        if self.args.op == "all_gather":
            part = torch.empty(numel, dtype=self.dtype, device=self.dev)
            out = torch.empty(self.world * numel, dtype=self.dtype, device=self.dev)
            self.inputs[backend] = part
            return (lambda: dist.all_gather_into_tensor(out, part, group=g)), out
        if self.args.op == "reduce_scatter":
            full = torch.empty(self.world * numel, dtype=self.dtype, device=self.dev)
            out = torch.empty(numel, dtype=self.dtype, device=self.dev)
            self.inputs[backend] = full
            return (lambda: dist.reduce_scatter_tensor(out, full, group=g)), out
        t = torch.empty(numel, dtype=self.dtype, device=self.dev)
        self.inputs[backend] = t
        return (lambda: dist.all_reduce(t, group=g)), t

    def check(self, backend: str, numel: int) -> str | None:
        """One call on known data: None if the result is right, else what is wrong. Records
        fastcomm's path for the size."""
        fn, result = self.op_for(backend, numel)
        pattern = (torch.arange(numel, device=self.dev) % 13).to(self.dtype)
        ranks = range(self.world)
        if self.args.op == "all_gather":
            self.inputs[backend].copy_(pattern + self.rank)
            want = torch.cat([pattern + r for r in ranks])
        elif self.args.op == "reduce_scatter":
            # Part q of rank r's input: pattern + r + q; this rank's sum over r.
            self.inputs[backend].copy_(torch.cat([pattern + self.rank + q for q in ranks]))
            want = pattern * self.world + sum(ranks) + self.world * self.rank
        else:
            source = result if backend.startswith("symm") else self.inputs[backend]
            source.copy_(pattern + self.rank)
            want = pattern * self.world + sum(ranks)
        before = self.counts() if backend == "fastcomm" else None
        out = fn()
        torch.cuda.synchronize()
        got = out if backend == "symm-one-shot" else result
        if before is not None:
            after = self.counts()
            took = [
                name for (_, name), b, a in zip(NVLINK_KEYS[self.args.op], before, after) if a > b
            ]
            self.path[numel] = took[0] if took else "nccl"
        if not torch.equal(got, want.to(self.dtype)):
            bad = int((got != want.to(self.dtype)).sum())
            return f"{bad} of {got.numel()} elements wrong"
        return None

    def counts(self) -> list[int]:
        s = self.torchext.stats(self.fastcomm)
        return [int(s.get(key, {}).get("count", 0)) for key, _ in NVLINK_KEYS[self.args.op]]

    # ------------------------------------------------------------------ timing

    def slowest(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.nccl)
        return t.tolist()

    def sync_ranks(self) -> None:
        dist.barrier(group=self.nccl)
        torch.cuda.synchronize()

    def time_graph(self, fn: Callable[[], Any]) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(self.args.iters):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.args.repeats):
            self.sync_ranks()
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / self.args.iters)
        del g
        torch.cuda.synchronize()
        return self.slowest([statistics.median(times)])[0]

    def time_eager(self, fn: Callable[[], Any]) -> tuple[float, float]:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu, issue = [], []
        for _ in range(self.args.repeats):
            self.sync_ranks()
            t0 = time.perf_counter()
            start.record()
            for _ in range(self.args.iters):
                fn()
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1000.0 / self.args.iters)
            issue.append((t1 - t0) * 1e6 / self.args.iters)
        g, i = self.slowest([statistics.median(gpu), statistics.median(issue)])
        return g, i

    # ------------------------------------------------------------------ the run

    def run(self) -> list[dict[str, Any]]:
        backends = [b for b in self.args.backends.split(",") if b]
        if self.symm_mem is None or self.args.op != "all_reduce":
            backends = [b for b in backends if not b.startswith("symm")]
        rows = []
        for nbytes in sizes_between(
            parse_size(self.args.min_bytes), parse_size(self.args.max_bytes)
        ):
            numel = nbytes // torch.tensor([], dtype=self.dtype).element_size()
            for backend in backends:
                try:
                    problem = self.check(backend, numel)
                except RuntimeError as e:
                    problem = f"failed: {e}".splitlines()[0]
                row: dict[str, Any] = {"bytes": nbytes, "backend": backend}
                if backend == "fastcomm":
                    row["path"] = self.path.get(numel, "?")
                if problem is not None:
                    if self.rank == 0:
                        print(f"# {backend} {size_text(nbytes)}: {problem}; not timed")
                    rows.append({**row, "mode": "check", "error": problem})
                    continue
                fn, _ = self.op_for(backend, numel)
                for mode in self.args.modes.split(","):
                    if mode == "graph":
                        rows.append({**row, "mode": mode, "gpu_us": self.time_graph(fn)})
                    else:
                        gpu, issue = self.time_eager(fn)
                        rows.append({**row, "mode": mode, "gpu_us": gpu, "issue_us": issue})
                    if self.rank == 0:
                        r = rows[-1]
                        extra = f" issue {r['issue_us']:.2f} us" if "issue_us" in r else ""
                        print(
                            f"{mode:>5} {size_text(nbytes):>8} {backend:>14} "
                            f"{r['gpu_us']:9.2f} us{extra} {row.get('path', '')}",
                            flush=True,
                        )
        return rows

    def meta(self) -> dict[str, Any]:
        limits = None
        low_latency = None
        try:
            import torchext._testing as testing

            if self.args.op == "all_reduce":
                limits = list(testing.nvlink_limits(self.world))
                low_latency = testing.nvlink_low_latency_bytes(self.world)
            else:
                gather, scatter = testing.nvlink_part_limits(self.world)
                limits = [gather if self.args.op == "all_gather" else scatter]
        except (ImportError, AttributeError):
            pass
        return {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "device": torch.cuda.get_device_name(self.dev),
            "world": self.world,
            "op": self.args.op,
            "dtype": self.args.dtype,
            "iters": self.args.iters,
            "repeats": self.args.repeats,
            "nvlink_limits": limits,
            "nvlink_low_latency_bytes": low_latency,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("FASTCOMM_", "NCCL_"))},
        }


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    op = meta.get("op", "all_reduce")
    limit_names = "one-shot, two-shot bytes" if op == "all_reduce" else "bytes per rank"
    sizes = "" if op == "all_reduce" else " (size: bytes per rank)"
    lines = [
        f"# {op} inside one node: {meta['world']}x {meta['device']}, {meta['dtype']}",
        "",
        (
            f"torch {meta['torch']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}; "
            f"{meta['iters']} calls per graph / loop, median of {meta['repeats']}, slowest rank. "
            f"fastcomm's NVLink limits ({limit_names}): {meta['nvlink_limits']}"
            + (
                f", the one-shot's low-latency kernel to {meta['nvlink_low_latency_bytes']} bytes."
                if meta.get("nvlink_low_latency_bytes")
                else "."
            )
        ),
    ]
    for mode in MODES:
        mine = [r for r in rows if r.get("mode") == mode]
        if not mine:
            continue
        what = f"GPU us per {op}{sizes}" + (" (host us to issue one)" if mode == "eager" else "")
        lines += ["", f"## {mode}: {what}", ""]
        lines.append(
            "| size | " + " | ".join(backends) + " | fastcomm path | NCCL / fastcomm | "
            "best symm / fastcomm |"
        )
        lines.append("|---" * (len(backends) + 4) + "|")
        for nbytes in sorted({r["bytes"] for r in mine}):
            at = {r["backend"]: r for r in mine if r["bytes"] == nbytes}
            cells = []
            for b in backends:
                r = at.get(b)
                if r is None:
                    cells.append("-")
                elif "issue_us" in r:
                    cells.append(f"{r['gpu_us']:.1f} ({r['issue_us']:.1f})")
                else:
                    cells.append(f"{r['gpu_us']:.1f}")
            fc = at.get("fastcomm")
            path = fc.get("path", "?") if fc else "-"
            ratio = symm = "-"
            if fc and "nccl" in at:
                ratio = f"{at['nccl']['gpu_us'] / fc['gpu_us']:.2f}x"
            best = [at[b]["gpu_us"] for b in ("symm-one-shot", "symm-two-shot") if b in at]
            if fc and best:
                symm = f"{min(best) / fc['gpu_us']:.2f}x"
            lines.append(
                f"| {size_text(nbytes)} | " + " | ".join(cells) + f" | {path} | {ratio} | {symm} |"
            )
    errors = [r for r in rows if r.get("mode") == "check"]
    if errors:
        lines += ["", "Not timed (wrong result or failure):", ""]
        lines += [f"- {r['backend']} {size_text(r['bytes'])}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def plot(meta: dict[str, Any], rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot")
        return
    modes = [m for m in MODES if any(r.get("mode") == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for b in BACKENDS:
            pts = sorted(
                (r["bytes"], r["gpu_us"])
                for r in rows
                if r.get("mode") == mode and r["backend"] == b
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        op = meta.get("op", "all_reduce")
        ax.set_xlabel("bytes" if op == "all_reduce" else "bytes per rank")
        ax.set_ylabel(f"GPU us per {op}")
        ax.set_title(f"{mode}: {meta['world']}x {meta['device']}, {meta['dtype']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--plot")
    args = p.parse_args()
    bench = Bench(args)
    rows = bench.run()
    if bench.rank == 0:
        meta = bench.meta()
        text = markdown(meta, rows)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"schema": "fastcomm-bench-nvlink-ar/1", "meta": meta, "rows": rows},
                    f,
                    indent=1,
                )
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)
        if args.plot:
            plot(meta, rows, args.plot)
    dist.barrier(group=bench.nccl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
