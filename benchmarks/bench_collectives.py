r"""Collective benchmark: fastcomm side by side with NCCL and Gloo, in the style of nccl-tests.

Run under torchrun; one process group is created per backend, so every backend is measured in
the same run, on the same machine state, size by size:

    torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --device cpu \
        --backends fastcomm,gloo --max-bytes 64M --json cpu.json --plot cpu.png
    torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --device cuda \
        --backends fastcomm,nccl --json gpu.json --plot gpu.png

Timing follows nccl-tests: warm-up, barrier, a host-timed loop of iterations (with
torch.cuda.synchronize() before and after on CUDA), time divided by iterations and the maximum
taken over ranks. algbw = size / time, busbw = algbw * factor (all_reduce 2(n-1)/n; all_gather,
reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1). "size" is the full output of
all_gather, the full input of reduce_scatter and the buffer of the other collectives.

Re-plot saved results without torchrun (several files are merged into one figure):

    python benchmarks/bench_collectives.py --plot-only a.json b.json --plot out.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
SPLIT_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # buffers split into one chunk per rank
REDUCING_OPS = ("all_reduce", "reduce_scatter", "reduce")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every integer in [0, limit] is exactly representable, so integer sums up to it are exact in any
# summation order.
EXACT_INT_LIMIT = {torch.float32: 2**24, torch.bfloat16: 2**8, torch.float16: 2**11}
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # FASTCOMM_WIRE_DTYPE values
PATTERN_MOD = 251  # check data: element i of rank r is (i + 7r) % m + 1 with m <= 251
CHECK_CHUNK = 1 << 24  # elements verified at a time, to bound the memory of the check
ENV_PREFIXES = ("FASTCOMM_", "NCCL_", "TORCH_", "GLOO_", "CUDA_", "OMP_")
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
UNSUPPORTED_RE = re.compile(
    r"not (yet )?(supported|implemented)|does not support|unsupported", re.I
)
SCHEMA = "fastcomm-bench-collectives/1"
BACKEND_COLORS = {"fastcomm": "C0", "gloo": "C1", "nccl": "C2"}  # the same in every plot


# ----------------------------------------------------------------------------- command line


def parse_size(text: str) -> int:
    """Parse a byte count such as 512, 1K, 4M, 1G, 64KiB (K/M/G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512, 1K, 4M, 1G)")
    return int(m.group(1)) * SIZE_UNITS[m.group(2).upper()]


def format_size(nbytes: float) -> str:
    """1024 -> '1K', 1536 -> '1.5K', 1 << 30 -> '1G'."""
    for unit in ("G", "M", "K"):
        if nbytes >= SIZE_UNITS[unit]:
            return f"{nbytes / SIZE_UNITS[unit]:g}{unit}"
    return f"{nbytes:g}"


