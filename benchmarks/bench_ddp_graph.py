r"""DDP training step time: eager over NCCL, eager over fastcomm, and the whole step captured
into a CUDA graph over fastcomm (forward, backward with a torchext.hooks hook, optimizer).

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_ddp_graph.py \
        --json out.json --md out.md --label "4x H200"

Two models: "launch" (many small layers, small batch: the step is bound by kernel launches and
host overhead, which the graph removes) and "compute" (a few large layers, large batch: bound
by the matrix products, where the graph must not lose the overlap of gradient all-reduces with
the backward pass). Every mode trains its own copy of a model (same seed) on static inputs.

Timing: each mode is set up and warmed up (>= 11 DDP iterations: DDP synchronises events for its
runtime statistics in its first 10), then the modes take turns --repeats times (A B C A B C ...);
a turn is: torch.cuda.synchronize(), a barrier, a host-timed loop of --iters steps (fewer if a
turn would exceed --time-per-repeat), synchronize. The time per step of a turn is the slowest
rank's; the reported time is the median over turns, +-% half their range relative to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_collectives import (  # noqa: E402  (the shared metadata helpers)
    _git_state,
    _launcher_cmdline,
    _local_info,
    apply_sim_nodes,
)

SCHEMA = "fastcomm-bench-ddp-graph/1"
MODES = ("nccl", "fastcomm", "fastcomm+hook", "fastcomm-graph", "nccl-graph")
DEFAULT_MODES = ("nccl", "fastcomm", "fastcomm-graph")
HOOKS = {"allreduce": "allreduce_hook", "bf16": "bf16_compress_hook", "fp16": "fp16_compress_hook"}
MIN_WARMUP = 11  # Reducer::should_collect_runtime_stats: event syncs in iterations 1..10


def backend_of(mode: str) -> str:
    """The backend a mode measures: "fastcomm+hook" and "fastcomm-graph" -> "fastcomm"."""
    return mode.split("-")[0].split("+")[0]


@dataclass
class ModelSpec:
    name: str
    layers: int
    width: int
    batch: int

    def describe(self) -> str:
        return f"{self.layers} x Linear({self.width}, {self.width}) + ReLU, batch {self.batch}/rank"


@dataclass
class Row:
    model: str
    mode: str
    world: int
    time_ms: Optional[float] = None  # median over repeats of the slowest rank's ms/step
    time_ms_min: Optional[float] = None  # median over repeats of the fastest rank's
    spread_pct: Optional[float] = None
    speedup_vs_nccl: Optional[float] = None
    iters: int = 0
    warmup: int = 0
    repeats_ms: list[float] = field(default_factory=list)
    ranks_agree: Optional[bool] = None
    status: str = "ok"
    error: Optional[str] = None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="launch,compute",
        help="comma list of launch, compute (default: %(default)s)",
    )
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma list of {', '.join(MODES)} (default: %(default)s)",
    )
    p.add_argument(
        "--hook", choices=sorted(HOOKS), default="allreduce", help="hook of +hook/graph modes"
    )
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="SGD(momentum=0.9) or Adam(capturable=True), both foreach (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype"
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (default: off)")
    p.add_argument("--launch-layers", type=int, default=48)
    p.add_argument("--launch-width", type=int, default=256)
    p.add_argument("--launch-batch", type=int, default=8)
    p.add_argument("--compute-layers", type=int, default=4)
    p.add_argument("--compute-width", type=int, default=4096)
    p.add_argument("--compute-batch", type=int, default=4096)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--warmup", type=int, default=15, help=f"eager warm-up steps (>= {MIN_WARMUP})")
    p.add_argument("--iters", type=int, default=200, help="steps per timed loop (upper bound)")
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="timed loops per mode, interleaved")
    p.add_argument("--time-per-repeat", type=float, default=0.5, help="seconds per timed loop")
    p.add_argument("--sim-nodes", type=int, default=1,
                   help="act as N nodes (FASTCOMM_HOST_ID/NCCL_HOSTID per block of ranks)")  # fmt: skip
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.models:
        if m not in ("launch", "compute"):
            p.error(f"unknown model {m!r}")
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (one of {', '.join(MODES)})")
    if args.warmup < MIN_WARMUP or args.warmup % 100 == 0:
        # DDP synchronises its timing events in the iteration after one of iterations 1..10
        # and every 100th: the captured iteration must not be one of those.
        p.error(f"--warmup must be at least {MIN_WARMUP} and not a multiple of 100")
    if min(args.iters, args.min_iters, args.repeats) < 1:
        p.error("--iters, --min-iters and --repeats must be positive")
    return args


def specs(args: argparse.Namespace) -> dict[str, ModelSpec]:
    return {
        "launch": ModelSpec("launch", args.launch_layers, args.launch_width, args.launch_batch),
        "compute": ModelSpec(
            "compute", args.compute_layers, args.compute_width, args.compute_batch
        ),
    }


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for _ in range(spec.layers):
        layers += [nn.Linear(spec.width, spec.width), nn.ReLU()]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


class Runner:
    """One mode: its own model copy, DDP, optimizer and (graph modes) captured step."""

    def __init__(
        self,
        mode: str,
        spec: ModelSpec,
        group: Any,
        args: argparse.Namespace,
        device: torch.device,
        data: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.mode, self.device = mode, device
        self.graphed = mode.endswith("-graph")
        hook = None
        if self.graphed or mode.endswith("+hook"):
            import torchext.hooks

            hook = getattr(torchext.hooks, HOOKS[args.hook])
        dtype = getattr(torch, args.dtype)
        # DDP built (and warmed up) on a side stream, as torch's whole-network capture
        # recipe asks; harmless for the eager modes, which use it too for equal footing.
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            self.x = data[0].clone()
            self.y = data[1].clone()
            ddp = DDP(
                build_model(spec, device, dtype),
                device_ids=[device.index],
                process_group=group,
                bucket_cap_mb=args.bucket_cap_mb,
                gradient_as_bucket_view=True,
                static_graph=True,
            )
            if hook is not None:
                ddp.register_comm_hook(group, hook)
            if args.optimizer == "adam":
                opt: torch.optim.Optimizer = torch.optim.Adam(
                    ddp.parameters(), lr=1e-4, capturable=True, foreach=True
                )
            else:
                opt = torch.optim.SGD(ddp.parameters(), lr=1e-4, momentum=0.9, foreach=True)
        self.ddp, self.opt = ddp, opt
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        with torch.cuda.stream(self.stream):
            for _ in range(args.warmup):
                self._step()
        torch.cuda.current_stream(device).wait_stream(self.stream)
        if self.graphed:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
        torch.cuda.synchronize(device)

    def _step(self) -> None:
        self.opt.zero_grad(set_to_none=False)  # in place: grads stay bucket views
        loss = nn.functional.mse_loss(self.ddp(self.x), self.y)
        loss.backward()
        self.opt.step()

    def steps(self, n: int) -> None:
        if self.graph is not None:
            for _ in range(n):
                self.graph.replay()
        else:
            with torch.cuda.stream(self.stream):
                for _ in range(n):
                    self._step()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def checksum(self) -> list[float]:
        flat = torch.cat([p.detach().reshape(-1).double() for p in self.ddp.parameters()])
        return [float(flat.sum()), float((flat * flat).sum())]

    def close(self) -> None:
        self.graph = None
        self.ddp = None  # type: ignore[assignment]
        self.opt = None  # type: ignore[assignment]


def timed(runner: Runner, iters: int, ctrl: Any) -> tuple[float, float]:
    """(slowest, fastest) rank's seconds per step over one loop of ``iters`` steps."""
    torch.cuda.synchronize(runner.device)
    dist.barrier(group=ctrl)
    t0 = time.perf_counter()
    runner.steps(iters)
    torch.cuda.synchronize(runner.device)
    dt = (time.perf_counter() - t0) / iters
    t = torch.tensor([dt, -dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctrl)
    return float(t[0]), float(-t[1])


def bench_model(
    spec: ModelSpec,
    args: argparse.Namespace,
    groups: dict[str, Any],
    ctrl: Any,
    device: torch.device,
) -> list[Row]:
    world = dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    data = (
        torch.randn(spec.batch, spec.width, generator=g).to(device=device, dtype=dtype),
        torch.randn(spec.batch, spec.width, generator=g).to(device=device, dtype=dtype),
    )
    rows = {m: Row(spec.name, m, world, warmup=args.warmup) for m in args.modes}
    runners: dict[str, Runner] = {}
    for mode in args.modes:
        group = groups.get(group_of(mode))
        err: Optional[str] = None
        try:
            if group is None:
                raise RuntimeError(f"no {backend_of(mode)} process group")
            runners[mode] = Runner(mode, spec, group, args, device, data)
        except Exception as e:  # noqa: BLE001  (reported in the table; other modes go on)
            err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        errs: list[Any] = [None] * world
        dist.all_gather_object(errs, err, group=ctrl)
        if any(errs):
            rows[mode].status, rows[mode].error = "failed", next(e for e in errs if e)
            runners.pop(mode, None)
    # Iterations per loop from one probe loop each (all ranks agree: max over ranks).
    iters: dict[str, int] = {}
    for mode, r in runners.items():
        slow, _ = timed(r, args.min_iters, ctrl)
        iters[mode] = max(args.min_iters, min(args.iters, int(args.time_per_repeat / slow)))
        rows[mode].iters = iters[mode]
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in runners}
    for _ in range(args.repeats):
        for mode, r in runners.items():
            times[mode].append(timed(r, iters[mode], ctrl))
    for mode, r in runners.items():
        row = rows[mode]
        slow = [1e3 * s for s, _ in times[mode]]
        fast = [1e3 * f for _, f in times[mode]]
        row.repeats_ms = slow
        row.time_ms = statistics.median(slow)
        row.time_ms_min = statistics.median(fast)
        row.spread_pct = 100 * (max(slow) - min(slow)) / 2 / row.time_ms
        sums: list[Any] = [None] * world
        dist.all_gather_object(sums, r.checksum(), group=ctrl)
        row.ranks_agree = all(s == sums[0] for s in sums)
        r.close()
    runners.clear()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = rows.get("nccl")
    for row in rows.values():
        if base is not None and base.time_ms and row.time_ms:
            row.speedup_vs_nccl = base.time_ms / row.time_ms
    return list(rows.values())


