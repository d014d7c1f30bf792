r"""A shaped-link testbed: N simulated nodes on one machine, each a Linux network namespace.

Every node is a namespace with loopback up and one interface with an IPv4 address of its own
(10.77.0.<i+1>/24; the addresses exist only inside the namespaces). Two nodes are joined by one
veth pair; more than two by a Linux bridge in a hub namespace, every node's veth peer one of its
ports. Every link is shaped in both directions with tc: a tbf qdisc at the link rate on the
egress of both ends. With a one-way delay, the link is a pair of TAP interfaces joined by the
delay line (benchmarks/netbed_delay.c, built with cc on first use) instead of a veth pair: it
holds every frame for the delay before passing it on (the kernel's netem qdisc would, but the
kernels of the machines this runs on lack it). With a bridge, the delay sits between each node
and its bridge port in the node-to-hub direction only, so node to node the delay is the one
asked for, not twice it.
Every interface receives with RPS over all CPUs: a veth hands each packet to the backlog of the
CPU that dequeued it from tbf, and tbf dequeues from whichever CPU sends or runs its timer, so
without RPS one flow's packets are received on several CPUs at once and arrive out of order
(SACK reordering, spurious retransmissions and, under many flows, retransmission timeouts that a
NIC's per-flow receive queues do not cause); RPS hashes each flow to one CPU.

One torchrun runs per node inside its namespace (ip netns exec), with --nnodes N --node_rank i
and the rendezvous on node 0's address; each node's processes get FASTCOMM_HOST_ID and
NCCL_HOSTID (the namespaces share the hostname, the boot id and /dev/shm: without these, fastcomm
and NCCL would treat them as one host and use shared memory between them), the veth as
FASTCOMM_SOCKET_IFNAME, NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, NCCL_NET=Socket and
NCCL_IB_DISABLE=1; with --device cuda the GPUs are split by CUDA_VISIBLE_DEVICES. The byte
counters of each node's veth are read before and after a launch: the report says how many bytes
crossed the links (traffic between ranks of one node never does).

Everything is torn down on exit, also on failure, Ctrl-C, SIGTERM and SIGHUP; should the owning
process die without tearing down (SIGKILL, a crash), a reaper process it started removes the
namespaces (and, with them, the veths and the bridge) when the owner's pipe closes. Names carry
the owner's pid and a random tag (netbed-<pid>-<tag>-n<i>, netbed-<pid>-<tag>-hub); namespaces
of that pattern whose owner is no longer alive are removed when a testbed starts.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ip and tc: from PATH (and /sbin,
/usr/sbin), else from --iproute2 DIR / NETBED_IPROUTE2, a folder holding Debian's iproute2 and
its libraries unpacked with dpkg -x (run with LD_LIBRARY_PATH set to its lib folders).

    python benchmarks/netbed.py --nodes 2 --rate 25gbit --delay 20us --nproc-per-node 2 \
        --device cpu -- benchmarks/bench_collectives.py --device cpu --max-bytes 64M
    python benchmarks/netbed.py --nodes 3 --rate 10gbit --plan      # show the plan, no root
    python benchmarks/netbed.py --check                             # can namespaces be made?
    python benchmarks/netbed.py --nodes 2 --rate 1gbit --raw -- sh -c 'ip addr'
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Iterable, Optional, Sequence

SUBNET = "10.77.0"  # node i is SUBNET.(i + 1)/24, inside the namespaces only
PREFIX = "netbed"
NS_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{4}})-(n\d+|hub)$")
DEFAULT_PORT = 29400
IPROUTE2_ENV = "NETBED_IPROUTE2"
# Per-node variables that make the namespaces distinct hosts on their veth.
HOST_ID_VARS = ("FASTCOMM_HOST_ID", "NCCL_HOSTID")
IFNAME_VARS = ("FASTCOMM_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
NET_ENV = {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
DELAY_LINE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netbed_delay.c")
TAP_TXQUEUELEN = 10000  # frames a TAP holds for the delay line to read (it drops beyond)
MAX_DELAY_QUEUES = 4  # queues per delay line: a forwarding thread (a busy core) per queue and way
DELAY_QUEUES_LIMIT = 16  # the most queues the delay line takes (netbed_delay.c's kMaxQueues)
MAX_GSO_BYTES = 64 << 10  # veth passes TCP segments of up to 64 KiB through the qdiscs
MIN_QUEUE_BYTES = 4 << 20
MIN_MTU, MAX_MTU = 576, 65535  # IPv4's smallest datagram every host takes; veth's largest
RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
TIME_UNITS = {"us": 1.0, "µs": 1.0, "usec": 1.0, "ms": 1e3, "msec": 1e3, "s": 1e6, "sec": 1e6}


class NetbedError(RuntimeError):
    """A testbed could not be set up (the message says which command failed and why)."""


# ----------------------------------------------------------------------------- link settings


def parse_rate(text: str) -> int:
    """'25gbit', '100Gbit', '10g', '500mbit', '1.5gbit' -> bits per second (SI units, as tc).

    A byte rate ('bps', 'GB/s') is refused: tc reads 'bps' as bytes, people often as bits.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit)?(?:/s)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a bit rate: {text!r} (examples: 10gbit, 25gbit, 100gbit, 500mbit)")
    bps = round(float(m.group(1)) * RATE_UNITS[m.group(2).lower()])
    if bps < 8000:
        raise ValueError(f"rate {text!r} is below 8 kbit/s")
    return bps