def _name_list(text: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("empty list")
    return list(dict.fromkeys(names))


def _op_list(text: str) -> list[str]:
    names = _name_list(text)
    if names == ["all"]:
        return list(OPS)
    unknown = [n for n in names if n not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown}; choose from {', '.join(OPS)}")
    return names


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the benchmark (see --help)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backends",
        type=_name_list,
        default="fastcomm,nccl,gloo",
        help="comma-separated backends measured side by side; those not available for the "
        "device are skipped with a note (default: %(default)s)",
    )
    p.add_argument(
        "--ops",
        type=_op_list,
        default=",".join(OPS),
        help="comma-separated collectives, or 'all' (default: %(default)s); all_gather = "
        "all_gather_into_tensor, reduce_scatter = reduce_scatter_tensor, all_to_all = "
        "all_to_all_single; reductions use SUM, broadcast and reduce use root 0",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="tensor device; cuda uses one GPU per local rank (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="element type (default: %(default)s)",
    )
    p.add_argument(
        "--min-bytes",
        type=parse_size,
        default="1K",
        help="smallest size; K/M/G suffixes are powers of 1024 (default: %(default)s)",
    )
    p.add_argument(
        "--max-bytes", type=parse_size, default="1G", help="largest size (default: %(default)s)"
    )
    p.add_argument(
        "--factor", type=int, default=2, help="size multiplier between steps (default: %(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="warm-up iterations per size, fewer for big sizes (default: %(default)s)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=20,
        help="timed iterations per size, fewer for big sizes (default: %(default)s)",
    )
    p.add_argument(
        "--min-iters",
        type=int,
        default=3,
        help="never time fewer iterations (default: %(default)s)",
    )
    p.add_argument(
        "--time-per-size",
        type=float,
        default=1.0,
        help="seconds one timed loop should last at most: iterations are reduced (down to "
        "--min-iters) when the warm-up shows --iters would take longer, so a 1G sweep stays "
        "short (default: %(default)s)",
    )
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each timed loop, refill the inputs with rank-dependent small integers "
        "(exact in the dtype), run once more and count wrong output elements over all ranks "
        "(#wrong); the exit status is 1 when any is wrong or an op failed (an op that a "
        "backend does not support is shown as n/a and does not count)",
    )
    p.add_argument("--json", metavar="PATH", help="write all results and metadata as JSON")
    p.add_argument("--plot", metavar="PATH", help="write busbw vs size as an image (matplotlib)")
    p.add_argument(
        "--md", metavar="PATH", help="write a Markdown report (command, versions, tables)"
    )
    p.add_argument("--label", default="", help="free text stored in the JSON and shown in plots")
    p.add_argument(
        "--plot-only",
        nargs="+",
        metavar="JSON",
        help="do not benchmark: read these result files and write --plot (and --md); no torchrun",
    )
    args = p.parse_args(argv)
    if args.plot_only and not (args.plot or args.md):
        p.error("--plot-only needs --plot PATH and/or --md PATH")
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need 1 <= --min-bytes <= --max-bytes")
    if args.factor < 2:
        p.error("--factor must be >= 2")
    if args.warmup < 1 or args.iters < 1 or args.min_iters < 1 or args.time_per_size <= 0:
        p.error("--warmup, --iters, --min-iters and --time-per-size must be positive")
    return args


# ----------------------------------------------------------------------------- data layout


@dataclass
class Layout:
    """Buffers of one collective at one size, for this rank."""

    count: int  # elements of the nccl-tests "size" buffer
    size_bytes: int
    in_numel: int
    out_numel: int  # 0: in place (the input buffer is the output)
    chunk: int  # elements each rank contributes to a split op


def make_layout(op: str, nbytes: int, elem_size: int, world: int) -> Optional[Layout]:
    """Layout for a nominal size, rounded down to whole chunks; None when too small."""
    count = nbytes // elem_size
    if op in SPLIT_OPS:
        count -= count % world
    chunk = count // world if op in SPLIT_OPS else count
    if chunk < 1:
        return None
    in_numel, out_numel = {
        "all_gather": (chunk, count),
        "reduce_scatter": (count, chunk),
        "all_to_all": (count, count),
    }.get(op, (count, 0))
    return Layout(count, count * elem_size, in_numel, out_numel, chunk)


