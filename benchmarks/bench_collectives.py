r"""Collective benchmark: fastcomm side by side with NCCL and Gloo, in the style of nccl-tests.

Run under torchrun; one process group is created per backend, so every backend is measured in
the same run, on the same machine state, size by size:

    torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --device cpu \
        --backends fastcomm,gloo --max-bytes 64M --json cpu.json --plot cpu.png
    torchrun --nproc_per_node=4 benchmarks/bench_collectives.py --device cuda \
        --backends fastcomm,nccl --json gpu.json --plot gpu.png

Timing follows nccl-tests: warm-up, barrier, a host-timed loop of iterations (with
torch.cuda.synchronize() before and after on CUDA), time divided by iterations and the maximum
taken over ranks. Each size is timed in --repeats loops per backend, the backends interleaved
(A B A B ...); the reported time is the median over repeats of the slowest rank's time.
algbw = size / time, busbw = algbw * factor (all_reduce 2(n-1)/n; all_gather,
reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1). "size" is the full output of
all_gather, the full input of reduce_scatter and the buffer of the other collectives.

--sim-nodes N makes one machine act as N nodes (FASTCOMM_HOST_ID / NCCL_HOSTID per block of
ranks, NCCL over sockets on loopback); benchmarks/run_multinode_sweep.py sweeps NCCL's socket
settings over several launches and merges the results.

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
import statistics
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
# Block-scaled wires: the largest error of one coding, relative to the largest magnitude of its
# block (int8: half a step of a power-of-two scale that puts that magnitude in (63.5, 127]).
BLOCK_SCALED_WIRES = {"int8": 1 / 127}
PATTERN_MOD = 251  # check data: element i of rank r is (i + 7r) % m + 1 with m <= 251
CHECK_CHUNK = 1 << 24  # elements verified at a time, to bound the memory of the check
ENV_PREFIXES = ("FASTCOMM_", "NCCL_", "NVSHMEM_", "TORCH_", "GLOO_", "CUDA_", "OMP_")
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
UNSUPPORTED_RE = re.compile(
    r"not (yet )?(supported|implemented)|does not support|unsupported", re.I
)
# Additions since the first files (repeats, spread, settings, sim-nodes) are new keys only, so
# the schema name is unchanged and old files still load (missing keys take the Row defaults).
SCHEMA = "fastcomm-bench-collectives/1"
BACKEND_COLORS = {"fastcomm": "C0", "gloo": "C1", "nccl": "C2"}  # the same in every plot
# Summary line: the smallest busbw ratio over the bandwidth range, the largest time difference
# (fastcomm minus peer) in the latency range.
BW_RANGE = (1 << 20, 1 << 30)
LATENCY_BELOW = 1 << 20
# --sim-nodes: NCCL over TCP on loopback, each set only when the user has not set it.
SIM_NCCL_NET_ENV = {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


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
        default=20,
        help="warm-up iterations per size and backend, fewer for big sizes (default: %(default)s)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=200,
        help="timed iterations of one timed loop (one repeat), fewer for big sizes "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--min-iters",
        type=int,
        default=3,
        help="never time fewer iterations in a loop (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed loops per size and backend, backends interleaved (A B A B ...); the time "
        "is the median over repeats of the slowest rank (default: %(default)s)",
    )
    p.add_argument(
        "--time-per-size",
        type=float,
        default=1.0,
        help="seconds all backends together should spend on one size: each backend gets an "
        "equal share, split into one slice for the warm-up and one per repeat; iterations are "
        "reduced (down to --min-iters) to fit a slice (default: %(default)s)",
    )
    p.add_argument(
        "--sim-nodes",
        type=int,
        default=1,
        help="act as this many nodes: blocks of LOCAL_WORLD_SIZE/N consecutive local ranks get "
        "FASTCOMM_HOST_ID=NCCL_HOSTID=simnode<k>, and NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo "
        "NCCL_IB_DISABLE=1 unless set already (default: %(default)s: leave all as they are)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=("none", *WIRE_DTYPES, *BLOCK_SCALED_WIRES),
        default=None,
        help="set FASTCOMM_WIRE_DTYPE (inter-node compression); when not none the fastcomm "
        "series is labelled e.g. fastcomm(bf16) and checked with a relative tolerance "
        "(default: FASTCOMM_WIRE_DTYPE as in the environment, else none)",
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
    if min(args.warmup, args.iters, args.min_iters, args.repeats) < 1 or args.time_per_size <= 0:
        p.error("--warmup, --iters, --min-iters, --repeats and --time-per-size must be positive")
    if args.sim_nodes < 1:
        p.error("--sim-nodes must be >= 1")
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
    """Modulus m of the check pattern, small enough that sums over ranks stay exact in dtype.

    A compressed wire type (FASTCOMM_WIRE_DTYPE=bf16|fp16) is deliberately not taken into
    account: its partial sums get rounded, and the check of that series uses wire_rtol instead.
    """
    limit = EXACT_INT_LIMIT[dtype]
    if op not in REDUCING_OPS:
        return min(PATTERN_MOD, limit)
    return max(1, min(PATTERN_MOD, limit // world))


def wire_rtol(wire: str, world: int) -> float:
    """Relative tolerance of the check when fastcomm sends data as `wire` (0: exact).

    Every value is positive, so each rounding of a partial sum to the wire type is off by at
    most half an ulp of the total; a sum passes at most `world` such roundings (one per hop and
    the final copy), hence world * eps (eps = 2 * unit roundoff) bounds the error with margin.
    """
    if wire not in WIRE_DTYPES:
        return 0.0
    return world * torch.finfo(WIRE_DTYPES[wire]).eps


def wire_max_rtol(wire: str, world: int) -> float:
    """Tolerance of the check relative to the largest possible sum (world * m) when fastcomm
    sends data in a block-scaled wire: a block's error scales with its largest value, not with
    each value (at most `world` codings, as in wire_rtol)."""
    return world * BLOCK_SCALED_WIRES.get(wire, 0.0)


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

    def count_wrong(
        self, rank: int, world: int, m: int, rtol: float = 0.0, max_rtol: float = 0.0
    ) -> int:
        """Output elements of this rank that differ from the exact result (by more than rtol of
        it plus max_rtol of the largest possible sum, world * m)."""
        if self.op == "reduce" and rank != 0:
            return 0  # only the root receives the result
        wrong = 0
        for start in range(0, self.out.numel(), CHECK_CHUNK):
            stop = min(start + CHECK_CHUNK, self.out.numel())
            idx = torch.arange(start, stop, device=self.out.device, dtype=torch.int64)
            want = expected_output(self.op, idx, rank, world, self.layout.chunk, m)
            got = self.out[start:stop]
            if rtol or max_rtol:
                want64 = want.to(torch.float64)
                bound = rtol * want64 + max_rtol * world * m
                ok = (got.to(torch.float64) - want64).abs() <= bound  # NaN: not ok
                wrong += int((~ok).sum())
            else:
                wrong += int((got != want.to(got.dtype)).sum())
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
    """One measured point: op x series x size (what rank 0 prints and stores)."""

    op: str
    backend: str  # the series: the backend name, or e.g. "fastcomm(bf16)", "nccl(best)"
    size_bytes: int
    count: int
    dtype: str
    status: str  # "ok", "unsupported" (the backend lacks the op) or "failed"
    time_us: Optional[float] = None  # slowest rank; median over repeats
    time_us_min: Optional[float] = None  # fastest rank; median over repeats
    algbw_gbps: Optional[float] = None  # from time_us
    busbw_gbps: Optional[float] = None  # from time_us
    wrong: Optional[int] = None  # None: not checked
    warmup: int = 0
    iters: int = 0  # per repeat
    error: Optional[str] = None
    # Added with --repeats (files written before have one loop: repeats 1, the rest None).
    repeats: int = 1
    time_us_repeats: Optional[list[float]] = None  # slowest rank of each repeat, in run order
    time_us_repeat_min: Optional[float] = None  # fastest repeat (slowest rank)
    time_us_repeat_max: Optional[float] = None  # slowest repeat (slowest rank)
    setting: Optional[str] = None  # merged sweeps: the peer setting this point comes from
    # merged sweeps with --rounds: busbw of this point in each round (launch), in run order
    rounds_busbw_gbps: Optional[list[Optional[float]]] = None


def spread_pct(row: Row) -> Optional[float]:
    """Half the range of the repeats relative to the median, in percent (the table's ±%)."""
    lo, hi, mid = row.time_us_repeat_min, row.time_us_repeat_max, row.time_us
    if lo is None or hi is None or not mid:
        return None
    return (hi - lo) / 2 / mid * 100


class Bench:
    """Holds the groups and runs the sweep; every rank executes the same calls in order."""

    def __init__(
        self,
        args: argparse.Namespace,
        backends: list[str],
        device: torch.device,
        series: dict[str, str],
        rtol: dict[str, float],
        max_rtol: Optional[dict[str, float]] = None,
    ) -> None:
        self.args = args
        self.backends = backends
        self.series = series  # backend -> label of its rows
        self.rtol = rtol  # backend -> relative tolerance of the check (0: exact)
        self.max_rtol = max_rtol or {}  # backend -> tolerance relative to the largest sum
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
        # Seconds of one slice: each backend gets an equal share of --time-per-size, split into
        # one slice for the warm-up and one per timed repeat.
        self.slice = args.time_per_size / len(backends) / (args.repeats + 1)

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
        """Warm-up iterations: all of --warmup unless the last size predicts more than a slice."""
        if (op, backend) not in self.last_time:
            return self.args.warmup
        prev_size, prev_time = self.last_time[(op, backend)]
        est = prev_time * size / prev_size
        return max(1, min(self.args.warmup, int(self.slice / est)))

    def plan_iters(self, est: float) -> int:
        a = self.args
        return max(min(a.min_iters, a.iters), min(a.iters, int(self.slice / max(est, 1e-9))))

    def prepare(self, bufs: Buffers, backend: str, m: int) -> tuple[Row, Optional[Callable]]:
        """First call (does the backend have the op?), warm-up and the iteration count.

        Returns the row and the call to time, None when the op failed (on any rank).
        """
        lay, op = bufs.layout, bufs.op
        row = Row(op, self.series[backend], lay.size_bytes, lay.count, self.args.dtype, "ok")
        row.repeats = 0
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
            return row, None
        local = self.timed(fn, row.warmup - 1) if row.warmup > 1 else first
        est = self.reduce_ctrl([local], dist.ReduceOp.MAX)[0]
        row.iters = self.plan_iters(est)
        return row, fn

    def measure_point(self, bufs: Buffers, m: int) -> list[Row]:
        """All backends at one size: warm-up each, then --repeats rounds of one timed loop per
        backend (interleaved), then the check; the same result on all ranks."""
        lay, op = bufs.layout, bufs.op
        prepared = [(b, *self.prepare(bufs, b, m)) for b in self.backends]
        timed = [(b, row, fn) for b, row, fn in prepared if fn is not None]
        local: dict[str, list[float]] = {b: [] for b, _, _ in timed}
        for _ in range(self.args.repeats):
            for b, row, fn in timed:
                local[b].append(self.timed(fn, row.iters))
        # One reduction for all loops: the slowest and the fastest rank of each.
        flat = [t for b, _, _ in timed for t in local[b]]
        red = self.reduce_ctrl(flat + [-t for t in flat], dist.ReduceOp.MAX) if flat else []
        slowest, fastest = red[: len(flat)], [-t for t in red[len(flat) :]]
        for k, (b, row, fn) in enumerate(timed):
            per_rep = slice(k * self.args.repeats, (k + 1) * self.args.repeats)
            reps, fast = slowest[per_rep], fastest[per_rep]
            mid = statistics.median(reps)
            self.last_time[(op, b)] = (lay.size_bytes, mid)
            row.repeats = len(reps)
            row.time_us_repeats = [t * 1e6 for t in reps]
            row.time_us, row.time_us_min = mid * 1e6, statistics.median(fast) * 1e6
            row.time_us_repeat_min, row.time_us_repeat_max = min(reps) * 1e6, max(reps) * 1e6
            row.algbw_gbps = lay.size_bytes / mid / 1e9
            row.busbw_gbps = row.algbw_gbps * BUSBW_FACTOR[op](self.world)
            if self.args.check:
                bufs.fill(self.rank, m)
                fn()
                self.sync()
                wrong = bufs.count_wrong(
                    self.rank, self.world, m, self.rtol.get(b, 0.0), self.max_rtol.get(b, 0.0)
                )
                row.wrong = int(self.reduce_ctrl([float(wrong)], dist.ReduceOp.SUM)[0])
        return [row for _, row, _ in prepared]

    def sizes(self) -> list[int]:
        out, s = [], self.args.min_bytes
        while s <= self.args.max_bytes:
            out.append(s)
            s *= self.args.factor
        return out

    def run_op(self, op: str, on_point: Optional[Callable[[list[Row]], None]] = None) -> list[Row]:
        """Sweep the sizes of one op; rank 0 prints the table as it goes, and `on_point` gets
        each size's rows once they are measured."""
        labels = [self.series[b] for b in self.backends]
        table = TextTable(op, labels, self.args.dtype, self.world, self.device.type)
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
            point = self.measure_point(bufs, m)
            del bufs
            self.print(table.line(point))
            rows += point
            if on_point is not None:
                on_point(point)
        self.print(table.footer(rows))
        return rows

    def print(self, text: str) -> None:
        if self.rank == 0 and text:
            print(text, flush=True)


# ----------------------------------------------------------------------------- tables


def _cells(row: Optional[Row]) -> tuple[str, str, str, str, str]:
    """time (us), ±%, algbw, busbw, #wrong of one series at one size, as text."""
    if row is None:
        return "", "", "", "", ""
    if row.status != "ok":
        return "n/a" if row.status == "unsupported" else "failed", "", "", "", ""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    spread = spread_pct(row)
    return (
        f"{row.time_us:.2f}",
        "-" if spread is None else f"{spread:.1f}",
        f"{row.algbw_gbps:.2f}",
        f"{row.busbw_gbps:.2f}",
        wrong,
    )


def _ok(row: Optional[Row]) -> bool:
    return row is not None and row.status == "ok" and bool(row.busbw_gbps)


def _ratio(rows: dict[str, Row], pair: tuple[str, str]) -> str:
    a, b = rows.get(pair[0]), rows.get(pair[1])
    if not (_ok(a) and _ok(b)):
        return "-"
    return f"{a.busbw_gbps / b.busbw_gbps:.2f}"


def _ratio_pairs(series: Sequence[str]) -> list[tuple[str, str]]:
    """(fastcomm series, peer series) pairs that get a busbw ratio column: every series named
    fastcomm or fastcomm(...) against every other series."""
    ours = [s for s in series if s.split("(")[0] == "fastcomm"]
    peers = [s for s in series if s not in ours]
    return [(a, b) for a in ours for b in peers]


def summarize(rows: Sequence[Row], series: Sequence[str]) -> list[dict[str, Any]]:
    """Per op and ratio pair: the smallest busbw ratio over the sizes measured within BW_RANGE
    (their smallest and largest size recorded, so the summary names the range it covers) and
    the largest time difference (ours minus peer, us; > 0: ours slower) below LATENCY_BELOW."""
    out = []
    for op in dict.fromkeys(r.op for r in rows):
        by_size: dict[int, dict[str, Row]] = {}
        for r in rows:
            if r.op == op:
                by_size.setdefault(r.size_bytes, {})[r.backend] = r
        for ours, peer in _ratio_pairs(series):
            both = [(s, p[ours], p[peer]) for s, p in by_size.items() if _ok(p.get(ours))]
            both = [(s, a, b) for s, a, b in both if _ok(b)]
            # Split ops round sizes down to whole elements per rank: allow a little slack.
            bw = [
                (a.busbw_gbps / b.busbw_gbps, s)
                for s, a, b in both
                if BW_RANGE[0] * 0.99 <= s <= BW_RANGE[1]
            ]
            lat = [(a.time_us - b.time_us, s) for s, a, b in both if s < LATENCY_BELOW * 0.99]
            worst_bw, worst_lat = min(bw, default=None), max(lat, default=None)
            out.append(
                {
                    "op": op,
                    "series": ours,
                    "peer": peer,
                    "min_busbw_ratio": worst_bw and worst_bw[0],
                    "min_busbw_ratio_size": worst_bw and worst_bw[1],
                    "max_latency_diff_us": worst_lat and worst_lat[0],
                    "max_latency_diff_size": worst_lat and worst_lat[1],
                    "busbw_size_min": min((sz for _, sz in bw), default=None),
                    "busbw_size_max": max((sz for _, sz in bw), default=None),
                    "latency_size_min": min((sz for _, sz in lat), default=None),
                    "latency_size_max": max((sz for _, sz in lat), default=None),
                    "size_min": min((s for s, _, _ in both), default=None),
                    "size_max": max((s for s, _, _ in both), default=None),
                }
            )
    return out


def summary_text(item: dict[str, Any]) -> str:
    """One summary line of `summarize`: every figure names the sizes it was taken over, those
    measured (not the ranges BW_RANGE and LATENCY_BELOW allow)."""

    def span(lo: Optional[int], hi: Optional[int]) -> str:
        return format_size(lo) if lo == hi else f"{format_size(lo)}..{format_size(hi)}"

    measured = ""
    if item.get("size_min") is not None:
        measured = f"; sizes compared: {span(item['size_min'], item['size_max'])}"
    text = f"{item['series']} vs {item['peer']}: min busbw ratio "
    if item["min_busbw_ratio"] is None:
        text += f"- (no size of {format_size(BW_RANGE[0])} or more{measured})"
    else:
        text += (
            f"{item['min_busbw_ratio']:.2f} at {format_size(item['min_busbw_ratio_size'])} "
            f"(over {span(item['busbw_size_min'], item['busbw_size_max'])})"
        )
    text += "; max latency difference "
    if item["max_latency_diff_us"] is None:
        text += f"- (no size below {format_size(LATENCY_BELOW)}{measured})"
    else:
        text += (
            f"{item['max_latency_diff_us']:+.2f} us at "
            f"{format_size(item['max_latency_diff_size'])} "
            f"(over {span(item['latency_size_min'], item['latency_size_max'])}; "
            f"+ = {item['series']} slower)"
        )
    return text


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
    """nccl-tests style table, one line per size, series side by side."""

    WIDTHS = (11, 6, 8, 8, 7)  # time, ±%, algbw, busbw, #wrong

    def __init__(
        self, op: str, backends: Sequence[str], dtype: str, world: int, device: str
    ) -> None:
        self.op, self.backends = op, list(backends)
        self.title = _op_title(op, dtype, world, device)
        self.pairs = _ratio_pairs(backends)
        self.rw = max([len(f"{a}/{b}") + 2 for a, b in self.pairs] + [0])

    def header(self) -> str:
        block = sum(self.WIDTHS)
        l1 = " " * 24 + "".join(f" {b} ".center(block - 1, "-") + " " for b in self.backends)
        l1 += "".join(f"{'busbw ratio':>{self.rw}}" for _ in self.pairs)
        l2 = f"{'size':>12}{'count':>12}"
        l3 = f"{'(B)':>12}{'(elements)':>12}"
        for _ in self.backends:
            l2 += "".join(
                f"{h:>{w}}" for h, w in zip(("time", "±", "algbw", "busbw", "#wrong"), self.WIDTHS)
            )
            l3 += "".join(
                f"{h:>{w}}" for h, w in zip(("(us)", "(%)", "(GB/s)", "(GB/s)", ""), self.WIDTHS)
            )
        l2 += "".join(f"{a + '/' + b:>{self.rw}}" for a, b in self.pairs)
        lines = ("", "  " + self.title, l1, l2, l3)
        return "\n".join(("#" + line[1:]).rstrip() for line in lines)

    def line(self, point: Sequence[Row]) -> str:
        rows = {r.backend: r for r in point}
        text = f"{point[0].size_bytes:>12}{point[0].count:>12}"
        for b in self.backends:
            text += "".join(f"{c:>{w}}" for c, w in zip(_cells(rows.get(b)), self.WIDTHS))
        return text + "".join(f"{_ratio(rows, p):>{self.rw}}" for p in self.pairs)

    def footer(self, rows: Sequence[Row]) -> str:
        lines = [f"# avg busbw (GB/s): {_avg_busbw(rows, self.backends) or 'none'}"]
        lines += [f"# {summary_text(item)}" for item in summarize(rows, self.backends)]
        notes = {(r.backend, r.status, r.error) for r in rows if r.status != "ok"}
        for backend, status, error in sorted(notes, key=str):
            lines.append(f"# {backend}: {self.op} {status}: {error or 'on another rank'}")
        return "\n".join(lines)


def _meta_lines(meta: dict[str, Any]) -> list[str]:
    """The bullet list at the top of a Markdown report."""
    out = [
        f"- Date: {meta['timestamp']}; host {meta['hostname']} "
        f"({len(meta['hosts'])} host(s): {', '.join(meta['hosts'])})",
        f"- Launcher: `{meta['launcher_cmdline'] or 'unknown'}`",
        f"- Command: `{shlex.join(meta['argv'])}`",
        f"- World: {meta['world_size']} ranks ({meta['local_world_size']} per host); device "
        f"{meta['device']['type']}: {meta['device']['name']}",
    ]
    if meta.get("partial"):
        out.append(
            "- Partial: the run stopped before its last point; these are the points it measured"
        )
    if meta.get("interrupted"):
        out.append(
            "- Interrupted: the sweep was stopped before its last launch; the launches below "
            "without an exit status, or marked partial, stopped before their last point"
        )
    sim, net = meta.get("sim_nodes"), meta.get("netbed")
    if net:
        link = net["link"]
        delay = f"{link['delay_us']:g} us one-way delay" if link["delay_us"] else "no delay"
        moved = ", ".join(f"{k} {v / 2**20:.4g} MiB" for k, v in net["bytes_by_launch"].items())
        out.append(
            f"- Network: {net['nodes']} nodes x {sim['ranks_per_node']} ranks, each node a "
            f"network namespace ({', '.join(net['node_addrs'])}), joined by a "
            f"{net['topology']} shaped with tc: {link['rate']} ({link['rate_gbyte_s']:.4g} "
            f"GB/s) each way, {delay}, tbf burst {link['burst_bytes']} B, limit "
            f"{link['limit_bytes']} B, MTU {link['mtu']}"
            + (f", receive: {net['receive']}" if net.get("receive") else "")
            + f" (benchmarks/netbed.py); host ids by "
            f"rank: {', '.join(sim['host_id_by_rank'])}; sent over the links by launch: "
            f"{moved or 'not recorded'}"
        )
    elif sim and sim.get("nodes", 1) > 1:
        out.append(
            f"- Simulated nodes: {sim['nodes']} x {sim['ranks_per_node']} ranks; host ids by "
            f"rank: {', '.join(sim['host_id_by_rank'])}; set by the benchmark: "
            f"{', '.join(f'`{k}={v}`' for k, v in sim['set'].items()) or 'none'}; kept as "
            f"given: {', '.join(f'`{k}={v}`' for k, v in sim['kept'].items()) or 'none'}"
        )
    if meta.get("wire_dtype", "none") != "none":
        if meta.get("check_max_rtol"):
            allows = f"an error of {meta['check_max_rtol']} of the largest possible sum"
        else:
            allows = f"a relative error of {meta.get('check_rtol', {})}"
        out.append(
            f"- fastcomm wire dtype: {meta['wire_dtype']} (busbw is the effective busbw: "
            f"computed from the {meta['dtype']} bytes, as for the other series; the check "
            f"allows {allows})"
        )
    out += [
        f"- Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}",
        f"- Environment: {', '.join(f'`{k}={v}`' for k, v in meta['env'].items()) or 'none set'}",
        f"- Skipped backends: "
        f"{', '.join(f'{k} ({v})' for k, v in meta['skipped'].items()) or 'none'}",
        f"- Timing: {meta['timing']}",
    ]
    return out


def render_markdown(data: dict[str, Any]) -> str:
    """A Markdown report of one result file: how it was made, then one table per op."""
    meta, rows = data["meta"], [Row(**r) for r in data["results"]]
    backends = meta["backends"]
    out = [f"# Collectives: {meta['label'] or meta['device']['name']}", ""]
    out += _meta_lines(meta)
    for launch in meta.get("sweep", {}).get("launches", []):
        env = " ".join(f"{k}={v}" for k, v in launch["env"].items())
        out.append(
            f"- Launch `{launch['name']}` (exit {launch['returncode']}): "
            f"`{(env + ' ') if env else ''}{shlex.join(launch['cmd'])}`"
        )
    pairs = _ratio_pairs(backends)
    for op in dict.fromkeys(r.op for r in rows):
        op_rows = [r for r in rows if r.op == op]
        title = _op_title(op, meta["dtype"], meta["world_size"], meta["device"]["type"])
        with_setting = [b for b in backends if any(r.setting for r in op_rows if r.backend == b)]
        head = ["size (B)", "count"]
        for b in backends:
            head += [f"{b} time (us)", f"{b} ±%", f"{b} algbw (GB/s)", f"{b} busbw (GB/s)"]
            head += [f"{b} #wrong"] + ([f"{b} setting"] if b in with_setting else [])
        head += [f"{a}/{b} busbw" for a, b in pairs]
        out += ["", f"## {title}", "", "| " + " | ".join(head) + " |"]
        out.append("|" + "---:|" * len(head))
        for size in dict.fromkeys(r.size_bytes for r in op_rows):
            point = {r.backend: r for r in op_rows if r.size_bytes == size}
            first = next(iter(point.values()))
            cells = [str(size), str(first.count)]
            for b in backends:
                cells += list(_cells(point.get(b)))
                if b in with_setting:
                    cells.append((point[b].setting or "") if b in point else "")
            cells += [_ratio(point, p) for p in pairs]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", f"Average busbw (GB/s): {_avg_busbw(op_rows, backends) or 'none'}"]
        summary = summarize(op_rows, backends)
        if summary:
            out += [""] + [f"- {summary_text(item)}" for item in summary]
        out += _setting_table(meta, op)
    return "\n".join(out) + "\n"


def _setting_table(meta: dict[str, Any], op: str) -> list[str]:
    """Merged sweeps (run_multinode_sweep.py): busbw of the peer at every setting and size."""
    sweep = meta.get("sweep", {})
    per_size = sweep.get("busbw_by_setting", {}).get(op)
    if not per_size:
        return []
    settings = list(dict.fromkeys(s for v in per_size.values() for s in v))
    best = sweep.get("best_setting", {}).get(op, {})
    out = [
        "",
        (
            f"{sweep['peer']} busbw (GB/s) by setting (NCCL_SOCKET_NTHREADS x "
            "NCCL_NSOCKS_PERTHREAD, NCCL_BUFFSIZE); the best per size in bold:"
        ),
        "",
        "| size (B) | " + " | ".join(settings) + " |",
        "|" + "---:|" * (len(settings) + 1),
    ]
    for size, values in sorted(per_size.items(), key=lambda kv: int(kv[0])):
        cells = []
        for s in settings:
            v = values.get(s)
            text = "" if s not in values else ("bad" if v is None else f"{v:.3g}")
            cells.append(f"**{text}**" if best.get(size) == s else text)
        out.append(f"| {size} | " + " | ".join(cells) + " |")
    wins = sweep.get("best_wins", {}).get(op, {})
    if wins:
        out += ["", "Sizes won: " + ", ".join(f"{k} {v}" for k, v in wins.items())]
    return out


# ----------------------------------------------------------------------------- plotting


def plot_results(datasets: Sequence[dict[str, Any]], path: str) -> bool:
    """busbw vs size, one panel per op, one line per series (and per file when merging); a
    shaded band spans the busbw of the slowest and the fastest repeat where recorded.

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
    # A series such as nccl(default) takes its backend's colour unless that is in use.
    colors = {b: c for b, c in BACKEND_COLORS.items() if b in named}
    spare = (f"C{i}" for i in range(len(BACKEND_COLORS), 100))
    for b in named:
        if b not in colors:
            base = BACKEND_COLORS.get(b.split("(")[0])
            colors[b] = base if base and base not in colors.values() else next(spare)
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
                band = [r for r in pts if r.get("time_us_repeat_min") and r.get("repeats", 1) > 1]
                if band:
                    ax.fill_between(
                        [r["size_bytes"] for r in band],
                        [r["busbw_gbps"] * r["time_us"] / r["time_us_repeat_max"] for r in band],
                        [r["busbw_gbps"] * r["time_us"] / r["time_us_repeat_min"] for r in band],
                        color=colors[b],
                        alpha=0.15,
                        linewidth=0,
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
    bench: Bench,
    torchext: Any,
    skipped: dict[str, str],
    device: torch.device,
    sim: dict[str, Any],
    wire: str,
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
        "backends": [bench.series[b] for b in bench.backends],  # the series, as in the rows
        "series": {bench.series[b]: b for b in bench.backends},  # series -> backend
        "skipped": skipped,
        "versions": versions,
        "git": _git_state(),
        "env": env0,
        "env_differs_by_rank": {r: d for r, d in env_diff.items() if d},
        "repeats": a.repeats,
        "sim_nodes": sim
        | {"host_id_by_rank": [i["env"].get("FASTCOMM_HOST_ID", "") for i in infos]},
        "wire_dtype": wire,
        "check_rtol": {bench.series[b]: t for b, t in bench.rtol.items() if t},
        "check_max_rtol": {bench.series[b]: t for b, t in bench.max_rtol.items() if t},
        "busbw_basis": f"bytes of the {a.dtype} buffers (with a compressed wire dtype: "
        "effective busbw)",
        "timing": (
            f"per size, each backend: warm-up (up to {a.warmup} iterations), then {a.repeats} "
            f"repeats, backends interleaved, of: barrier, "
            f"{'torch.cuda.synchronize() before and after, ' if device.type == 'cuda' else ''}"
            f"host time of a loop divided by its iterations (up to {a.iters}, fewer for big "
            f"sizes: about {a.time_per_size:g} s per size for all backends, at least "
            f"{a.min_iters}); max over ranks per repeat, median over repeats"
        ),
    }


# ----------------------------------------------------------------------------- main


def sim_node(nodes: int) -> int:
    """This process's simulated node when torchrun's ranks of a host act as `nodes` nodes:
    GROUP_RANK * nodes + LOCAL_RANK // (LOCAL_WORLD_SIZE / nodes)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world % nodes:
        raise ValueError(
            f"--sim-nodes {nodes} does not divide LOCAL_WORLD_SIZE={local_world} ranks per host"
        )
    return int(os.environ.get("GROUP_RANK", "0")) * nodes + local_rank // (local_world // nodes)


def apply_sim_nodes(nodes: int) -> dict[str, Any]:
    """Give this process the identity of simulated node k = LOCAL_RANK // (LOCAL_WORLD_SIZE / N).

    Sets FASTCOMM_HOST_ID and NCCL_HOSTID to simnode<k> (k counts on over torchrun's nodes via
    GROUP_RANK) and the NCCL socket network (SIM_NCCL_NET_ENV) where not set already. Must run
    before any process group exists: NCCL reads these once per process. Returns the record
    stored in the JSON metadata (rank 0's).
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if nodes == 1:
        return {"nodes": 1, "ranks_per_node": local_world, "set": {}, "kept": {}}
    node = sim_node(nodes)
    per_node = local_world // nodes
    for key in ("FASTCOMM_HOST_ID", "NCCL_HOSTID"):
        os.environ[key] = f"simnode{node}"
    done: dict[str, str] = {}
    kept: dict[str, str] = {}
    for key, value in SIM_NCCL_NET_ENV.items():
        if key in os.environ:
            kept[key] = os.environ[key]
        else:
            os.environ[key] = done[key] = value
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "host_id_vars": ["FASTCOMM_HOST_ID", "NCCL_HOSTID"],
        "set": done,  # network variables the benchmark set
        "kept": kept,  # network variables the user had set, used as given
    }


def apply_wire_dtype(choice: Optional[str]) -> str:
    """Set FASTCOMM_WIRE_DTYPE from --wire-dtype (if given); the value in effect."""
    if choice is not None:
        os.environ["FASTCOMM_WIRE_DTYPE"] = choice
    return os.environ.get("FASTCOMM_WIRE_DTYPE", "none").strip().lower() or "none"


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


def write_json(data: dict[str, Any], path: str) -> None:
    """Write a result file whole or not at all (a reader never sees half of one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def write_outputs(data: dict[str, Any], args: argparse.Namespace) -> None:
    """Write --json, --md and --plot for one run."""
    _make_folders(args)
    if args.json:
        write_json(data, args.json)
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
    rank = int(os.environ["RANK"])
    try:
        sim = apply_sim_nodes(args.sim_nodes)
    except ValueError as exc:
        if rank == 0:
            print(exc, file=sys.stderr)
        return 2
    wire = apply_wire_dtype(args.wire_dtype)
    backends, skipped, torchext = select_backends(args.backends, args.device)
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
    # Bound as training scripts bind it: communicators are set up at init.
    dist.init_process_group(
        backend=backends[0], device_id=device if device.type == "cuda" else None
    )
    world = dist.get_world_size()
    series = {b: f"{b}({wire})" if b == "fastcomm" and wire != "none" else b for b in backends}
    rtol = {"fastcomm": wire_rtol(wire, world)} if "fastcomm" in backends else {}
    max_rtol = {"fastcomm": wire_max_rtol(wire, world)} if "fastcomm" in backends else {}
    bench = Bench(args, backends, device, series, rtol, max_rtol)
    meta = collect_metadata(bench, torchext, skipped, device, sim, wire)
    if rank == 0:
        print(f"# bench_collectives {meta['timestamp']} {meta['label']}")
        print(
            f"# {meta['world_size']} ranks on {', '.join(meta['hosts'])}; {meta['device']['name']}"
        )
        print("# " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))
        print(f"# backends: {', '.join(meta['backends'])}")
        for name, reason in skipped.items():
            print(f"# skipped {name}: {reason}")
        if sim["nodes"] > 1:
            print(
                f"# simulated nodes: {sim['nodes']} x {sim['ranks_per_node']} ranks, host ids "
                f"{' '.join(meta['sim_nodes']['host_id_by_rank'])}; set "
                f"{' '.join(f'{k}={v}' for k, v in sim['set'].items()) or '-'}; kept "
                f"{' '.join(f'{k}={v}' for k, v in sim['kept'].items()) or '-'}"
            )
        if meta["check_rtol"]:
            print(f"# check: relative tolerance {meta['check_rtol']} (wire dtype {wire})")
        if meta["check_max_rtol"]:
            print(
                f"# check: tolerance {meta['check_max_rtol']} of the largest possible sum "
                f"(block-scaled wire dtype {wire})"
            )
        print(f"# timing: {meta['timing']}")
        print("# env: " + (" ".join(f"{k}={v}" for k, v in meta["env"].items()) or "-"), flush=True)
    rows: list[Row] = []

    def keep(point: list[Row]) -> None:
        # --json holds every point measured so far, marked partial until the run ends: a run
        # stopped by a timeout still leaves what it measured.
        rows.extend(point)
        if rank == 0 and args.json:
            partial = {"schema": SCHEMA, "meta": dict(meta, partial=True)}
            write_json(partial | {"results": [asdict(r) for r in rows]}, args.json)

    if rank == 0:
        _make_folders(args)
    for op in args.ops:
        bench.run_op(op, keep)
    wrong = sum(r.wrong or 0 for r in rows)
    failed = sum(r.status == "failed" for r in rows)
    if rank == 0:
        verdict = "N/A (--no-check)" if not args.check else ("OK" if wrong == 0 else "FAILED")
        print(f"# total #wrong: {wrong} {verdict}; failed points: {failed}", flush=True)
        data = {"schema": SCHEMA, "meta": meta, "results": [asdict(r) for r in rows]}
        data["summary"] = summarize(rows, meta["backends"])
        write_outputs(data, args)
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