def parse_delay(text: str) -> float:
    """'20us', '20µs', '0.05ms', '0' -> microseconds (a non-zero delay needs a unit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zµ]*)\s*", text, re.IGNORECASE)
    if m is None or (
        m.group(2).lower() not in TIME_UNITS and not (m.group(2) == "" and not float(m.group(1)))
    ):
        raise ValueError(f"not a delay: {text!r} (examples: 0, 10us, 20us, 0.05ms)")
    return float(m.group(1)) * TIME_UNITS.get(m.group(2).lower(), 1.0)


def format_rate(bps: float) -> str:
    """25e9 -> '25 Gbit/s'."""
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}bit/s"
    return f"{bps:g} bit/s"


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g} B"


@dataclasses.dataclass(frozen=True)
class Link:
    """How every node's link is shaped (both directions alike).

    burst: tbf's bucket; by default two 64 KiB segments or 16 us at the rate, whichever is
    more: smaller would split veth's segments in tbf (costing CPU), larger lets a message of
    that size pass unshaped after an idle gap. queue: how long a backlog tbf holds before it
    drops: its limit is the bytes of queue_us at the rate (at least MIN_QUEUE_BYTES: a bulk TCP
    flow overshoots a queue of a few segments, and its losses would cut the rate), plus the burst.
    """

    rate_bps: int
    delay_us: float = 0.0
    burst_bytes: Optional[int] = None
    queue_us: float = 2000.0
    mtu: int = 1500

    @property
    def burst(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(2 * MAX_GSO_BYTES, round(self.rate_bps / 8 * 16e-6))

    @property
    def limit(self) -> int:
        return max(round(self.rate_bps / 8 * self.queue_us * 1e-6), MIN_QUEUE_BYTES) + self.burst

    def describe(self) -> str:
        delay = f"{self.delay_us:g} us one-way delay (delay line)" if self.delay_us else "no delay"
        return (
            f"{format_rate(self.rate_bps)} ({self.rate_bps / 8e9:.4g} GB/s) each way, {delay}; "
            f"tbf burst {format_bytes(self.burst)}, queue {self.queue_us / 1e3:g} ms "
            f"(limit {format_bytes(self.limit)}); MTU {self.mtu}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate_bps": self.rate_bps,
            "rate": format_rate(self.rate_bps),
            "rate_gbyte_s": self.rate_bps / 8e9,
            "delay_us": self.delay_us,
            "burst_bytes": self.burst,
            "queue_us": self.queue_us,
            "limit_bytes": self.limit,
            "mtu": self.mtu,
        }


def parse_mtu(text: str) -> int:
    """'9000' -> 9000: an Ethernet MTU a veth takes (IPv4's 576 to 65535)."""
    if not re.fullmatch(r"\s*\d+\s*", text) or not MIN_MTU <= int(text) <= MAX_MTU:
        raise ValueError(f"not an MTU: {text!r} ({MIN_MTU} to {MAX_MTU}, e.g. 1500 or 9000)")
    return int(text)


def parse_link(text: str) -> Link:
    """'25gbit', '25gbit,20us', '25gbit,mtu9000' or '100gbit,20us,mtu9000'
    (RATE[,DELAY][,mtuMTU]) -> Link."""
    rate, *parts = text.split(",")
    settings: dict[str, Any] = {}
    for part in filter(str.strip, parts):
        key = "mtu" if part.strip().lower().startswith("mtu") else "delay_us"
        if key in settings:
            raise ValueError(f"link {text!r} gives the {key.removesuffix('_us')} twice")
        settings[key] = parse_mtu(part.strip()[3:]) if key == "mtu" else parse_delay(part)
    return Link(parse_rate(rate), **settings)


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Node:
    """One simulated node: its namespace, its veth (the interface its traffic uses), address."""

    rank: int
    netns: str
    ifname: str
    addr: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """Names, addresses and the ip / tc commands of one testbed (computed without root)."""

    tag: str  # <pid>-<4 hex>
    nodes: tuple[Node, ...]
    link: Link
    hub: Optional[str] = None  # the hub namespace (more than two nodes)
    bridge: Optional[str] = None
    delay_queues: int = 1  # queues of each delay line's TAP interfaces (delay_line_queues())

    @property
    def namespaces(self) -> list[str]:
        return [n.netns for n in self.nodes] + ([self.hub] if self.hub else [])

    @property
    def master_addr(self) -> str:
        return self.nodes[0].addr

    def hub_port(self, rank: int) -> str:
        return f"nb{self.tag[-4:]}h{rank}"

    def _shape(self, netns: str, dev: str) -> list[list[str]]:
        tbf = ["tbf", "rate", f"{self.link.rate_bps}bit", "burst", str(self.link.burst)]
        tbf += ["limit", str(self.link.limit)]
        return [["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:"] + tbf]

    def _join(self, ns_a: str, if_a: str, ns_b: str, if_b: str, b_to_a_us: float) -> list[str]:
        """The command that makes the link between two interfaces: a veth pair, or with a delay
        the delay line ['delay', ns_a, if_a, ns_b, if_b, a-to-b ns, b-to-a ns, queues]."""
        if not self.link.delay_us:
            return ["ip", "link", "add", if_a, "netns", ns_a, "type", "veth"] + [
                "peer", "name", if_b, "netns", ns_b,
            ]  # fmt: skip
        d = round(self.link.delay_us * 1e3)
        return ["delay", ns_a, if_a, ns_b, if_b, str(d), str(round(b_to_a_us * 1e3))] + [
            str(self.delay_queues)
        ]

    def setup_commands(self) -> list[list[str]]:
        """Commands in order; each starts with 'ip' or 'tc' (the tool to run), or 'delay' (a
        delay line to start: its namespaces and interfaces, then the delay of each direction
        in ns)."""
        cmds = [["ip", "netns", "add", ns] for ns in self.namespaces]
        if self.hub is None:
            a, b = self.nodes
            cmds.append(self._join(a.netns, a.ifname, b.netns, b.ifname, self.link.delay_us))
            ends = [(a.netns, a.ifname), (b.netns, b.ifname)]
        else:
            cmds.append(["ip", "-n", self.hub, "link", "add", self.bridge, "type", "bridge"])
            cmds.append(["ip", "-n", self.hub, "link", "set", self.bridge, "up"])
            ends = []
            for n in self.nodes:
                port = self.hub_port(n.rank)
                cmds.append(self._join(n.netns, n.ifname, self.hub, port, 0.0))
                cmds.append(["ip", "-n", self.hub, "link", "set", port, "master", self.bridge])
                cmds.append(
                    ["ip", "-n", self.hub, "link", "set", port, "mtu", str(self.link.mtu), "up"]
                )
                ends += [(n.netns, n.ifname), (self.hub, port)]
        if self.link.delay_us:  # TAP interfaces: room for a burst while the delay line reads
            cmds += [
                ["ip", "-n", netns, "link", "set", dev, "txqueuelen", str(TAP_TXQUEUELEN)]
                for netns, dev in ends
            ]
        for n in self.nodes:
            cmds.append(["ip", "-n", n.netns, "link", "set", "lo", "up"])
            cmds.append(["ip", "-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.ifname])
            cmds.append(
                ["ip", "-n", n.netns, "link", "set", n.ifname, "mtu", str(self.link.mtu), "up"]
            )
        cmds += [self._rps(netns, dev) for netns, dev in ends]
        for netns, dev in ends:
            cmds += self._shape(netns, dev)
        return cmds

    @staticmethod
    def _rps(netns: str, dev: str) -> list[str]:
        """Receive packet steering over every CPU for `dev`'s receive queues (module docstring):
        a flow's packets are then received on one CPU, in order."""
        mask = rps_mask(usable_cpus())
        script = f"for q in /sys/class/net/{dev}/queues/rx-*; do echo {mask} > $q/rps_cpus; done"
        # sh without the unpacked iproute2 libraries (Tools.env) that ip itself may need
        return ["ip", "netns", "exec", netns, "env", "-u", "LD_LIBRARY_PATH", "sh", "-c", script]

    def node_env(self, rank: int) -> dict[str, str]:
        """The variables a node's processes get (see the module docstring)."""
        n = self.nodes[rank]
        env = {k: f"netnode{rank}" for k in HOST_ID_VARS}
        env |= {k: n.ifname for k in IFNAME_VARS}
        return env | NET_ENV

    @property
    def topology(self) -> str:
        """What joins the nodes, as a noun ('joined by a ...')."""
        if self.hub:
            return "bridge" + (
                " (each node's port through a delay line)" if self.link.delay_us else ""
            )
        if self.link.delay_us:
            return f"delay line between TAP interfaces of {self.delay_queues} queue(s)"
        return "veth pair"

    def describe(self) -> str:
        """The topology and the link settings, for people."""
        lines = [f"netbed {self.tag}: {len(self.nodes)} nodes, {self.link.describe()}"]
        for n in self.nodes:
            lines.append(f"  node {n.rank}: netns {n.netns}, {n.ifname} {n.addr}/24")
        if self.hub:
            lines.append(
                f"  hub: netns {self.hub}, bridge {self.bridge}, ports "
                + ", ".join(self.hub_port(n.rank) for n in self.nodes)
                + " (tbf on the ports too; the delay node to hub only)"
            )
        else:
            lines.append(f"  one {self.topology} {self.nodes[0].ifname} <-> {self.nodes[1].ifname}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes": len(self.nodes),
            "topology": self.topology,
            "link": self.link.as_dict(),
            "node_addrs": [n.addr for n in self.nodes],
            "node_ifnames": [n.ifname for n in self.nodes],
            "shaping": "tbf on the egress of both ends of every link"
            + (
                "; the one-way delay held by the delay line (benchmarks/netbed_delay.c)"
                if self.link.delay_us
                else ""
            ),
            "receive": "RPS over all CPUs on every interface (a flow on one CPU, in order)",
        }


def make_plan(
    nodes: int, link: Link, tag: Optional[str] = None, delay_queues: Optional[int] = None
) -> Plan:
    """The plan of a testbed of `nodes` nodes (2..250); `tag` defaults to <pid>-<random>,
    `delay_queues` (the delay lines' queues, 1..DELAY_QUEUES_LIMIT) to delay_line_queues()."""
    if not 2 <= nodes <= 250:
        raise ValueError(f"nodes must be 2..250, not {nodes}")
    tag = tag or f"{os.getpid()}-{secrets.token_hex(2)}"
    short = tag[-4:]
    members = tuple(
        Node(i, f"{PREFIX}-{tag}-n{i}", f"nb{short}n{i}", f"{SUBNET}.{i + 1}") for i in range(nodes)
    )
    queues = delay_line_queues() if delay_queues is None else delay_queues
    if not 1 <= queues <= DELAY_QUEUES_LIMIT:
        raise ValueError(f"delay_queues must be 1..{DELAY_QUEUES_LIMIT}, not {queues}")
    if nodes == 2:
        return Plan(tag, members, link, delay_queues=queues)
    return Plan(
        tag, members, link, hub=f"{PREFIX}-{tag}-hub", bridge=f"nb{short}br", delay_queues=queues
    )


def delay_line_queues(cpus: Optional[int] = None) -> int:
    """Queues per delay line: one thread copies ~3 GB/s each way, so faster links need several
    (the kernel puts each flow on one queue); each busy queue takes a core per direction, so a
    quarter of the CPUs at most, 1..MAX_DELAY_QUEUES."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, min(MAX_DELAY_QUEUES, cpus // 4))


# ----------------------------------------------------------------------------- ip and tc


@dataclasses.dataclass(frozen=True)
class Tools:
    """Where ip and tc are, and the library folders they need (unpacked debs only)."""

    ip: str
    tc: str
    lib_dirs: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.lib_dirs:
            old = os.environ.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = ":".join(self.lib_dirs + ((old,) if old else ()))
        return env

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ['ip'|'tc', args...]; raises NetbedError with stderr when it fails."""
        exe = {"ip": self.ip, "tc": self.tc}[argv[0]]
        try:
            out = subprocess.run(
                [exe, *argv[1:]], env=self.env(), capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NetbedError(f"{shlex.join(argv)}: {exc}") from exc
        if out.returncode != 0:
            raise NetbedError(
                f"{shlex.join(argv)} exited {out.returncode}: {out.stderr.strip() or out.stdout}"
            )
        return out

    def exec_prefix(self, netns: str) -> list[str]:
        """The command prefix that runs a program inside `netns`, without our library path."""
        prefix = [self.ip, "netns", "exec", netns]
        if self.lib_dirs:  # keep the unpacked libraries away from the program itself
            old = os.environ.get("LD_LIBRARY_PATH")
            prefix += ["env"] + ([f"LD_LIBRARY_PATH={old}"] if old else ["-u", "LD_LIBRARY_PATH"])
        return prefix


def find_tools(iproute2: Optional[str] = None) -> Tools:
    """ip and tc from `iproute2` (or $NETBED_IPROUTE2): a dpkg -x folder; else from PATH."""
    root = iproute2 or os.environ.get(IPROUTE2_ENV)
    if root:
        found = {}
        for name in ("ip", "tc"):
            for sub in ("sbin", "bin", "usr/sbin", "usr/bin"):
                path = os.path.join(root, sub, name)
                if os.access(path, os.X_OK):
                    found[name] = path
                    break
            else:
                raise NetbedError(f"no {name} under {root} (unpack iproute2's deb with dpkg -x)")
        libs = [
            d
            for pattern in ("lib/*-linux-gnu", "usr/lib/*-linux-gnu", "lib", "usr/lib")
            for d in sorted(glob.glob(os.path.join(root, pattern)))
            if glob.glob(os.path.join(d, "*.so*"))
        ]
        return Tools(found["ip"], found["tc"], tuple(dict.fromkeys(libs)))
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    ip, tc = shutil.which("ip", path=path), shutil.which("tc", path=path)
    if not ip or not tc:
        raise NetbedError(
            f"ip and tc not found on PATH (ip: {ip}, tc: {tc}); install iproute2 or pass "
            f"--iproute2 DIR / {IPROUTE2_ENV} (Debian debs unpacked with dpkg -x)"
        )
    return Tools(ip, tc)


def list_namespaces(tools: Tools) -> list[str]:
    out = tools.run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespaces(tools: Tools, names: Sequence[str], grace_s: float = 3.0) -> list[str]:
    """Kill every process inside the namespaces, then delete them (their veths and bridge go
    with them). Returns the errors, if any."""
    existing = set(list_namespaces(tools)) if names else set()
    names = [n for n in names if n in existing]
    errors = kill_in_namespaces(tools, names, grace_s)
    for ns in names:
        try:
            tools.run(["ip", "netns", "delete", ns])
        except NetbedError as exc:
            errors.append(str(exc))
    return errors


def kill_in_namespaces(tools: Tools, names: Sequence[str], grace_s: float = 3.0) -> list[str]:
    """SIGTERM every process inside the namespaces (only a testbed's programs run there), then
    SIGKILL those left after grace_s. Returns the errors, if any."""
    errors: list[str] = []
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = set()
        for ns in names:
            try:
                pids |= {int(p) for p in tools.run(["ip", "netns", "pids", ns]).stdout.split()}
            except NetbedError as exc:
                errors.append(str(exc))
        pids.discard(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p) and not _zombie(p)}
            time.sleep(0.05)
        if not pids:
            break
    return errors


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def clean_stale(tools: Tools) -> list[str]:
    """Remove testbed namespaces (netbed-<pid>-<tag>-...) whose owner pid is gone."""
    stale = [
        ns
        for ns in list_namespaces(tools)
        if (m := NS_RE.match(ns)) and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))
    ]
    if stale:
        remove_namespaces(tools, stale, grace_s=1.0)
    return stale


# ----------------------------------------------------------------------------- the testbed


# Run in each of two nodes by Netbed.tcp_ceiling: listens on its address, opens `streams`
# connections to the peer, sends for `seconds` while receiving, prints the GB/s it received.
TCP_PROBE = r"""
import socket, sys, threading, time
me, peer, port, streams, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
srv = socket.create_server((me, port), backlog=streams)
outs, deadline = [], time.monotonic() + 30
while len(outs) < streams:
    try:
        outs.append(socket.create_connection((peer, port), timeout=1))
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
ins = [srv.accept()[0] for _ in range(streams)]
got, first, last = [0] * streams, [None] * streams, [0.0] * streams
buf = memoryview(bytearray(4 << 20))
def send(s):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        s.sendall(buf)
    s.shutdown(socket.SHUT_WR)
def recv(i, s):
    m = memoryview(bytearray(4 << 20))
    while True:
        n = s.recv_into(m)
        if not n:
            return
        now = time.monotonic()
        if first[i] is None:
            first[i] = now
        else:
            got[i] += n
        last[i] = now
th = [threading.Thread(target=send, args=(s,)) for s in outs]
th += [threading.Thread(target=recv, args=(i, s)) for i, s in enumerate(ins)]
for t in th:
    t.start()
for t in th:
    t.join()
span = max(last) - min(f for f in first if f is not None)
print(sum(got) / span / 1e9)
"""


@dataclasses.dataclass
class Counters:
    """Byte counters of one node's veth (what crossed its link, both directions)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    qdisc_drops: int  # packets the node end's qdiscs dropped (queue full)
    tcp_retransmits: int = 0  # TCP segments the node's namespace sent again (RetransSegs)
    # Retransmission timeouts in the node's namespace (TcpExt TCPTimeouts): each stalls a flow
    # for at least the minimum RTO (200 ms on Linux), which a collective's time shows.
    tcp_timeouts: int = 0
    veth_drops: int = 0  # packets the node's veth dropped, either direction (not the qdisc's)
    # Segments the node's receiving sockets dropped or pruned (TcpExt TCPRcvQDrop, TCPOFODrop,
    # RcvPruned, OfoPruned, TCPBacklogDrop): losses that no link counter sees.
    tcp_rcv_drops: int = 0
    # Retransmissions the peers reported as unneeded (TcpExt TCPDSACKRecv, TCPDSACKOfoRecv):
    # spurious ones, sent on delay or reordering, not on loss.
    tcp_spurious: int = 0

    def minus(self, other: "Counters") -> "Counters":
        return Counters(
            *(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )


class Netbed:
    """The testbed as a context manager: `with Netbed(2, Link(...)) as bed: launch(bed, ...)`.

    On entry: removes stale testbeds, starts the reaper, runs the plan's commands (a failure
    tears down what was made and raises NetbedError). On exit, or close(): stops every process
    started in the namespaces and deletes them.
    """

    def __init__(
        self,
        nodes: int,
        link: Link,
        iproute2: Optional[str] = None,
        tag: Optional[str] = None,
        log: Optional[IO[str]] = None,
        delay_queues: Optional[int] = None,
    ) -> None:
        self.tools = find_tools(iproute2)
        self.plan = make_plan(nodes, link, tag, delay_queues)
        self.log = log
        self._reaper: Optional[subprocess.Popen] = None
        self._procs: list[subprocess.Popen] = []
        self._delay_lines: list[subprocess.Popen] = []
        self._closed = True

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self.plan.nodes

    def _say(self, text: str) -> None:
        if self.log is not None:
            print(text, file=self.log, flush=True)

    def __enter__(self) -> "Netbed":
        stale = clean_stale(self.tools)
        if stale:
            self._say(f"netbed: removed stale namespaces {', '.join(stale)}")
        self._closed = False
        self._start_reaper()
        try:
            for cmd in self.plan.setup_commands():
                if cmd[0] == "delay":
                    self._delay_lines.append(start_delay_line(cmd[1:]))
                else:
                    self.tools.run(cmd)
        except BaseException:
            self.close()
            raise
        self._say(self.plan.describe())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start_reaper(self) -> None:
        """A process that deletes the namespaces if we die before close(): it waits for EOF on
        its stdin (our end closes when we exit, however we exit); 'done' first means closed."""
        spec = json.dumps(
            {"ip": self.tools.ip, "tc": self.tools.tc, "libs": list(self.tools.lib_dirs)}
            | {"namespaces": self.plan.namespaces}
        )
        self._reaper = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--reap", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C and the terminal's hangup do not reach it
            close_fds=True,
        )

    def close(self) -> None:
        """Stop the programs started in the namespaces, delete the namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _stop(proc)
        for line in self._delay_lines:  # its TAP interfaces go with it
            stop_delay_line(line)
        errors = remove_namespaces(self.tools, self.plan.namespaces)
        left = set(self.plan.namespaces) & set(list_namespaces(self.tools))
        if self._reaper is not None:
            try:
                if not left:  # else the reaper tries once more
                    self._reaper.stdin.write(b"done\n")
                self._reaper.stdin.close()
                self._reaper.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._reaper.kill()
        if left:
            raise NetbedError(f"teardown left namespaces {sorted(left)}: {'; '.join(errors)}")

    def node_env(self, rank: int) -> dict[str, str]:
        return self.plan.node_env(rank)

    def popen(
        self, rank: int, argv: Sequence[str], env: dict[str, str], **kw: Any
    ) -> subprocess.Popen:
        """Start `argv` in node `rank`'s namespace, in a process group of its own."""
        full_env = dict(env)
        if self.tools.lib_dirs:
            full_env["LD_LIBRARY_PATH"] = self.tools.env()["LD_LIBRARY_PATH"]
        proc = subprocess.Popen(
            self.tools.exec_prefix(self.nodes[rank].netns) + list(argv),
            env=full_env,
            start_new_session=True,
            **kw,
        )
        self._procs.append(proc)
        return proc

    def counters(self) -> list[Counters]:
        """Per node: the counters of its veth."""
        out = []
        for n in self.nodes:
            info = json.loads(
                self.tools.run(
                    ["ip", "-n", n.netns, "-s", "-j", "link", "show", "dev", n.ifname]
                ).stdout
            )[0]["stats64"]
            qdiscs = json.loads(
                self.tools.run(
                    ["tc", "-n", n.netns, "-s", "-j", "qdisc", "show", "dev", n.ifname]
                ).stdout
                or "[]"
            )
            tcp = self._tcp_counters(n.netns)
            out.append(
                Counters(
                    info["tx"]["bytes"],
                    info["rx"]["bytes"],
                    info["tx"]["packets"],
                    info["rx"]["packets"],
                    sum(q.get("drops", 0) for q in qdiscs if q.get("kind") == "tbf"),
                    tcp["retransmits"],
                    tcp["timeouts"],
                    info["tx"].get("dropped", 0) + info["rx"].get("dropped", 0),
                    tcp["rcv_drops"],
                    tcp["spurious"],
                )
            )
        return out

    def _tcp_counters(self, netns: str) -> dict[str, int]:
        """The Counters' TCP fields from the namespace's /proc/net/snmp and /proc/net/netstat
        (both per network namespace); 0 for what cannot be read."""
        text = subprocess.run(
            self.tools.exec_prefix(netns) + ["cat", "/proc/net/snmp", "/proc/net/netstat"],
            env=self.tools.env(),  # ip itself may need the unpacked libraries
            capture_output=True,
            text=True,
            check=False,
        ).stdout

        def ext(*names: str) -> int:
            return sum(_snmp_value(text, "TcpExt:", name) for name in names)

        return {
            "retransmits": _snmp_value(text, "Tcp:", "RetransSegs"),
            "timeouts": ext("TCPTimeouts"),
            "rcv_drops": ext(
                "TCPRcvQDrop", "TCPOFODrop", "RcvPruned", "OfoPruned", "TCPBacklogDrop"
            ),
            "spurious": ext("TCPDSACKRecv", "TCPDSACKOfoRecv"),
        }

    def tcp_ceiling(self, streams: int = 4, seconds: float = 1.5) -> float:
        """GB/s per direction that plain TCP gets between nodes 0 and 1 with `streams`
        connections each way, both directions at once (the lower of the two): what this
        machine's network stack makes of the shaped link, the ceiling of every backend on it."""
        a, b = self.nodes[0], self.nodes[1]
        port = 29000 + secrets.randbelow(1000)
        procs = []
        for me, peer in ((a, b), (b, a)):
            argv = [sys.executable, "-c", TCP_PROBE, me.addr, peer.addr, str(port)]
            argv += [str(streams), str(seconds)]
            procs.append(
                self.popen(self.nodes.index(me), argv, dict(os.environ), stdout=subprocess.PIPE)
            )
        rates = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                for p in procs:
                    _stop(p)
                raise NetbedError("the TCP probe did not finish in time") from None
            if proc.returncode != 0 or not out.strip():
                raise NetbedError(f"the TCP probe exited {proc.returncode}")
            rates.append(float(out.split()[-1]))
        return min(rates)