COLUMNS = ("mode", "ms/step", "±%", "fastest", "iters", "vs nccl", "ranks agree")
WIDTHS = (-16, 10, 7, 10, 7, 9, 13)  # console: negative = left-aligned


def row_cells(r: Row) -> list[str]:
    """A row's columns as text (COLUMNS), for the console table and the markdown alike; a
    failed mode has two: its name and the error."""
    if r.status != "ok":
        return [r.mode, f"failed: {r.error}"]
    sp = f"{r.speedup_vs_nccl:.2f}x" if r.speedup_vs_nccl else "-"
    return [
        r.mode,
        f"{r.time_ms:.3f}",
        f"{r.spread_pct:.1f}",
        f"{r.time_ms_min:.3f}",
        str(r.iters),
        sp,
        str(r.ranks_agree),
    ]


def table(rows: Sequence[Row], spec: ModelSpec, args: argparse.Namespace) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        if len(cells) < len(WIDTHS):  # a failed mode: the error runs on unaligned
            return f"{cells[0]:<{-WIDTHS[0]}}  {cells[1]}"
        return "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(cells, WIDTHS))

    title = (
        f"# model {spec.name}: {spec.describe()}, {args.dtype}, {args.optimizer}, "
        f"{rows[0].world if rows else 0} ranks"
    )
    return [title, "# " + line(COLUMNS)] + ["  " + line(row_cells(r)) for r in rows]


