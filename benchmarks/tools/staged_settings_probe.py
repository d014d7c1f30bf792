"""Tail latency of all_reduce across nodes under several settings, with TCP counters.

Run on the shaped-link testbed, one rank per node; each setting gets a process group of its own
(settings are read when a group is created). It prints first the plain-TCP throughput between
the two nodes (1 and 4 connections each way, both directions at once), then per setting and
size the median and mean time per call, the slowest call, how many calls took over 3x the
median, and the TCP counters of rank 0's network namespace that moved meanwhile:

    python benchmarks/netbed.py --rate 25gbit --device cuda --nproc-per-node 1 -- \\
        benchmarks/tools/staged_settings_probe.py 25gbit

`--device cpu` measures CPU tensors (the host path instead of the staged rail).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import torchext  # noqa: F401  (registers the backend)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import netbed as nb  # noqa: E402

TCP_COUNTERS = (
    "RetransSegs",
    "TCPLossProbes",
    "TCPTimeouts",
    "TCPFastRetrans",
    "TCPSlowStartRetrans",
    "DelayedACKs",
    "TCPSpuriousRTOs",
    "TCPLostRetransmit",
    "TCPSackRecovery",
    "TCPLossProbeRecovery",
)
SIZES = ((256 << 10, 300), (1 << 20, 300), (4 << 20, 100), (16 << 20, 40), (256 << 20, 6))


def setting(sockets: int, chunk: str, **more: str) -> dict[str, str]:
    return {"FASTCOMM_TCP_SOCKETS": str(sockets), "FASTCOMM_CUDA_CHUNK_BYTES": chunk, **more}


SETTINGS = (
    setting(8, "4M"),
    setting(2, "1M"),
    setting(4, "1M"),
    setting(4, "2M"),
    setting(8, "1M"),
    setting(2, "2M"),
    setting(2, "1M", FASTCOMM_CUDA_HIER_MIN_BYTES="256K"),
    setting(4, "1M", FASTCOMM_CUDA_WINDOW="12"),
)


def tcp_counters() -> dict[str, int]:
    """The TCP counters of this process's network namespace."""
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            for k, v in zip(names.split()[1:], values.split()[1:]):
                if k in TCP_COUNTERS:
                    out[k] = int(v)
    return out


def softnet_drops() -> int:
    """Packets the kernel dropped from full receive backlogs, over all CPUs (not per namespace)."""
    with open("/proc/net/softnet_stat") as f:
        return sum(int(line.split()[1], 16) for line in f)


def interface_address(ifname: str) -> str:
    """The IPv4 address of `ifname` (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", ifname.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])


def plain_tcp(me: str, peer: str, streams: int, port: int, seconds: float = 1.0) -> float:
    """GB/s received from `peer` while sending to it over `streams` connections each way: the
    testbed's own probe (netbed.TCP_PROBE), run by both ranks at once."""
    argv = [sys.executable, "-c", nb.TCP_PROBE, me, peer, str(port), str(streams), str(seconds)]
    dist.barrier()
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60)
    return float(out.stdout.split()[-1])


def probe(group: dist.ProcessGroup, size: int, calls: int, device: str) -> str:
    x = torch.randn(size // 4, device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(5):
        dist.all_reduce(x, group=group)
    sync()
    dist.barrier(group=group)
    before, drops = tcp_counters(), softnet_drops()
    times = []
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    total = (time.perf_counter() - start) * 1e6
    after, drops = tcp_counters(), softnet_drops() - drops
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    med = statistics.median(times)
    stats = [med, total / calls, max(times), sum(t > 3 * med for t in times)]
    worst = torch.tensor(stats, device=device, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's view
    med, mean, longest, slow = worst.tolist()
    return (
        f"{size >> 10:>7} KiB  median {med:9.1f} us  mean {mean:9.1f}  busbw(mean) "
        f"{size / mean / 1e3:6.2f} GB/s  max {longest:9.1f}  slow(>3x med) {int(slow):3d}/{calls}"
        f"  softnet drops {drops} tcp r0 {moved}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("link", help="the link's name, printed with the results")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("fastcomm", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("fastcomm")
    if dist.get_world_size() != 2:
        raise SystemExit("one rank on each of two nodes")
    if rank == 0:
        backlog = "/proc/sys/net/core/netdev_max_backlog"  # only in the root namespace
        limit = open(backlog).read().strip() if os.path.exists(backlog) else "n/a"
        print(f"# link: {args.link}", flush=True)
        print(f"# netdev_max_backlog {limit} softnet drops {softnet_drops()}", flush=True)
    addrs: list[str] = [""] * 2
    dist.all_gather_object(addrs, interface_address(os.environ["FASTCOMM_SOCKET_IFNAME"]))
    for streams in (1, 4):
        gbps = plain_tcp(addrs[rank], addrs[1 - rank], streams, port=39000 + 100 * streams)
        t = torch.tensor([gbps], device=args.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(
                f"raw TCP both ways, {streams} streams each way: {t.item():.3f} GB/s per "
                "direction (min over ranks)",
                flush=True,
            )
    for env in SETTINGS:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        group = dist.new_group(backend="fastcomm")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        label = " ".join(f"{k[len('FASTCOMM_') :]}={v}" for k, v in env.items())
        for size, calls in SIZES:
            line = probe(group, size, calls, args.device)
            if rank == 0:
                print(f"{label:70s} {line}", flush=True)
        dist.destroy_process_group(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