def delay_line_binary() -> str:
    """The delay line built from DELAY_LINE_SOURCE with cc (once per source: the binary's name
    carries the source's hash, in the temporary folder)."""
    with open(DELAY_LINE_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    binary = os.path.join(tempfile.gettempdir(), f"netbed_delay-{digest}")
    if os.access(binary, os.X_OK):
        return binary
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NetbedError("a one-way delay needs a C compiler (cc, gcc or $CC) for the delay line")
    tmp = f"{binary}.{os.getpid()}.tmp"
    out = subprocess.run(
        [cc, "-O2", "-pthread", "-o", tmp, DELAY_LINE_SOURCE], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise NetbedError(f"building the delay line failed: {out.stderr.strip()}")
    os.replace(tmp, binary)  # atomic: a concurrent build finds a whole binary or none
    return binary


def start_delay_line(args: Sequence[str], timeout_s: float = 10.0) -> subprocess.Popen:
    """Start the delay line (`args`: the 'delay' command's arguments) and wait until its
    interfaces exist. It ends when its stdin closes, also when we die."""
    proc = subprocess.Popen(
        [delay_line_binary(), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode() if ready else ""
    if line.strip() != "ready":
        stop_delay_line(proc, keep_stderr=True)
        err = proc.stderr.read().decode().strip()
        proc.stderr.close()
        raise NetbedError(f"the delay line did not start ({shlex.join(args)}): {err or 'no reply'}")
    return proc


def stop_delay_line(proc: subprocess.Popen, keep_stderr: bool = False) -> None:
    """Close the delay line's stdin (it exits), SIGKILL it if it does not; then close its
    pipes (stderr stays open with keep_stderr, for the caller to read)."""
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()
    proc.stdout.close()
    if not keep_stderr:
        proc.stderr.close()


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL it after grace_s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def netbed_available(iproute2: Optional[str] = None, delay: bool = False) -> tuple[bool, str]:
    """Whether a testbed can be made here: makes (and deletes) two namespaces joined by a veth
    pair shaped with tbf (with `delay`: by the delay line). (False, why) otherwise."""
    try:
        with Netbed(2, Link(10**9, 10.0 if delay else 0.0), iproute2=iproute2):
            pass
    except (NetbedError, OSError, ValueError) as exc:
        hint = "" if os.geteuid() == 0 else " (not root: needs CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        return False, f"no network namespace testbed here: {exc}{hint}"
    return True, "namespaces, tbf and " + ("the delay line" if delay else "veth") + " work"


# ----------------------------------------------------------------------------- launching


@dataclasses.dataclass
class LaunchResult:
    """What one launch did: exit status per node, time, bytes over each node's link."""

    returncodes: list[int]
    seconds: float
    link: list[Counters]  # per node: what crossed its link during the launch
    output: list[list[str]]  # per node, when captured
    timed_out: bool = False
    stopped: list[bool] = dataclasses.field(default_factory=list)  # per node: we ended it

    @property
    def worst(self) -> int:
        """The worst exit status of the nodes that ended on their own (a node stopped because
        another failed is no news); on a timeout 124."""
        own = [c for c, s in zip(self.returncodes, self.stopped) if not s]
        if self.timed_out:
            return max(own + [124])
        return max(own or self.returncodes, default=0)

    @property
    def link_bytes(self) -> int:
        """Bytes sent over all links (each node's tx; a byte crosses one node link when two
        nodes are joined directly, two through the bridge: counted once, at the sender)."""
        return sum(c.tx_bytes for c in self.link)

    def as_dict(self) -> dict[str, Any]:
        return {
            "returncodes": self.returncodes,
            "seconds": self.seconds,
            "timed_out": self.timed_out,
            "stopped": self.stopped,
            "link_tx_bytes": [c.tx_bytes for c in self.link],
            "link_rx_bytes": [c.rx_bytes for c in self.link],
            "link_qdisc_drops": [c.qdisc_drops for c in self.link],
            "link_tcp_retransmits": [c.tcp_retransmits for c in self.link],
            "link_tcp_timeouts": [c.tcp_timeouts for c in self.link],
            "link_veth_drops": [c.veth_drops for c in self.link],
            "link_tcp_rcv_drops": [c.tcp_rcv_drops for c in self.link],
            "link_tcp_spurious": [c.tcp_spurious for c in self.link],
        }

    def describe(self) -> str:
        per = ", ".join(
            f"node {i} sent {format_bytes(c.tx_bytes)} received {format_bytes(c.rx_bytes)}"
            + (f" ({c.qdisc_drops} packets dropped by its qdisc)" if c.qdisc_drops else "")
            + (f" ({c.tcp_retransmits} TCP segments retransmitted)" if c.tcp_retransmits else "")
            + (f" ({c.tcp_timeouts} retransmission timeouts)" if c.tcp_timeouts else "")
            + (f" ({c.veth_drops} packets dropped by its veth)" if c.veth_drops else "")
            + (f" ({c.tcp_rcv_drops} segments dropped by its sockets)" if c.tcp_rcv_drops else "")
            + (f" ({c.tcp_spurious} retransmissions reported unneeded)" if c.tcp_spurious else "")
            for i, c in enumerate(self.link)
        )
        return f"exit {self.returncodes} in {self.seconds:.1f} s; over the links: {per}"


def rps_mask(cpus: Iterable[int]) -> str:
    """The rps_cpus mask of the CPU ids `cpus`: hex words of 32 CPUs, highest first,
    comma-separated (what /sys/class/net/*/queues/rx-*/rps_cpus takes)."""
    bits = sum(1 << c for c in set(cpus))
    words = [f"{(bits >> lo) & 0xFFFFFFFF:08x}" for lo in range(0, max(bits.bit_length(), 1), 32)]
    return ",".join(reversed(words))


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (online ones): the receive CPUs of the testbed."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _snmp_value(text: str, table: str, name: str) -> int:
    """The value of `name` in the `table` of /proc/net/snmp or /proc/net/netstat text (a header
    line and a value line per table); 0 if absent."""
    rows = [line.split() for line in text.splitlines() if line.startswith(table)]
    for header, values in zip(rows[::2], rows[1::2]):
        if name in header:
            return int(values[header.index(name)])
    return 0


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s: 128 + s, as a shell says


def torchrun_commands(
    plan: Plan,
    script_argv: Sequence[str],
    nproc_per_node: int,
    master_port: int = DEFAULT_PORT,
    launcher: Optional[Sequence[str]] = None,
) -> list[list[str]]:
    """One torchrun command per node: --nnodes N --node_rank i, rendezvous on node 0."""
    base = list(launcher or [sys.executable, "-m", "torch.distributed.run"])
    n = len(plan.nodes)
    return [
        base
        + [f"--nnodes={n}", f"--node_rank={i}", f"--nproc_per_node={nproc_per_node}"]
        + [f"--master_addr={plan.master_addr}", f"--master_port={master_port}"]
        + list(script_argv)
        for i in range(n)
    ]


def gpu_split(nodes: int, per_node: int, visible: Optional[str] = None) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each node: consecutive blocks of the visible GPUs."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [t.strip() for t in text.split(",") if t.strip()] if text else []
    if not ids:
        ids = [str(i) for i in range(nodes * per_node)]
    if len(ids) < nodes * per_node:
        raise ValueError(f"{nodes} nodes x {per_node} GPUs need {nodes * per_node}, have {ids}")
    return [",".join(ids[i * per_node : (i + 1) * per_node]) for i in range(nodes)]


def launch(
    bed: Netbed,
    commands: Sequence[Sequence[str]],
    env: Optional[dict[str, str]] = None,
    device: str = "cpu",
    nproc_per_node: int = 1,
    timeout: Optional[float] = None,
    stream: Optional[IO[str]] = None,
    quiet: bool = False,
    capture: bool = False,
    fail_grace_s: float = 60.0,
    cwd: Optional[str] = None,
) -> LaunchResult:
    """Run commands[i] in node i's namespace, all started together, each with `env` (default:
    ours) plus the node's variables (and its GPUs with device 'cuda'); each output line is
    streamed to `stream` (default: sys.stdout; none with `quiet`) with a '[n<i>] ' prefix, and
    kept with `capture`. When a node fails, the others get fail_grace_s to end on their own
    before they are stopped; after `timeout` seconds all are stopped (exit status 124)."""
    if len(commands) != len(bed.nodes):
        raise ValueError(f"{len(commands)} commands for {len(bed.nodes)} nodes")
    stream = None if quiet else (stream or sys.stdout)
    base = dict(os.environ if env is None else env)
    gpus = (
        gpu_split(len(bed.nodes), nproc_per_node, base.get("CUDA_VISIBLE_DEVICES"))
        if device == "cuda"
        else None
    )
    before = bed.counters()
    start = time.monotonic()
    lock = threading.Lock()
    output: list[list[str]] = [[] for _ in commands]
    procs, readers = [], []
    for i, argv in enumerate(commands):
        node_env = (
            base
            | bed.node_env(i)
            | {"NETBED_NODE_RANK": str(i), "NETBED_NODES": str(len(bed.nodes))}
        )
        node_env["NETBED_MASTER_ADDR"] = bed.plan.master_addr
        if gpus is not None:
            node_env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        proc = bed.popen(
            i, argv, node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd
        )
        procs.append(proc)

        def pump(i: int = i, proc: subprocess.Popen = proc) -> None:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if capture:
                    output[i].append(line)
                if stream is not None:
                    with lock:
                        print(f"[n{i}] {line}", file=stream, flush=True)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        readers.append(t)
    timed_out = False
    failed_at: Optional[float] = None
    try:
        while None in [p.poll() for p in procs]:  # a list: poll every one of them
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                timed_out = True
                _note(stream, f"netbed: timed out after {timeout:g} s, stopping every node")
                break
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > fail_grace_s:
                _note(stream, f"netbed: a node failed {fail_grace_s:g} s ago, stopping the others")
                break
            time.sleep(0.05)
    finally:
        ended = [p.poll() for p in procs]  # None: still running, stopped below
        for p in procs:
            _stop(p)
        # Whatever outlived its launcher (a worker whose torchrun died) goes too: the next
        # launch on this testbed starts from empty namespaces.
        kill_in_namespaces(bed.tools, bed.plan.namespaces, grace_s=2.0)
        for t in readers:
            t.join(timeout=10)
    seconds = time.monotonic() - start
    after = bed.counters()
    codes = [
        (
            _exit_code(p.returncode)
            if rc is not None
            else (124 if timed_out else _exit_code(p.returncode))
        )
        for p, rc in zip(procs, ended)
    ]
    return LaunchResult(
        codes,
        round(seconds, 2),
        [a.minus(b) for a, b in zip(after, before)],
        output,
        timed_out,
        [rc is None for rc in ended],
    )


def _note(stream: Optional[IO[str]], text: str) -> None:
    if stream is not None:
        print(text, file=stream, flush=True)


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line (see --help); the program and its arguments follow `--`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, command = argv[:k], argv[k + 1 :]
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default: %(default)s)")
    p.add_argument(
        "--rate", default="25gbit", help="link rate, e.g. 10gbit, 100gbit (default: %(default)s)"
    )
    p.add_argument("--delay", default="0", help="one-way delay, e.g. 10us, 20us (default: none)")
    p.add_argument("--burst", help="tbf burst in bytes (default: see Link)")
    p.add_argument(
        "--queue", default="2ms", help="tbf queue as time at the rate (default: %(default)s)"
    )
    p.add_argument("--mtu", type=int, default=1500, help="MTU of the veths (default: %(default)s)")
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="ranks per node (default: %(default)s)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: split the GPUs by CUDA_VISIBLE_DEVICES",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_PORT,
        help="rendezvous port on node 0 (default: %(default)s)",
    )
    p.add_argument(
        "--torchrun",
        default=f"{shlex.quote(sys.executable)} -m torch.distributed.run",
        help="launcher command (default: %(default)s)",
    )
    p.add_argument(
        "--raw", action="store_true", help="run the command itself on every node, no torchrun"
    )
    p.add_argument("--timeout", type=float, help="seconds after which every node is stopped")
    p.add_argument(
        "--iproute2", help=f"a dpkg -x folder of iproute2 and its libraries (or ${IPROUTE2_ENV})"
    )
    p.add_argument("--json", metavar="PATH", help="write the plan and the launch's result")
    p.add_argument("--plan", action="store_true", help="print the plan and commands, make nothing")
    p.add_argument(
        "--check", action="store_true", help="try to make a testbed, say whether it works"
    )
    p.add_argument("--reap", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.command = command
    try:
        args.link = Link(
            parse_rate(args.rate),
            parse_delay(args.delay),
            int(args.burst) if args.burst else None,
            parse_delay(args.queue),
            parse_mtu(str(args.mtu)),
        )
    except ValueError as exc:
        p.error(str(exc))
    if not (args.plan or args.check or args.reap) and not command:
        p.error("give the program after --, e.g. -- script.py --arg")
    if args.nodes < 2 or args.nproc_per_node < 1:
        p.error("need --nodes >= 2 and --nproc-per-node >= 1")
    return args


def node_commands(args: argparse.Namespace, plan: Plan) -> list[list[str]]:
    """The command of every node: the program itself (--raw) or torchrun running it."""
    if args.raw:
        return [list(args.command) for _ in plan.nodes]
    launcher = shlex.split(args.torchrun)
    return torchrun_commands(plan, args.command, args.nproc_per_node, args.master_port, launcher)


def _reap(spec_text: str) -> int:
    """The reaper (see Netbed._start_reaper)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(spec_text)
    message = sys.stdin.read()
    if message.strip() == "done":
        return 0
    tools = Tools(spec["ip"], spec["tc"], tuple(spec["libs"]))
    remove_namespaces(tools, spec["namespaces"], grace_s=2.0)
    return 0


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Make the testbed, run the command on every node, tear down; the worst exit status."""
    args = parse_args(argv)
    if args.reap:
        return _reap(args.reap)
    if args.check:
        ok, why = netbed_available(args.iproute2, delay=bool(args.link.delay_us))
        print(why)
        return 0 if ok else 1
    if args.plan:
        plan = make_plan(args.nodes, args.link)
        print(plan.describe())
        for cmd in plan.setup_commands():
            print("  " + shlex.join(["netbed_delay", *cmd[1:]] if cmd[0] == "delay" else cmd))
        if args.command:
            for i, cmd in enumerate(node_commands(args, plan)):
                env = " ".join(f"{k}={v}" for k, v in plan.node_env(i).items())
                print(f"  node {i}: ip netns exec {plan.nodes[i].netns} {env} {shlex.join(cmd)}")
        return 0
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    try:
        with Netbed(args.nodes, args.link, iproute2=args.iproute2, log=sys.stdout) as bed:
            commands = node_commands(args, bed.plan)
            for i, cmd in enumerate(commands):
                print(f"node {i}: {shlex.join(cmd)}", flush=True)
            result = launch(
                bed,
                commands,
                device=args.device,
                nproc_per_node=args.nproc_per_node,
                timeout=args.timeout,
            )
            print(f"netbed: {result.describe()}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(
                        {"netbed": bed.plan.as_dict(), "launch": result.as_dict()}, f, indent=1
                    )
            return result.worst
    except NetbedError as exc:
        print(f"netbed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netbed: interrupted, torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
