#!/usr/bin/env python
"""Reordering on the shaped-link testbed with and without RPS on the veth ends.

Makes a 2-node testbed (benchmarks/netbed.py, root), runs plain TCP between the nodes
(Netbed.tcp_ceiling: STREAMS connections each way, both directions at once) as the testbed sets
it up (RPS over all CPUs) and again with RPS switched off on both veth ends, and prints per node
the TcpExt / Tcp counters that show reordering and retransmissions over each run.

    sudo python benchmarks/tools/netbed_reorder_probe.py --rate 25gbit --streams 16 --seconds 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import netbed as nb  # noqa: E402

COUNTERS = [
    ("TcpExt:", "TCPSACKReorder"),
    ("TcpExt:", "TCPOFOQueue"),
    ("Tcp:", "RetransSegs"),
    ("TcpExt:", "TCPDSACKRecv"),
    ("TcpExt:", "TCPTimeouts"),
    ("Tcp:", "OutSegs"),
]


def read(bed: nb.Netbed, netns: str) -> dict[str, int]:
    text = subprocess.run(
        bed.tools.exec_prefix(netns) + ["cat", "/proc/net/snmp", "/proc/net/netstat"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {name: nb._snmp_value(text, table, name) for table, name in COUNTERS}


def set_rps(bed: nb.Netbed, mask: str) -> None:
    for n in bed.nodes:
        script = (
            f"for q in /sys/class/net/{n.ifname}/queues/rx-*; do echo {mask} > $q/rps_cpus; done"
        )
        subprocess.run(bed.tools.exec_prefix(n.netns) + ["sh", "-c", script], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", default="25gbit")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--iproute2", help="a dpkg -x folder of iproute2 (see benchmarks/netbed.py)")
    args = p.parse_args(argv)
    link = nb.parse_link(args.rate)
    with nb.Netbed(2, link, iproute2=args.iproute2) as bed:
        for label, mask in (("rps on", nb.rps_mask(nb.usable_cpus())), ("rps off", "0")):
            set_rps(bed, mask)
            before = [read(bed, n.netns) for n in bed.nodes]
            gbps = bed.tcp_ceiling(streams=args.streams, seconds=args.seconds)
            after = [read(bed, n.netns) for n in bed.nodes]
            print(f"{label}: {gbps:.3f} GB/s per direction, {args.streams} streams each way")
            for i, (a, b) in enumerate(zip(after, before)):
                print(f"  node {i}: " + ", ".join(f"{k} {a[k] - b[k]}" for k in a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