def render_markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    sim = meta.get("sim_nodes") or {}
    out = [
        f"# DDP step time, eager vs CUDA graph: {meta['label'] or meta['device']}",
        "",
        f"- Date: {meta['timestamp']}; host {meta['hostname']}",
        f"- Launcher: `{meta['launcher_cmdline'] or 'unknown'}`",
        f"- Command: `{shlex.join(meta['argv'])}`",
        f"- World: {meta['world_size']} ranks; device {meta['device']}",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}",
        f"- Git: {meta['git']}",
        f"- Environment: {', '.join(f'`{k}={v}`' for k, v in meta['env'].items()) or 'none set'}",
        f"- Modes: {meta['modes_described']}",
        f"- Timing: {meta['timing']}",
    ]
    if sim.get("nodes", 1) > 1:
        out.append(
            f"- Simulated nodes: {sim['nodes']} x {sim['ranks_per_node']} ranks "
            f"(FASTCOMM_HOST_ID / NCCL_HOSTID per block of ranks; NCCL network set: "
            f"{sim.get('set') or 'none'}, kept from the environment: {sim.get('kept') or 'none'})"
        )
    for name, desc in meta["models"].items():
        out += ["", f"## {name}: {desc}", ""]
        out.append("| " + " | ".join(COLUMNS) + " |")
        out.append("|" + "---|" * len(COLUMNS))
        for r in (Row(**x) for x in data["results"] if x["model"] == name):
            cells = row_cells(r)
            cells += [""] * (len(COLUMNS) - len(cells))
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def group_of(mode: str) -> str:
    """Which group a mode runs on: eager modes share their backend's, graph modes get one of
    their own ("nccl-graph"), so a capture cannot change how the eager modes' collectives run
    (fastcomm hands a group's eager multi-node all_reduces to its proxy in stream order once
    the group captured one; NCCL routes eager proxy work through host callbacks while
    captured plans exist)."""
    return mode if mode.endswith("-graph") else backend_of(mode)


