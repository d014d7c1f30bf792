r"""Simulated multi-node sweep: fastcomm against NCCL at its default and at its best socket setting.

NCCL reads its socket variables once per process, so every NCCL setting needs its own torchrun
launch of bench_collectives.py. This driver runs, one after the other, on one machine:

  1. fastcomm alone, then the peer (NCCL) alone at its default (with --together, one launch
     running both side by side, interleaved);
  2. the peer alone, once per setting of a small sweep: NCCL_SOCKET_NTHREADS x
     NCCL_NSOCKS_PERTHREAD in --socket-settings, times NCCL_BUFFSIZE in --buffsizes;
  3. optionally fastcomm alone once per wire dtype of --wire-dtype (e.g. bf16,int8), and once
     per setting of --fastcomm-env (e.g. "FASTCOMM_TCP_SOCKETS=2;FASTCOMM_TCP_SOCKETS=4"): the
     series fastcomm(TCP_SOCKETS=2), ..., to compare fastcomm's own settings on the same links;

all with the same --sim-nodes, --device, --ops, sizes and iteration options, and with
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1. It then merges the
result files into one with the series "fastcomm", "nccl(default)", "nccl(best)" (per op and
size the best busbw of the default and all swept settings, the winning setting recorded per
size) and "fastcomm(bf16)", prints the Markdown report and writes --json, --plot and --md.

    python benchmarks/run_multinode_sweep.py --nproc-per-node 4 --sim-nodes 2 \
        --json sweep.json --plot sweep.png --md sweep.md --wire-dtype bf16

On a machine without GPUs the driver can be exercised with Gloo as the peer:

    python benchmarks/run_multinode_sweep.py --device cpu --nproc-per-node 2 --sim-nodes 2 \
        --peer gloo --no-fastcomm --max-bytes 1M --json /tmp/sweep.json

With --netbed RATE[,DELAY][,mtuMTU] every launch runs across --sim-nodes network namespaces
joined by links shaped with tc (benchmarks/netbed.py; needs root): one torchrun per node, each
with --nproc-per-node / --sim-nodes ranks, over a real (if simulated) network instead of TCP
loopback inside one namespace. The link settings and the bytes that crossed the links go
into the JSON metadata and the Markdown report.

    python benchmarks/run_multinode_sweep.py --nproc-per-node 2 --sim-nodes 2 \
        --netbed 25gbit,20us --wire-dtype bf16 --json sweep-25g.json --md sweep-25g.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_collectives as bc  # noqa: E402 - next to this file, not an installed module
import netbed as nb  # noqa: E402

BENCH = os.path.join(HERE, "bench_collectives.py")
# Set (overriding the environment) for every launch.
LAUNCH_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# What the sweep varies; removed from the inherited environment so "default" means NCCL's own.
SWEPT_VARS = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_BUFFSIZE")
DEFAULT_SETTING = "default"
# bench_collectives options passed through to every launch when given here.
PASSTHROUGH = (
    ("--dtype", str),
    ("--factor", int),
    ("--warmup", int),
    ("--iters", int),
    ("--min-iters", int),
    ("--repeats", int),
    ("--time-per-size", float),
)


@dataclass
class Launch:
    """One torchrun launch of bench_collectives.py."""

    name: str  # also the file name of its JSON and its --label
    # "main" (fastcomm [+ peer at default]), "peer" (one swept setting), "wire" (fastcomm with a
    # wire dtype), "variant" (fastcomm with the environment settings in env)
    role: str
    backends: list[str]
    setting: str = DEFAULT_SETTING  # the peer setting, as shown in tables
    env: dict[str, str] = field(default_factory=dict)  # set for this launch only
    wire_dtype: Optional[str] = None
    series: str = ""  # the merged series of a "wire" or "variant" launch
    cmd: list[str] = field(default_factory=list)
    json: str = ""
    returncode: Optional[int] = None
    seconds: Optional[float] = None
    link: Optional[list[dict[str, Any]]] = None  # --netbed, per round: exit codes, link bytes


# ----------------------------------------------------------------------------- command line


def _socket_settings(text: str) -> list[tuple[int, int]]:
    """'1x1,2x8,4x4' -> [(1, 1), (2, 8), (4, 4)] (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            threads, socks = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not THREADSxSOCKS: {item!r}") from None
        if threads < 1 or socks < 1:
            raise argparse.ArgumentTypeError(f"need positive counts: {item!r}")
        out.append((threads, socks))
    return out


def _buffsizes(text: str) -> list[Optional[int]]:
    """'default,16777216' -> [None, 16777216] (None: NCCL_BUFFSIZE not set); 16M works too."""
    out: list[Optional[int]] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        out.append(None if item.lower() == DEFAULT_SETTING else bc.parse_size(item))
    return out


# What Netbed.tcp_ceiling measures, as the reports say it.
TCP_CEILING_TEXT = (
    "Plain TCP between the nodes on this link (4 connections each way, both directions at once)"
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of the driver (see --help)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc-per-node",
        "--gpus",
        type=int,
        default=4,
        help="ranks (GPUs) of the one machine (default: %(default)s)",
    )
    p.add_argument(
        "--sim-nodes",
        type=int,
        default=2,
        help="simulated nodes, passed to every launch (default: %(default)s)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--ops", default="all_reduce", help="passed through (default: %(default)s)")
    p.add_argument("--min-bytes", default="1K", help="passed through (default: %(default)s)")
    p.add_argument("--max-bytes", default="1G", help="passed through (default: %(default)s)")
    for flag, kind in PASSTHROUGH:
        p.add_argument(flag, type=kind, help="passed through when given")
    p.add_argument(
        "--bench-args",
        default="",
        help="more bench_collectives options for every launch, as one shell-quoted string",
    )
    p.add_argument(
        "--peer",
        default="nccl",
        help="the backend swept against fastcomm (default: %(default)s; gloo to try the "
        "driver without GPUs: the NCCL_* variables are then set but unused)",
    )
    p.add_argument(
        "--fastcomm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure fastcomm in the first launch, beside the peer at its default",
    )
    p.add_argument(
        "--together",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run fastcomm and the peer's default in one launch, interleaved (default: each in "
        "a launch of its own)",
    )
    p.add_argument(
        "--socket-settings",
        type=_socket_settings,
        default="1x1,2x8,4x4",
        help="NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD pairs (default: %(default)s)",
    )
    p.add_argument(
        "--buffsizes",
        type=_buffsizes,
        default="default,16777216",
        help="NCCL_BUFFSIZE values, 'default' = unset (default: %(default)s)",
    )
    p.add_argument(
        "--wire-dtype",
        type=_wire_dtypes,
        default="none",
        help="comma-separated FASTCOMM_WIRE_DTYPE values (bf16, fp16, int8): one more launch "
        "of fastcomm alone for each, the series fastcomm(<dtype>) (default: %(default)s)",
    )
    p.add_argument(
        "--fastcomm-env",
        type=_fastcomm_envs,
        default=[],
        metavar="'NAME=V [NAME=V];...'",
        help="one more launch of fastcomm alone per ';'-separated setting, each a list of "
        "FASTCOMM_* or NCCL_* assignments (NCCL_* reach the NCCL communicator fastcomm runs "
        "CUDA collectives on): the series fastcomm(<setting without the FASTCOMM_ prefix>)",
    )
    p.add_argument(
        "--out-dir",
        help="folder of the per-launch JSON files (default: a new folder under the temp dir)",
    )
    p.add_argument("--json", metavar="PATH", help="write the merged result")
    p.add_argument("--plot", metavar="PATH", help="write busbw vs size of the merged result")
    p.add_argument("--md", metavar="PATH", help="write the Markdown report of the merged result")
    p.add_argument("--label", default="", help="label of the merged result")
    p.add_argument(
        "--torchrun",
        default=f"{shlex.quote(sys.executable)} -m torch.distributed.run",
        help="launcher command (default: %(default)s)",
    )
    p.add_argument(
        "--launch-timeout",
        type=float,
        help="seconds after which a launch is stopped (its process group killed)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole list of launches this many times, one round after the other; each "
        "point of a launch is then its round with the median busbw (the lower middle for an even "
        "count; every round's busbw kept in rounds_busbw_gbps): shows the spread between "
        "launches, which one launch per series cannot (default: %(default)s)",
    )
    p.add_argument(
        "--netbed",
        metavar="RATE[,DELAY][,mtuMTU]",
        type=_link,
        help="run every launch across --sim-nodes network namespaces joined by links of this "
        "rate, one-way delay and MTU (e.g. 25gbit, 100gbit,20us or 25gbit,mtu9000; "
        "benchmarks/netbed.py, needs root), one torchrun per node, instead of one torchrun on "
        "TCP loopback",
    )
    p.add_argument(
        "--iproute2",
        help="with --netbed: a dpkg -x folder of iproute2 and its libraries, when ip and tc "
        f"are not on PATH (or ${nb.IPROUTE2_ENV})",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=nb.DEFAULT_PORT,
        help="with --netbed: the rendezvous port of the first launch on node 0, one more for "
        "each further launch (default: %(default)s)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the launches, run nothing")
    p.add_argument(
        "--merge-only",
        action="store_true",
        help="run nothing: merge the JSON files an earlier run left in --out-dir",
    )
    args = p.parse_args(argv)
    if args.nproc_per_node < 1 or args.sim_nodes < 1 or args.nproc_per_node % args.sim_nodes:
        p.error("--sim-nodes must divide --nproc-per-node")
    if args.merge_only and not args.out_dir:
        p.error("--merge-only needs --out-dir")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.peer == "fastcomm":
        p.error("--peer must be another backend than fastcomm")
    if args.netbed and args.sim_nodes < 2:
        p.error("--netbed needs --sim-nodes of at least 2 (the nodes of the testbed)")
    return args


def _wire_dtypes(text: str) -> list[str]:
    known = (*bc.WIRE_DTYPES, *bc.BLOCK_SCALED_WIRES)
    names = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]
    bad = [t for t in names if t not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown wire dtype(s) {bad}: choose from {known}")
    return list(dict.fromkeys(names))


# Prefixes of the variables a fastcomm variant may set: fastcomm's own, and NCCL's (read by the
# NCCL communicator fastcomm runs CUDA collectives on, e.g. NCCL_MIN_NCHANNELS).
VARIANT_PREFIXES = ("FASTCOMM_", "NCCL_")


def _fastcomm_envs(text: str) -> list[dict[str, str]]:
    """'FASTCOMM_A=1 NCCL_B=2;FASTCOMM_A=3' -> [{A: 1, B: 2}, {A: 3}] (full names)."""
    settings = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        env = {}
        for item in part.split():
            name, eq, value = item.partition("=")
            if not eq or not name.startswith(VARIANT_PREFIXES) or not value:
                raise argparse.ArgumentTypeError(
                    f"{item!r}: give FASTCOMM_NAME=VALUE or NCCL_NAME=VALUE assignments, "
                    "separated by spaces"
                )
            env[name] = value
        settings.append(env)
    return settings


def env_label(env: dict[str, str]) -> str:
    """'TCP_SOCKETS=2 CHUNK_BYTES=1M' for {FASTCOMM_TCP_SOCKETS: 2, FASTCOMM_CHUNK_BYTES: 1M}."""
    return " ".join(f"{k.removeprefix('FASTCOMM_')}={v}" for k, v in env.items())


def _link_text(link: nb.Link) -> str:
    """'25 Gbit/s', '25 Gbit/s, 20 us delay' or '25 Gbit/s, 20 us delay, MTU 9000'."""
    text = nb.format_rate(link.rate_bps)
    if link.delay_us:
        text += f", {link.delay_us:g} us delay"
    return text + (f", MTU {link.mtu}" if link.mtu != nb.Link.mtu else "")


def _link(text: str) -> nb.Link:
    try:
        return nb.parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ----------------------------------------------------------------------------- launches


def setting_label(threads: int, socks: int, buffsize: Optional[int]) -> str:
    """'4x4' or '4x4 buf=16M' (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD, NCCL_BUFFSIZE)."""
    text = f"{threads}x{socks}"
    return text if buffsize is None else f"{text} buf={bc.format_size(buffsize)}"


def plan_launches(args: argparse.Namespace, out_dir: str, fallback: bool = False) -> list[Launch]:
    """The launches of the sweep, in run order, with their commands; with `fallback`, one more
    at the end: the peer alone at its default (for when the main launch failed)."""
    # Each backend in processes of its own by default: a backend's idle threads (NCCL's socket
    # proxies, fastcomm's progress threads) share the host's cores with the other's busy ones.
    together = args.together or not args.fastcomm
    main_backends = (["fastcomm"] if args.fastcomm else []) + ([args.peer] if together else [])
    launches = [Launch("main", "main", main_backends)]
    if not together:
        launches.append(Launch(f"{args.peer}-{DEFAULT_SETTING}", "peer", [args.peer]))
    for threads, socks in args.socket_settings:
        for buffsize in args.buffsizes:
            env = {"NCCL_SOCKET_NTHREADS": str(threads), "NCCL_NSOCKS_PERTHREAD": str(socks)}
            if buffsize is not None:
                env["NCCL_BUFFSIZE"] = str(buffsize)
            label = setting_label(threads, socks, buffsize)
            name = f"{args.peer}-" + label.replace(" buf=", "-buf")
            launches.append(Launch(name, "peer", [args.peer], label, env))
    for wire in args.wire_dtype:
        launches.append(
            Launch(
                f"fastcomm-{wire}",
                "wire",
                ["fastcomm"],
                wire_dtype=wire,
                series=f"fastcomm({wire})",
            )
        )
    for k, env in enumerate(args.fastcomm_env):
        label = env_label(env)
        launches.append(
            Launch(
                f"fastcomm-env{k}", "variant", ["fastcomm"], env=env, series=f"fastcomm({label})"
            )
        )
    if fallback:
        launches.append(Launch(f"{args.peer}-{DEFAULT_SETTING}", "peer", [args.peer]))
    if args.netbed:
        # One torchrun per node (run_launch fills in the node and the port): each node is a
        # host of its own, so bench_collectives itself simulates nothing.
        per_node = args.nproc_per_node // args.sim_nodes
        launcher = shlex.split(args.torchrun) + [
            f"--nnodes={args.sim_nodes}",
            "--node_rank=<node>",
            f"--nproc_per_node={per_node}",
            f"--master_addr={nb.SUBNET}.1",
            "--master_port=<port>",
        ]
    else:
        launcher = shlex.split(args.torchrun) + [
            "--standalone",
            f"--nproc_per_node={args.nproc_per_node}",
        ]
    base = launcher + [
        BENCH,
        "--device",
        args.device,
        "--ops",
        args.ops,
        "--sim-nodes",
        str(1 if args.netbed else args.sim_nodes),
        "--min-bytes",
        args.min_bytes,
        "--max-bytes",
        args.max_bytes,
    ]
    for flag, _ in PASSTHROUGH:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            base += [flag, str(value)]
    for launch in launches:
        launch.json = os.path.join(out_dir, f"{launch.name}.json")
        launch.cmd = base + ["--backends", ",".join(launch.backends)]
        if launch.wire_dtype:
            launch.cmd += ["--wire-dtype", launch.wire_dtype]
        launch.cmd += ["--json", launch.json, "--label", launch.name]
        launch.cmd += shlex.split(args.bench_args)
    return launches


def launch_env(launch: Launch) -> dict[str, str]:
    """The environment of one launch: ours without the swept variables, plus its own."""
    env = {k: v for k, v in os.environ.items() if k not in SWEPT_VARS}
    return env | LAUNCH_ENV | launch.env


def run_launch(
    launch: Launch,
    timeout: Optional[float],
    bed: Optional[nb.Netbed] = None,
    args: Optional[argparse.Namespace] = None,
    port: int = nb.DEFAULT_PORT,
) -> None:
    """Run one launch to its end (or its timeout), recording exit status and duration; with a
    testbed, one torchrun per node in its namespace."""
    shown = " ".join(f"{k}={v}" for k, v in (LAUNCH_ENV | launch.env).items())
    print(f"\n### launch {launch.name}: {shown} {shlex.join(launch.cmd)}", flush=True)
    if os.path.exists(launch.json):
        os.remove(launch.json)  # never merge a stale file
    if bed is not None and args is not None:
        per_node = args.nproc_per_node // args.sim_nodes
        commands = nb.torchrun_commands(
            bed.plan,
            launch.cmd[launch.cmd.index(BENCH) :],
            per_node,
            port,
            shlex.split(args.torchrun),
        )
        result = nb.launch(
            bed,
            commands,
            env=launch_env(launch),
            device=args.device,
            nproc_per_node=per_node,
            timeout=timeout,
        )
        launch.returncode, launch.seconds = result.worst, result.seconds
        launch.link = [result.as_dict()]
        print(f"### launch {launch.name}: {result.describe()}", flush=True)
        return
    start = time.monotonic()
    # setsid: torchrun and its ranks in a process group of their own, so a timeout stops them all.
    proc = subprocess.Popen(launch.cmd, env=launch_env(launch), start_new_session=True)
    try:
        launch.returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"### launch {launch.name}: timed out after {timeout:g} s, stopping it", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        launch.returncode = 124
    except BaseException:  # Ctrl-C, or the sweep stopped (SweepStopped)
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    launch.seconds = round(time.monotonic() - start, 1)
    print(f"### launch {launch.name}: exit {launch.returncode} in {launch.seconds} s", flush=True)


def for_round(launch: Launch, r: int, rounds: int) -> Launch:
    """The launch as run in round r (its own JSON file when there are several rounds)."""
    if rounds == 1:
        return launch
    copy_ = copy.deepcopy(launch)
    copy_.json = launch.json[: -len(".json")] + f".r{r}.json"
    copy_.cmd[copy_.cmd.index("--json") + 1] = copy_.json
    return copy_


def combine_rounds(datasets: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One launch's results over its rounds: per point the round with the median busbw (the
    lower middle for an even count; over the rounds that have the point); a point that any round
    failed keeps that round's row. Every round's busbw goes into rounds_busbw_gbps."""
    if len(datasets) == 1:
        return datasets[0]
    per_point: dict[tuple[str, str, int], list[Optional[dict[str, Any]]]] = {}
    for k, data in enumerate(datasets):
        for row in data["results"]:
            key = (row["backend"], row["op"], row["size_bytes"])
            per_point.setdefault(key, [None] * len(datasets))[k] = row
    rows = []
    for rounds in per_point.values():
        measured = [r for r in rounds if r is not None and r["status"] == "ok" and r["busbw_gbps"]]
        bad = [r for r in rounds if r is not None and r not in measured]
        if bad:
            row = dict(bad[0])
        else:
            pick = sorted(measured, key=lambda r: r["busbw_gbps"])[(len(measured) - 1) // 2]
            wrong = [r["wrong"] for r in measured if r.get("wrong") is not None]
            row = dict(pick, wrong=max(wrong) if wrong else None)
        row["rounds_busbw_gbps"] = [r["busbw_gbps"] if r is not None else None for r in rounds]
        rows.append(row)
    merged = copy.deepcopy(datasets[0])
    merged["results"] = rows
    merged["meta"]["rounds"] = len(datasets)
    merged["meta"]["partial"] = any(d["meta"].get("partial") for d in datasets)
    return merged


def rounds_table(merged: dict[str, Any]) -> str:
    """Markdown: busbw of every series and size over the rounds (min / median / max)."""
    lines = [
        "",
        f"busbw over {merged['meta']['sweep']['rounds']} rounds of launches (GB/s, min / "
        "median / max; the tables above show the median round):",
        "",
        "| op | size (B) | series | rounds | min | median | max |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for row in merged["results"]:
        values = [v for v in row.get("rounds_busbw_gbps") or [] if v is not None]
        if not values:
            continue
        shown = ", ".join(f"{v:.3g}" for v in row["rounds_busbw_gbps"] if v is not None)
        lines.append(
            f"| {row['op']} | {row['size_bytes']} | {row['backend']} | {shown} | "
            f"{min(values):.3g} | {statistics.median(values):.3g} | {max(values):.3g} |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- merging


def _row_key(row: dict[str, Any]) -> tuple[str, int]:
    return row["op"], row["size_bytes"]


def _usable(row: dict[str, Any]) -> bool:
    """A candidate for "best": measured and not wrong."""
    return row["status"] == "ok" and bool(row["busbw_gbps"]) and not row.get("wrong")


def merge(
    launches: Sequence[Launch],
    loaded: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    netbed: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """One bench_collectives result (same schema) with the series of the sweep; `netbed`: the
    testbed's plan (Plan.as_dict()) when the launches ran on one."""
    peer = args.peer
    default_series, best_series = f"{peer}({DEFAULT_SETTING})", f"{peer}(best)"
    rows: list[dict[str, Any]] = []  # in series order, re-sorted below

    def take(name: str, backend: str, series: str, setting: Optional[str]) -> None:
        for row in loaded.get(name, {}).get("results", []):
            if row["backend"] == backend:
                rows.append(dict(row, backend=series, setting=setting))

    # Candidates of the peer: its default run beside fastcomm, then every swept setting.
    candidates: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for launch in launches:
        if launch.role in ("main", "peer"):
            for row in loaded.get(launch.name, {}).get("results", []):
                if row["backend"] == peer:
                    candidates.setdefault(_row_key(row), []).append(
                        dict(row, setting=launch.setting)
                    )
    if args.fastcomm:
        take("main", "fastcomm", "fastcomm", None)
    defaults = [
        la.name for la in launches if la.setting == DEFAULT_SETTING and la.role in ("main", "peer")
    ]
    defaults = [
        name
        for name in defaults
        if any(r["backend"] == peer for r in loaded.get(name, {}).get("results", []))
    ]
    if defaults:
        take(defaults[0], peer, default_series, None)
    best_setting: dict[str, dict[str, str]] = {}
    table: dict[str, dict[str, dict[str, Optional[float]]]] = {}
    for (op, size), rows_here in candidates.items():
        usable = [r for r in rows_here if _usable(r)]
        best = max(usable, key=lambda r: r["busbw_gbps"]) if usable else rows_here[0]
        if not usable:
            best = dict(best, setting=None)
        rows.append(dict(best, backend=best_series))
        if best["setting"]:
            best_setting.setdefault(op, {})[str(size)] = best["setting"]
        table.setdefault(op, {})[str(size)] = {
            r["setting"]: (r["busbw_gbps"] if _usable(r) else None) for r in rows_here
        }
    for launch in launches:
        if launch.role == "wire":  # bench_collectives names the series itself
            take(launch.name, launch.series, launch.series, None)
        elif launch.role == "variant":
            take(launch.name, "fastcomm", launch.series, None)

    series_order = (["fastcomm"] if args.fastcomm else []) + [default_series, best_series]
    series_order += [la.series for la in launches if la.role in ("wire", "variant")]
    series_order = [s for s in series_order if any(r["backend"] == s for r in rows)]
    ops = list(dict.fromkeys(r["op"] for d in loaded.values() for r in d["results"]))
    rank = {s: k for k, s in enumerate(series_order)}
    rows.sort(key=lambda r: (ops.index(r["op"]), r["size_bytes"], rank.get(r["backend"], 99)))

    base_name = "main" if "main" in loaded else next(iter(loaded))
    meta = copy.deepcopy(loaded[base_name]["meta"])
    meta.pop("source", None)
    meta.pop("partial", None)  # said per launch below
    wins: dict[str, dict[str, int]] = {}
    for op, per_size in best_setting.items():
        for setting in per_size.values():
            wins.setdefault(op, {}).setdefault(setting, 0)
            wins[op][setting] += 1
    meta.update(
        {
            "label": args.label
            or f"simulated {args.sim_nodes}-node sweep"
            + (f" over {_link_text(args.netbed)}" if args.netbed else ""),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(sys.argv),
            "launcher_cmdline": shlex.join([sys.executable] + sys.argv),
            "backends": series_order,
            "series": {s: (peer if s.startswith(peer + "(") else "fastcomm") for s in series_order},
            "skipped": {k: v for d in loaded.values() for k, v in d["meta"]["skipped"].items()},
            "sweep": {
                "peer": peer,
                "base_launch": base_name,
                "best_rule": "per op and size, the highest busbw over the peer's default and "
                "every swept setting, among points with no wrong element",
                "settings": [la.setting for la in launches if la.role in ("main", "peer")],
                "best_setting": best_setting,  # op -> size (str) -> winning setting
                "best_wins": wins,  # op -> setting -> number of sizes it won
                "busbw_by_setting": table,  # op -> size (str) -> setting -> busbw (None: bad)
                "launch_env": LAUNCH_ENV,
                "rounds": args.rounds,
                "launches": [
                    {
                        "name": la.name,
                        "setting": la.setting if la.role in ("main", "peer") else None,
                        "series": la.series or None,
                        "backends": la.backends,
                        "env": LAUNCH_ENV | la.env,
                        "cmd": la.cmd,
                        "json": la.json,
                        "returncode": la.returncode,
                        "seconds": la.seconds,
                        "loaded": la.name in loaded,
                        "partial": bool(loaded.get(la.name, {}).get("meta", {}).get("partial")),
                        "netbed": la.link,
                    }
                    for la in launches
                ],
            },
        }
    )
    if netbed is not None:
        # Each node a host of its own: the simulated nodes are the testbed's namespaces.
        per_node = args.nproc_per_node // args.sim_nodes
        meta["sim_nodes"] = {
            "nodes": args.sim_nodes,
            "ranks_per_node": per_node,
            "host_id_by_rank": meta.get("sim_nodes", {}).get("host_id_by_rank", []),
            "set": {},
            "kept": {},
        }
        meta["netbed"] = netbed | {
            "bytes_by_launch": {
                la.name: sum(sum(x["link_tx_bytes"]) for x in la.link) for la in launches if la.link
            }
        }
    wire = [la for la in launches if la.role == "wire" and la.name in loaded]
    if wire:
        meta["wire_dtype"] = ",".join(la.wire_dtype for la in wire)
        for key in ("check_rtol", "check_max_rtol"):
            meta[key] = {}
            for la in wire:
                meta[key].update(loaded[la.name]["meta"].get(key, {}))
    merged = {"schema": bc.SCHEMA, "meta": meta, "results": rows}
    merged["summary"] = bc.summarize([bc.Row(**r) for r in rows], series_order)
    return merged


# ----------------------------------------------------------------------------- main


class SweepStopped(Exception):
    """SIGTERM or SIGHUP (a timeout around the sweep): stop the launch that runs, keep the rest."""


def _stop_on_signal(signum: int, _frame: Any) -> None:
    # Later signals take their default action: a second TERM ends the merge too.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    raise SweepStopped(signal.Signals(signum).name)


def run_all_or_stop(
    args: argparse.Namespace, launches: list[Launch], out_dir: str, bed: Optional[nb.Netbed]
) -> bool:
    """run_all; False where a signal stopped it (what ran so far is merged all the same)."""
    try:
        run_all(args, launches, out_dir, bed)
    except SweepStopped as exc:
        print(f"### stopped by {exc}: merging what the launches measured so far", flush=True)
        return False
    return True


def run_all(
    args: argparse.Namespace, launches: list[Launch], out_dir: str, bed: Optional[nb.Netbed]
) -> None:
    """Every launch, round after round (a launch's record: its first failure, total time)."""
    port = args.master_port
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"\n### round {r + 1} of {args.rounds}", flush=True)
        for la in list(launches):
            ran = for_round(la, r, args.rounds)
            run_launch(ran, args.launch_timeout, bed, args, port)
            port += 1
            if ran is not la:
                la.returncode = ran.returncode if la.returncode in (0, None) else la.returncode
                la.seconds = (la.seconds or 0.0) + (ran.seconds or 0.0)
                if ran.link is not None:
                    la.link = (la.link or []) + ran.link
            alone_planned = any(x.role == "peer" and x.setting == DEFAULT_SETTING for x in launches)
            if la.role == "main" and not alone_planned and not os.path.exists(ran.json):
                # fastcomm failed the whole launch: measure the peer's default on its own.
                alone = plan_launches(args, out_dir, fallback=True)[-1]
                print(f"### no result from {la.name}: adding {alone.name}", flush=True)
                launches.insert(launches.index(la) + 1, alone)
                run_launch(for_round(alone, r, args.rounds), args.launch_timeout, bed, args, port)
                port += 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the launches (unless --merge-only), merge, report; 1 when a launch failed."""
    args = parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or os.path.join(tempfile.gettempdir(), f"fastcomm-sweep-{stamp}")
    launches = plan_launches(args, out_dir)
    if args.dry_run:
        for r in range(args.rounds):
            for la in launches:
                la = for_round(la, r, args.rounds)
                env = " ".join(f"{k}={v}" for k, v in (LAUNCH_ENV | la.env).items())
                print(f"{env} {shlex.join(la.cmd)}")
        return 0
    os.makedirs(out_dir, exist_ok=True)
    print(f"### {len(launches)} launches, results in {out_dir}", flush=True)
    dropped = {k: os.environ[k] for k in SWEPT_VARS if k in os.environ}
    if dropped:
        print(f"### note: not passing {dropped} on: the sweep sets these itself", flush=True)
    netbed_meta: Optional[dict[str, Any]] = None
    completed = True
    if not args.merge_only:
        # SIGTERM (a timeout around the sweep) and SIGHUP stop the launch that runs (and delete
        # the testbed's namespaces on the way out); the results so far are still merged.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _stop_on_signal)
    if not args.merge_only and args.netbed:
        try:
            with nb.Netbed(args.sim_nodes, args.netbed, args.iproute2, log=sys.stdout) as bed:
                netbed_meta = bed.plan.as_dict()
                try:
                    ceiling = bed.tcp_ceiling()
                    netbed_meta["tcp_ceiling_gbps"] = ceiling
                    print(f"### {TCP_CEILING_TEXT}: {ceiling:.3f} GB/s per direction", flush=True)
                except nb.NetbedError as exc:  # the sweep itself does not need it
                    print(f"### no plain-TCP figure: {exc}", file=sys.stderr)
                completed = run_all_or_stop(args, launches, out_dir, bed)
        except nb.NetbedError as exc:
            print(f"### no testbed: {exc}", file=sys.stderr)
            return 1
        except SweepStopped as exc:  # while the testbed was set up or measured
            print(f"### stopped by {exc} before any launch", file=sys.stderr)
            return 1
    elif not args.merge_only:
        completed = run_all_or_stop(args, launches, out_dir, None)
    elif (args.fastcomm and args.together) and not os.path.exists(
        for_round(launches[0], 0, args.rounds).json
    ):
        launches.insert(1, plan_launches(args, out_dir, fallback=True)[-1])
    loaded: dict[str, dict[str, Any]] = {}
    for la in launches:
        files = [for_round(la, r, args.rounds).json for r in range(args.rounds)]
        found = [f for f in files if os.path.exists(f)]
        for f in files:
            if f not in found:
                print(f"### launch {la.name}: no result file {f}", file=sys.stderr)
        if found:
            loaded[la.name] = combine_rounds(bc.load_results(found))
    if not loaded:
        print("### nothing to merge", file=sys.stderr)
        return 1
    merged = merge(launches, loaded, args, netbed_meta)
    if not completed:
        merged["meta"]["interrupted"] = True
    print()
    print(bc.render_markdown(merged), flush=True)
    outputs = argparse.Namespace(json=args.json, md=args.md, plot=args.plot, label=args.label)
    bc.write_outputs(merged, outputs)
    if netbed_meta and "tcp_ceiling_gbps" in netbed_meta:
        line = f"\n{TCP_CEILING_TEXT}: {netbed_meta['tcp_ceiling_gbps']:.3f} GB/s per direction.\n"
        print(line, flush=True)
        if args.md:
            with open(args.md, "a") as f:
                f.write(line)
    if args.rounds > 1:
        table = rounds_table(merged)
        print(table, flush=True)
        if args.md:
            with open(args.md, "a") as f:
                f.write(table)
    failed = [la.name for la in launches if la.returncode not in (0, None)]
    missing = [la.name for la in launches if la.name not in loaded]
    if failed or missing:
        print(f"### failed launches: {failed or 'none'}; without results: {missing or 'none'}")
    return 1 if failed or missing or not completed else 0


if __name__ == "__main__":
    sys.exit(main())