def pattern_modulus(op: str, dtype: torch.dtype, world: int) -> int:
    """Modulus m of the check pattern, small enough that sums over ranks stay exact.

    With FASTCOMM_WIRE_DTYPE=bf16|fp16, fastcomm sends partial sums in that type between nodes,
    so the sums must be exact in it too (values up to m <= 251 always are).
    """
    limit = EXACT_INT_LIMIT[dtype]
    if op not in REDUCING_OPS:
        return min(PATTERN_MOD, limit)
    wire = WIRE_DTYPES.get(os.environ.get("FASTCOMM_WIRE_DTYPE", "none").lower())
    if wire is not None:
        limit = min(limit, EXACT_INT_LIMIT[wire])
    return max(1, min(PATTERN_MOD, limit // world))


def _value(rank: Any, index: torch.Tensor, m: int) -> torch.Tensor:
    """Check value of element `index` of rank `rank`'s input (int64, 1..m)."""
    return (index + 7 * rank) % m + 1


def fill_pattern(buf: torch.Tensor, rank: int, m: int) -> None:
    """Write the check pattern of `rank` into a flat buffer."""
    for start in range(0, buf.numel(), CHECK_CHUNK):
        stop = min(start + CHECK_CHUNK, buf.numel())
        idx = torch.arange(start, stop, device=buf.device, dtype=torch.int64)
        buf[start:stop].copy_(_value(rank, idx, m))


def expected_output(
    op: str, idx: torch.Tensor, rank: int, world: int, chunk: int, m: int
) -> torch.Tensor:
    """Exact expected values of this rank's output elements `idx` (int64)."""
    if op in ("all_reduce", "reduce"):
        return sum(_value(r, idx, m) for r in range(world))
    if op == "broadcast":
        return _value(0, idx, m)
    if op == "all_gather":
        return _value(idx // chunk, idx % chunk, m)
    if op == "reduce_scatter":
        return sum(_value(r, rank * chunk + idx, m) for r in range(world))
    if op == "all_to_all":
        return _value(idx // chunk, rank * chunk + idx % chunk, m)
    raise ValueError(op)


class Buffers:
    """Input and output tensors of one collective at one size on this rank."""

    def __init__(self, op: str, layout: Layout, dtype: torch.dtype, device: torch.device) -> None:
        self.op = op
        self.layout = layout
        self.inp = torch.empty(layout.in_numel, dtype=dtype, device=device)
        self.out = (
            torch.empty(layout.out_numel, dtype=dtype, device=device)
            if layout.out_numel
            else self.inp
        )

    def fill(self, rank: int, m: int) -> None:
        """Inputs get the pattern (broadcast receivers: zeros); separate outputs are zeroed."""
        if self.op == "broadcast" and rank != 0:
            self.inp.zero_()
        else:
            fill_pattern(self.inp, rank, m)
        if self.out is not self.inp:
            self.out.zero_()

    def count_wrong(self, rank: int, world: int, m: int) -> int:
        """Output elements of this rank that differ from the exact result."""
        if self.op == "reduce" and rank != 0:
            return 0  # only the root receives the result
        wrong = 0
        for start in range(0, self.out.numel(), CHECK_CHUNK):
            stop = min(start + CHECK_CHUNK, self.out.numel())
            idx = torch.arange(start, stop, device=self.out.device, dtype=torch.int64)
            want = expected_output(self.op, idx, rank, world, self.layout.chunk, m)
            wrong += int((self.out[start:stop] != want.to(self.out.dtype)).sum())
        return wrong

    def call(self, group: dist.ProcessGroup) -> Callable[[], None]:
        """The collective on these buffers, as a no-argument callable."""
        inp, out = self.inp, self.out
        return {
            "all_reduce": lambda: dist.all_reduce(inp, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(out, inp, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, inp, group=group),
            "broadcast": lambda: dist.broadcast(inp, src=0, group=group),
            "reduce": lambda: dist.reduce(inp, dst=0, group=group),
            "all_to_all": lambda: dist.all_to_all_single(out, inp, group=group),
        }[self.op]


# ----------------------------------------------------------------------------- measurement


@dataclass
class Row:
    """One measured point: op x backend x size (what rank 0 prints and stores)."""

    op: str
    backend: str
    size_bytes: int
    count: int
    dtype: str
    status: str  # "ok", "unsupported" (the backend lacks the op) or "failed"
    time_us: Optional[float] = None  # slowest rank
    time_us_min: Optional[float] = None  # fastest rank
    algbw_gbps: Optional[float] = None
    busbw_gbps: Optional[float] = None
    wrong: Optional[int] = None  # None: not checked
    warmup: int = 0
    iters: int = 0
    error: Optional[str] = None


class Bench:
    """Holds the groups and runs the sweep; every rank executes the same calls in order."""

    def __init__(self, args: argparse.Namespace, backends: list[str], device: torch.device) -> None:
        self.args = args
        self.backends = backends
        self.device = device
        self.dtype = DTYPES[args.dtype]
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # The default group uses the first backend; the others get their own group each.
        self.groups = {backends[0]: dist.group.WORLD}
        for name in backends[1:]:
            self.groups[name] = dist.new_group(backend=name)
        # Barriers and the max/sum over ranks of results go over a separate Gloo group, so the
        # measured groups only ever run the measured collectives.
        self.ctrl = dist.new_group(backend="gloo")
        self.last_time: dict[tuple[str, str], tuple[int, float]] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reduce_ctrl(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.ctrl)
        return t.tolist()

    def timed(self, fn: Callable[[], None], n: int) -> float:
        """Seconds per iteration of `n` calls on this rank, started after a barrier."""
        self.sync()
        dist.barrier(group=self.ctrl)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - start) / n

    def plan_warmup(self, op: str, backend: str, size: int) -> int:
        """Warm-up iterations: all of --warmup unless the last size predicts > half the budget."""
        if (op, backend) not in self.last_time:
            return self.args.warmup
        prev_size, prev_time = self.last_time[(op, backend)]
        est = prev_time * size / prev_size
        return max(1, min(self.args.warmup, int(self.args.time_per_size / 2 / est)))

    def plan_iters(self, est: float) -> int:
        a = self.args
        return max(min(a.min_iters, a.iters), min(a.iters, int(a.time_per_size / max(est, 1e-9))))

    def measure(self, bufs: Buffers, backend: str, m: int) -> Row:
        """Warm up, time and check one collective on one backend; same result on all ranks."""
        lay, op = bufs.layout, bufs.op
        row = Row(op, backend, lay.size_bytes, lay.count, self.args.dtype, "ok")
        fn = bufs.call(self.groups[backend])
        bufs.fill(self.rank, m)
        row.warmup = self.plan_warmup(op, backend, lay.size_bytes)
        # The first warm-up call also finds out whether the backend has the op. A backend that
        # lacks it raises on every rank before communicating, so all ranks agree below.
        try:
            first = self.timed(fn, 1)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            first, error = 0.0, f"{type(exc).__name__}: {exc}".strip()
        if self.reduce_ctrl([float(error is not None)], dist.ReduceOp.MAX)[0]:
            row.status = "failed"
            if error is not None:
                unsupported = UNSUPPORTED_RE.search(error) or error.startswith("NotImplemented")
                row.status, row.error = ("unsupported" if unsupported else "failed"), error
            return row
        local = self.timed(fn, row.warmup - 1) if row.warmup > 1 else first
        est = self.reduce_ctrl([local], dist.ReduceOp.MAX)[0]
        row.iters = self.plan_iters(est)
        local = self.timed(fn, row.iters)
        slowest, neg_fastest = self.reduce_ctrl([local, -local], dist.ReduceOp.MAX)
        self.last_time[(op, backend)] = (lay.size_bytes, slowest)
        row.time_us, row.time_us_min = slowest * 1e6, -neg_fastest * 1e6
        row.algbw_gbps = lay.size_bytes / slowest / 1e9
        row.busbw_gbps = row.algbw_gbps * BUSBW_FACTOR[op](self.world)
        if self.args.check:
            bufs.fill(self.rank, m)
            fn()
            self.sync()
            wrong = bufs.count_wrong(self.rank, self.world, m)
            row.wrong = int(self.reduce_ctrl([float(wrong)], dist.ReduceOp.SUM)[0])
        return row

    def sizes(self) -> list[int]:
        out, s = [], self.args.min_bytes
        while s <= self.args.max_bytes:
            out.append(s)
            s *= self.args.factor
        return out

    def run_op(self, op: str) -> list[Row]:
        """Sweep the sizes of one op; rank 0 prints the table as it goes."""
        table = TextTable(op, self.backends, self.args.dtype, self.world, self.device.type)
        self.print(table.header())
        rows: list[Row] = []
        m = pattern_modulus(op, self.dtype, self.world)
        elem = torch.empty((), dtype=self.dtype).element_size()
        seen: set[int] = set()
        for nominal in self.sizes():
            lay = make_layout(op, nominal, elem, self.world)
            if lay is None or lay.size_bytes in seen:
                continue
            seen.add(lay.size_bytes)
            bufs = Buffers(op, lay, self.dtype, self.device)
            point = [self.measure(bufs, b, m) for b in self.backends]
            del bufs
            self.print(table.line(point))
            rows += point
        self.print(table.footer(rows))
        return rows

    def print(self, text: str) -> None:
        if self.rank == 0 and text:
            print(text, flush=True)


# ----------------------------------------------------------------------------- tables


def _cells(row: Optional[Row]) -> tuple[str, str, str, str]:
    """time (us), algbw, busbw, #wrong of one backend at one size, as text."""
    if row is None:
        return "", "", "", ""
    if row.status != "ok":
        return "n/a" if row.status == "unsupported" else "failed", "", "", ""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return f"{row.time_us:.2f}", f"{row.algbw_gbps:.2f}", f"{row.busbw_gbps:.2f}", wrong


def _ratio(rows: dict[str, Row], other: str) -> str:
    a, b = rows.get("fastcomm"), rows.get(other)
    if a is None or b is None or a.status != "ok" or b.status != "ok" or not b.busbw_gbps:
        return "-"
    return f"{a.busbw_gbps / b.busbw_gbps:.2f}"


def _ratio_backends(backends: Sequence[str]) -> list[str]:
    return [b for b in backends if b != "fastcomm"] if "fastcomm" in backends else []


def _op_title(op: str, dtype: str, world: int, device: str) -> str:
    how = {
        "all_reduce": "sum, in place",
        "reduce": "sum, root 0, in place",
        "broadcast": "root 0, in place",
        "reduce_scatter": "sum",
    }.get(op, "")
    factor = {"all_reduce": "2(n-1)/n", "broadcast": "1", "reduce": "1"}.get(op, "(n-1)/n")
    return (
        f"{op}: {dtype}{', ' + how if how else ''}; {world} ranks on {device}; "
        f"busbw = algbw * {factor}"
    )


def _avg_busbw(rows: Sequence[Row], backends: Sequence[str]) -> str:
    parts = []
    for b in backends:
        vals = [r.busbw_gbps for r in rows if r.backend == b and r.status == "ok"]
        if vals:
            parts.append(f"{b} {sum(vals) / len(vals):.2f}")
    return ", ".join(parts)


class TextTable:
    """nccl-tests style table, one line per size, backends side by side."""

    WIDTHS = (11, 8, 8, 7)  # time, algbw, busbw, #wrong

    def __init__(
        self, op: str, backends: Sequence[str], dtype: str, world: int, device: str
    ) -> None:
        self.op, self.backends = op, list(backends)
        self.title = _op_title(op, dtype, world, device)
        self.ratios = _ratio_backends(backends)
        self.rw = max([len(f"fastcomm/{b}") + 2 for b in self.ratios] + [0])

    def header(self) -> str:
        block = sum(self.WIDTHS)
        l1 = " " * 24 + "".join(f" {b} ".center(block - 1, "-") + " " for b in self.backends)
        l1 += "".join(f"{'busbw ratio':>{self.rw}}" for _ in self.ratios)
        l2 = f"{'size':>12}{'count':>12}"
        l3 = f"{'(B)':>12}{'(elements)':>12}"
        for _ in self.backends:
            l2 += "".join(
                f"{h:>{w}}" for h, w in zip(("time", "algbw", "busbw", "#wrong"), self.WIDTHS)
            )
            l3 += "".join(
                f"{h:>{w}}" for h, w in zip(("(us)", "(GB/s)", "(GB/s)", ""), self.WIDTHS)
            )
        l2 += "".join(f"{'fastcomm/' + b:>{self.rw}}" for b in self.ratios)
        lines = ("", "  " + self.title, l1, l2, l3)
        return "\n".join(("#" + line[1:]).rstrip() for line in lines)

    def line(self, point: Sequence[Row]) -> str:
        rows = {r.backend: r for r in point}
        text = f"{point[0].size_bytes:>12}{point[0].count:>12}"
        for b in self.backends:
            text += "".join(f"{c:>{w}}" for c, w in zip(_cells(rows.get(b)), self.WIDTHS))
        return text + "".join(f"{_ratio(rows, b):>{self.rw}}" for b in self.ratios)

    def footer(self, rows: Sequence[Row]) -> str:
        lines = [f"# avg busbw (GB/s): {_avg_busbw(rows, self.backends) or 'none'}"]
        notes = {(r.backend, r.status, r.error) for r in rows if r.status != "ok"}
        for backend, status, error in sorted(notes, key=str):
            lines.append(f"# {backend}: {self.op} {status}: {error or 'on another rank'}")
        return "\n".join(lines)


def render_markdown(data: dict[str, Any]) -> str:
    """A Markdown report of one result file: how it was made, then one table per op."""
    meta, rows = data["meta"], [Row(**r) for r in data["results"]]
    backends = meta["backends"]
    out = [
        f"# Collectives: {meta['label'] or meta['device']['name']}",
        "",
        f"- Date: {meta['timestamp']}; host {meta['hostname']} "
        f"({len(meta['hosts'])} host(s): {', '.join(meta['hosts'])})",
        f"- Launcher: `{meta['launcher_cmdline'] or 'unknown'}`",
        f"- Command: `{shlex.join(meta['argv'])}`",
        f"- World: {meta['world_size']} ranks ({meta['local_world_size']} per host); device "
        f"{meta['device']['type']}: {meta['device']['name']}",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}",
        f"- Environment: {', '.join(f'`{k}={v}`' for k, v in meta['env'].items()) or 'none set'}",
        f"- Skipped backends: "
        f"{', '.join(f'{k} ({v})' for k, v in meta['skipped'].items()) or 'none'}",
        f"- Timing: {meta['timing']}",
    ]
    ratios = _ratio_backends(backends)
    for op in dict.fromkeys(r.op for r in rows):
        op_rows = [r for r in rows if r.op == op]
        title = _op_title(op, meta["dtype"], meta["world_size"], meta["device"]["type"])
        head = ["size (B)", "count"]
        for b in backends:
            head += [f"{b} time (us)", f"{b} algbw (GB/s)", f"{b} busbw (GB/s)", f"{b} #wrong"]
        head += [f"fastcomm/{b} busbw" for b in ratios]
        out += ["", f"## {title}", "", "| " + " | ".join(head) + " |"]
        out.append("|" + "---:|" * len(head))
        for size in dict.fromkeys(r.size_bytes for r in op_rows):
            point = {r.backend: r for r in op_rows if r.size_bytes == size}
            first = next(iter(point.values()))
            cells = [str(size), str(first.count)]
            for b in backends:
                cells += list(_cells(point.get(b)))
            cells += [_ratio(point, b) for b in ratios]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", f"Average busbw (GB/s): {_avg_busbw(op_rows, backends) or 'none'}"]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- plotting


def plot_results(datasets: Sequence[dict[str, Any]], path: str) -> bool:
    """busbw vs size, one panel per op, one line per backend (and per file when merging).

    Returns False (with a warning) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print(
            f"warning: matplotlib is not installed (pip install matplotlib), skipping {path}",
            file=sys.stderr,
        )
        return False
    ops = list(dict.fromkeys(r["op"] for d in datasets for r in d["results"]))
    named = dict.fromkeys(b for d in datasets for b in d["meta"]["backends"])
    extra = [b for b in named if b not in BACKEND_COLORS]
    colors = BACKEND_COLORS | {b: f"C{i + len(BACKEND_COLORS)}" for i, b in enumerate(extra)}
    styles = ("-", "--", ":", "-.")
    ncols = min(3, max(1, len(ops)))
    nrows = max(1, math.ceil(len(ops) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.4 * ncols, 3.9 * nrows), squeeze=False)
    for ax in axes.flat[len(ops) :]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        for k, data in enumerate(datasets):
            meta = data["meta"]
            prefix = f"{meta['label'] or meta['source']}: " if len(datasets) > 1 else ""
            for b in meta["backends"]:
                pts = [
                    r
                    for r in data["results"]
                    if r["op"] == op and r["backend"] == b and r["status"] == "ok"
                ]
                if not pts:
                    continue
                xs = [r["size_bytes"] for r in pts]
                ax.plot(
                    xs,
                    [r["busbw_gbps"] for r in pts],
                    styles[k % len(styles)],
                    color=colors[b],
                    marker="o",
                    markersize=3,
                    label=f"{prefix}{b}",
                )
                bad = [r for r in pts if r["wrong"]]
                if bad:
                    ax.plot(
                        [r["size_bytes"] for r in bad],
                        [r["busbw_gbps"] for r in bad],
                        "x",
                        color="red",
                        markersize=8,
                        label=f"{prefix}{b}: #wrong > 0",
                    )
        ax.set_xscale("log", base=2)
        lo, hi = ax.get_xlim()
        e0, e1 = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
        step = max(1, math.ceil((e1 - e0 + 1) / 8))
        ax.set_xticks([2.0**e for e in range(e0, e1 + 1, step)])
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(x)))
        ax.set_xlim(lo, hi)
        ax.set_ylim(bottom=0)
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    titles = dict.fromkeys(
        f"{d['meta']['world_size']} ranks, {d['meta']['device']['name']}, {d['meta']['dtype']}"
        + (f" ({d['meta']['label']})" if d["meta"]["label"] else "")
        for d in datasets
    )
    fig.suptitle("; ".join(titles), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Read result JSON files written by --json, remembering each file name as its source."""
    datasets = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("schema") != SCHEMA:
            raise SystemExit(f"{path}: not a bench_collectives result (schema {SCHEMA})")
        data["meta"]["source"] = os.path.splitext(os.path.basename(path))[0]
        datasets.append(data)
    return datasets


# ----------------------------------------------------------------------------- metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _launcher_cmdline() -> Optional[str]:
    """Command line of the parent process (torchrun) on Linux."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
        return shlex.join(p.decode(errors="replace") for p in parts if p)
    except OSError:
        return None


def _git_state() -> Optional[dict[str, Any]]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {
        "commit": commit.stdout.strip() if commit.returncode == 0 else None,
        "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
    }


def _local_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_model()} ({os.cpu_count()} cores, {len(os.sched_getaffinity(0))} usable)"
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    return {"hostname": socket.gethostname(), "device_name": name, "env": env}


def collect_metadata(
    bench: Bench, torchext: Any, skipped: dict[str, str], device: torch.device
) -> dict[str, Any]:
    """Everything needed to reproduce and cite a run (collective: call on every rank)."""
    infos: list[Any] = [None] * bench.world
    dist.all_gather_object(infos, _local_info(device), group=bench.ctrl)
    env0 = infos[0]["env"]
    env_diff = {
        str(r): {k: v for k, v in info["env"].items() if env0.get(k) != v}
        | {k: None for k in env0 if k not in info["env"]}
        for r, info in enumerate(infos)
    }
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "nccl": None,
        "torchext": getattr(torchext, "__version__", None),
        "torchext_nccl": None,
    }
    if device.type == "cuda":
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        if torchext is not None and torchext.nccl_version() is not None:
            versions["torchext_nccl"] = ".".join(map(str, torchext.nccl_version()))
    a = bench.args
    return {
        "label": a.label,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "launcher_cmdline": _launcher_cmdline(),
        "args": {k: v for k, v in vars(a).items() if k != "plot_only"},
        "world_size": bench.world,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", bench.world)),
        "hostname": infos[0]["hostname"],
        "hosts": list(dict.fromkeys(i["hostname"] for i in infos)),
        "device": {
            "type": device.type,
            "name": " / ".join(dict.fromkeys(i["device_name"] for i in infos)),
        },
        "dtype": a.dtype,
        "backends": bench.backends,
        "skipped": skipped,
        "versions": versions,
        "git": _git_state(),
        "env": env0,
        "env_differs_by_rank": {r: d for r, d in env_diff.items() if d},
        "timing": (
            f"host time after warm-up (up to {a.warmup} iterations) and a barrier, "
            f"{'torch.cuda.synchronize() before and after, ' if device.type == 'cuda' else ''}"
            f"divided by iterations (up to {a.iters}, fewer for big sizes: about "
            f"{a.time_per_size:g} s per point, at least {a.min_iters}), max over ranks"
        ),
    }


# ----------------------------------------------------------------------------- main


def select_backends(wanted: Sequence[str], device: str) -> tuple[list[str], dict[str, str], Any]:
    """Available backends in the order asked, the skipped ones with the reason, and torchext."""
    torchext, why_not = None, None
    try:
        import torchext  # registers the "fastcomm" backend
    except Exception as exc:  # noqa: BLE001 - a broken build is reported, not fatal
        why_not = f"import torchext failed: {type(exc).__name__}: {exc}"
    available, skipped = [], {}
    for name in wanted:
        if name == "fastcomm":
            reason = why_not
            if torchext is not None and device == "cuda" and not torchext.has_cuda():
                reason = "torchext was built without CUDA"
        elif name == "nccl":
            reason = None if dist.is_nccl_available() else "torch has no NCCL"
            if device != "cuda":
                reason = "NCCL needs --device cuda"
        elif name == "gloo":
            reason = None if dist.is_gloo_available() else "torch has no Gloo"
        else:
            known = name.upper() in dist.Backend._plugins or name in dist.Backend.backend_list
            reason = None if known else "not a registered torch.distributed backend"
        if reason:
            skipped[name] = reason
        else:
            available.append(name)
    return available, skipped, torchext


def _make_folders(args: argparse.Namespace) -> None:
    for path in (args.json, args.md, args.plot):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def write_outputs(data: dict[str, Any], args: argparse.Namespace) -> None:
    """Write --json, --md and --plot for one run."""
    _make_folders(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(f"# wrote {args.json}", flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(render_markdown(data))
        print(f"# wrote {args.md}", flush=True)
    if args.plot:
        data["meta"].setdefault("source", args.label or "run")
        if plot_results([data], args.plot):
            print(f"# wrote {args.plot}", flush=True)


def run(args: argparse.Namespace) -> int:
    """Benchmark under torchrun; returns the exit status (1: wrong data or a failed op)."""
    if "RANK" not in os.environ:
        print(
            "run under torchrun, e.g. torchrun --nproc_per_node=4 " + sys.argv[0], file=sys.stderr
        )
        return 2
    backends, skipped, torchext = select_backends(args.backends, args.device)
    rank = int(os.environ["RANK"])
    if "fastcomm" in skipped:
        # Asked for and unusable: a broken build must not pass as a peer-only run.
        if rank == 0:
            print(f"fastcomm unavailable: {skipped['fastcomm']}", file=sys.stderr)
        return 1
    if not backends:
        if rank == 0:
            print(f"no backend available: {skipped}", file=sys.stderr)
        return 2
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # No device_id: with a bound default group, torch 2.11's new_group(backend="nccl")
    # hands the default group's backend to NCCL as split_from and fails when that
    # backend is not NCCL. Communicators are created during warm-up instead.
    dist.init_process_group(backend=backends[0])
    bench = Bench(args, backends, device)
    meta = collect_metadata(bench, torchext, skipped, device)
    if rank == 0:
        print(f"# bench_collectives {meta['timestamp']} {meta['label']}")
        print(
            f"# {meta['world_size']} ranks on {', '.join(meta['hosts'])}; {meta['device']['name']}"
        )
        print("# " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))
        print(f"# backends: {', '.join(backends)}")
        for name, reason in skipped.items():
            print(f"# skipped {name}: {reason}")
        print(f"# timing: {meta['timing']}")
        print("# env: " + (" ".join(f"{k}={v}" for k, v in meta["env"].items()) or "-"), flush=True)
    rows: list[Row] = []
    for op in args.ops:
        rows += bench.run_op(op)
    wrong = sum(r.wrong or 0 for r in rows)
    failed = sum(r.status == "failed" for r in rows)
    if rank == 0:
        verdict = "N/A (--no-check)" if not args.check else ("OK" if wrong == 0 else "FAILED")
        print(f"# total #wrong: {wrong} {verdict}; failed points: {failed}", flush=True)
        write_outputs({"schema": SCHEMA, "meta": meta, "results": [asdict(r) for r in rows]}, args)
    dist.barrier(group=bench.ctrl)
    dist.destroy_process_group()
    return 1 if wrong or failed else 0


def plot_only(args: argparse.Namespace) -> int:
    """Re-plot (and re-render) saved result files."""
    datasets = load_results(args.plot_only)
    _make_folders(args)
    status = 0
    if args.plot:
        if plot_results(datasets, args.plot):
            print(f"wrote {args.plot}")
        else:
            status = 1
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(render_markdown(d) for d in datasets))
        print(f"wrote {args.md}")
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: benchmark under torchrun, or --plot-only."""
    args = parse_args(argv)
    return plot_only(args) if args.plot_only else run(args)


if __name__ == "__main__":
    sys.exit(main())