def make_groups(modes: Sequence[str]) -> tuple[dict[str, Any], Any, Any]:
    """The default group is Gloo (barriers, timing reductions); one group per group_of()
    key. Returns (groups, control group, torchext or None)."""
    dist.init_process_group(backend="gloo")
    groups: dict[str, Any] = {}
    torchext = None
    for key in dict.fromkeys(group_of(m) for m in modes):
        b = backend_of(key)
        if b == "fastcomm" and torchext is None:
            import torchext as te  # registers the backend

            torchext = te
        groups[key] = dist.new_group(backend=b)
    return groups, dist.group.WORLD, torchext


def describe_modes(args: argparse.Namespace) -> str:
    hook = HOOKS[args.hook]
    text = {
        "nccl": "eager DDP over NCCL (DDP's built-in reduction)",
        "fastcomm": "eager DDP over fastcomm (DDP's built-in reduction)",
        "fastcomm+hook": f"eager DDP over fastcomm with torchext.hooks.{hook}",
        "fastcomm-graph": f"whole step captured with torch.cuda.graph over fastcomm, torchext.hooks.{hook}",
        "nccl-graph": f"whole step captured with torch.cuda.graph over NCCL, torchext.hooks.{hook}",
    }
    return "; ".join(f"{m}: {text[m]}" for m in args.modes)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "run under torchrun, e.g. torchrun --nproc_per_node=4 " + sys.argv[0], file=sys.stderr
        )
        return 2
    if not torch.cuda.is_available():
        print("bench_ddp_graph measures CUDA graphs: it needs GPUs", file=sys.stderr)
        return 2
    try:
        sim = apply_sim_nodes(args.sim_nodes)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    groups, ctrl, torchext = make_groups(args.modes)
    rank, world = dist.get_rank(), dist.get_world_size()
    infos: list[Any] = [None] * world
    dist.all_gather_object(infos, _local_info(device), group=ctrl)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "torchext": getattr(torchext, "__version__", None),
        "torchext_nccl": ".".join(map(str, torchext.nccl_version()))
        if torchext is not None and torchext.nccl_version()
        else None,
    }
    model_specs = specs(args)
    meta = {
        "label": args.label,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "launcher_cmdline": _launcher_cmdline(),
        "args": vars(args),
        "world_size": world,
        "hostname": infos[0]["hostname"],
        "device": " / ".join(dict.fromkeys(i["device_name"] for i in infos)),
        "versions": versions,
        "git": _git_state(),
        "env": infos[0]["env"],
        "sim_nodes": sim,
        "models": {m: model_specs[m].describe() for m in args.models},
        "modes_described": describe_modes(args),
        "timing": (
            f"per model, each mode: {args.warmup} eager warm-up steps (then capture for graph "
            f"modes), one probe loop of {args.min_iters} steps to size the loops (up to "
            f"{args.iters} steps or {args.time_per_repeat:g} s), then {args.repeats} timed loops "
            "per mode, modes interleaved; a loop: synchronize, barrier, host time of the steps, "
            "synchronize; ms/step of the slowest rank per loop, median over loops"
        ),
    }
    if rank == 0:
        print(f"# bench_ddp_graph {meta['timestamp']} {args.label}")
        print(f"# {world} ranks; {meta['device']}")
        print("# " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
        print(f"# modes: {meta['modes_described']}")
        print("# env: " + (" ".join(f"{k}={v}" for k, v in meta["env"].items()) or "-"), flush=True)
    rows: list[Row] = []
    for name in args.models:
        model_rows = bench_model(model_specs[name], args, groups, ctrl, device)
        rows += model_rows
        if rank == 0:
            print("\n".join(table(model_rows, model_specs[name], args)), flush=True)
    failed = any(r.status != "ok" or r.ranks_agree is False for r in rows)
    if rank == 0:
        data = {"schema": SCHEMA, "meta": meta, "results": [asdict(r) for r in rows]}
        for path in (args.json, args.md):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
            print(f"# wrote {args.json}")
        if args.md:
            with open(args.md, "w") as f:
                f.write(render_markdown(data))
            print(f"# wrote {args.md}")
    dist.barrier(group=ctrl)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
