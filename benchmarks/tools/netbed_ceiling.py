#!/usr/bin/env python
"""Plain TCP across a shaped testbed link: the ceiling of every backend on it.

For each link, delay-line queue count and stream count: a 2-node testbed (benchmarks/netbed.py)
and `Netbed.tcp_ceiling` (both directions at once, GB/s per direction, the lower of the two),
median of --repeats. The delay line forwards a queue's frames on one thread per direction, so a
link with a delay is capped by how many queues carry the flows; without a delay the queue count
has no effect (a veth pair).

    python benchmarks/tools/netbed_ceiling.py --links 100gbit,20us 25gbit,20us \
        --queues 1,4 --streams 1,4,8 --json ceiling.json

Needs root and ip / tc (NETBED_IPROUTE2: an unpacked iproute2, see netbed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import netbed as nb


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", nargs="+", default=["100gbit,20us"], help="netbed link specs")
    p.add_argument("--queues", type=ints, default=[1, nb.delay_line_queues()])
    p.add_argument("--streams", type=ints, default=[1, 4, 8])
    p.add_argument("--seconds", type=float, default=1.5, help="per probe")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write every probe's rate here")
    args = p.parse_args()

    rows: list[dict[str, Any]] = []
    print(f"{'link':>20s} {'queues':>6s} {'streams':>7s} {'GB/s per direction (median, all)':>s}")
    for spec in args.links:
        link = nb.parse_link(spec)
        # Without a delay the link is a veth pair: no queues to vary.
        for queues in args.queues if link.delay_us else args.queues[:1]:
            with nb.Netbed(2, link, delay_queues=queues) as bed:
                for streams in args.streams:
                    rates = [
                        bed.tcp_ceiling(streams=streams, seconds=args.seconds)
                        for _ in range(args.repeats)
                    ]
                    med = statistics.median(rates)
                    rows.append(
                        {
                            "link": spec,
                            "rate_gbps": link.rate_bps / 8e9,
                            "queues": queues,
                            "streams": streams,
                            "median_gbps": med,
                            "rates_gbps": rates,
                        }
                    )
                    listed = " ".join(f"{r:.2f}" for r in rates)
                    print(f"{spec:>20s} {queues:6d} {streams:7d} {med:6.2f}  ({listed})")
    if args.json:
        meta = {"cpus": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta | {"command": sys.argv}, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
